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

from .int8 import ALIGN, BLOCK
from .keys import FIRST, SECOND
from .lowbit import NoMaximum

MAGNITUDE = 0x7FFFFFFF


class RowBlocks:
    """The int8 moments of one piece whose blocks are cut (its launch's third operand):
    decoded before the step, encoded after it with the scales its sharers agree on."""

    def __init__(self, store: "Int8RowMoments", s0: int, rows):
        self.store, self.s0, self.map = store, s0, rows
        self.first = rows.first_block(BLOCK)
        self.count = rows.blocks(BLOCK)
        self.offset = rows.c0 - self.first * BLOCK  # where the part starts in its first block

    @property
    def table(self) -> torch.Tensor:
        return self.store.tables[self.s0]

    def _per_element(self, table: torch.Tensor) -> torch.Tensor:
        """Each local element's scales, float32 [numel, 2], from a table of its rows."""
        mine = table[:, self.first:self.first + self.count]  # [rows, count, 2]
        wide = mine[:, :, None, :].expand(-1, -1, BLOCK, -1).reshape(mine.shape[0], -1, 2)
        return wide[:, self.offset:self.offset + self.map.width].reshape(-1, 2)

    def widen(self) -> tuple:
        """The moments in float32 (fresh tensors): the pending ones, or decoded."""
        pending = self.store.pending.get(self.s0)
        if pending is not None:
            return pending[0].clone(), pending[1].clone()
        n = self.map.numel
        first, second = (t[self.s0:self.s0 + n] for t in (self.store.exp_avg, self.store.exp_avg_sq))
        scales = self._per_element(self.table)
        return (quant.decode_each(first, scales[:, 0], quant.FIRST),
                quant.decode_each(second, scales[:, 1], quant.SECOND))

    def maxima(self, m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """int32 [rows, cols / 256, 2]: the largest magnitude's bits of this rank's part of
        each block of its rows (zero where it holds none; NaN the largest, as in the
        kernels), for a MAX all-reduce among the ranks that share the rows."""
        rows = self.map.rows.numel()
        out = torch.zeros(rows, self.map.cols // BLOCK, 2, dtype=torch.int32, device=m.device)
        if not rows or not self.map.width:
            return out
        for col, x in enumerate((m, v)):
            bits = x.reshape(rows, self.map.width).view(torch.int32) & MAGNITUDE
            padded = torch.zeros(rows, self.count * BLOCK, dtype=torch.int32, device=m.device)
            padded[:, self.offset:self.offset + self.map.width] = bits
            out[:, self.first:self.first + self.count, col] = padded.view(rows, self.count, BLOCK).amax(-1)
        return out

    def narrow(self, m: torch.Tensor, v: torch.Tensor, agreed: torch.Tensor) -> None:
        """Keep the agreed scales (``agreed``: ``maxima``'s all-reduced bits) and encode
        ``m`` and ``v`` with them."""
        table = self.table
        table.copy_(agreed.to(table.device).view(torch.float32))
        scales = self._per_element(table)
        n = self.map.numel
        self.store.exp_avg[self.s0:self.s0 + n] = quant.encode_each(m, scales[:, 0], quant.FIRST)
        self.store.exp_avg_sq[self.s0:self.s0 + n] = quant.encode_each(v, scales[:, 1], quant.SECOND)
        self.store.pending.pop(self.s0, None)


class Int8RowMoments(NoMaximum):
    """exp_avg and exp_avg_sq of DTensor local shards whose blocks are cut across ranks
    (``maps``: each piece's ``RowMap`` by its state offset): ``Int8Moments``' codes, and
    the scales by row (the module's docstring)."""

    format = "int8"
    align = ALIGN
    block = BLOCK
    live = False   # export() is a decoded copy
    keyed = False  # rounding to nearest

    def __init__(self, numel: int, dtype: torch.dtype, device, amsgrad: bool = False, *, maps: dict):
        self.check(dtype, amsgrad)
        self.numel, self.dtype, self.device = numel, dtype, device
        self.exp_avg = torch.zeros(numel, dtype=quant.FIRST.dtype, device=device)
        self.exp_avg_sq = torch.zeros(numel, dtype=quant.SECOND.dtype, device=device)
        self.maps = dict(maps)
        sizes = {s0: (m.rows.numel(), m.cols // BLOCK) for s0, m in self.maps.items()}
        self.scales = torch.zeros(sum(r * k for r, k in sizes.values()), 2, dtype=torch.float32,
                                  device=device)
        self.tables, at = {}, 0
        for s0, (r, k) in sizes.items():
            self.tables[s0] = self.scales[at:at + r * k].view(r, k, 2)
            at += r * k
        self.pending: dict = {}  # state offset -> (exp_avg, exp_avg_sq) float32, not yet encoded

    def operands(self, a: int, b: int, amsgrad: bool) -> tuple:
        self.check(None, amsgrad)
        rows = self.maps.get(a)
        if rows is None or b - a != rows.numel:
            raise ValueError(f"int8 moments of cut blocks are stepped a whole local shard at a "
                             f"time, got state elements [{a}, {b})")
        return self.exp_avg[a:b], self.exp_avg_sq[a:b], RowBlocks(self, a, rows)

    def reset(self, amsgrad: bool | None = None) -> None:
        self.check(None, amsgrad)
        for t in self.storage():
            t.zero_()
        self.pending.clear()

    def export(self) -> dict:
        out = {k: torch.zeros(self.numel, dtype=torch.float32, device=self.device) for k in (FIRST, SECOND)}
        for s0, rows in self.maps.items():
            m, v = RowBlocks(self, s0, rows).widen()
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
        """The scales of every block of piece ``s0``'s rows, [rows, cols / 256, 2]."""
        return self.tables[s0]

    def stored(self) -> dict:
        raise NotImplementedError(
            "int8 moments of blocks cut across ranks have no flat checkpoint file form; "
            "save DTensor parameters' state through DCP (zero_triton.compact_state_dicts)")

    def carry_over(self, old) -> None:
        if isinstance(old, Int8RowMoments) and old.numel == self.numel and old.maps.keys() == self.maps.keys():
            for mine, theirs in zip(self.storage(), old.storage()):
                mine.copy_(theirs)
            self.pending = {k: tuple(t.to(self.device) for t in v) for k, v in old.pending.items()}
            return
        self.commit({k: v.to(self.device, torch.float32) for k, v in old.export().items()
                     if k in (FIRST, SECOND)})
