"""DTensor parameters (FSDP2's ``fully_shard``, tensor parallel) on 2 gloo ranks.

FusedAdam does not step them yet and ZeroAdam never will (the engine shards them
already): both refuse them with the fix, before anything is built or communicated, and
the parameters stay the engine's.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from dist_utils import run_ranks  # noqa: E402

pytest.importorskip("torch.distributed.fsdp", reason="needs torch.distributed.fsdp (FSDP2)")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _refused(rank, world_size, engine, optimizer):
    from torch.distributed.device_mesh import init_device_mesh
    import zero_triton
    mesh = init_device_mesh("cpu", (world_size,))
    model = _model()
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    before = [(p.to_local().data_ptr(), p.to_local().clone()) for p in model.parameters()]
    clip = torch.nn.utils.clip_grad_norm_
    cls = getattr(zero_triton, optimizer)
    try:
        cls(model.parameters(), lr=1e-2)
    except TypeError as exc:
        message = str(exc)
    else:
        raise AssertionError(f"{optimizer} took DTensor parameters")
    after = [(p.to_local().data_ptr(), p.to_local()) for p in model.parameters()]
    assert all(a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(before, after)), \
        "the engine's parameters were moved or changed"
    assert torch.nn.utils.clip_grad_norm_ is clip, "a patch was applied by a refused optimizer"
    # The model still trains under torch's optimizer: nothing of it was taken.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return message


@pytest.mark.parametrize("engine", ["fsdp2", "tp"])
@pytest.mark.parametrize("optimizer", ["FusedAdamW", "ZeroAdamW"])
def test_dtensor_parameters_are_refused_with_the_fix(engine, optimizer):
    messages = run_ranks(_refused, 2, engine, optimizer, timeout=300)
    for message in messages:
        assert "parameter 0 of param group 0 is a DTensor" in message, message
        assert "torch.optim.AdamW(fused=True)" in message, message
        if optimizer == "ZeroAdamW":
            assert "would shard it again" in message, message
        else:
            assert "does not step DTensor parameters yet" in message, message
