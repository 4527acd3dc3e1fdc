"""``moments="int8"`` for DTensor parameters whose int8 blocks other ranks hold a part of:
the same codes and scales as the whole parameter's, at every layout.

A parameter's int8 blocks are runs of 256 of its rows (``zero_triton.state.int8``). A
tensor-parallel cut of the rows (``Shard(1)``: a RowwiseParallel weight at a tp size whose
part of a row is not a multiple of 256, 128 of a 512-element row at tp=4) leaves blocks
that lie partly on each of two or more ranks. Their scale is the largest magnitude of the
whole block, which no one rank sees; the ranks that hold its parts agree on it: each
computes the largest magnitude of its part, one MAX all-reduce over the mesh dimensions
that cut the rows settles every block of the rows they share, and each encodes its part
with the agreed scale (``zero_triton.optim.launch.RowsLaunch``). The codes and scales are
then the bits every other layout holds, and a checkpoint moves between layouts exactly.

Storage, per piece (a parameter's local shard, ``RowMap``): its codes (one byte per moment
per element, in local order, as ``Int8Moments``) and a table of the scales of every block
of its rows, float32 [local rows, cols / 256, 2], the same on every rank that shares the
rows (what the agreement leaves): the compact state dict hands DCP this table, replicated
over the ranks that cut the rows. 8 bytes per 256 elements of the whole row: tp times
what the ranks' own blocks take (0.125 bytes per element at tp=4).

A commit (a torch-format load) keeps the float32 values (``pending``) until the next step
encodes them with agreed scales: a load needs no collective of its own, and encoding a
block's part by a scale of the part alone and again by the agreed one would round twice.
"""
from __future__ import annotations

import torch

from zero_triton.kernels import quant

from .buffers import PLAIN, Scratch
from .int8 import ALIGN, BLOCK, Int8Moments
from .keys import FIRST, SECOND
from .lowbit import NoMaximum

MAGNITUDE = 0x7FFFFFFF


