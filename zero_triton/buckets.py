"""Gradient buckets: averaged as soon as backward has finished them, in one agreed order.

Each flat buffer is cut into buckets (``zero_triton.flat``); a ``Bucket`` here is one
bucket's runtime state: views of the local gradients, of this rank's averaged shard and
of the parameters, and the collectives in flight over them. The ``Reducer`` (one per
optimizer) starts a bucket's reduce-scatter from a post-accumulate-grad hook once
backward has reached every parameter of it, and afterwards the all-gather of its
updated parameters.

Collectives pair up by their order on each rank, so buckets are launched strictly in one
order that every rank shares: before the first step, none are launched during backward
(``step`` reduces them all); the first step learns the order in which rank 0's backward
finished them and every rank uses it from then on, launching a bucket only after every
bucket before it in that order. A bucket that backward never finishes (unused
parameters), or one whose gradients changed after it was launched (another micro-batch
without ``no_sync``, ``GradScaler.unscale_``, a ``.grad`` written by hand), is reduced
again at ``step``: launching early only ever saves time, the result is the same.

Nothing here holds the optimizer or a ``FlatShard``: the hooks live on the parameters,
and an optimizer that is dropped must be collectable (its finalizer removes them).
"""
from __future__ import annotations

import collections
import functools
import weakref

import torch


class GradBuffer:
    """What the hooks of one flat buffer share: the local gradients and the version
    of them that the last hook saw (a later write means every bucket is stale)."""

    __slots__ = ("flat_grad", "seen_version", "__weakref__")

    def __init__(self, flat_grad: torch.Tensor):
        self.flat_grad = flat_grad
        self.seen_version = flat_grad._version

    def written_since_hooks(self) -> bool:
        return self.flat_grad._version != self.seen_version


class Bucket:
    """One bucket of one flat buffer (``flat.Bucket`` ``geometry``) on this rank."""

    def __init__(self, key, geometry, grads: GradBuffer, grad_shard, flat_param, rank: int):
        g = geometry
        self.key = key  # (flat buffer ordinal, bucket index): the same on every rank
        self.geometry = g
        self.nparams = g.end - g.first
        self.grads = grads
        self.grad_in = grads.flat_grad[g.start:g.start + g.numel]
        self.grad_out = grad_shard[g.shard_start:g.shard_start + g.shard_numel]
        self.param_full = flat_param[g.start:g.start + g.numel]
        lo, hi = g.shard_range(rank)
        self.param_shard = flat_param[lo:hi]
        self.arrived = bytearray(self.nparams)
        self.count = 0
        self.ready = False      # backward reached every parameter since the last launch
        self.launched = False   # reduced (or in flight) this step
        self.stale = False      # gradients arrived after the launch
        self.reduce = None      # Pending reduce-scatter
        self.recv = None        # its scratch, back to ``pool`` at the wait
        self.pool = None
        self.gather = None      # Pending all-gather of the updated parameters

    def name(self, what: str) -> str:
        return f"{what} of bucket {self.key[1]} of flat buffer {self.key[0]}"

    def wait_reduce(self) -> None:
        pending = self.reduce
        if pending is None:
            return
        try:
            pending.wait()
        finally:
            self.reduce = None
            if self.recv is not None:
                self.pool.append(self.recv)
                self.recv = None

    def wait_gather(self) -> None:
        pending, self.gather = self.gather, None
        if pending is not None:
            pending.wait()

    def reset(self) -> None:
        self.arrived[:] = bytes(self.nparams)
        self.count = 0
        self.ready = self.launched = self.stale = False


