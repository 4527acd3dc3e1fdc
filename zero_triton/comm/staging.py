"""ZeRO-2's staging: where a bucket's gradients wait from backward's hooks to its launch.

At stage 2 a rank keeps no full gradient buffer: each parameter's ``.grad`` is added
into its bucket's staging buffer and let go (``comm.hooks``), and the bucket's launch
averages that buffer into this rank's shard (``comm.buckets.Reducer.launch``). A staging
buffer comes from the pools (``comm.pools``, per dtype and device, shared by every flat
buffer of the optimizer) and goes back once the average that reads it is done: at the
wait on CPUs (the buffer is ``sending`` until then), at its event on a GPU.

A bucket of one parameter whose gradient fills it exactly takes autograd's gradient as
its staging buffer (``adopted``): no copy, and no pool buffer the size of the largest
parameter (embeddings, output layers). It is never written: a second micro-batch's
gradient before the launch moves it into a pool buffer first (``restaged``).

``OwnStaging`` (capturable=True, ``optim.capture``): each bucket stages into a buffer of
its own, the same at every step, so that a captured step's average reads its gradients
where backward wrote them at every replay; it holds every bucket's gradients until the
step, as stage 1 does.
"""
from __future__ import annotations

import torch

from zero_triton.state.buffers import PLAIN

# Larger blocks glibc maps afresh at every allocation (its mmap threshold grows only to
# this), paying a page fault per 4 KiB page each step (~0.85 ms per MiB measured on a
# 2-core CPU, 5x a copy): a bucket's averages that large are kept across steps on CPUs.
_C_HEAP_MAX_BYTES = 32 * 2**20


class Staged:
    """One ZeRO-2 bucket's staging: the buffer its gradients are added into until the
    launch (``buffer``; the bucket's ``grad_in`` views it), and on CPUs the one the
    average in flight reads (``sending``), each possibly autograd's own gradient."""

    __slots__ = ("pool", "buffer", "view", "adopted", "sending", "sending_adopted", "own")

    def __init__(self):
        self.pool = None          # the free staging buffers of the bucket's (dtype, device)
        self.buffer = None
        self.view = None          # the bucket's gradients in ``buffer`` (its ``grad_in``)
        self.adopted = False
        self.sending = None
        self.sending_adopted = False
        self.own = None           # ``OwnStaging``: the bucket's own buffer

    def use(self, pool) -> None:
        """Take staging buffers from ``pool`` (``comm.pools``: the free ones of the
        bucket's dtype and device)."""
        self.pool = pool

    def sent(self) -> None:
        """The CPU average that read ``sending`` is done: back to the pool (a gradient
        taken as it was just goes)."""
        if self.sending is not None:
            if not self.sending_adopted and self.sending is not self.own:
                self.pool.append((self.sending, None))
            self.sending = None

    def tensors(self) -> tuple:
        """What it holds now (for the bytes held)."""
        held = [t for t in (self.buffer, self.sending) if t is not None and t is not self.own]
        return tuple(held + ([self.own] if self.own is not None else []))