class RowBlocks:
    """The int8 moments of one piece whose blocks are cut (its launch's third operand):
    decoded before the step, encoded after it with the scales its sharers agree on. The
    intermediates come from ``tmp`` (``Scratch``: kept ones under capturable=True). The
    store's class says the codes (``CODES``), their blocks (``block``) and the scales'
    dtype; ``zero_triton.state.int4_rows`` steps 4-bit ones with this class's geometry."""

    def __init__(self, store: "Int8RowMoments", s0: int, rows):
        self.store, self.s0, self.map = store, s0, rows
        self.block = block = store.block
        self.first = rows.first_block(block)
        self.count = rows.blocks(block)
        self.offset = rows.c0 - self.first * block  # where the part starts in its first block
        self.shape = (rows.rows.numel(), rows.width)  # the local part, as rows

    @property
    def table(self) -> torch.Tensor:
        return self.store.tables[self.s0]

    def _scratch(self, tmp):
        return tmp or Scratch(PLAIN, None, self.store.device)

    def _codes(self) -> tuple:
        return tuple(t.view(self.shape) for t in self.store.codes(self.s0, self.s0 + self.map.numel))

    def _per_element(self, table: torch.Tensor, col: int, tmp) -> torch.Tensor:
        """Each local element's scale of moment ``col``, float32 [rows, width] (a view
        of ``tmp``'s "wide"), from a table of its rows."""
        rows = self.shape[0]
        wide = tmp("wide", (rows, self.count * self.block), torch.float32)
        mine = table[:, self.first:self.first + self.count, col, None]
        wide.view(rows, self.count, self.block).copy_(mine.expand(-1, -1, self.block))
        return wide[:, self.offset:self.offset + self.map.width]

    def widen(self, tmp=None) -> tuple:
        """The moments in float32 (``tmp``'s "m" and "v"): the pending ones, or decoded."""
        tmp = self._scratch(tmp)
        n = self.map.numel
        m, v = tmp("m", (n,), torch.float32), tmp("v", (n,), torch.float32)
        pending = self.store.pending.get(self.s0)
        if pending is not None:
            return m.copy_(pending[0]), v.copy_(pending[1])
        for codes, x, col, fmt in zip(self._codes(), (m, v), (0, 1), self.store.CODES):
            quant.decode_each(codes, self._per_element(self.table, col, tmp), fmt,
                              out=x.view(self.shape), tmp=tmp.shaped(self.shape, "scratch"))
        return m, v

    def keys(self, step: torch.Tensor, seed: int, tmp=None):
        """The step's rounding keys ``narrow`` takes (the step count on the device): none,
        the int8 codes round to nearest."""
        return None

    def maxima(self, m: torch.Tensor, v: torch.Tensor, tmp=None) -> torch.Tensor:
        """int32 [rows, cols / block, 2]: the largest magnitude's bits of this rank's part of
        each block of its rows (zero where it holds none; NaN the largest, as in the
        kernels), for a MAX all-reduce among the ranks that share the rows."""
        tmp = self._scratch(tmp)
        rows, width = self.shape
        out = tmp("maxima", (rows, self.map.cols // self.block, 2), torch.int32).zero_()
        if not rows or not width:
            return out
        padded = tmp("padded", (rows, self.count * self.block), torch.int32)
        part = tmp("part", (rows, self.count), torch.int32)
        for col, x in enumerate((m, v)):
            padded.zero_()
            torch.bitwise_and(x.view(torch.int32).view(self.shape), MAGNITUDE,
                              out=padded[:, self.offset:self.offset + width])
            torch.amax(padded.view(rows, self.count, self.block), -1, out=part)
            out[:, self.first:self.first + self.count, col].copy_(part)
        return out

    def narrow(self, m: torch.Tensor, v: torch.Tensor, agreed: torch.Tensor, skip=None,
               tmp=None, keys=None) -> None:
        """Keep the agreed scales (``agreed``: ``maxima``'s all-reduced bits) and encode
        ``m`` and ``v`` with them; where ``skip`` (bool [1] on the device: this rank
        skipped the step) is set, the codes and scales stay as they were. ``keys``: the
        step's rounding keys, for a store that rounds stochastically (None: to nearest)."""
        tmp = self._scratch(tmp)
        agreed = agreed.to(self.table.device)
        scales = self._scales(agreed, keys, tmp)
        for codes, x, col, fmt in zip(self._codes(), (m, v), (0, 1), self.store.CODES):
            into = tmp(("codes", col), self.shape, codes.dtype)
            self._encode(x.view(self.shape), col, fmt, scales, agreed, keys, into, tmp)
            if skip is not None:
                torch.where(skip, codes, into, out=into)
            self._write(col, into)
        if skip is None:
            self.table.copy_(scales)
        else:
            torch.where(skip, self.table, scales, out=self.table)
        self.store.pending.pop(self.s0, None)

    def _scales(self, agreed: torch.Tensor, keys, tmp) -> torch.Tensor:
        """The table's new scales from the agreed largest magnitudes' bits: those
        magnitudes (float32)."""
        return agreed.view(torch.float32)

    def _encode(self, x, col: int, fmt, scales, agreed, keys, out, tmp) -> None:
        """``x``'s codes of moment ``col`` under the new ``scales`` into ``out``."""
        quant.encode_each(x, self._per_element(scales, col, tmp), fmt, out=out,
                          tmp=tmp.shaped(self.shape, "scratch"))

    def _write(self, col: int, codes: torch.Tensor) -> None:
        n = self.map.numel
        store = (self.store.exp_avg, self.store.exp_avg_sq)[col]
        store[self.s0:self.s0 + n].copy_(codes.view(-1))


class Int8RowMoments(NoMaximum):
    """exp_avg and exp_avg_sq of DTensor local shards whose blocks are cut across ranks
    (``maps``: each piece's ``RowMap`` by its state offset): ``Int8Moments``' codes, and
    the scales by row (the module's docstring)."""

    format = "int8"
    align = ALIGN
    block = BLOCK
    live = False   # export() is a decoded copy
    keyed = False  # rounding to nearest
    CODES = Int8Moments.CODES
    COMPACT = Int8Moments.COMPACT
    SCALE_DTYPE = Int8Moments.SCALE_DTYPE
    blocks = RowBlocks  # a piece's launch operand

    def __init__(self, numel: int, dtype: torch.dtype, device, amsgrad: bool = False, *, maps: dict):
        self.check(dtype, amsgrad)
        self.numel, self.dtype, self.device = numel, dtype, device
        self.exp_avg, self.exp_avg_sq = self._codes_storage(numel, device)
        self.maps = dict(maps)
        sizes = {s0: (m.rows.numel(), m.cols // self.block) for s0, m in self.maps.items()}
        self.scales = torch.zeros(sum(r * k for r, k in sizes.values()), 2, dtype=self.SCALE_DTYPE,
                                  device=device)
        self.tables, at = {}, 0
        for s0, (r, k) in sizes.items():
            self.tables[s0] = self.scales[at:at + r * k].view(r, k, 2)
            at += r * k
        self.pending: dict = {}  # state offset -> (exp_avg, exp_avg_sq) float32, not yet encoded

    @staticmethod
    def _codes_storage(numel: int, device) -> tuple:
        return tuple(torch.zeros(numel, dtype=fmt.dtype, device=device) for fmt in Int8Moments.CODES)

    def codes(self, a: int, b: int) -> tuple:
        return Int8Moments.codes(self, a, b)

    def operands(self, a: int, b: int, amsgrad: bool) -> tuple:
        self.check(None, amsgrad)
        rows = self.maps.get(a)
        if rows is None or b - a != rows.numel:
            raise ValueError(f"{self.format} moments of cut blocks are stepped a whole local "
                             f"shard at a time, got state elements [{a}, {b})")
        return (*self._held(a, b), self.blocks(self, a, rows))

    def _held(self, a: int, b: int) -> tuple:
        """The storage of state elements [a, b)."""
        return self.exp_avg[a:b], self.exp_avg_sq[a:b]

    def reset(self, amsgrad: bool | None = None) -> None:
        self.check(None, amsgrad)
        for t in self.storage():
            t.zero_()
        self.pending.clear()

    def export(self) -> dict:
        out = {k: torch.zeros(self.numel, dtype=torch.float32, device=self.device) for k in (FIRST, SECOND)}
        for s0, rows in self.maps.items():
            m, v = self.blocks(self, s0, rows).widen()
            out[FIRST][s0:s0 + rows.numel] = m
            out[SECOND][s0:s0 + rows.numel] = v
        return out

    def commit(self, exported: dict) -> None:
        """Held as float32 until the next step encodes them with agreed scales (the
        module's docstring); what an export shows meanwhile."""
        for s0, rows in self.maps.items():
            n = rows.numel
            self.pending[s0] = tuple(exported[k][s0:s0 + n].to(self.device, torch.float32).clone()
                                     for k in (FIRST, SECOND))

    def nbytes(self) -> int:
        held = sum(t.numel() * t.element_size() for pair in self.pending.values() for t in pair)
        return sum(t.numel() * t.element_size() for t in self.storage()) + held

    def storage(self) -> list:
        return [self.exp_avg, self.exp_avg_sq, self.scales]

    def table(self, s0: int) -> torch.Tensor:
        """The scales of every block of piece ``s0``'s rows, [rows, cols / block, 2]."""
        return self.tables[s0]

    def stored(self) -> dict:
        raise NotImplementedError(
            f"{self.format} moments of blocks cut across ranks have no flat checkpoint file form; "
            "save DTensor parameters' state through DCP (zero_triton.compact_state_dicts)")

    def carry_over(self, old) -> None:
        if type(old) is type(self) and old.numel == self.numel and old.maps.keys() == self.maps.keys():
            for mine, theirs in zip(self.storage(), old.storage()):
                mine.copy_(theirs)
            self.pending = {k: tuple(t.to(self.device) for t in v) for k, v in old.pending.items()}
            return
        self.commit({k: v.to(self.device, torch.float32) for k, v in old.export().items()
                     if k in (FIRST, SECOND)})
