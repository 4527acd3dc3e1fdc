"""The optimizer state seen per parameter: the one view every way out of the state
builds on (torch's format on one rank, gathered or served; DCP's shards; the compact
form; the loads of each; ``opt.state``'s edits).

Parameter ``i`` of a flat buffer holds ``layout.shapes[i]`` elements (a complex one's
``view_as_real``) at ``layout.offsets[i]``, in its memory order (``layout.strides[i]``,
contiguous when None). A rank's state holds, of each parameter, at most one run of
those elements, since a parameter lies in one bucket and a rank owns one range of each
bucket: ``Run(index, a, b, at)``, elements [a, b) of parameter ``index``, held at
``at`` in that rank's state. A whole per-parameter value, as torch's format holds it
(the parameter's shape, any strides, complex for a complex parameter), is read and
written through ``elements(i, value)``: its elements in that memory order, 1-D.

The two directions every way out of the state takes are here: ``unpack`` copies a
rank's state (a chunk of it) out into whole per-parameter values, ``pack`` copies this
rank's elements of given values (whole ones, or ``Pieces`` of them as a DCP load gives)
in. ``optim/export.py`` builds torch's format on them; DCP's boxes are cut from
``owned`` runs; checkpoint files read and write ``canonical`` ranges; none of them
computes where a parameter's elements sit in a shard on its own
(``tests/test_layers.py`` holds that).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from zero_triton.state.flat import FlatLayout, contiguous_strides, memory_order


class Run(NamedTuple):
    """Elements [a, b) of parameter ``index`` (in its memory order), held at ``at`` in a
    rank's state."""

    index: int
    a: int
    b: int
    at: int


class Pieces:
    """Runs of one per-parameter value's elements in flat order, ``(first element, 1-D
    tensor)``, under the parameter's ``shape``: this rank's part of it, as a DCP load
    gives it (``zero_triton.optim.sharded_state.localized``)."""

    def __init__(self, shape, runs):
        self.shape = torch.Size(shape)
        self.runs = runs

    def is_complex(self) -> bool:
        return False

    def covers(self, a: int, b: int) -> bool:
        """Whether the runs hold every element of [a, b)."""
        for start, run in self.runs:
            end = start + run.numel()
            if start <= a < end:
                a = end
            if a >= b:
                return True
        return a >= b

    def range(self, a: int, b: int) -> torch.Tensor:
        """Elements [a, b), flat (``covers(a, b)`` was checked)."""
        parts = [run[max(a, start) - start:min(b, start + run.numel()) - start]
                 for start, run in self.runs if start < b and a < start + run.numel()]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class ParamView:
    """Where each parameter's state lives in every rank's shard of one flat buffer.
    ``segments``: this rank's (buffer lo, buffer hi, state offset) per segment, as its
    shard holds them (the layout's own for a flat buffer; one per local tensor for the
    engine's DTensor shards)."""

    def __init__(self, layout: FlatLayout, segments):
        self.layout = layout
        self.segments = list(segments)
        self._mine = None  # this rank's runs over all of its state (read per state by a load)

    def segments_of(self, rank: int | None = None) -> list[tuple[int, int, int]]:
        """(buffer lo, buffer hi, state offset) of each segment of ``rank``'s state (this
        rank's for None): the ranges our own collectives move as one."""
        return self.segments if rank is None else self.layout.shard_segments(rank)

    def runs(self, rank: int | None = None, lo: int = 0, hi: int | None = None) -> list[Run]:
        """The runs of ``rank``'s state [lo, hi) (this rank's for None; all of it by
        default), in state order."""
        whole = rank is None and lo == 0 and hi is None  # this rank's, all: computed once
        if whole and self._mine is not None:
            return list(self._mine)
        layout = self.layout
        hi = layout.shard_numel if hi is None else hi
        out = []
        for b_lo, b_hi, s0 in self.segments_of(rank):  # state [s0, s0 + b_hi - b_lo) is buffer [b_lo, b_hi)
            s_a, s_b = max(s0, lo), min(s0 + b_hi - b_lo, hi)
            if s_a >= s_b:
                continue
            start = b_lo + s_a - s0
            out.extend(Run(i, a, b, layout.offsets[i] + a - b_lo + s0)
                       for i, a, b in layout.ranges_in(start, start + s_b - s_a))
        if whole:
            self._mine = tuple(out)
        return out

    def owned(self, rank: int | None = None) -> dict[int, Run]:
        """{parameter index: its run} of ``rank``'s state (this rank's for None)."""
        return {run.index: run for run in self.runs(rank)}

    def canonical(self, rank: int) -> list[tuple[int, int, int]]:
        """(canonical lo, canonical hi, state offset) of ``rank``'s state: its runs in the
        coordinates checkpoint files keep (``FlatLayout.canonical``: one bucket, world
        size 1), merged across the alignment gaps between parameters, so a file holds a
        few long ranges, not one per parameter."""
        return self.layout.canonical_segments(rank)

    def stride(self, i: int) -> tuple:
        """Parameter ``i``'s strides in the flat buffer (its memory order)."""
        return self.layout.strides[i] or contiguous_strides(self.layout.shapes[i])

    def empty(self, i: int, dtype: torch.dtype, device="cpu") -> torch.Tensor:
        """A new tensor for a whole state value of parameter ``i``: its shape in the flat
        buffer and its memory order, so that ``elements`` is a view of it."""
        return torch.empty_strided(self.layout.shapes[i], self.stride(i), dtype=dtype,
                                   device=device)

    def elements(self, i: int, value: torch.Tensor) -> torch.Tensor:
        """A whole state value of parameter ``i`` (complex for a complex parameter) as its
        elements in the flat buffer's order, 1-D: a view when ``value`` is laid out that
        way (what ``empty`` makes, a contiguous tensor of a contiguous parameter), a
        copy otherwise."""
        if value.is_complex():
            value = torch.view_as_real(value)
        stride = self.layout.strides[i]
        if stride is None:
            return value.reshape(-1)
        if tuple(value.stride()) == tuple(stride):
            return value.as_strided((value.numel(),), (1,))
        return memory_order(value, stride)

    def unpack(self, rank: int, c: int, part: torch.Tensor, values: list) -> None:
        """Copy ``part``, elements [c, c + part.numel()) of ``rank``'s state, into the whole
        per-parameter ``values`` (by parameter index, each laid out as ``empty`` makes)."""
        for i, a, b, at in self.runs(rank, c, c + part.numel()):
            self.elements(i, values[i])[a:b].copy_(part[at - c:at - c + b - a])

    def pack(self, values: list, buf: torch.Tensor) -> None:
        """Copy this rank's elements of each given per-parameter value (by parameter index;
        None: none given) into ``buf``, this rank's state: a whole value is read in the
        flat buffer's memory order (channels_last keeps its own; complex: pairs),
        ``Pieces`` by their runs (``uncovered`` was checked)."""
        for i, a, b, at in self.runs():
            value = values[i]
            if value is not None:
                given = value.range(a, b) if isinstance(value, Pieces) else self.elements(i, value)[a:b]
                buf[at:at + b - a].copy_(given)

    def uncovered(self, values: list) -> tuple[int, int, int] | None:
        """The first (index, a, b) of this rank's runs whose elements a ``Pieces`` value
        of ``values`` lacks (a DCP load that was not resharded to this layout), or None."""
        for i, a, b, _ in self.runs():
            if isinstance(values[i], Pieces) and not values[i].covers(a, b):
                return i, a, b
        return None
