"""The moment stores (``zero_triton.state.protocol.MomentStore``) and their registry.

``fp32``: torch.optim.Adam's own layout: ``exp_avg``, ``exp_avg_sq`` and, with amsgrad,
``max_exp_avg_sq``, one contiguous tensor each over the shard, in the parameters'
compute dtype (float32; float64 for float64 parameters). Its export is the storage
itself, so ``opt.state`` and ``state_dict()`` hand out views of the live state, as torch
does.

``int8``: block-scaled 8-bit codes (``zero_triton.state.int8``); ``int4``: 4-bit ones,
two to a byte (``zero_triton.state.int4``); ``bf16``: bfloat16 moments written by
stochastic rounding (``zero_triton.state.bf16``).

A format is added by a class here (or a module of its own) registered in ``FORMATS``
and its kernels in ``zero_triton.native.backends``; ``ShardState`` makes the one the
optimizer was built with.
"""
from __future__ import annotations

import torch

from .bf16 import Bf16Moments
from .flat import ALIGN
from .int4 import Int4Moments
from .int8 import Int8Moments
from .keys import FIRST, KEYS, MAXIMUM, SECOND

__all__ = ["FIRST", "SECOND", "MAXIMUM", "KEYS", "FORMATS", "Fp32Moments", "Bf16Moments",
           "Int8Moments", "Int4Moments", "make"]


class Fp32Moments:
    """The moments in full precision, one tensor per moment over the shard."""

    format = "fp32"
    align = ALIGN  # the flat layout's alignment this format needs
    block = 1      # each element stored by itself
    live = True    # export() is the storage itself
    keyed = False  # the step takes no element index

    def __init__(self, numel: int, dtype: torch.dtype, device, amsgrad: bool = False):
        self.numel, self.dtype, self.device = numel, dtype, device
        self.exp_avg = torch.zeros(numel, dtype=dtype, device=device)
        self.exp_avg_sq = torch.zeros(numel, dtype=dtype, device=device)
        self.max_exp_avg_sq = torch.zeros(numel, dtype=dtype, device=device) if amsgrad else None

    @property
    def amsgrad(self) -> bool:
        return self.max_exp_avg_sq is not None

    def ensure_amsgrad(self) -> bool:
        if self.max_exp_avg_sq is None:
            self.max_exp_avg_sq = torch.zeros_like(self.exp_avg)
            return True
        return False

    def operands(self, a: int, b: int, amsgrad: bool) -> tuple:
        return (self.exp_avg[a:b], self.exp_avg_sq[a:b],
                self.max_exp_avg_sq[a:b] if amsgrad else None)

    def reset(self, amsgrad: bool | None = None) -> None:
        if amsgrad:
            self.ensure_amsgrad()
        exported = self.export()
        for t in exported.values():
            t.zero_()
        self.commit(exported)

    def export(self) -> dict:
        out = {FIRST: self.exp_avg, SECOND: self.exp_avg_sq}
        if self.max_exp_avg_sq is not None:
            out[MAXIMUM] = self.max_exp_avg_sq
        return out

    def commit(self, exported: dict) -> None:
        """The export is the storage: written in place already."""

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.export().values())

    def storage(self) -> list:
        return list(self.export().values())

    def carry_over(self, old) -> None:
        if old.amsgrad:
            self.ensure_amsgrad()
        mine = self.export()
        for key, value in old.export().items():
            mine[key].copy_(value)
        self.commit(mine)


FORMATS = {cls.format: cls for cls in (Fp32Moments, Bf16Moments, Int8Moments, Int4Moments)}


def make(format: str, numel: int, dtype: torch.dtype, device, amsgrad: bool = False,
         rows: dict | None = None):
    """A store of ``format`` for a shard of ``numel`` state elements (``rows``: the
    ``RowMap`` of each local shard stepped through its rows, by state offset: int8 and
    int4 keep their blocks' scales by row, ``zero_triton.state.int8_rows``)."""
    try:
        cls = FORMATS[format]
    except KeyError:
        raise ValueError(f"unknown moments format {format!r}; choose one of "
                         f"{tuple(FORMATS)}") from None
    if rows is not None and cls is Int8Moments:
        from .int8_rows import Int8RowMoments
        return Int8RowMoments(numel, dtype, device, amsgrad, maps=rows)
    if rows is not None and cls is Int4Moments:
        from .int4_rows import Int4RowMoments
        return Int4RowMoments(numel, dtype, device, amsgrad, maps=rows)
    return cls(numel, dtype, device, amsgrad)
