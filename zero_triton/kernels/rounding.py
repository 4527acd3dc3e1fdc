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

from .quant import scratch

MASK32 = 0xFFFFFFFF
GOLDEN, M1, M2 = 0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35
# exp_avg, exp_avg_sq, the parameter; the 4-bit second moment's block scales
FIRST_STREAM, SECOND_STREAM, PARAM_STREAM, SCALE_STREAM = 1, 2, 3, 4


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


def key_at(step: torch.Tensor, seed: int, stream: int, out: torch.Tensor,
           t: torch.Tensor) -> torch.Tensor:
    """``key`` of the step count a device tensor holds (float32 [1]), into ``out`` (int64
    [1], ``t`` its scratch): nothing read on the host (a capturable step)."""
    out.copy_(step).mul_(GOLDEN).bitwise_and_(MASK32)
    out.bitwise_xor_(fmix32_int(seed) ^ ((stream * M1) & MASK32))
    return _fmix32(out, t)


def _fmix32(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """fmix32 on an int64 tensor holding uint32 values, in place (``t``: scratch of its
    shape): x ^= x >> 16; x *= M1; x ^= x >> 13; x *= M2; x ^= x >> 16 (mod 2^32)."""
    for shift, factor in ((16, M1), (13, M2), (16, None)):
        x.bitwise_xor_(torch.bitwise_right_shift(x, shift, out=t))
        if factor is not None:
            x.mul_(factor).bitwise_and_(MASK32)
    return x


def random_bits(run_key: int, index0: int, n: int, device) -> torch.Tensor:
    """32 random bits (int64 tensor) for elements ``index0 .. index0 + n - 1``."""
    return random_bits_at(run_key, torch.arange(index0, index0 + n, dtype=torch.int64, device=device))


def random_bits_at(run_key, index: torch.Tensor, out=None, tmp=None) -> torch.Tensor:
    """32 random bits (int64 tensor) for the elements of canonical indices ``index``
    (int64): what a run of them would draw, for elements that are not one run:
    ``fmix32(lo ^ key ^ hi * M2)``. ``run_key``: an int, or ``key_at``'s tensor; ``out``
    and ``tmp`` as in ``zero_triton.kernels.quant.scratch``."""
    tmp = tmp or scratch(index)
    t = tmp(0, torch.int64)
    x = torch.bitwise_and(index, MASK32, out=torch.empty_like(index) if out is None else out)
    hi = torch.bitwise_right_shift(index, 32, out=t).mul_(M2).bitwise_and_(MASK32)
    return _fmix32(x.bitwise_xor_(run_key).bitwise_xor_(hi), t)


def to_bf16_stochastic(x: torch.Tensor, bits: torch.Tensor, out=None, tmp=None) -> torch.Tensor:
    """float32 ``x`` rounded to bfloat16, up with probability the dropped fraction (by
    the low 16 of ``bits``); NaN stays NaN, infinities stay. ``out``: a bfloat16 tensor to
    write; ``tmp`` as in ``zero_triton.kernels.quant.scratch``."""
    tmp = tmp or scratch(x)
    i64, flag = torch.int64, tmp(0, torch.bool)
    raw = tmp(0, i64).copy_(x.float().view(torch.int32)).bitwise_and_(MASK32)
    y = torch.bitwise_and(bits, 0xFFFF, out=tmp(1, i64))
    y.add_(raw).bitwise_right_shift_(16).bitwise_and_(0xFFFF)  # ((raw + low 16) >> 16) & 0xFFFF
    inf = torch.eq(torch.abs(x, out=tmp(0, torch.float32)), float("inf"), out=flag)
    torch.where(inf, raw.bitwise_right_shift_(16), y, out=y)  # infinities: truncated
    y.masked_fill_(torch.ne(x, x, out=flag), 0x7FC0)  # NaN: the canonical NaN
    y.sub_(raw.copy_(torch.ge(y, 0x8000, out=flag)).mul_(0x10000))  # as int16
    if out is None:
        return y.to(torch.int16).view(torch.bfloat16)
    out.view(torch.int16).copy_(y)
    return out
