"""Hybrid sharding: a ``Comm`` over a 2-D mesh of (replicate, shard) ranks.

FSDP2's HSDP convention: ``mesh[r, s]`` is shard ``s`` of replica ``r``. The state is
sharded over the S ranks of a row (the shard group, within a node) and each row holds a
full copy (the replicate group, a column, goes across nodes). For ZeroAdam that is:

    average grad[bucket] within the row         # shard group: S-way, ordered sum
    average that 1/S shard down the column      # replicate group: R-way reduce-scatter
                                                #   + all-gather, ordered sum
    step 1/S of the state
    all-gather the parameters within the row    # shard group

A rank sends (S-1)/S of a bucket within its node and 2(R-1)/(R S) of it across nodes,
where flat ZeRO over the R*S ranks sends (W-1)/W of it to every rank, most of them in
other nodes. Both averages sum in rank order, so every replica holds the same bits; the
result is (sum over the row / S) summed down the column / R: the average, associated
differently from flat ZeRO's one sum over W ranks (equal to it within rounding, and
bitwise where the sums are exact).

``HybridComm`` is what ``comm.protocol.Comm`` says, with the layout's coordinates:
``rank`` and ``world_size`` are the shard group's (the flat layout shards over S), and
``everyone`` is a ``GroupComm`` over every rank of the mesh (the agreements, the model
check, the side channel); ``replica`` says which copy of the shards this rank holds.

The column's average starts once the row's has landed. On a GPU the stream orders them;
on gloo the host would block, so a launch first moves on any averages whose row half has
landed (``landed()`` does too, as the buffer pools poll it), in launch order, and a wait
finishes every earlier one first: each group sees its collectives in the same order on
every rank, and nothing waits on a collective its peers cannot have launched.
"""
from __future__ import annotations

import collections

import torch

from .group import GroupComm, settled


class Chain:
    """A hybrid average in flight: collectives one after the other (``stages``: each
    launches one and returns its handle), the next launched by ``comm.advance`` once
    the one before has landed; then ``out`` takes (adds) the first ``out.numel()``
    elements of ``tmp``. ``comm.queue`` holds the chains not fully launched."""

    __slots__ = ("comm", "current", "stages", "tmp", "out", "accumulate", "done")

    def __init__(self, comm, first, stages, tmp, out, accumulate):
        self.comm, self.current, self.stages = comm, first, collections.deque(stages)
        self.tmp, self.out, self.accumulate = tmp, out, accumulate
        self.done = False

    def step(self, block: bool) -> bool:
        """Launch the next stage if the current one landed (``block``: wait for it);
        True once every stage is launched."""
        while self.stages:
            if not block and not self.current.landed():
                return False
            self.current.wait()
            self.current = self.stages.popleft()()
        return True

    def wait(self) -> None:
        if self.done:
            return
        if self.stages:  # still queued: launch what comes before it, and it
            self.comm.advance(until=self)
        current, self.current = self.current, None
        current.wait()
        m = self.out.numel()
        if self.accumulate:
            self.out.add_(self.tmp[:m])
        elif self.tmp.data_ptr() != self.out.data_ptr():
            self.out.copy_(self.tmp[:m])
        self.done = True
        self.tmp = self.out = None

    def landed(self) -> bool:
        if self.done:
            return True
        self.comm.advance()
        return not self.stages and self.current.landed()


