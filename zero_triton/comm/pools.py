"""The reusable buffers of a Reducer's buckets (``zero_triton.comm.buckets``): what the
gradient averages cost beyond the gradients.

Per (dtype, device) of the gradients, a pool of receive scratch for the reduce-scatters
(both stages; none at two ranks on gloo) and, at ZeRO-2, a pool of staging buffers that
hold a bucket's gradients from backward's hooks to its launch. Each entry is ``(buffer,
Done or None)``: on a GPU a staging buffer is free once the event of the average that
read it has passed. Buffers are made when first needed, at the size the bucket needs,
up to ``limit`` of each kind; past it a free one too small makes way, or the oldest
average in flight is waited for. On a GPU, ZeRO-2's gradients taken as they were (a
bucket of one parameter: ``zero_triton.comm.staging``) are held here with their event
until sent.
"""
from __future__ import annotations

import torch

from zero_triton.state.buffers import PLAIN


def kind(bucket) -> tuple:
    """The pool a bucket draws from: its gradients' (dtype, device)."""
    return (bucket.grad_dtype, bucket.param_full.device)


class BufferPools:
    """``comm``: the communicator (how much scratch a reduce-scatter needs);
    ``max_in_flight``: buffers of one kind made before waiting on CPUs (twice that on a
    GPU, where a wait stalls the compute stream); ``side_of(device)``: the device's side
    stream, None on CPUs."""

    def __init__(self, comm, max_in_flight: int, side_of):
        self.comm = comm
        self.max_in_flight = max(1, max_in_flight)
        self.side_of = side_of
        self.recv: dict = {}      # (dtype, device) -> free receive scratch
        self.staging: dict = {}   # (dtype, device) -> free ZeRO-2 staging buffers
        self.made: dict = {}      # (role, kind) -> buffers made and not let go
        self.into_out: dict = {}  # kind -> every bucket's average lands in its shard's dtype
        self.held: list = []      # GPU: (adopted gradient, Done of the average sending it)

    def rebuild(self, buckets) -> None:
        """New pools for ``buckets`` (the Reducer's), each bucket pointed at its own."""
        into_out: dict = {}
        for b in buckets:
            k = kind(b)
            into_out[k] = into_out.get(k, True) and b.out_dtype == b.grad_dtype
        self.recv, self.staging, self.into_out, self.made = {}, {}, into_out, {}
        for b in buckets:
            k = kind(b)
            # Receive scratch is sized for an average into the shard (ZeRO-2's later
            # averages of a step, added to the shard, take one chunk more for the launch:
            # zero_triton.comm.group).
            if self.comm.recv_numel(b.geometry.numel, into_out[k]) > 0:
                self.recv.setdefault(k, [])
            if b.sharded:
                self.staging.setdefault(k, [])
        for b in buckets:
            b.use_pools(self.recv.get(kind(b)), self.staging.get(kind(b)))

    def limit(self, device) -> int:
        """Buffers of one kind made before waiting: on a GPU a wait stalls the compute
        stream, not just the host, so twice as many (memory is cheap next to that)."""
        return self.max_in_flight * (2 if self.side_of(device) is not None else 1)

    def need(self, bucket, role: str) -> int:
        """Elements of a ``role`` buffer for ``bucket``: its gradients (staging), or the
        receive scratch of its reduce-scatter."""
        if role == "staging":
            return bucket.geometry.numel
        return self.comm.recv_numel(bucket.geometry.numel, self.into_out[kind(bucket)])

    def take(self, pool: list, bucket, role: str, grow: bool, in_flight) -> torch.Tensor:
        """A buffer from ``pool`` large enough for ``bucket``: a free one, else a new one
        while fewer than the limit exist, else one freed by waiting for the oldest
        average still using it (``in_flight``: the CPU averages in launch order). ZeRO-2
        staging may ``grow`` past the limit when no average holds one (buckets waiting
        for their turn); ``trim`` hands the extra ones back. A free buffer too small for
        this bucket is let go for a new one, so a pool holds the largest buckets in
        flight, not ``limit`` copies of the largest bucket of all.

        On a GPU a receive buffer is free as soon as its average is queued (the side
        stream reuses it in order) and a staging buffer once its average's event has
        passed; only past the limit (more than 2 x max_in_flight buckets' gradients
        queued behind the network) does the compute stream wait, which is what bounds
        ZeRO-2's memory. On CPUs waiting blocks the host, so the limit is max_in_flight."""
        k = kind(bucket)
        key = (role, k)
        limit = self.limit(k[1])
        need = self.need(bucket, role)
        while True:
            small = None  # a free buffer too small for this bucket
            for i, (buf, done) in enumerate(pool):
                if done is None or done.query():
                    if buf.numel() >= need:
                        del pool[i]
                        return buf
                    small = i if small is None else small
            if in_flight and (in_flight[0].reduce is None or in_flight[0].reduce.landed()):
                # CPU: an average that already arrived gives its buffers back (its sum in
                # rank order runs now) before another buffer is made: a model whose
                # buckets' averages do not overlap each other holds one of each kind.
                in_flight.popleft().wait_reduce()
                continue
            if self.made.get(key, 0) < limit:
                break
            if small is not None:  # at the limit: a free one too small makes way
                del pool[small]
                self.made[key] -= 1
                break
            if pool:  # GPU: every staging buffer is still being sent: the oldest one
                buf, done = pool.pop(0)
                done.wait()
                if buf.numel() >= need:
                    return buf
                self.made[key] -= 1
                break
            if in_flight:
                in_flight.popleft().wait_reduce()
                continue
            if grow:
                break
            raise AssertionError("zero_triton: a gradient bucket buffer was lost")
        self.made[key] = self.made.get(key, 0) + 1
        return PLAIN.empty(need, k[0], k[1])

    def hold(self, grad: torch.Tensor, done) -> None:
        """GPU: keep an adopted gradient until the side stream has sent it, at most the
        staging buffers' limit of them: past it the compute stream waits for the oldest,
        as it would for a staging buffer."""
        self.held = [(t, d) for t, d in self.held if not d.query()]
        while len(self.held) >= self.limit(grad.device):
            self.held.pop(0)[1].wait()
        self.held.append((grad, done))

    def trim(self) -> None:
        """After a step's averages: buffers made beyond the limit (a round launched
        without waiting) go back; the held gradients go (the compute stream has waited
        for every average)."""
        self.held.clear()
        for role, pools in (("staging", self.staging), ("recv", self.recv)):
            for k, pool in pools.items():
                keep = self.limit(k[1])
                extra = len(pool) - keep
                if extra > 0:
                    del pool[keep:]
                    self.made[(role, k)] -= extra

    def nbytes(self, buckets) -> int:
        """The receive and staging buffers held now: free in the pools, or in use by
        ``buckets``."""
        free = list(self.recv.values()) + list(self.staging.values())
        return sum(t.numel() * t.element_size() for pool in free for t, _ in pool) + sum(
            t.numel() * t.element_size() for b in buckets
            for t in ((b.recv,) if b.recv is not None else ()) + (b.staged.tensors() if b.staged else ()))
