"""How ranks talk: the one interface the optimizer's layers communicate through.

``Comm`` is what a flat shard, the buckets, the agreements and the checkpoint protocol
use of a communicator: its rank and size, the rank-ordered average a ZeRO step
reduce-scatters gradients with, the all-gather of parameters, the all-reduce of norms and
flags, and two object collectives. ``Handle`` is what an async launch returns.
Implementations: ``comm.group.LocalComm`` (one rank: copies), ``comm.group.GroupComm``
(a torch.distributed process group) and ``comm.hybrid.HybridComm`` (a 2-D mesh of
(replicate, shard) ranks: averages within a node, then across nodes). A new way of
talking is a class of its own that implements ``Comm``; nothing that uses one changes.
``tests/test_comm_protocol.py`` holds the implementations to it, signature by signature.

A communicator that wraps another (``comm.compressed.Int8Comm`` over any ``Comm``,
``comm.hybrid.HybridComm`` over one per mesh dimension) uses only what is declared here:
``exchange`` moves its own payloads, the inner comm counts the bytes (``wire``, under
``wire_prefix``) and names a failed collective, and ``buffers`` is where every
communicator's payloads and scratch come from (``zero_triton.state.buffers``).

``rank`` and ``world_size`` are the layout's: the state is sharded ``world_size`` ways
and this rank steps shard ``rank``. Where several ranks hold each shard (hybrid
sharding), ``replicas`` says how many and ``replica`` which copy this rank's is;
``everyone`` is the communicator over every rank (flat ZeRO: the comm itself), what
agreements, the model check and the side channel go over, and ``members`` are the
ranks of this rank's shards as ``everyone`` numbers them, by shard.

``GradHolder`` is how a shard's gradients are held until the step: one class per ZeRO
stage and one for gradients their engine keeps (DTensor).
"""
from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

import torch


@runtime_checkable
class Handle(Protocol):
    """A collective in flight."""

    def wait(self) -> None:
        """Block until it finished, and do what is left after the transfer (a sum, a
        copy); raise, naming the collective, if it failed."""

    def landed(self) -> bool:
        """Finished (a host query that never blocks); ``wait`` must still run."""


