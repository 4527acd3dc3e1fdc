"""Gradient buckets: averaged as soon as backward has finished them, in one agreed order.

Each flat buffer is cut into buckets (``zero_triton.state.flat``); a ``Bucket`` here is one
bucket's runtime state: views of the local gradients, of this rank's averaged shard and
of the parameters, and the collectives in flight over them. The ``Reducer`` (one per
optimizer) starts a bucket's reduce-scatter from a post-accumulate-grad hook once
backward has reached every parameter of it, and afterwards the all-gather of its
updated parameters.

Collectives pair up by their order on each rank, so buckets are launched strictly in one
order that every rank shares: before the first step, none are launched during backward
(``step`` reduces them all); the first step learns the order in which rank 0's backward
finished them and every rank uses it from then on, launching a bucket only after every
bucket before it in that order. Buckets that rank 0's backward did not finish come last
and are left to ``step``, so that they do not hold up the next micro-batch's launches. A
bucket that backward never finishes (unused
parameters), or one whose gradients changed after it was launched (another micro-batch
without ``no_sync``, ``GradScaler.unscale_``, a ``.grad`` written by hand), is reduced
again at ``step``: launching early only ever saves time, the result is the same.

ZeRO-2 (``sharded`` buckets): there is no full gradient buffer. The post-accumulate hook
adds a parameter's ``.grad`` into its bucket's staging buffer, taken from a small pool,
and sets ``.grad`` to None, freeing it; a bucket's average is added into this rank's
shard, its staging buffer going back to the pool when the reduce-scatter is done. So a
rank holds its gradient shard plus a few buckets, and every micro-batch is averaged
(DeepSpeed's stage 2): the shard accumulates the averages.

Nothing here holds the optimizer or a ``Shard``: the hooks live on the parameters,
and an optimizer that is dropped must be collectable (its finalizer removes them).
"""
from __future__ import annotations

import collections
import contextlib

import torch

from . import pending_reads, streams
from .pools import BufferPools
from .staging import Staged, Staging
from .protocol import Comm

from zero_triton.state.buffers import PLAIN

SIGNATURE_MOD = 16_777_213  # a prime below 2^24: exact in float32

# What a bucket's buffers cost: ZeRO-2 stages each bucket's gradients until its launch
# and every reduce-scatter at more than two ranks receives into scratch, up to
# ``BufferPools.limit`` buckets of each (``zero_triton.comm.pools``). ``bucket_cap_mb``
# (25, DDP's) alone would make those buffers larger than the gradient shard for any
# model under ~1B parameters at 8 ranks; so a flat buffer is also cut into at least
# MIN_BUCKETS buckets, none under MIN_BUCKET_BYTES (a collective that small is latency).
MIN_BUCKETS = 8
MIN_BUCKET_BYTES = 2**20


