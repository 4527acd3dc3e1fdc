"""Stochastic rounding to bfloat16 from a counter-based generator, defined in torch ops
that every backend's kernel reproduces (C++: csrc/rounding.h; Triton and CUDA the same).

A value stored in bf16 by round-to-nearest cannot move by less than half its last place
(0.2-0.4% of itself): Adam's second moment moves by ``1 - beta2`` = 0.1% a step and would
stay where it is. Rounding up with probability equal to the fraction dropped keeps the
expected value exact. The random bits come from a hash of (seed, step, stream, element
index), no generator state: the same element at the same step gets the same bits on
every rank, world size and backend, and a resumed run draws what the uninterrupted one
would have (the index is the element's place in the flat buffer's canonical layout,
``zero_triton.state.flat``, which depends on the parameters only).

``key(seed, step, stream)``, then per element ``bits = fmix32(lo ^ key ^ hi * C)`` with
``lo, hi`` the index's 32-bit halves and ``fmix32`` MurmurHash3's finaliser; the low 16
bits are added to the float's bits before the low half is dropped.
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
GOLDEN, M1, M2 = 0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35
FIRST_STREAM, SECOND_STREAM, PARAM_STREAM = 1, 2, 3  # exp_avg, exp_avg_sq, the parameter


def fmix32_int(x: int) -> int:
    """MurmurHash3's 32-bit finaliser on a Python int."""
    x &= MASK32
    x ^= x >> 16
    x = (x * M1) & MASK32
    x ^= x >> 13
    x = (x * M2) & MASK32
    x ^= x >> 16
    return x


def key(seed: int, step: int, stream: int) -> int:
    """The per-run constant of the hash (the kernels compute it from the step they read)."""
    return fmix32_int(fmix32_int(seed) ^ ((step * GOLDEN) & MASK32) ^ ((stream * M1) & MASK32))


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """fmix32 on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = (x * M1) & MASK32
    x = x ^ (x >> 13)
    x = (x * M2) & MASK32
    return x ^ (x >> 16)


def random_bits(run_key: int, index0: int, n: int, device) -> torch.Tensor:
    """32 random bits (int64 tensor) for elements ``index0 .. index0 + n - 1``."""
    return random_bits_at(run_key, torch.arange(index0, index0 + n, dtype=torch.int64, device=device))


def random_bits_at(run_key: int, index: torch.Tensor) -> torch.Tensor:
    """32 random bits (int64 tensor) for the elements of canonical indices ``index``
    (int64): what a run of them would draw, for elements that are not one run."""
    lo, hi = index & MASK32, index >> 32
    return _fmix32(lo ^ run_key ^ ((hi * M2) & MASK32))


def to_bf16_stochastic(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` rounded to bfloat16, up with probability the dropped fraction (by
    the low 16 of ``bits``); NaN stays NaN, infinities stay."""
    raw = x.float().view(torch.int32).to(torch.int64) & MASK32
    out = ((raw + (bits & 0xFFFF)) >> 16) & 0xFFFF
    out = torch.where(torch.isinf(x), raw >> 16, out)
    out = torch.where(torch.isnan(x), torch.full_like(out, 0x7FC0), out)  # the canonical NaN
    out = torch.where(out >= 0x8000, out - 0x10000, out)  # as int16
    return out.to(torch.int16).view(torch.bfloat16)