@runtime_checkable
class Comm(Protocol):
    """A communicator over ``world_size`` ranks, this one ``rank``."""

    rank: int
    world_size: int
    group: Any  # the torch.distributed group (None: the world group, or one rank)
    # The group itself (None: one rank): what torch's group-keyed APIs compare and read
    # (Join, the agreement's side channel and timeout, DCP's placements).
    process_group: Any
    replica: int   # which copy of the shards this rank holds (0 without replicas)
    replicas: int  # how many copies of the shards there are
    everyone: Any  # a Comm over every rank (the comm itself without replicas)
    members: Any   # the ranks holding shards 0 .. world_size-1 of this copy, in everyone
    wire: dict     # bytes this rank sent, per collective, since ``reset_wire``
    wire_prefix: str  # what ``wire``'s keys of this comm start with (a wrapper's name for it)
    buffers: Any   # where its payloads and scratch come from (``state.buffers.Buffers``)

    def reset_wire(self) -> None:
        """Start counting ``wire`` again."""

    def held_bytes(self) -> int:
        """Bytes the communicator keeps between steps (error feedback's buffers)."""

    def reduce_scatter_avg(self, out: torch.Tensor, inp: torch.Tensor, recv=None,
                           async_op: bool = False, name: str = "reduce_scatter",
                           accumulate: bool = False) -> Optional[Handle]:
        """``out`` (``inp.numel() // world_size`` elements) becomes (``accumulate``: is
        added) this rank's chunk of the average of every rank's ``inp``, summed in rank
        order, so the bits do not depend on arrival order. ``recv`` is receive scratch of
        ``recv_numel`` elements; ``inp`` and ``recv`` are busy until the wait."""

    def recv_numel(self, numel: int, into_out: bool = True) -> int:
        """The receive scratch ``reduce_scatter_avg`` needs for an input of ``numel``."""

    def needs_recv(self, out: torch.Tensor, inp: torch.Tensor, accumulate: bool = False) -> bool:
        """Whether ``reduce_scatter_avg(out, inp)`` needs any receive scratch."""

    def all_gather(self, flat: torch.Tensor, shard: torch.Tensor, async_op: bool = False,
                   name: str = "all_gather") -> Optional[Handle]:
        """``flat`` (``world_size`` chunks of ``shard``'s size) receives every rank's
        ``shard`` in rank order."""

    def gather_params(self, flat: torch.Tensor, shard: torch.Tensor, async_op: bool = False,
                      name: str = "all_gather") -> Optional[Handle]:
        """The parameters' all-gather: ``all_gather``'s, except that a compressing comm
        may send them lossily (``comm.compressed``), every rank, the owner too, writing
        the same values; ``all_gather`` itself is always exact (state, fingerprints)."""

    def gathered(self, shard: torch.Tensor) -> torch.Tensor:
        """What ``gather_params`` writes for this rank's ``shard`` (``shard`` itself
        when it is exact): what a parameter the optimizer wrote holds, told apart from
        one the user wrote."""

    def all_gather_average(self, flat: torch.Tensor, part: torch.Tensor, async_op: bool = False,
                           name: str = "all_gather") -> Optional[Handle]:
        """An average's second half: every rank's averaged ``part`` into ``flat`` (hybrid
        sharding's column), exact or as the comm compresses averages, every rank writing
        the same values."""

    def exchange(self, recv: torch.Tensor, send: torch.Tensor, async_op: bool = False,
                 name: str = "all_to_all", kind: str = "all_to_all") -> Optional[Handle]:
        """An all-to-all of equal rows: row ``k`` of ``send`` ([world_size, n]) goes to
        rank ``k``, whose ``recv`` row ``rank`` receives it; this rank's own row need not
        travel (what ``recv[rank]`` holds afterwards is unspecified). The bytes sent are counted under
        ``kind`` (a profiler range ``zero_triton.<kind>``); a failure names ``name``."""

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        """``t`` becomes, in place, the sum over the shards of a value each shard holds
        (a replica holds the same and counts once), or (``op="max"``) the maximum over
        every rank."""

    def all_gather_object(self, obj, what: str = "all_gather_object") -> list:
        """Every rank's picklable ``obj``, in ``everyone``'s rank order."""

    def gather(self, tensor: torch.Tensor, gather_list, dst: int, what: str = "gather") -> None:
        """``tensor`` of every shard into ``gather_list`` on shard ``dst`` (only there;
        with replicas, on each copy's)."""


@runtime_checkable
class GradHolder(Protocol):
    """How one shard's gradients are held between backward and the step. Implementations:
    ``comm.grads.LocalGrads`` (stage 1 and one process: a local buffer, each ``.grad`` its
    view), ``comm.grads.ShardedGrads`` (stage 2: handed to the buckets as backward makes
    them, no local buffer) and ``optim.engine_home.EngineGrads`` (DTensor parameters:
    where their engine puts them). ``comm.grads.HOLDERS`` maps a ZeRO stage to its class;
    ``stage`` picks one once, at construction, and nothing else asks which stage it is."""

    sharded: bool   # handed over as backward makes them: no local buffer, every micro-batch averaged
    flat: Optional[torch.Tensor]  # the local gradient buffer, None without one

    def register_hooks(self, bucket_list, reducer) -> list:
        """Backward's hooks on the parameters (taking each gradient in, launching the
        buckets with ``reducer``); returns their handles."""

    def sync(self, param_views):
        """At the step: take what backward's hooks did not, and return which parameters
        have a gradient (a host list; None when all do)."""

    def zero(self, set_to_none: bool = True) -> None:
        """``zero_grad``, as torch.optim.Optimizer's."""

    def carry_over(self, old) -> None:
        """Take ``old``'s gradients (the same parameters, re-homed)."""

    def nbytes(self) -> int:
        """Bytes of gradients held outside the buckets."""

    def written_since_hooks(self) -> bool:
        """Something wrote the held gradients after the last bucket hook: average again."""

    def rewritten(self) -> None:
        """They were changed by an op that leaves version counters alone."""