def bucket_numel(cap_mb: float, dtype: torch.dtype, numel: int) -> int:
    """Elements per bucket of a flat buffer of ``numel`` elements of ``dtype``:
    ``cap_mb`` MiB at most, ``numel / MIN_BUCKETS`` where that keeps MIN_BUCKET_BYTES.
    The result does not depend on it (the averages are summed in rank order, element
    by element), only the buffers and the overlap do."""
    cap = max(1, int(cap_mb * 2**20) // dtype.itemsize)
    return min(cap, max(MIN_BUCKET_BYTES // dtype.itemsize, -(-numel // MIN_BUCKETS)))


def _written_while_gathering(bucket: Bucket, param):
    return RuntimeError(
        f"zero_triton.overlap: a parameter {tuple(param.shape)} of bucket {bucket.key[1]} of flat "
        f"buffer {bucket.key[0]} was written or replaced (p.data = x) between step() and the "
        "next forward while its all-gather was in flight: the gathered values may have "
        "overwritten the write. "
        "Writes on the thread that called step() wait by themselves; before a write from "
        "another thread (or one torch does not see, through numpy) after step(), call "
        "optimizer.wait_params()")


class Bucket:
    """One bucket of one flat buffer (``flat.Bucket`` ``geometry``) on this rank."""

    def __init__(self, key, geometry, grads, out, flat_param, rank: int, members=(), *,
                 out_dtype=None, keep_out: bool = True):
        g = geometry
        self.key = key  # (flat buffer ordinal, bucket index): the same on every rank
        self._names = {}
        self.geometry = g
        self.nparams = g.end - g.first
        self.grads = grads  # zero_triton.comm.grads.LocalGrads; None under ZeRO-2
        self.sharded = grads is None  # ZeRO-2: grad_in is a staging buffer while it exists
        self._local_in = None if self.sharded else grads.flat[g.start:g.start + g.numel]
        self.grad_dtype = flat_param.dtype
        # ZeRO-2: the buffer grad_in lives in, and the one the average in flight reads
        # (zero_triton.comm.staging).
        self.staged = Staged() if self.sharded else None
        self.accumulated = False  # ZeRO-2: the shard already holds an average this step
        # This rank's averaged shard of the bucket (``averaged``). ``out``: where it lives
        # for good (world size 1: the local gradients themselves, nothing to average);
        # None: a tensor of its own, made by the step's first launch and, unless
        # ``keep_out``, let go once the step's kernel has read it (``release``), as
        # DDP's .grad is let go by zero_grad: between steps, while the next forward's
        # activations pile up, it takes no memory.
        self.kept = out is not None or keep_out
        self.out_dtype = out.dtype if out is not None else out_dtype
        self.grad_out = None if out is None else out[g.shard_start:g.shard_start + g.shard_numel]
        self.param_full = flat_param[g.start:g.start + g.numel]
        # (parameter, its view of flat_param): a parameter moved by model.to() on another
        # thread while step() gathered copied stale values; wait_gather puts the right ones
        # in (after step() returned, under overlap, it refuses: see wait_gather).
        self.members = list(members)
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
        self.versions = None    # under overlap(): the members' versions when it started
        # ``watch(landed)``: told when an average of the bucket starts (False: what was
        # taken of the last one is stale) and when it has landed (True), on the side
        # stream on GPUs, at the host's wait on CPUs (offload copies it to the host then:
        # ``FlatHome.watch_averages``). None: nobody watches.
        self.watch = None
        self.landing = None     # CPU: ``watch``, due at the wait for the average in flight

    @property
    def grad_in(self):
        """The bucket's local gradients, what its average reads: a view of the local
        gradients (stage 1), or of its staging buffer while it has one (ZeRO-2)."""
        return self._local_in if self.staged is None else self.staged.view

    def use_pools(self, recv, staging) -> None:
        """Take receive scratch from ``recv`` and staging buffers from ``staging``
        (``comm.pools``: the free ones of the bucket's dtype and device; None: none)."""
        self.pool = recv
        if self.staged is not None:
            self.staged.use(staging)

    def watch_with(self, watch) -> None:
        """Tell ``watch(landed)`` when an average of the bucket starts and when it has
        landed (None: nobody watches)."""
        self.watch = watch

    def start_gather(self, comm, watch_writes: bool) -> None:
        """Start gathering every rank's updated shard of the bucket (``watch_writes``: it
        outlives step(), under overlap: the members' versions are noted, see
        ``wait_gather``)."""
        self.gather = comm.gather_params(self.param_full, self.param_shard, async_op=True,
                                         name=self.name("all_gather"))
        if watch_writes:
            self.versions = [p._version for p, _ in self.members]

    def averaged(self) -> torch.Tensor:
        """This rank's averaged shard of the bucket: what the step's kernel, clipping and
        unscaling read once the bucket is averaged, zeros if it never was (launches write
        it: ``out``)."""
        return self._shard(PLAIN.zeros)

    def out(self, accumulate: bool) -> torch.Tensor:
        """The averaged shard for a launch to write (``accumulate``: to add to)."""
        return self._shard(PLAIN.zeros if accumulate else PLAIN.empty)

    def _shard(self, make) -> torch.Tensor:
        if self.grad_out is None:
            self.grad_out = make(self.geometry.shard_numel, dtype=self.out_dtype,
                                 device=self.param_full.device)
        return self.grad_out

    def release(self) -> None:
        """The step's kernel has read the averaged shard: let it go unless it is kept."""
        if not self.kept:
            self.grad_out = None

    def name(self, what: str) -> str:
        """The phase named in errors, made once (launches happen every step)."""
        name = self._names.get(what)
        if name is None:
            name = self._names[what] = f"{what} of bucket {self.key[1]} of flat buffer {self.key[0]}"
        return name

    def wait_reduce(self) -> None:
        pending = self.reduce
        if pending is None:
            return
        landing, self.landing = self.landing, None
        try:
            pending.wait()
        finally:
            self.reduce = None
            if self.recv is not None:
                self.pool.append((self.recv, None))
                self.recv = None
            if self.staged is not None:
                self.staged.sent()
        if landing is not None:
            landing(True)

    def wait_gather(self) -> None:
        pending, self.gather = self.gather, None
        if pending is None:
            return
        pending.wait()
        versions, self.versions = self.versions, None
        for i, (p, view) in enumerate(self.members):
            moved = p.data_ptr() != view.data_ptr()
            if versions is not None and (moved or p._version != versions[i]):
                # After step() returned (overlap), off the thread whose torch operations
                # wait for the gathers first (pending_reads): a write or a `p.data = x`
                # that the gathered values may have undone, which we cannot tell apart
                # from model.to() copying half-gathered values.
                raise _written_while_gathering(self, p)
            if moved:  # by model.to() on another thread while step() gathered
                with torch.no_grad():
                    p.copy_(view)

    def reset(self) -> None:
        self.arrived[:] = bytes(self.nparams)
        self.count = 0
        self.ready = self.launched = self.stale = self.accumulated = False


class Reducer:
    """Launches the buckets of every flat buffer of one optimizer in one agreed order,
    and waits for them."""

    def __init__(self, comm: Comm, max_in_flight: int = 2, staging=Staging,
                 early: bool = True, enter=None):
        self.comm = comm
        self.buckets: list[Bucket] = []
        self.order: list[Bucket] | None = None   # agreed launch order, once learned
        self.in_backward = 0                      # how many of them backward launches
        self.seen: list | None = []              # this rank's finishing order, until learned
        self.next = 0
        self.sync = True                          # False inside no_sync()
        self.early = early                        # False: launch in finish() only
        self.in_flight = collections.deque()     # CPU: buckets whose buffers a wait frees
        self.sides: dict = {}                     # device -> streams.SideStream (GPUs)
        # Receive scratch and ZeRO-2 staging buffers (zero_triton.comm.pools).
        self.pools = BufferPools(comm, max_in_flight, self._side_of)
        self.bucket_of_param: dict = {}  # id(parameter) -> its Bucket
        self.param_ranges: list = []      # per bucket: its parameters' byte addresses
        self.gathering = False            # all-gathers may be in flight
        self.overlapped = False           # zero_triton.overlap: they outlive step()
        self.reads = pending_reads.ReadGuards()  # of step() under overlap(), until the forward
        # Where the buckets' buffers wait between backward and the step (``staging``: a
        # class of zero_triton.comm.staging; ``OwnStaging``: one per bucket, capturable=True).
        self.staging = staging(self.pools, self.in_flight)
        # A checksum of the buckets launched this step, in order: ranks that launched
        # different ones (a parameter reached on some ranks only) paired the wrong
        # collectives, which the step's agreement detects (FusedAdam._agree).
        self.signature = 0
        self.last_signature = 0
        # Called before backward launches the first bucket of a round: ZeroAdam's
        # agreement that every rank is there (``Ranks.backward_entry``); None: no check.
        self.enter = enter
        # Every rank agreed at the start of this round's launches: they are all in it, so
        # launching the rest of it (complete_round) pairs up before any other agreement.
        self.round_agreed = False
        self.backwards = 0       # backward passes that reached our parameters since the last step
        self._in_backward = False

    # -- building -------------------------------------------------------------------
    def rebuild(self, flats) -> None:
        """Take the buckets of ``flats`` (construction, a new param group, a re-home)."""
        self.wait_all()
        old = [b.key for b in self.buckets]
        self.buckets = [b for flat in flats for b in reversed(flat.buckets)]
        self.bucket_of_param = {id(p): b for flat in flats for b in flat.buckets
                                for p in flat.params[b.geometry.first:b.geometry.end]}
        # [lo, hi) byte addresses of the parameters each bucket gathers into: what a
        # read between step() and the next forward is checked against (guard_reads).
        self.param_ranges = [(b.param_full.data_ptr(), b.param_full.data_ptr()
                              + b.param_full.numel() * b.param_full.element_size())
                             for b in self.buckets]
        if [b.key for b in self.buckets] != old or self.order is None:
            self.order, self.seen = None, []
        else:  # same keys: keep the learned order over the new buckets
            by_key = {b.key: b for b in self.buckets}
            self.order = [by_key[b.key] for b in self.order]
            self.in_backward = min(self.in_backward, len(self.order))
        # Receive and staging buffers are made when first needed (a model of two buckets
        # never needs more than two), up to the pools' limit of each kind.
        self.pools.rebuild(self.buckets)
        for b in self.buckets:
            b.reset()
        self.next = 0
        if any(b.sharded for b in self.buckets) and self.order is None:
            # ZeRO-2 holds a bucket's gradients until its launch: start in the static
            # order (backward's, for most models) rather than none; learned at step 1.
            self.order = list(self.buckets)
            self.in_backward = len(self.order)

    def _side(self, bucket: Bucket):
        return self._side_of(bucket.param_full.device)

    def _side_of(self, device):
        """The side stream of ``device`` (None on CPUs)."""
        if device not in self.sides:
            self.sides[device] = streams.side_stream(device)
        return self.sides[device]

    @property
    def made(self) -> dict:
        """(role, (dtype, device)) -> receive and staging buffers made and kept."""
        return self.pools.made

    @property
    def bytes(self) -> int:
        """The receive and staging buffers held now."""
        return self.pools.nbytes(self.buckets)

    # -- backward -------------------------------------------------------------------
    def note_backward(self) -> None:
        """From a gradient hook: count this backward pass once, when it ends (the
        agreement compares the counts: a rank that ran one more backward, or skipped a
        step, is at another iteration)."""
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self._in_backward = False
        self.backwards += 1

    def accept(self, bucket: Bucket, j: int, lo: int, hi: int, grad: torch.Tensor,
               adopt: bool = False) -> None:
        """ZeRO-2: parameter ``j``'s gradient, added into elements [lo, hi) of its
        bucket's staging buffer (``Staging.add``; ``adopt``: autograd's own, which a
        bucket of that one parameter may take as it is), has arrived."""
        self.staging.add(bucket, lo, hi, grad, adopt)
        self.arrived(bucket, j)

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
        if order is None or not self.sync or not self.early:
            return
        while self.next < self.in_backward and order[self.next].ready:
            if self.next == 0 and self.enter is not None:
                self.enter(order[0].name("the reduce_scatter"))
                self.round_agreed = True
            self.launch(order[self.next])
            self.next += 1
        if self.next == self.in_backward:
            self.next = 0  # all that backward launches went: the next micro-batch starts over

    def launch(self, bucket: Bucket, grow: bool = False) -> None:
        """Start averaging ``bucket``'s local gradients into this rank's shard (ZeRO-2:
        added to it after the first average of the step). On a GPU this never waits:
        the average goes to the side stream behind the ones before it."""
        side = self._side(bucket)
        if side is None:
            if bucket.reduce is not None:
                bucket.wait_reduce()  # it holds buffers (ZeRO-2: the staging it sends)
        if bucket.sharded:  # nothing arrived: this rank adds zeros
            self.staging.ensure(bucket)
        accumulate, bucket.accumulated = bucket.accumulated, bucket.sharded
        out = bucket.out(accumulate)
        recv = None
        if bucket.pool is not None and self.comm.needs_recv(out, bucket.grad_in, accumulate):
            recv = self.pools.take(bucket.pool, bucket, "recv", grow, self.in_flight)
        bucket.ready = bucket.stale = False
        bucket.launched = True
        watch = bucket.watch
        if watch is not None:
            watch(False)
        self.signature = (self.signature * 1009 + bucket.key[0] * 4099 + bucket.key[1] + 1) % SIGNATURE_MOD

        def start():
            return self.comm.reduce_scatter_avg(
                out, bucket.grad_in, recv,
                async_op=True, name=bucket.name("reduce_scatter"), accumulate=accumulate)

        if side is not None:
            done = bucket.reduce = side.run(start, None if watch is None else lambda: watch(True))
            if recv is not None:  # reused in the side stream's order
                bucket.pool.append((recv, None))
            if bucket.sharded:  # reused once the compute stream may write it
                self.staging.launched(bucket, done)
            return
        bucket.recv = recv
        bucket.reduce = start()
        bucket.landing = watch
        if bucket.sharded:  # held until the wait; the next micro-batch stages into another
            self.staging.launched(bucket)
        if self.comm.everyone.world_size > 1:
            self.in_flight.append(bucket)
            if watch is not None:
                self._settle()
        else:
            bucket.wait_reduce()  # one rank: a copy, done

    def _settle(self) -> None:
        """Wait for the averages in flight before the newest, oldest first, so that whoever
        watches them (offload, copying each to the host) hears of them while backward
        runs rather than at ``step``. CPUs only: gloo's sends and receives say they have
        landed only once waited for, and the rank-order sum runs on this thread at the
        wait anyway; ranks in step with each other have sent them by then (a rank whose
        backward never reaches a bucket launches the rest of the round at its ``step``
        before any agreement: ``complete_round``)."""
        in_flight = self.in_flight
        while len(in_flight) > 1:
            in_flight.popleft().wait_reduce()

    # -- step -----------------------------------------------------------------------
    def changed_since_launch(self, grad_buffers) -> bool:
        """Whether this rank's gradients changed after backward launched a bucket of them
        (a ``.grad`` edited by hand, GradScaler.unscale_, another micro-batch without
        ``no_sync``, ``zero_grad`` between backward and step): what ``finish`` needs to
        know, agreed over the ranks first, to average everything again."""
        if any(b.stale for b in self.buckets):
            return True
        return any(b.launched for b in self.buckets) and any(
            g.written_since_hooks() for g in grad_buffers)

    def complete_round(self) -> None:
        """Launch, in order, the buckets backward did not, without waiting for a receive
        buffer (more are made instead): after an agreed round every rank launches the
        same ones, and nothing here may block before the step's own agreement, which a
        rank still in backward (waiting for these very launches) could never join."""
        for b in self.order or self.buckets:
            if not b.launched:
                self.launch(b, grow=True)

    def finish(self, grad_buffers, again: bool | None = None) -> None:
        """Reduce whatever backward did not, in the agreed order, then, when ``again``
        (the ranks' agreed ``changed_since_launch``; None: this rank's own), every bucket
        once more, and wait for everything. Every rank launched the same buckets in
        backward, so both passes pair up. Learns the order at the first step."""
        if again is None:
            again = self.changed_since_launch(grad_buffers)
        order = self.order or self.buckets
        for b in order:
            if not b.launched:
                self.launch(b)
        if again:  # ZeRO-2 adds what was staged since (zeros on ranks that staged none)
            for b in order:
                self.launch(b)
        self.wait_reduces()
        self.pools.trim()  # buffers made beyond the limit go back
        if self.seen is not None and self.comm.everyone.world_size > 1:
            self._learn()
        for b in self.buckets:
            b.reset()
        self.next = 0
        self.round_agreed = False
        self.last_signature, self.signature = self.signature, 0

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
        self.in_backward = len(order)
        order.extend(b for b in self.buckets if b.key not in taken)
        self.order, self.seen = order, None

    def reset(self) -> None:
        """``zero_grad``: wait for reductions reading the gradients, start a new step.
        Buckets backward launched already (``zero_grad`` between backward and ``step``)
        stay launched and become stale: ``step`` averages them again, on every rank."""
        self.wait_reduces()
        for b in self.buckets:
            if b.sharded:  # ZeRO-2 gradients not averaged yet: dropped
                self.staging.drop(b)
            launched = b.launched
            b.reset()
            if launched:
                b.launched = b.stale = True
        self.next = 0
        if not any(b.launched for b in self.buckets):
            self.signature = 0

    def wait_reduces(self) -> None:
        while self.in_flight:
            self.in_flight.popleft().wait_reduce()
        for b in self.buckets:
            b.wait_reduce()
        self.pools.held.clear()  # the compute stream has waited for every average

    def guard_reads(self) -> None:
        """``step()`` under ``overlap()`` returns with the gathers in flight: until the
        next forward, a torch operation on a parameter waits for them (``pending_reads``)."""
        self.reads.release()
        if self.gathering:
            self.reads.push(self, self.param_ranges)

    def wait_gathers(self) -> None:
        if self.reads.active:
            self.reads.release()
        if not self.gathering:
            return
        for b in self.buckets:
            b.wait_gather()
        self.gathering = False

    def wait_all(self) -> None:
        self.wait_reduces()
        self.wait_gathers()

    def start_gathers(self) -> list[Bucket]:
        """The step's all-gathers begin (the caller starts each bucket's, in this order):
        until ``wait_gathers``, they may be in flight."""
        self.gathering = True
        return self.gather_order()

    def set_overlapped(self, on: bool) -> None:
        """``zero_triton.overlap`` installed (``on``) or removed: the gathers outlive step()."""
        self.overlapped = on

    def reset_backwards(self) -> None:
        """A step completed: count backward passes from here."""
        self.backwards = 0

    @contextlib.contextmanager
    def accumulating(self, averaged: bool):
        """``no_sync()``: backward passes inside only accumulate the local gradients,
        unless ``averaged`` (stage 2: every micro-batch is averaged into the shard)."""
        before, self.sync = self.sync, averaged
        try:
            yield
        finally:
            self.sync = before

    def gather_order(self) -> list[Bucket]:
        """The order the next forward needs the parameters in: backward's, reversed."""
        return list(reversed(self.order or self.buckets))