class Staging:
    """Where the buckets of one Reducer keep their buffers between backward and the step:
    the staging of every ZeRO-2 bucket, and whether averaged shards are kept
    (``keeps_averages``). ``pools``: its ``BufferPools``; ``in_flight``: its CPU averages
    in launch order (a full pool waits for the oldest). ``counts``: gradients taken as
    they were, and moved out again."""

    adopts = True  # a bucket of one parameter may take autograd's gradient as its buffer

    def __init__(self, pools, in_flight):
        self.pools = pools
        self.in_flight = in_flight
        self.counts = {"adopted": 0, "restaged": 0}

    @staticmethod
    def keeps_averages(device: torch.device, numel: int, dtype: torch.dtype) -> bool:
        """Whether a bucket's averaged shard (``numel`` of ``dtype`` on ``device``) is
        kept between steps rather than made during each backward: on GPUs the caching
        allocator hands its block to the next forward's activations and back for free;
        on CPUs only blocks the C heap recycles."""
        if device.type == "cuda":
            return False
        return numel * dtype.itemsize > _C_HEAP_MAX_BYTES

    def add(self, bucket, lo: int, hi: int, grad: torch.Tensor, adopt: bool = False) -> None:
        """Add a parameter's gradient into elements [lo, hi) of ``bucket``'s staging
        buffer (a new one when the last is still being sent: the next micro-batch).
        ``adopt``: the gradient is autograd's own, handed over (nobody else holds it), so
        a bucket of that one parameter may take it as its buffer (``adoptable``)."""
        if grad.is_complex():  # a complex parameter's gradient as (real, imaginary) pairs
            grad = torch.view_as_real(grad)
        staged = bucket.staged
        if staged.view is None and adopt and lo == 0 and self.adopts and adoptable(bucket, grad):
            staged.buffer = staged.view = grad.view(-1)
            staged.adopted = True
            self.counts["adopted"] += 1
            return
        if staged.adopted:  # another micro-batch's gradient: the adopted one is read only
            adopted = staged.view
            self._new(bucket)
            staged.view.copy_(adopted)
            self.counts["restaged"] += 1
        elif staged.view is None:
            self._new(bucket)
            staged.view.zero_()
        staged.view[lo:hi].add_(grad.reshape(-1))

    def ensure(self, bucket) -> None:
        """A launch of a bucket none of whose gradients arrived: this rank sends zeros."""
        if bucket.staged.view is None:
            self._new(bucket)
            bucket.staged.view.zero_()

    def launched(self, bucket, done=None) -> None:
        """The launch took the bucket's buffer: on a GPU (``done``: the average's
        event) it is free once that has passed (an adopted gradient is held until
        then); on CPUs it is ``sending`` until the wait. The next micro-batch stages into
        another buffer."""
        staged = bucket.staged
        if staged.buffer is staged.own:  # OwnStaging: it stays the bucket's
            staged.sending = staged.own if done is None else None
        elif done is not None:
            if staged.adopted:
                self.pools.hold(staged.buffer, done)
            else:
                staged.pool.append((staged.buffer, done))
        else:
            staged.sending, staged.sending_adopted = staged.buffer, staged.adopted
        staged.buffer = staged.view = None
        staged.adopted = False

    def drop(self, bucket) -> None:
        """``zero_grad`` before the launch: the gradients staged are dropped."""
        staged = bucket.staged
        if staged.buffer is not None:
            if not staged.adopted and staged.buffer is not staged.own:
                staged.pool.append((staged.buffer, None))
            staged.buffer = staged.view = None
            staged.adopted = False

    def _new(self, bucket) -> None:
        """A staging buffer for ``bucket`` (not zeroed): from the pool, after the oldest
        average in flight when it is empty, or a new one (handed back at step)."""
        buf = self.pools.take(bucket.staged.pool, bucket, "staging", True, self.in_flight)
        staged = bucket.staged
        staged.buffer, staged.adopted = buf, False
        staged.view = buf[:bucket.geometry.numel]


class OwnStaging(Staging):
    """Staging for a step a CUDA graph can capture: each bucket's own buffer, made at its
    first use and staged into at every step after, never a pool's or autograd's."""

    adopts = False

    @staticmethod
    def keeps_averages(device: torch.device, numel: int, dtype: torch.dtype) -> bool:
        """Always: a replay reads each average where the captured step did."""
        return True

    def _new(self, bucket) -> None:
        staged = bucket.staged
        if staged.own is None:
            staged.own = PLAIN.empty(bucket.geometry.numel, bucket.grad_dtype,
                                     bucket.param_full.device)
        staged.buffer, staged.adopted = staged.own, False
        staged.view = staged.own


def adoptable(bucket, grad: torch.Tensor) -> bool:
    """A bucket of one parameter whose gradient fills it exactly (no padding), of its
    dtype and contiguous: the gradient is the staging buffer (autograd made it for us;
    the hook lets go of ``.grad``)."""
    return (bucket.nparams == 1 and grad.numel() == bucket.geometry.numel
            and grad.dtype == bucket.grad_dtype and grad.device == bucket.param_full.device
            and grad.is_contiguous() and not grad.requires_grad)
