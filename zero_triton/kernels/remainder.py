"""``master_weights="remainder"``: the fp32 master of a bf16 parameter kept as the
parameter's 16 bits and 16 more beside it, defined in torch ops that every backend's
kernel reproduces (C++ and CUDA: csrc/remainder.h; Triton: ``kernels/adam.py``).

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


def split(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``master`` -> (the bfloat16 parameter, the int16 remainder)."""
    u = _bits(master)
    rem = u & MASK16
    hi = (u + 0x8000) >> 16
    hi = torch.where(torch.isnan(master), (u >> 16) | 0x40, hi) & MASK16
    return _int16(hi).view(torch.bfloat16), _int16(rem)


def join(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The float32 master of bfloat16 ``param`` and its int16 ``remainder``."""
    p = param.view(torch.int16).to(torch.int64) & MASK16
    r = remainder.to(torch.int64)
    hi = (p - (r < 0).to(torch.int64)) & MASK16
    bits = (hi << 16) | (r & MASK16)
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def consistent(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """``remainder`` where it still pairs with ``param`` (the master they make splits back
    to ``param``), 0 elsewhere: what a parameter the user wrote keeps."""
    back, _ = split(join(param, remainder))
    same = back.view(torch.int16) == param.view(torch.int16)
    return torch.where(same, remainder, torch.zeros_like(remainder))
