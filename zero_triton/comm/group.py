"""The collectives of a ZeRO step, over one explicit process group.

``LocalComm`` is world size 1: each rank's shard is the whole buffer, so reduce-scatter
and all-gather have nothing to move. ``GroupComm`` wraps a torch.distributed group.
With ``async_op=True`` the gradient and parameter collectives return a ``Pending``
handle: ``wait()`` ends it (on CUDA: the current stream waits for it, the host does not)
and turns a failure into an error that names the phase.

The gradient average moves each chunk of the input to the rank that owns it and sums
the chunks in rank order (``OrderedSum``): every element is
``(((g_0 + g_1) + g_2) + ...) / W`` whatever bucket it travels in, so the result does
not depend on the bucket size (a ring reduce-scatter's summation order depends on where
an element sits in the buffer). It moves the bytes a reduce-scatter moves, in the
gradient's own dtype, and sums in the output's dtype (``reduce_dtype``). On gloo the
chunks go pairwise (a send and a receive per peer, tagged per launch): a rank's own
chunk never travels (it is read in place at the sum), the first peer's lands in the
output itself when the output is of the input's dtype and is not added to, the others
in receive scratch, so the scratch is (W - 2) / W of the input (none at two ranks);
gloo's reduce-scatter all-reduces a copy and its all-to-all receives every chunk, own
included, into one buffer. On NCCL the average is an all-to-all into scratch of the
input's size, except with two ranks, where NCCL's own reduce-scatter (two numbers
added: order-free) is used.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from zero_triton.state.buffers import PLAIN


@contextlib.contextmanager
def phase(name: str, cuda: bool):
    """A profiler range (and an NVTX range on CUDA) around one phase of the step."""
    with torch.profiler.record_function(name):
        if cuda:
            torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            if cuda:
                torch.cuda.nvtx.range_pop()


@contextlib.contextmanager
def without_python_tls():
    """Launch a collective without the Python object torch keeps in thread-local state
    during backward (the ``contextvars`` context ``autograd.graph`` stashes for compiled
    code). A gloo work captures the thread-local state when launched; the worker thread
    that drops the finished work last then has to release that object, which takes the
    GIL, and if the interpreter is finalizing by then (the script just ended) the thread
    is killed inside a destructor and the process aborts (SIGABRT, "terminate called
    without an active exception"). Collectives need nothing from it."""
    if not _TLS_KEYS or not torch._C._is_key_in_tls("context"):
        yield
        return
    saved = torch._C._get_obj_in_tls("context")
    torch._C._remove_obj_from_tls("context")
    try:
        yield
    finally:
        torch._C._stash_obj_in_tls("context", saved)


_TLS_KEYS = all(hasattr(torch._C, name) for name in (
    "_is_key_in_tls", "_get_obj_in_tls", "_remove_obj_from_tls", "_stash_obj_in_tls"))


class Pending:
    """A collective in flight (or, with no work, one already done)."""

    __slots__ = ("work", "comm", "name")

    def __init__(self, work=None, comm=None, name: str = ""):
        self.work, self.comm, self.name = work, comm, name

    def wait(self) -> None:
        work, self.work = self.work, None
        if work is None:
            return
        try:
            work.wait()
        except RuntimeError as exc:  # DistBackendError and gloo's errors derive from it
            raise self.comm._failed(self.name, exc) from exc

    def landed(self) -> bool:
        """The collective has finished (a host query that never blocks; ``wait`` still
        has to run: it raises a failure and does any work left after the transfer)."""
        return self.work is None or self.work.is_completed()


DONE = Pending()


def settled(pending, async_op: bool):
    """A launch's answer: ``pending`` itself (``async_op``), or None once waited for."""
    if async_op:
        return pending
    pending.wait()
    return None


class AllOf(Pending):
    """Several collectives in flight, waited in the order they started."""

    __slots__ = ("rest",)

    def __init__(self, works, comm, name):
        super().__init__(works[0], comm, name)
        self.rest = works[1:]

    def wait(self) -> None:
        super().wait()
        rest, self.rest = self.rest, ()
        for work in rest:
            Pending(work, self.comm, self.name).wait()

    def landed(self) -> bool:
        return super().landed() and all(w.is_completed() for w in self.rest)


class OrderedSum(AllOf):
    """Chunks in flight; ``wait()`` then sums them in rank order into ``out`` and divides
    by the world size (``accumulate``: adds that to ``out``). ``chunks``: where each
    rank's chunk is, or lands, in rank order (``own``: this rank's, read in place, or
    None when it travelled too)."""

    __slots__ = ("out", "accumulate", "chunks", "own")

    def __init__(self, works, comm, name, chunks, out, accumulate=False, own=None):
        super().__init__(works, comm, name)
        self.chunks, self.out, self.accumulate, self.own = chunks, out, accumulate, own

    def wait(self) -> None:
        if self.work is None:
            return
        super().wait()
        total, chunks = self.out, self.chunks
        if self.accumulate:  # the sum goes into a received chunk when it can
            self.out = next((c for c in chunks if c is not self.own and c.dtype == total.dtype),
                            None)
            if self.out is None:
                self.out = self.comm.buffers.empty(total.shape, total.dtype, total.device)
        self._sum(chunks)
        if self.accumulate:
            total.add_(self.out)
        self.out = self.chunks = self.own = None

    def _sum(self, chunks) -> None:
        out = self.out
        if out.dtype == chunks[0].dtype:  # out may be chunk 0 or 1 itself: elementwise
            torch.add(chunks[0], chunks[1], out=out)
        else:
            out.copy_(chunks[0])
            out.add_(chunks[1])
        for k in range(2, len(chunks)):
            out.add_(chunks[k])
        out.div_(self.comm.world_size)


class _Added(Pending):
    """NCCL's reduce-scatter into a temporary, added to ``out`` at the wait."""

    __slots__ = ("tmp", "out")

    def __init__(self, work, comm, name, tmp, out):
        super().__init__(work, comm, name)
        self.tmp, self.out = tmp, out

    def wait(self) -> None:
        if self.work is None:
            return
        super().wait()
        self.out.add_(self.tmp)
        self.tmp = self.out = None


class LocalComm:
    """One rank (``comm.protocol.Comm``): every collective is a copy or nothing."""

    world_size = 1
    rank = 0
    group = process_group = None
    replica, replicas, members = 0, 1, (0,)
    wire: dict = {}
    wire_prefix = ""
    buffers = PLAIN

    @property
    def everyone(self):
        return self

    def reset_wire(self) -> None:
        pass

    def held_bytes(self) -> int:
        return 0

    def recv_numel(self, numel: int, into_out: bool = True) -> int:
        return 0

    def needs_recv(self, out, inp, accumulate: bool = False) -> bool:
        return False

    def reduce_scatter_avg(self, out: torch.Tensor, inp: torch.Tensor, recv=None,
                           async_op: bool = False, name: str = "reduce_scatter",
                           accumulate: bool = False):
        if accumulate:
            out.add_(inp)
        elif out.data_ptr() != inp.data_ptr() or out.dtype != inp.dtype:
            out.copy_(inp)
        return DONE if async_op else None

    def all_gather(self, flat: torch.Tensor, shard: torch.Tensor, async_op: bool = False,
                   name: str = "all_gather"):
        if shard.data_ptr() != flat.data_ptr():
            flat.copy_(shard)
        return DONE if async_op else None

    def gather_params(self, flat: torch.Tensor, shard: torch.Tensor, async_op: bool = False,
                      name: str = "all_gather"):
        return self.all_gather(flat, shard, async_op, name)

    def gathered(self, shard: torch.Tensor) -> torch.Tensor:
        return shard

    def all_gather_average(self, flat: torch.Tensor, part: torch.Tensor, async_op: bool = False,
                           name: str = "all_gather"):
        return self.all_gather(flat, part, async_op, name)

    def exchange(self, recv: torch.Tensor, send: torch.Tensor, async_op: bool = False,
                 name: str = "all_to_all", kind: str = "all_to_all"):
        return DONE if async_op else None  # the one row is this rank's own: nothing travels

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        pass

    def all_gather_object(self, obj, what: str = "all_gather_object"):
        return [obj]

    def gather(self, tensor: torch.Tensor, gather_list, dst: int, what: str = "gather") -> None:
        gather_list[0].copy_(tensor)


# torch 2.13 renamed the tensor collectives; older torch (>= 2.4) has only the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# Point-to-point tags of the gradient averages, counted per process group (gloo's
# collectives tag their own slots apart from these).
_TAGS = 1 << 24
_tags: dict = {}


class GroupComm:
    """Collectives over ``group`` (None: the world group): ``comm.protocol.Comm``."""

    _OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ZeroAdam needs an initialised torch.distributed process group: launch with "
                "`torchrun --nproc_per_node=N script.py` and call "
                "torch.distributed.init_process_group('nccl' or 'gloo') first, or use "
                "zero_triton.FusedAdam for a single process")
        self.group = group
        # The group itself, the world group for None: what torch's own group-keyed APIs
        # (Join, the agreement's side group and timeout) compare and read.
        self.process_group = group if group is not None else dist.distributed_c10d._get_default_group()
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = dist.get_backend(group)
        self.global_ranks = dist.get_process_group_ranks(self.process_group)
        # One group: every rank is in it, holding one copy of the shards.
        self.everyone, self.replica, self.replicas = self, 0, 1
        self.members = list(range(self.world_size))
        # Bytes this rank sent per collective (what an optimal algorithm sends: (W-1)/W
        # of a reduce-scatter's input or an all-gather's output, 2(W-1)/W of an
        # all-reduce's tensor), under ``wire_prefix`` + the collective's name.
        self.wire: dict = {}
        self.wire_prefix = ""
        self.buffers = PLAIN

    def reset_wire(self) -> None:
        self.wire.clear()

    def held_bytes(self) -> int:
        return 0

    def _count(self, kind: str, nbytes: float) -> None:
        key = self.wire_prefix + kind
        self.wire[key] = self.wire.get(key, 0) + int(nbytes)

    def _failed(self, name: str, exc: BaseException) -> RuntimeError:
        return RuntimeError(
            f"zero_triton: {name} failed on rank {self.rank}: {exc} (a peer rank probably died "
            "or stopped calling the collective; the process group's timeout bounds the wait)")

    @contextlib.contextmanager
    def _collective(self, name: str, kind: str | None = None):
        """Re-raise a failed collective as a RuntimeError that names the phase, so a rank
        that died mid-step fails the others with a message, never a bare gloo error.
        ``kind`` ("reduce_scatter", "all_gather"): the launch is a ``zero_triton.<kind>``
        profiler range, so a trace tells this collective's calls (an all-to-all, one
        broadcast per rank on gloo) from other collectives of the same name."""
        try:
            with (torch.profiler.record_function(f"zero_triton.{kind}") if kind
                  else contextlib.nullcontext()), without_python_tls():
                yield
        except RuntimeError as exc:  # DistBackendError and gloo's errors derive from it
            raise self._failed(name, exc) from exc

    def reduce_scatter_avg(self, out: torch.Tensor, inp: torch.Tensor, recv=None,
                           async_op: bool = False, name: str = "reduce_scatter",
                           accumulate: bool = False):
        """``out`` (``inp.numel() // world_size`` elements, of ``inp``'s dtype or wider)
        becomes (``accumulate``: is added) this rank's chunk of the group's average of
        ``inp``, summed in rank order. ``recv`` is scratch of ``inp``'s dtype (or None),
        busy until the wait, as is ``inp``: ``recv_numel`` says how much a launch needs
        and ``needs_recv`` whether it needs any. What a launch needs beyond ``recv`` (an
        average added to ``out`` on scratch sized for one into ``out``) is allocated for
        it and freed at the wait."""
        if self.world_size == 1:
            return LocalComm.reduce_scatter_avg(self, out, inp, recv, async_op, name, accumulate)
        self._count("reduce_scatter", inp.numel() // self.world_size * (self.world_size - 1)
                    * inp.element_size())
        with self._collective(name, "reduce_scatter"):
            if self.backend == "gloo" and inp.device.type == "cpu":
                pending = self._pairwise(out, inp, recv, name, accumulate)
            elif self.backend == "nccl" and self.world_size == 2 and out.dtype == inp.dtype:
                tmp = self.buffers.empty(out.shape, out.dtype, out.device) if accumulate else out
                work = _reduce_scatter(tmp, inp, op=dist.ReduceOp.AVG, group=self.group,
                                       async_op=True)
                pending = _Added(work, self, name, tmp, out) if accumulate else Pending(work, self, name)
            else:  # (gloo on GPU tensors too: scratch sized for pairs is too small, so made)
                recv = (recv.view(-1)[:inp.numel()] if recv is not None and recv.numel() >= inp.numel()
                        else self.buffers.empty(inp.shape, inp.dtype, inp.device))
                work = dist.all_to_all_single(recv, inp, group=self.group, async_op=True)
                pending = OrderedSum([work], self, name, list(recv.view(self.world_size, -1).unbind()),
                                     out, accumulate)
        return settled(pending, async_op)

    def _pairwise(self, out, inp, recv, name, accumulate) -> OrderedSum:
        """gloo: each peer's chunk sent from ``inp`` in place, and this rank's chunk
        received from each peer: the first peer's into ``out`` where it can land there,
        the others into ``recv`` (what does not fit: allocated)."""
        w, r = self.world_size, self.rank
        n = inp.numel() // w
        sent = inp.view(w, n)
        slots = [] if recv is None else list(recv.view(-1)[:recv.numel() // n * n].view(-1, n).unbind())
        into_out = self._into_out(out, inp, accumulate)
        chunks = []
        for k in range(w):
            if k == r:
                chunks.append(sent[k])
            elif into_out:
                chunks.append(out)
                into_out = False
            else:
                chunks.append(slots.pop(0) if slots else self.buffers.empty(n, inp.dtype, inp.device))
        works = self._swap_rows(sent, chunks)
        return OrderedSum(works, self, name, chunks, out, accumulate, own=chunks[r])

    def _swap_rows(self, send, recv) -> list:
        """Row ``k`` of ``send`` to each peer ``k`` and its row into ``recv[k]``, one
        send and one receive per peer. One tag per launch on the group, counted alike on
        every rank (they launch in the same order, which the step's agreement checks):
        the rows of launches in flight together (any optimizer's buckets) never pair
        across launches."""
        tag = _tags[self.group] = _tags.get(self.group, 0) % _TAGS + 1
        peers = [k for k in range(self.world_size) if k != self.rank]
        gr = self.global_ranks
        works = [dist.isend(send[k], dst=gr[k], group=self.group, tag=tag) for k in peers]
        return works + [dist.irecv(recv[k], src=gr[k], group=self.group, tag=tag) for k in peers]

    @staticmethod
    def _into_out(out, inp, accumulate) -> bool:
        """A received chunk can land in ``out``: of ``inp``'s dtype, apart from it, and
        not added to."""
        return (not accumulate and out.dtype == inp.dtype
                and out.untyped_storage().data_ptr() != inp.untyped_storage().data_ptr())

    def recv_numel(self, numel: int, into_out: bool = True) -> int:
        """The receive scratch ``reduce_scatter_avg`` needs for an input of ``numel``
        into an output it can receive into (``_into_out``: of the input's dtype, not
        added to) or otherwise."""
        if self.world_size == 1:
            return 0
        if self.backend != "gloo":
            return numel
        return numel // self.world_size * (self.world_size - 1 - int(into_out))

    def needs_recv(self, out: torch.Tensor, inp: torch.Tensor, accumulate: bool = False) -> bool:
        """Whether ``reduce_scatter_avg(out, inp, ...)`` needs receive scratch: on gloo
        not at two ranks into an ``out`` it can receive into (ZeRO-1's averages at two
        ranks hold no scratch); on NCCL not at two ranks with ``out`` of ``inp``'s dtype."""
        if self.world_size == 1:
            return False
        if self.backend != "gloo":
            return not (self.world_size == 2 and out.dtype == inp.dtype)
        return self.recv_numel(inp.numel(), self._into_out(out, inp, accumulate)) > 0

    def all_gather(self, flat: torch.Tensor, shard: torch.Tensor, async_op: bool = False,
                   name: str = "all_gather"):
        """``flat`` (``world_size`` chunks of ``shard``'s size) receives every rank's
        ``shard`` in rank order. On gloo CPU ranks, pairwise and in place: this rank's
        chunk sent to each peer and each peer's received into its chunk of ``flat``.
        gloo's all-gather receives into a temporary of ``flat``'s size and copies it out
        (a bucket-sized allocation per gather in flight); one broadcast per rank, the
        gather before, left a survivor waiting for the process group's timeout when a
        peer died (a binomial tree: a rank that receives a dead root's chunk through
        another survivor never hears of the death). Pairwise, every survivor receives
        from every peer, so each one's wait fails as the dead peer's pair closes."""
        if self.world_size > 1:
            self._count("all_gather", shard.numel() * shard.element_size() * (self.world_size - 1))
        if self.backend != "gloo" or not flat.is_contiguous() or flat.device.type != "cpu":
            with self._collective(name, "all_gather"):
                work = _all_gather(flat, shard, group=self.group, async_op=async_op)
            return Pending(work, self, name) if async_op else None
        chunks = flat.view(self.world_size, -1)
        own = chunks[self.rank]
        if shard.data_ptr() != own.data_ptr():
            own.copy_(shard)
        if self.world_size == 1:
            return DONE if async_op else None
        with self._collective(name, "all_gather"):
            works = self._swap_rows([own] * self.world_size, chunks)
        pending = AllOf(works, self, name)
        return settled(pending, async_op)

    def gather_params(self, flat: torch.Tensor, shard: torch.Tensor, async_op: bool = False,
                      name: str = "all_gather"):
        """The parameters' all-gather: exact here (``all_gather``)."""
        return self.all_gather(flat, shard, async_op, name)

    def gathered(self, shard: torch.Tensor) -> torch.Tensor:
        """What ``gather_params`` writes for ``shard``: ``shard`` itself."""
        return shard

    def all_gather_average(self, flat: torch.Tensor, part: torch.Tensor, async_op: bool = False,
                           name: str = "all_gather"):
        """An averaged ``part`` gathered back (hybrid sharding's replicas): exact here."""
        return self.all_gather(flat, part, async_op, name)

    def exchange(self, recv: torch.Tensor, send: torch.Tensor, async_op: bool = False,
                 name: str = "all_to_all", kind: str = "all_to_all"):
        """Row ``k`` of ``send`` to rank ``k``, into its ``recv`` row ``rank``: pairwise on
        gloo (``_swap_rows``; this rank's row stays), one ``all_to_all_single`` otherwise."""
        w = self.world_size
        if w == 1:
            return DONE if async_op else None
        self._count(kind, (w - 1) * send[0].numel() * send.element_size())
        with self._collective(name, kind):
            if self.backend == "gloo" and send.device.type == "cpu":
                works = self._swap_rows(send, recv)
            else:
                works = [dist.all_to_all_single(recv.view(-1), send.view(-1), group=self.group,
                                                async_op=True)]
        return settled(AllOf(works, self, name), async_op)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        if self.world_size > 1:
            self._count("all_reduce", 2 * (self.world_size - 1) / self.world_size
                        * t.numel() * t.element_size())
        with self._collective("all_reduce"):
            dist.all_reduce(t, op=self._OPS[op], group=self.group)

    def all_gather_object(self, obj, what: str = "all_gather_object"):
        out = [None] * self.world_size
        with self._collective(what):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, tensor: torch.Tensor, gather_list, dst: int, what: str = "gather") -> None:
        """``dist.gather`` to group rank ``dst`` (``gather_list`` only there)."""
        if self.rank != dst:
            self._count("gather", tensor.numel() * tensor.element_size())
        with self._collective(what):
            dist.gather(tensor, gather_list, dst=dist.get_global_rank(self.group, dst)
                        if self.group is not None else dst, group=self.group)
