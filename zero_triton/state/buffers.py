"""Where the library's buffers come from: one declared allocator instead of
``torch.empty`` at each site.

The flat buffers (``state.flat``), the local gradients (``comm.grads``), the buckets'
averages (``comm.buckets``), the staging pools (``comm.pools``) and the communicators'
payloads and scratch (``comm.group``, ``comm.hybrid``, ``comm.compressed``) ask a
``Buffers`` for their tensors (this layer is below all of them); a communicator
names the one it and its wrappers use (``Comm.buffers``). ``PLAIN`` hands out fresh
tensors from torch's allocator (its caching allocator on GPUs). Another implementation
of the same two methods (host-pinned memory for offloaded state, buffers reserved once
for a captured step) changes where every buffer lives without touching a call site.
"""
from __future__ import annotations

import math

import torch


class Buffers:
    """Fresh tensors from torch's allocator."""

    def empty(self, size, dtype: torch.dtype, device) -> torch.Tensor:
        """An uninitialised tensor of ``size`` (an int or a shape)."""
        return torch.empty(size, dtype=dtype, device=device)

    def zeros(self, size, dtype: torch.dtype, device) -> torch.Tensor:
        """A zeroed tensor of ``size`` (an int or a shape)."""
        return torch.zeros(size, dtype=dtype, device=device)

    def kept(self, key, size, dtype: torch.dtype, device) -> torch.Tensor:
        """The buffer of one use, named by ``key`` (a bucket's payload, clipping's
        norm): here a fresh one at every call (``Kept``: the same one)."""
        return self.empty(size, dtype, device)

    def constant(self, key, make) -> torch.Tensor:
        """A tensor whose value never changes, made by ``make()``: here made at every
        call (``Kept``: once, then handed out again)."""
        return make()

    def nbytes(self) -> int:
        """Bytes held between calls."""
        return 0


class Kept(Buffers):
    """Fresh tensors, except ``kept`` ones: made at the first call of each key and
    handed out again after, so that a captured step (capturable=True) reads and writes
    the same memory at every replay."""

    def __init__(self):
        self.held: dict = {}

    def kept(self, key, size, dtype: torch.dtype, device) -> torch.Tensor:
        full = (key, size, dtype, torch.device(device))
        t = self.held.get(full)
        if t is None:
            t = self.held[full] = self.empty(size, dtype, device)
        return t

    def constant(self, key, make) -> torch.Tensor:
        t = self.held.get(("constant", key))
        if t is None:
            t = self.held[("constant", key)] = make()
        return t

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.held.values())


PLAIN = Buffers()


class Scratch:
    """The intermediates of one site of a step (a DTensor local shard stepped through
    its rows), from ``buffers`` under ``key``: with ``Kept`` buffers (capturable=True) the
    same tensors at every step, so the step allocates nothing."""

    def __init__(self, buffers: Buffers, key, device):
        self.buffers, self.key, self.device = buffers, key, torch.device(device)

    def __call__(self, name, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        return self.buffers.kept((self.key, name), math.prod(shape), dtype, self.device).view(shape)

    def shaped(self, shape: tuple, prefix: str):
        """``tmp(name, dtype)`` of ``shape`` under ``prefix`` (``zero_triton.kernels.quant.scratch``)."""
        return lambda name, dtype: self((prefix, name), shape, dtype)
