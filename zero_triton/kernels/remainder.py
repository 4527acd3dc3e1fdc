"""``master_weights="remainder"``: the fp32 master of a bf16 parameter kept as the
parameter's 16 bits and 16 more beside it; ``master_weights="remainder8"``: 8 more, a
24-bit master. Both defined in torch ops that every backend's kernel reproduces (C++ and
CUDA: csrc/remainder.h; Triton: ``kernels/adam.py``).

An fp32 number is its high 16 bits (a bf16) and its low 16. Keeping the low half beside
the bf16 parameter keeps the whole master for 2 bytes, if the parameter is the master's
high half. It is not quite: the parameter must be the master *rounded*, not truncated.
So the split rounds half up in magnitude (the high half plus one when the low half is
0x8000 or more) and stores the low half as a signed int16, negative exactly when it
rounded up; the join takes one back off. This is Apex's and TransformerEngine's
convention (``store_param_remainders``). The master is exact; the parameter is the
master rounded to nearest, ties away from zero, where ``master_weights=True`` rounds
ties to even: they differ only when the master's low half is exactly 0x8000.

(No 16-bit remainder can pair with round-to-nearest-even: 65,537 fp32 values round to
an even bf16 and 65,535 to an odd one, so the pairs would not be one to one.)

A NaN master splits to a quiet NaN parameter (the high half with its quiet bit set);
its remainder joins back to a NaN. A parameter written by the user keeps its remainder
where the two still pair (``split(join(p, r))`` gives ``p`` back) and takes 0 elsewhere
(``consistent``), so a value written equal to the one it had keeps its exact master.

The one-byte remainder keeps the master to 24 bits: sign, exponent and 15 bits of
mantissa, 8 more than the bf16 parameter's 7, so a master holds 1/256 of the parameter's
ULP where fp32 holds 1/65,536. After each step the fp32 value the kernel computed is
rounded to 24 bits (to nearest, ties to even: ``round24``) and split as above; its low 8
bits being zero, the int16 remainder is a whole multiple of 256 and its high byte, an
int8, keeps all of it (negative exactly when the parameter was rounded up, as before).
``join`` of an int8 remainder is that byte shifted back. The pairs are one to one again:
``split(join(p, r), torch.int8) == (p, r)``, so a master exported and committed back,
or saved and loaded, keeps its bits. What it loses against the exact master: each step's
result is rounded to 2**-16 of the master's magnitude, relative (the exact one keeps
2**-24), so an update smaller than half of that (|update| < 2**-17 |w|, e.g. weight
decay's lr * wd * w at lr * wd < 7.6e-6) rounds away where the exact master accumulates
it. FlashOptim's 8-bit correction (an error normalised by the bf16 ULP, rounded to one
of 255 levels) keeps as many bits; this one is the master's own bits, so it reproduces
bit for bit on every backend with integer operations only.
"""
from __future__ import annotations

import torch

MASK16 = 0xFFFF


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The uint32 bits of float32 ``x`` as int64."""
    return x.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _int16(u: torch.Tensor) -> torch.Tensor:
    """int64 holding uint16 values -> int16 with the same bits."""
    return torch.where(u >= 0x8000, u - 0x10000, u).to(torch.int16)


def round24(master: torch.Tensor) -> torch.Tensor:
    """float32 ``master`` rounded to 24 bits (its low 8 bits zero): to nearest, ties to
    even; a NaN kept as it is (``split`` quiets it)."""
    u = _bits(master)
    r = (u + 0x7F + ((u >> 8) & 1)) & 0xFFFFFF00
    r = torch.where(torch.isnan(master), u, r)
    return torch.where(r >= 2**31, r - 2**32, r).to(torch.int32).view(torch.float32)


def split(master: torch.Tensor, dtype: torch.dtype = torch.int16) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``master`` -> (the bfloat16 parameter, the remainder): int16, exact, or
    int8 (``dtype``), of the master rounded to 24 bits (``round24``)."""
    if dtype == torch.int8:
        high, low = split(round24(master))
        return high, (low.to(torch.int32) >> 8).to(torch.int8)
    u = _bits(master)
    rem = u & MASK16
    hi = (u + 0x8000) >> 16
    hi = torch.where(torch.isnan(master), (u >> 16) | 0x40, hi) & MASK16
    return _int16(hi).view(torch.bfloat16), _int16(rem)


def join(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The float32 master of bfloat16 ``param`` and its ``remainder`` (int16, or int8:
    its high byte)."""
    p = param.view(torch.int16).to(torch.int64) & MASK16
    r = remainder.to(torch.int64)
    if remainder.dtype == torch.int8:
        r = r * 256
    hi = (p - (r < 0).to(torch.int64)) & MASK16
    bits = (hi << 16) | (r & MASK16)
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def consistent(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """``remainder`` where it still pairs with ``param`` (the master they make splits back
    to ``param``), 0 elsewhere: what a parameter the user wrote keeps."""
    back, _ = split(join(param, remainder), remainder.dtype)
    same = back.view(torch.int16) == param.view(torch.int16)
    return torch.where(same, remainder, torch.zeros_like(remainder))