def grad_ready(reached: bytearray, i: int, j: int, view: torch.Tensor, bucket: Bucket,
               reducer_ref, param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of parameter ``i`` (``j`` within its bucket)."""
    reached[i] = 1
    g = param.grad
    if g is not view and g is not None and not g.is_sparse:
        # .grad was None (module.zero_grad()): autograd made a tensor of its own.
        view.copy_(g)
        param.grad = view
    bucket.grads.seen_version = bucket.grads.flat_grad._version
    reducer = reducer_ref()
    if reducer is not None:
        reducer.arrived(bucket, j)


def before_accumulate(bucket: Bucket, grad):
    """Tensor hook, before autograd adds into ``.grad``: a reduce-scatter still reading
    this bucket's gradients (from an earlier micro-batch) must finish first."""
    if bucket.reduce is not None:
        bucket.wait_reduce()
    return None


class Reducer:
    """Launches the buckets of every flat buffer of one optimizer in one agreed order,
    and waits for them."""

    def __init__(self, comm, max_in_flight: int = 2):
        self.comm = comm
        self.max_in_flight = max(1, max_in_flight)
        self.buckets: list[Bucket] = []
        self.order: list[Bucket] | None = None   # agreed launch order, once learned
        self.seen: list | None = []              # this rank's finishing order, until learned
        self.next = 0
        self.sync = True                          # False inside no_sync()
        self.in_flight = collections.deque()
        self.pools: dict = {}
        self.pool_bytes = 0
        self.bucket_of_param: dict = {}  # id(parameter) -> its Bucket
        self.gathering = False            # all-gathers may be in flight

    # -- building -------------------------------------------------------------------
    def rebuild(self, flats) -> None:
        """Take the buckets of ``flats`` (construction, a new param group, a re-home)."""
        self.wait_all()
        old = [b.key for b in self.buckets]
        self.buckets = [b for flat in flats for b in reversed(flat.buckets)]
        self.bucket_of_param = {id(p): b for flat in flats for b in flat.buckets
                                for p in flat.params[b.geometry.first:b.geometry.end]}
        if [b.key for b in self.buckets] != old or self.order is None:
            self.order, self.seen = None, []
        else:  # same keys: keep the learned order over the new buckets
            by_key = {b.key: b for b in self.buckets}
            self.order = [by_key[b.key] for b in self.order]
        sizes: dict = {}
        for b in self.buckets:
            kind = (b.grad_in.dtype, b.grad_in.device)
            sizes[kind] = max(sizes.get(kind, 0), b.grad_in.numel())
        self.pools, self.pool_bytes = {}, 0
        if self.comm.world_size > 1:
            for (dtype, device), n in sizes.items():
                self.pools[(dtype, device)] = [torch.empty(n, dtype=dtype, device=device)
                                               for _ in range(self.max_in_flight)]
                self.pool_bytes += self.max_in_flight * n * dtype.itemsize
        for b in self.buckets:
            b.pool = self.pools.get((b.grad_in.dtype, b.grad_in.device))
            b.reset()
        self.next = 0

    # -- backward -------------------------------------------------------------------
    def arrived(self, bucket: Bucket, j: int) -> None:
        bucket.stale = bucket.launched
        if not bucket.arrived[j]:
            bucket.arrived[j] = 1
            bucket.count += 1
        if bucket.count < bucket.nparams:
            return
        bucket.arrived[:] = bytes(bucket.nparams)
        bucket.count = 0
        bucket.ready = True
        if self.seen is not None:
            self.seen.append(bucket.key)
        self._advance()

    def _advance(self) -> None:
        order = self.order
        if order is None or not self.sync:
            return
        while self.next < len(order) and order[self.next].ready:
            self.launch(order[self.next])
            self.next += 1
        if self.next == len(order):
            self.next = 0  # every bucket went: the next micro-batch starts over

    def launch(self, bucket: Bucket) -> None:
        """Start averaging ``bucket``'s local gradients into this rank's shard."""
        bucket.wait_reduce()
        recv = None
        if bucket.pool is not None:
            while not bucket.pool:
                self.in_flight.popleft().wait_reduce()
            recv = bucket.pool.pop()
        bucket.recv = recv
        bucket.ready = bucket.stale = False
        bucket.launched = True
        bucket.reduce = self.comm.reduce_scatter_avg(
            bucket.grad_out, bucket.grad_in, None if recv is None else recv[:bucket.grad_in.numel()],
            async_op=True, name=bucket.name("reduce_scatter"))
        if bucket.recv is not None:
            self.in_flight.append(bucket)
        else:
            bucket.wait_reduce()  # world size 1: a copy, done

    # -- step -----------------------------------------------------------------------
    def finish(self, grad_buffers) -> None:
        """Reduce whatever backward did not (or whose gradients changed since), in the
        agreed order, and wait for everything. Learns the order at the first step."""
        for grads in grad_buffers:
            if grads.written_since_hooks():
                for b in self.buckets:
                    if b.grads is grads:
                        b.stale = True
        for b in self.order or self.buckets:
            if b.stale or not b.launched:
                self.launch(b)
        self.wait_reduces()
        if self.seen is not None and self.comm.world_size > 1:
            self._learn()
        for b in self.buckets:
            b.reset()
        self.next = 0

    def _learn(self) -> None:
        """Rank 0's finishing order, then the buckets its backward never finished."""
        theirs = self.comm.all_gather_object(self.seen, "bucket order")[0]
        by_key = {b.key: b for b in self.buckets}
        order, taken = [], set()
        for key in theirs:
            key = tuple(key)
            if key in by_key and key not in taken:
                order.append(by_key[key])
                taken.add(key)
        order.extend(b for b in self.buckets if b.key not in taken)
        self.order, self.seen = order, None

    def reset(self) -> None:
        """``zero_grad``: wait for reductions reading the gradients, start a new step."""
        self.wait_reduces()
        for b in self.buckets:
            b.reset()
        self.next = 0

    def wait_reduces(self) -> None:
        while self.in_flight:
            self.in_flight.popleft().wait_reduce()
        for b in self.buckets:
            b.wait_reduce()

    def wait_gathers(self) -> None:
        if not self.gathering:
            return
        for b in self.buckets:
            b.wait_gather()
        self.gathering = False

    def wait_all(self) -> None:
        self.wait_reduces()
        self.wait_gathers()

    def gather_order(self) -> list[Bucket]:
        """The order the next forward needs the parameters in: backward's, reversed."""
        return list(reversed(self.order or self.buckets))


def _on_leaf(p: torch.Tensor, register):
    """Register a grad hook also on a parameter frozen right now (a re-home after
    ``requires_grad_(False)``): torch refuses hooks on a tensor that does not require
    grad, and they must fire once the parameter is unfrozen."""
    if p.requires_grad:
        return register()
    p.requires_grad_(True)
    try:
        return register()
    finally:
        p.requires_grad_(False)


def post_accumulate_hook(p: torch.Tensor, fn):
    return _on_leaf(p, lambda: p.register_post_accumulate_grad_hook(fn))


def register_hooks(params, reached, grad_views, buckets, reducer) -> list:
    """The post-accumulate-grad and before-accumulate hooks of one flat buffer's
    parameters; returns their handles."""
    ref = weakref.ref(reducer)
    handles = []
    for b in buckets:
        g = b.geometry
        for j, i in enumerate(range(g.first, g.end)):
            p = params[i]
            handles.append(post_accumulate_hook(p, functools.partial(
                grad_ready, reached, i, j, grad_views[i], b, ref)))
            handles.append(_on_leaf(p, lambda p=p, b=b: p.register_hook(
                functools.partial(before_accumulate, b))))
    return handles
