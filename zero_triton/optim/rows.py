"""Where a DTensor parameter's local shard lies in the whole parameter, as rows: the
geometry that keeps its state a function of the global parameter at every layout.

A parameter is seen as rows (its first dimension) of ``cols`` elements (the rest,
flattened), the view its int8 blocks are cut in (runs of 256 of a row). Every placement a
DTensor can have splits rows whole (``Shard(0)``, FSDP's ``_StridedShard(0)`` over tensor
parallelism, uneven and empty local shards) or cuts each row (``Shard(d)``, d >= 1: a
RowwiseParallel weight). ``RowMap`` says, for one rank, which global rows its local shard
holds (``rows``) and which run of each row (``[c0, c0 + width)``), so that

- each local element's global index (its stochastic-rounding key) is known at every
  layout: ``base + rows[r] * cols + c0 + c``, one run (``affine``) where the rows are
  consecutive and whole, else computed per element (``index``);
- an int8 block of a row that a cut splits across ranks (``straddles``) is known, with the
  ranks that share it (``groups``: the mesh dimensions that cut rows), so that they agree
  on its scale (``zero_triton.optim.launch.RowsLaunch``).

What a rank cannot step exactly by this view (a row cut into more than one run on one
rank: two dimensions after the first split, or a split dimension after one longer than 1)
has ``runs == False``; it is refused where its format needs the view (``check``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def _splits(placement, dim: int) -> bool:
    """Whether ``placement`` shards tensor dimension ``dim`` (``Shard``, ``_StridedShard``)."""
    return (not placement.is_replicate() and not placement.is_partial()
            and getattr(placement, "dim", None) is not None and placement.dim == dim)


def local_indices(p, dim: int) -> torch.Tensor:
    """The global indices along dimension ``dim`` of ``p``'s local shard, by DTensor's own
    sharding of an arange (no communication: each rank takes its own part)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    placements = []
    for pl in p.placements:
        if not _splits(pl, dim):
            placements.append(Replicate())
        elif type(pl) is Shard:
            placements.append(Shard(0))
        else:  # a strided shard keeps its split factor
            placements.append(type(pl)(0, split_factor=pl.split_factor))
    idx = torch.arange(p.shape[dim], dtype=torch.int64)
    return distribute_tensor(idx, p.device_mesh, placements, src_data_rank=None)._local_tensor


@dataclass(frozen=True)
class RowMap:
    """One rank's local shard of a DTensor parameter, as rows of the global parameter."""

    name: str        # the parameter, for errors
    rows: torch.Tensor  # int64 [local rows]: each local row's global row
    cols: int        # elements per row of the global parameter
    c0: int          # the first element of each row held here
    width: int       # elements of each row held here (cols where rows are whole)
    runs: bool       # whether each local row is one run of its global row
    base: int        # the parameter's first element in the canonical layout (rounding keys)
    groups: tuple    # the process groups of the mesh dimensions that cut rows
    placements: tuple

    @property
    def numel(self) -> int:
        return self.rows.numel() * self.width

    @property
    def consecutive(self) -> bool:
        n = self.rows.numel()
        return n <= 1 or bool((self.rows[1:] - self.rows[:-1] == 1).all())

    @property
    def affine(self) -> bool:
        """Whether the local elements' global indices are one run (one key start)."""
        return self.runs and self.consecutive and (self.width == self.cols or self.rows.numel() <= 1)

    def start(self) -> int:
        """The canonical index of the local shard's first element (``affine`` maps)."""
        first = int(self.rows[0]) if self.rows.numel() else 0
        return self.base + first * self.cols + self.c0

    def index(self, device) -> torch.Tensor:
        """Every local element's canonical index, int64 [numel], in local order."""
        rows = self.rows.to(device)
        cols = torch.arange(self.c0, self.c0 + self.width, dtype=torch.int64, device=device)
        return (self.base + rows[:, None] * self.cols + cols[None, :]).reshape(-1)

    def straddles(self, block: int) -> bool:
        """Whether some block of ``block`` elements of a row lies partly on another rank."""
        return block > 1 and self.width < self.cols and bool(self.c0 % block or self.width % block)

    # -- the blocks of this rank's part of each row (``block`` elements each) -----------
    def first_block(self, block: int) -> int:
        return self.c0 // block

    def blocks(self, block: int) -> int:
        """Blocks of a row that this rank holds a part of."""
        if not self.width:
            return 0
        return (self.c0 + self.width - 1) // block - self.c0 // block + 1

    def check(self, why: str) -> None:
        """Refuse a map the row view cannot step exactly, naming why it is needed."""
        if not self.runs:
            raise ValueError(
                f"{self.name} has placements {self.placements}: each of its rows is cut into "
                f"more than one run on a rank, and {why} needs each rank's part of a row to be "
                "one run. Shard it on its first dimension or on one dimension whose "
                "preceding dimensions after the first are 1 (a Linear weight's Shard(0) or "
                "Shard(1)), or give it a param group with moments='fp32' and "
                "master_weights=True")


def row_map(p, name: str, base: int) -> RowMap:
    """``p``'s ``RowMap`` on this rank (``base``: its first element's canonical index)."""
    shape = tuple(p.shape)
    if not shape:
        shape = (1,)
    local = tuple(p._local_tensor.shape) or (1,)
    cols = math.prod(shape[1:])
    rows = local_indices(p, 0) if len(tuple(p.shape)) else torch.zeros(1, dtype=torch.int64)
    cut = [d for d in range(1, len(shape)) if any(_splits(pl, d) for pl in p.placements)]
    runs, c0, width = True, 0, cols
    if len(cut) > 1 or (cut and math.prod(shape[1:cut[0]]) != 1):
        runs = False
    elif cut:
        d = cut[0]
        along = local_indices(p, d)
        inner = math.prod(shape[d + 1:])
        n = along.numel()
        if n and not bool((along[1:] - along[:-1] == 1).all()):
            runs = False
        c0 = (int(along[0]) if n else 0) * inner
        width = n * inner
    if runs and math.prod(local) != rows.numel() * width:
        runs = False  # a placement this view does not know
    groups = tuple(p.device_mesh.get_group(m) for m, pl in enumerate(p.placements)
                   if any(_splits(pl, d) for d in range(1, len(shape)))
                   and p.device_mesh.size(m) > 1)
    return RowMap(name, rows, cols, c0, width, runs, base, groups, tuple(p.placements))
