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

import torch


class Buffers:
    """Fresh tensors from torch's allocator."""

    def empty(self, size, dtype: torch.dtype, device) -> torch.Tensor:
        """An uninitialised tensor of ``size`` (an int or a shape)."""
        return torch.empty(size, dtype=dtype, device=device)

    def zeros(self, size, dtype: torch.dtype, device) -> torch.Tensor:
        """A zeroed tensor of ``size`` (an int or a shape)."""
        return torch.zeros(size, dtype=dtype, device=device)


PLAIN = Buffers()
