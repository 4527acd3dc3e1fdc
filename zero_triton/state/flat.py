"""Flat layout: parameters of one dtype and device packed into one buffer.

Each parameter starts at an offset aligned to ``align`` elements (16 elements: at least
32 bytes for fp16/bf16, 64 for fp32, enough for 16-byte vector loads). The *canonical*
layout packs them one after another; it depends on the shapes only, and it is what
checkpoints record, so a checkpoint maps onto any world size and any bucket size.

The buffer itself is cut into buckets (``bucket_numel``: elements per bucket, None for
one bucket), each a run of consecutive parameters, filled from the last parameter
backwards (the order backward produces gradients) and padded to a multiple of
``world_size * align``: every bucket is sharded over the ranks on its own, rank r
owning ``[start + r*S_b, start + (r+1)*S_b)`` of bucket b, so a bucket's gradients can
be reduce-scattered as soon as they are final. A rank's optimizer state is its shards
of every bucket, one after another (``shard_segments``). Within a bucket the offsets
are the canonical ones shifted by one constant; with one bucket they are equal.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zero_triton.state.buffers import PLAIN

ALIGN = 16


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class Bucket:
    """Parameters [first, end) of a flat buffer, sharded over the ranks on their own."""

    first: int
    end: int
    start: int            # buffer offset
    numel: int            # padded size: a multiple of world_size * align
    canonical_start: int  # its data [canonical_start, canonical_end) in the canonical layout
    canonical_end: int
    shard_numel: int      # numel // world_size
    shard_start: int      # where its shard starts in a rank's state

    def shard_range(self, rank: int) -> tuple[int, int]:
        lo = self.start + rank * self.shard_numel
        return lo, lo + self.shard_numel


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter of a flat buffer lives. Offsets and sizes in elements."""

    shapes: tuple
    offsets: tuple            # in the buffer
    numel: int                # end of the last parameter in the canonical layout
    padded_numel: int         # the buffer's size
    world_size: int
    align: int = ALIGN
    buckets: tuple = ()
    canonical_offsets: tuple = ()
    bucket_numel: int | None = None
    # Per parameter: its strides over its slice when they are not the contiguous ones
    # (channels_last, or any dense layout: the slice holds it in memory order), else None.
    strides: tuple = ()

    @classmethod
    def build(cls, shapes, world_size: int = 1, align: int = ALIGN,
              bucket_numel: int | None = None, strides=None) -> "FlatLayout":
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if bucket_numel is not None and bucket_numel < 1:
            raise ValueError(f"bucket_numel must be >= 1 or None, got {bucket_numel}")
        shapes = tuple(tuple(int(d) for d in s) for s in shapes)
        strides = tuple(None if st is None else tuple(int(d) for d in st)
                        for st in (strides or [None] * len(shapes)))
        if len(strides) != len(shapes):
            raise ValueError(f"{len(strides)} strides for {len(shapes)} shapes")
        canonical, end = [], 0
        for s in shapes:
            canonical.append(end)
            end = _round_up(end + _numel(s), align)
        # end already sits on an alignment boundary; only the last parameter's tail
        # alignment is padding, count numel as the end of the data.
        numel = canonical[-1] + _numel(shapes[-1]) if shapes else 0
        unit = world_size * align
        offsets, buckets, start, shard_start = [], [], 0, 0
        for first, last in _bucket_runs(shapes, bucket_numel):
            c0 = canonical[first] if shapes else 0
            c1 = canonical[last] if last < len(shapes) else numel
            size = _round_up(max(c1 - c0, 1), unit)
            offsets.extend(o - c0 + start for o in canonical[first:last])
            buckets.append(Bucket(first, last, start, size, c0, c1, size // world_size, shard_start))
            start += size
            shard_start += size // world_size
        return cls(shapes, tuple(offsets), numel, start, world_size, align, tuple(buckets),
                   tuple(canonical), bucket_numel, strides)

    def with_world_size(self, world_size: int) -> "FlatLayout":
        return FlatLayout.build(self.shapes, world_size, self.align, self.bucket_numel, self.strides)

    @property
    def canonical(self) -> "FlatLayout":
        """The same parameters in one bucket at world size 1: the layout checkpoints keep."""
        return FlatLayout.build(self.shapes, 1, self.align, strides=self.strides)

    @property
    def shard_numel(self) -> int:
        """Elements of a rank's state: its shard of every bucket."""
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """A rank's shard as one range of the buffer (a layout of one bucket only)."""
        if len(self.buckets) != 1:
            raise ValueError(f"a layout of {len(self.buckets)} buckets has no single shard "
                             "range; use shard_segments")
        return self.buckets[0].shard_range(rank)

    def shard_segments(self, rank: int) -> list[tuple[int, int, int]]:
        """(buffer lo, buffer hi, state offset) of each bucket's shard of ``rank``."""
        return [(*b.shard_range(rank), b.shard_start) for b in self.buckets]

    def canonical_segments(self, rank: int) -> list[tuple[int, int, int]]:
        """(canonical lo, canonical hi, state offset): the parameter data (padding between
        buckets left out) that ``rank``'s state holds, in canonical coordinates."""
        out = []
        for b in self.buckets:
            lo, hi = b.shard_range(rank)
            c_lo = b.canonical_start + lo - b.start
            c_hi = min(b.canonical_start + hi - b.start, b.canonical_end)
            if c_lo < c_hi:
                out.append((c_lo, c_hi, b.shard_start))
        return out

    def to_canonical(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat``'s data as views that, concatenated, are its canonical layout."""
        return [flat[b.start:b.start + b.canonical_end - b.canonical_start] for b in self.buckets]

    @property
    def padding(self) -> int:
        """Elements of the buffer that belong to no parameter (alignment and tail)."""
        return self.padded_numel - sum(_numel(s) for s in self.shapes)

    def numels(self) -> list[int]:
        """Each parameter's number of elements."""
        return [_numel(s) for s in self.shapes]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One view of ``flat`` per parameter, shaped (and strided) like it."""
        return [shaped(flat[o:o + _numel(s)], s, st)
                for o, s, st in zip(self.offsets, self.shapes, self.strides)]

    def aliases(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Like ``views``, but each tensor has a storage of its own over its part of
        ``flat``'s memory (a slice of ``flat``'s storage, which keeps ``flat`` alive).
        Savers that take tensors sharing one storage for tied weights (safetensors,
        accelerate, transformers) then see each parameter as the separate tensor it is,
        and ``torch.save`` of one writes only its own bytes."""
        storage, base, size = flat.untyped_storage(), flat.storage_offset(), flat.element_size()
        out = []
        for o, s, st in zip(self.offsets, self.shapes, self.strides):
            lo, hi = (base + o) * size, (base + o + _numel(s)) * size
            out.append(torch.empty(0, dtype=flat.dtype, device=flat.device).set_(
                storage[lo:hi], 0, s, st if st is not None else contiguous_strides(s)))
        return out

    def ranges_in(self, start: int, end: int):
        """(param index, lo, hi) for the part [lo, hi) of each parameter (in its own
        flat numbering) that falls inside the buffer range [start, end)."""
        for i, (o, s) in enumerate(zip(self.offsets, self.shapes)):
            lo, hi = max(start, o), min(end, o + _numel(s))
            if lo < hi:
                yield i, lo - o, hi - o


def _bucket_runs(shapes, bucket_numel):
    """(first, end) parameter runs, filled from the last parameter backwards with at
    most ``bucket_numel`` elements each (a larger parameter gets a bucket of its own)."""
    n = len(shapes)
    if bucket_numel is None or n == 0:
        return [(0, n)]
    runs, end, size = [], n, 0
    for i in range(n - 1, -1, -1):
        k = _numel(shapes[i])
        if end > i + 1 and size + k > bucket_numel:
            runs.append((i + 1, end))
            end, size = i + 1, 0
        size += k
    runs.append((0, end))
    return runs[::-1]


def contiguous_strides(shape) -> tuple:
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= max(d, 1)
    return tuple(reversed(out))


def shaped(run: torch.Tensor, shape, stride=None) -> torch.Tensor:
    """A 1-D run of ``numel(shape)`` elements seen with ``shape`` (and ``stride``)."""
    return run.view(shape) if stride is None else run.as_strided(shape, stride)


def is_dense(shape, stride) -> bool:
    """``stride`` lays ``shape`` out densely, without overlap: numel elements exactly."""
    expected = 1
    for st, d in sorted((st, d) for st, d in zip(stride, shape) if d != 1):
        if st != expected:
            return False
        expected *= d
    return True


def dense_strides(p: torch.Tensor):
    """``p``'s strides when they are a dense, non-overlapping layout other than the
    contiguous one (channels_last, a transposed weight made contiguous that way): its
    place in a flat buffer keeps them. None otherwise (contiguous, or a view with gaps,
    which is packed contiguously)."""
    if p.is_complex() or p.dim() < 2 or p.is_contiguous() or not is_dense(p.shape, p.stride()):
        return None
    return tuple(p.stride())


def memory_order(t: torch.Tensor, stride) -> torch.Tensor:
    """``t``'s values as a 1-D tensor in the memory order of ``stride`` (its flat-buffer
    order; ``t.reshape(-1)`` when None)."""
    if stride is None:
        return t.reshape(-1)
    dense = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device)
    dense.copy_(t)
    return dense.as_strided((t.numel(),), (1,))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def real_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a flat buffer holds ``dtype`` in: a complex parameter lives in a buffer
    of its real dtype as (real, imaginary) pairs, as ``torch.view_as_real`` lays it out."""
    return {torch.complex64: torch.float32, torch.complex128: torch.float64}.get(dtype, dtype)


def real_shape(p: torch.Tensor) -> tuple:
    """The shape a parameter has in a flat buffer (a complex one's ``view_as_real``)."""
    return tuple(p.shape) + (2,) if p.is_complex() else tuple(p.shape)


def as_param(view: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``view`` (laid out as ``real_shape(like)``) seen as ``like`` sees it: complex for a
    complex parameter."""
    return torch.view_as_complex(view) if like.is_complex() else view


def _as_params(module_or_params):
    if isinstance(module_or_params, torch.nn.Module):
        return list(module_or_params.parameters())
    return list(module_or_params)


def flatten_params(module_or_params, *, world_size: int = 1, align: int = ALIGN,
                   rehome: bool = False, bucket_numel: int | None = None):
    """Pack parameters (a module's, or a list) into one new flat buffer.

    Returns ``(flat, layout)``: ``flat`` is a 1-D tensor of ``layout.padded_numel``
    elements of the parameters' dtype and device, padding zeroed. With
    ``rehome=True`` every parameter's ``.data`` lives in ``flat`` (the optimizers do
    this), so the buffer *is* the model's storage afterwards; each parameter keeps a
    storage of its own over its part of it (``FlatLayout.aliases``).
    All parameters must share dtype and device.
    """
    params = _as_params(module_or_params)
    if not params:
        raise ValueError("flatten_params got no parameters")
    dtype, device = real_dtype(params[0].dtype), params[0].device
    for i, p in enumerate(params):
        if real_dtype(p.dtype) != dtype or p.device != device:
            raise ValueError(
                f"flatten_params needs one dtype and device: parameter {i} is {p.dtype} on "
                f"{p.device}, parameter 0 is {params[0].dtype} on {device}; flatten each kind "
                "separately")
    layout = FlatLayout.build([real_shape(p) for p in params], world_size, align, bucket_numel,
                              [dense_strides(p) for p in params])
    flat = PLAIN.zeros(layout.padded_numel, dtype, device)
    with torch.no_grad():
        own = rehome and device.type != "meta"  # meta storages cannot be sliced; nothing to save
        for p, view in zip(params, layout.aliases(flat) if own else layout.views(flat)):
            view = as_param(view, p)
            view.copy_(p)
            if rehome:
                p.data = view
    return flat, layout


def unflatten_into(module_or_params, flat: torch.Tensor, layout: FlatLayout | None = None) -> None:
    """Copy the parameters' values out of ``flat`` (laid out by ``layout``, by default
    the one ``flatten_params`` builds for these parameters). Parameters already living
    in ``flat`` are left alone."""
    params = _as_params(module_or_params)
    if layout is None:
        layout = FlatLayout.build([real_shape(p) for p in params])
    if len(layout.shapes) != len(params):
        raise ValueError(f"layout has {len(layout.shapes)} parameters, got {len(params)}")
    if flat.numel() < layout.numel:
        raise ValueError(f"flat has {flat.numel()} elements, the layout needs {layout.numel}")
    with torch.no_grad():
        for i, (p, view) in enumerate(zip(params, layout.views(flat))):
            if real_shape(p) != tuple(view.shape):
                raise ValueError(f"parameter {i} has shape {tuple(p.shape)}, the layout says {tuple(view.shape)}")
            if p.data_ptr() != view.data_ptr():
                p.copy_(as_param(view, p))
