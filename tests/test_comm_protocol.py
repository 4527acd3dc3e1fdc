"""How ranks talk (``zero_triton.comm.protocol``): both communicators implement ``Comm``,
signature by signature, and what they return from an async launch is a ``Handle``. A new
communicator (hybrid sharding, compressed collectives) is held to the same test by adding
it to ``IMPLEMENTATIONS``."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_signature, protocol_methods
from dist_utils import run_ranks
from zero_triton.comm.compressed import Int8Comm
from zero_triton.comm.group import GroupComm, LocalComm
from zero_triton.comm.hybrid import HybridComm
from zero_triton.comm.protocol import Comm, Handle

IMPLEMENTATIONS = [LocalComm, GroupComm, HybridComm, Int8Comm]
METHODS = protocol_methods(Comm)


def test_the_protocol_names_the_collectives_the_step_uses():
    assert set(METHODS) == {"reduce_scatter_avg", "recv_numel", "needs_recv", "all_gather",
                            "all_reduce", "all_gather_object", "gather", "reset_wire", "held_bytes",
                            "gather_params", "gathered", "all_gather_average", "exchange"}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("method", METHODS)
def test_each_communicator_has_the_protocols_signature(impl, method):
    assert_signature(impl, Comm, method)


def test_one_rank_is_a_comm_and_its_launches_are_handles():
    comm = LocalComm()
    assert isinstance(comm, Comm)
    out, inp = torch.zeros(4), torch.arange(4.0)
    assert isinstance(comm.reduce_scatter_avg(out, inp, async_op=True), Handle)
    assert torch.equal(out, inp)
    flat = torch.zeros(4)
    assert isinstance(comm.all_gather(flat, inp, async_op=True), Handle)
    assert torch.equal(flat, inp)


def test_int8_over_one_rank_is_a_comm_and_passes_through():
    comm = Int8Comm(LocalComm(), gather="int8", reduce="int8")
    assert isinstance(comm, Comm)
    out, inp = torch.zeros(4), torch.arange(4.0)
    comm.reduce_scatter_avg(out, inp)
    assert torch.equal(out, inp)


def _int8(rank, world):
    """Int8Comm over a group talks only through the group's declared members: its
    average moves as one exchange counted by the group under the average's name."""
    comm = Int8Comm(GroupComm(), gather="int8", reduce="int8", feedback=None)
    comm.wire_prefix = "x."
    out, inp = torch.zeros(256), torch.arange(512.0) * (rank + 1)
    comm.reduce_scatter_avg(out, inp, async_op=True).wait()
    return isinstance(comm, Comm), out.tolist(), comm.wire, comm.inner.wire_prefix


def test_int8_wraps_a_group_through_the_protocol():
    for rank, (is_comm, out, wire, prefix) in enumerate(run_ranks(_int8, 2)):
        assert is_comm and prefix == "x."
        want = [1.5 * k for k in range(256 * rank, 256 * rank + 256)]
        assert max(abs(a - b) for a, b in zip(out, want)) <= 767 * 2 / 127 / 2, rank
        assert wire == {"x.reduce_scatter": 256 + 4}, wire  # 256 codes and one scale


def _group(rank, world):
    comm = GroupComm()
    out, inp = torch.zeros(2), torch.arange(4.0) + rank
    handle = comm.reduce_scatter_avg(out, inp, torch.empty(comm.recv_numel(4)), async_op=True)
    handle.wait()
    flat = torch.zeros(2 * world)
    gathered = comm.all_gather(flat, out, async_op=True)
    gathered.wait()
    return isinstance(comm, Comm), isinstance(handle, Handle), isinstance(gathered, Handle), flat.tolist()


def test_a_group_is_a_comm_and_its_launches_are_handles():
    for is_comm, rs, ag, flat in run_ranks(_group, 2):
        assert is_comm and rs and ag
        assert flat == [0.5, 1.5, 2.5, 3.5]  # the average of (0..3) and (1..4), gathered


def _hybrid(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    comm = HybridComm(init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    out, inp = torch.zeros(3), torch.arange(6.0) * (rank + 1)
    handle = comm.reduce_scatter_avg(out, inp, async_op=True)
    handle.wait()
    flat = torch.zeros(6)
    gathered = comm.all_gather(flat, out, async_op=True)
    gathered.wait()
    flag = torch.tensor([float(rank)])
    comm.all_reduce(flag, "max")
    return (isinstance(comm, Comm), isinstance(handle, Handle), flat.tolist(), flag.item(),
            comm.wire, (comm.rank, comm.world_size, comm.replica, comm.replicas, comm.members))


def test_a_mesh_is_a_comm_averaging_over_every_rank_and_counting_its_bytes():
    for rank, (is_comm, handle, flat, flag, wire, coords) in enumerate(run_ranks(_hybrid, 4)):
        assert is_comm and handle
        assert flat == [2.5 * k for k in range(6)]  # the mean of (1, 2, 3, 4) x (0..5)
        assert flag == 3.0  # max: over every rank
        assert coords == (rank % 2, 2, rank // 2, 2, [2 * (rank // 2), 2 * (rank // 2) + 1])
        # 3 of 6 floats to the row's other rank; 2 floats (3 padded to 4) down the column,
        # reduce-scattered and gathered back; 3 floats gathered within the row
        assert wire == {"reduce_scatter": 12, "replicas.reduce_scatter": 8,
                        "replicas.all_gather": 8, "all_gather": 12, "all_reduce": 6}, wire


# How gradients are held (``GradHolder``): one class per ZeRO stage and the engine's.
from zero_triton.comm import grads as _grads  # noqa: E402
from zero_triton.comm.protocol import GradHolder  # noqa: E402
from zero_triton.optim.engine_home import EngineGrads  # noqa: E402

HOLDERS = [_grads.LocalGrads, _grads.ShardedGrads, EngineGrads]


@pytest.mark.parametrize("impl", HOLDERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("method", protocol_methods(GradHolder))
def test_each_gradient_holder_has_the_protocols_signature(impl, method):
    assert_signature(impl, GradHolder, method)


def test_a_stage_is_a_holder_and_its_attributes_say_what_differs():
    assert {s: c.__name__ for s, c in _grads.HOLDERS.items()} == {1: "LocalGrads", 2: "ShardedGrads"}
    for impl in HOLDERS:  # what differs is said by attributes, never by the stage's number
        assert isinstance(impl.sharded, bool) and not hasattr(impl, "stage"), impl
    assert [c.sharded for c in HOLDERS] == [False, True, False]
    assert _grads.ShardedGrads.flat is None and EngineGrads.flat is None
    # one place turns a stage into a class: the spec
    from zero_triton.optim.spec import Spec
    assert Spec.build(stage=2).grads is _grads.ShardedGrads
    with pytest.raises(ValueError, match="stage must be 1"):
        Spec.build(stage=3)
