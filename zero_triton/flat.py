"""Flat layout: parameters of one dtype and device packed into one buffer.

Each parameter starts at an offset aligned to ``align`` elements (16 elements: at least
32 bytes for fp16/bf16, 64 for fp32, enough for 16-byte vector loads); the buffer is
padded to a multiple of ``world_size * align`` so that every rank's shard
``[r*S, (r+1)*S)`` has the same size S, as ``reduce_scatter_tensor`` requires. The
offsets do not depend on the world size, only the trailing padding does: a checkpoint
written at one world size maps onto any other.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN = 16


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter of a flat buffer lives. Offsets and sizes in elements."""

    shapes: tuple
    offsets: tuple
    numel: int          # end of the last parameter
    padded_numel: int   # numel rounded up to a multiple of world_size * align
    world_size: int
    align: int = ALIGN

    @classmethod
    def build(cls, shapes, world_size: int = 1, align: int = ALIGN) -> "FlatLayout":
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        shapes = tuple(tuple(int(d) for d in s) for s in shapes)
        offsets, end = [], 0
        for s in shapes:
            offsets.append(end)
            end = _round_up(end + _numel(s), align)
        # end already sits on an alignment boundary; only the last parameter's tail
        # alignment is padding, count numel as the end of the data.
        numel = offsets[-1] + _numel(shapes[-1]) if shapes else 0
        padded = _round_up(max(numel, 1), world_size * align)
        return cls(shapes, tuple(offsets), numel, padded, world_size, align)

    def with_world_size(self, world_size: int) -> "FlatLayout":
        return FlatLayout.build(self.shapes, world_size, self.align)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        s = self.shard_numel
        return rank * s, (rank + 1) * s

    @property
    def padding(self) -> int:
        """Elements of the buffer that belong to no parameter (alignment and tail)."""
        return self.padded_numel - sum(_numel(s) for s in self.shapes)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One view of ``flat`` per parameter, shaped like it."""
        return [flat[o:o + _numel(s)].view(s) for o, s in zip(self.offsets, self.shapes)]

    def aliases(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Like ``views``, but each tensor has a storage of its own over its part of
        ``flat``'s memory (a slice of ``flat``'s storage, which keeps ``flat`` alive).
        Savers that take tensors sharing one storage for tied weights (safetensors,
        accelerate, transformers) then see each parameter as the separate tensor it is,
        and ``torch.save`` of one writes only its own bytes."""
        storage, base, size = flat.untyped_storage(), flat.storage_offset(), flat.element_size()
        out = []
        for o, s in zip(self.offsets, self.shapes):
            lo, hi = (base + o) * size, (base + o + _numel(s)) * size
            out.append(torch.empty(0, dtype=flat.dtype, device=flat.device).set_(storage[lo:hi], 0, s))
        return out

    def ranges_in(self, start: int, end: int):
        """(param index, lo, hi) for the part [lo, hi) of each parameter (in its own
        flat numbering) that falls inside the buffer range [start, end)."""
        for i, (o, s) in enumerate(zip(self.offsets, self.shapes)):
            lo, hi = max(start, o), min(end, o + _numel(s))
            if lo < hi:
                yield i, lo - o, hi - o


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _as_params(module_or_params):
    if isinstance(module_or_params, torch.nn.Module):
        return list(module_or_params.parameters())
    return list(module_or_params)


def flatten_params(module_or_params, *, world_size: int = 1, align: int = ALIGN,
                   rehome: bool = False):
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
    dtype, device = params[0].dtype, params[0].device
    for i, p in enumerate(params):
        if p.dtype != dtype or p.device != device:
            raise ValueError(
                f"flatten_params needs one dtype and device: parameter {i} is {p.dtype} on "
                f"{p.device}, parameter 0 is {dtype} on {device}; flatten each kind separately")
    layout = FlatLayout.build([p.shape for p in params], world_size, align)
    flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
    with torch.no_grad():
        for p, view in zip(params, layout.aliases(flat) if rehome else layout.views(flat)):
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
        layout = FlatLayout.build([p.shape for p in params])
    if len(layout.shapes) != len(params):
        raise ValueError(f"layout has {len(layout.shapes)} parameters, got {len(params)}")
    if flat.numel() < layout.numel:
        raise ValueError(f"flat has {flat.numel()} elements, the layout needs {layout.numel}")
    with torch.no_grad():
        for i, (p, view) in enumerate(zip(params, layout.views(flat))):
            if tuple(p.shape) != tuple(view.shape):
                raise ValueError(f"parameter {i} has shape {tuple(p.shape)}, the layout says {tuple(view.shape)}")
            if p.data_ptr() != view.data_ptr():
                p.copy_(view)