class HybridComm:
    """ZeroAdam over a (replicate, shard) mesh (``comm.protocol.Comm``)."""

    def __init__(self, mesh, wrap=lambda comm: comm, buffers=None):
        """``wrap``: what each dim's ``GroupComm`` becomes (``comm.compressed.Int8Comm``:
        both averages, and the row's parameter gathers, sent compressed); ``buffers``:
        where each average's buffers come from, by its name (a bucket's): ``Kept``
        (capturable=True, chosen by the optimizer) keeps them for the next, so that a
        captured step uses the same memory at every replay; by default the shard dim's."""
        import torch.distributed as dist
        self.mesh = mesh
        replicate, shard = mesh.get_group(0), mesh.get_group(1)
        self.shard = wrap(GroupComm(shard))
        self.replicate = wrap(GroupComm(replicate))
        # Every rank of the mesh: the default group (the mesh covers it: checked).
        self.everyone = GroupComm(None)
        self.group = self.shard.group
        self.process_group = self.shard.process_group
        self.rank, self.world_size = self.shard.rank, self.shard.world_size
        self.replica, self.replicas = self.replicate.rank, self.replicate.world_size
        self.buffers = self.shard.buffers if buffers is None else buffers
        # The ranks of this rank's shard group, as ``everyone`` numbers them, by shard.
        self.members = [dist.get_group_rank(self.everyone.process_group, g)
                        for g in dist.get_process_group_ranks(self.process_group)]
        self.queue: collections.deque = collections.deque()
        # Per-collective bytes this rank sent (``Comm.wire``), the column's average under
        # its own name.
        self.shard.wire_prefix, self.replicate.wire_prefix = "", "replicas."
        self.wire_prefix = ""

    # -- the gradient average ----------------------------------------------------------
    def recv_numel(self, numel: int, into_out: bool = True) -> int:
        return self.shard.recv_numel(numel, into_out) if self.world_size > 1 else 0

    def needs_recv(self, out, inp, accumulate: bool = False) -> bool:
        return self.world_size > 1 and self.shard.needs_recv(out, inp, False)

    def reduce_scatter_avg(self, out: torch.Tensor, inp: torch.Tensor, recv=None,
                           async_op: bool = False, name: str = "reduce_scatter",
                           accumulate: bool = False):
        """``out`` becomes (is added) this rank's 1/S of the mesh's average of ``inp``:
        the row's average into a padded buffer of ``out``'s dtype, then the column's
        average of that buffer."""
        m = out.numel()
        if self.replicas == 1:
            return self.shard.reduce_scatter_avg(out, inp, recv, async_op, name, accumulate)
        chunk = -(-m // self.replicas)
        tmp = self.buffers.kept((name, "row"), chunk * self.replicas, out.dtype, out.device)
        if tmp.numel() > m:
            tmp[m:].zero_()
        part = self.buffers.kept((name, "column"), chunk, out.dtype, out.device)
        self.advance()
        first = self.shard.reduce_scatter_avg(tmp[:m], inp, recv, async_op=True, name=name)
        column = f"{name} (replicas)"
        pending = Chain(self, first, (
            lambda: self.replicate.reduce_scatter_avg(part, tmp, None, async_op=True, name=column),
            lambda: self.replicate.all_gather_average(tmp, part, async_op=True, name=column)),
            tmp, out, accumulate)
        self.queue.append(pending)
        if inp.device.type != "cpu":  # the stream orders the two: no host wait
            self.advance(until=pending)
        return settled(pending, async_op)

    def advance(self, until=None) -> None:
        """Launch the next collectives of the averages in flight whose last one landed,
        in launch order; with ``until``, every one of every average up to it, waiting
        for each before the next."""
        queue = self.queue
        while queue:
            head = queue[0]
            if not head.step(block=until is not None):
                return
            queue.popleft()
            if head is until:
                return

    # -- the rest of Comm --------------------------------------------------------------
    def all_gather(self, flat, shard, async_op: bool = False, name: str = "all_gather"):
        """Within the row: the parameters (every replica holds the same shards)."""
        return self.shard.all_gather(flat, shard, async_op, name)

    def gather_params(self, flat, shard, async_op: bool = False, name: str = "all_gather"):
        """Within the row, as the row's comm sends parameters (compressed or not)."""
        return self.shard.gather_params(flat, shard, async_op, name)

    def gathered(self, shard: torch.Tensor) -> torch.Tensor:
        return self.shard.gathered(shard)

    def all_gather_average(self, flat, part, async_op: bool = False, name: str = "all_gather"):
        """Within the row, as the row's comm gathers averages."""
        return self.shard.all_gather_average(flat, part, async_op, name)

    def exchange(self, recv, send, async_op: bool = False, name: str = "all_to_all",
                 kind: str = "all_to_all"):
        """Within the row."""
        return self.shard.exchange(recv, send, async_op, name, kind)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        """``sum``: over the row (a shard's value, the same on every replica, counts
        once); ``max``: over every rank (flags each rank finds on its own)."""
        if op == "max":
            self.everyone.all_reduce(t, op)
        elif self.world_size > 1:
            self.shard.all_reduce(t, op)

    def all_gather_object(self, obj, what: str = "all_gather_object"):
        """Over every rank, in ``everyone``'s order: what the ranks agree on."""
        return self.everyone.all_gather_object(obj, what)

    def gather(self, tensor, gather_list, dst: int, what: str = "gather") -> None:
        """Within the row, to its shard ``dst``."""
        if self.world_size == 1:
            gather_list[0].copy_(tensor)
            return
        self.shard.gather(tensor, gather_list, dst, what)

    def held_bytes(self) -> int:
        """The compressed averages' error buffers, both hops (``comm.compressed``), and
        the buffers kept."""
        return self.shard.held_bytes() + self.replicate.held_bytes() + self.buffers.nbytes()

    @property
    def wire(self) -> dict:
        """Bytes this rank sent, per collective (``GroupComm.wire``)."""
        out: dict = {}
        for comm in (self.shard, self.replicate, self.everyone):
            for k, v in comm.wire.items():
                out[k] = out.get(k, 0) + v
        return out

    def reset_wire(self) -> None:
        for comm in (self.shard, self.replicate, self.everyone):
            comm.reset_wire()

