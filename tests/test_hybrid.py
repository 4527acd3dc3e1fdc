"""Hybrid sharding (``ZeroAdam(device_mesh=...)`` over a 2-D (replicate, shard) mesh,
``zero_triton.comm.hybrid``): every replica holds the same bits, the result is flat
ZeRO's (bitwise where one dim is 1, within rounding of the other summation order at
2 x 2), every checkpoint path reshards between (2, 2), (1, 4), (4, 1), 2 and 1 ranks
bitwise, and bad meshes are refused before anything changes."""
from __future__ import annotations

import io
import os
import random
import time

import pytest
import torch

from dist_utils import run_ranks

SHAPES = ((2, 2), (1, 4), (4, 1))


class Net(torch.nn.Module):
    """An fp32 layer and a bf16 one (an fp32 master), sizes that divide nothing."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(24, 37)
        self.b = torch.nn.Linear(37, 11).to(torch.bfloat16)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)).to(torch.bfloat16)).float()


def _mesh(layout):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", layout, mesh_dim_names=("replicate", "shard"))


def _build(layout, model, **kw):
    import zero_triton as zt
    if isinstance(layout, tuple):
        return zt.ZeroAdamW(model.parameters(), lr=1e-2, device_mesh=_mesh(layout), **kw)
    if layout == 1:
        kw.pop("stage", None), kw.pop("bucket_cap_mb", None)
        return zt.FusedAdamW(model.parameters(), lr=1e-2, **kw)
    return zt.ZeroAdamW(model.parameters(), lr=1e-2, **kw)


def _train(model, opt, rank, steps, start=0, jitter=None):
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, 24, generator=g)
        if jitter is not None:  # ranks reach their buckets at random moments
            time.sleep(jitter.random() * 0.02)
        model(x).square().mean().backward()
        if jitter is not None:
            time.sleep(jitter.random() * 0.02)
        opt.step()
        opt.zero_grad()


def _dump(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _load(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def _job_train(rank, world, layout, stage, bucket, jitter_seed):
    torch.manual_seed(0)
    model = Net()
    # Clipping by the global norm: summed over the row's shards, once per replica.
    opt = _build(layout, model, stage=stage, bucket_cap_mb=bucket, max_grad_norm=0.05)
    jitter = random.Random(jitter_seed * 7919 + rank) if jitter_seed is not None else None
    _train(model, opt, rank, 4, jitter=jitter)
    assert opt.grad_norm is not None and float(opt.grad_norm) > 0.05  # it clipped
    full = opt.consolidated_state_dict(to_rank=None) if world > 1 else opt.state_dict()
    from zero_triton.optim.interface import internals
    view = internals(opt)  # FusedAdam at one rank: its comm sends nothing
    return _dump(([p.detach() for p in model.parameters()], full)), dict(view.comm.wire)


def _same(a, b, where):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where}: max diff {(a.float() - b.float()).abs().max()}"
    else:
        assert a == b, where


def _close(a, b, where):
    for k in a["state"]:
        for name, t in a["state"][k].items():
            u = b["state"][k][name]
            torch.testing.assert_close(t.float(), u.float(), rtol=1e-3, atol=1e-3,
                                       msg=lambda m: f"{where} state {k} {name}: {m}")


@pytest.mark.parametrize("stage,bucket", [(1, None), (2, 0.001)], ids=["stage1-one-bucket",
                                                                       "stage2-buckets"])
def test_every_replica_holds_the_same_bits_and_the_result_is_flat_zeros(stage, bucket):
    flat = [_load(r[0]) for r in run_ranks(_job_train, 4, 4, stage, bucket, None)]
    for shape in SHAPES:
        runs = run_ranks(_job_train, 4, shape, stage, bucket, None)
        got = [_load(r[0]) for r in runs]
        for r in range(1, 4):
            _same(got[r], got[0], f"{shape} rank {r} vs rank 0")
        if shape == (1, 4):  # flat ZeRO's layout and sums, in rank order: bitwise
            _same(got[0], flat[0], f"{shape} vs flat ZeRO")
        else:  # (g0 + g1) + (g2 + g3), and at (4, 1) the norm's terms of one shard, not
            # four: flat ZeRO's within rounding, which Adam's m / sqrt(v) can magnify
            # for tiny gradients (lr 1e-2, 4 steps)
            for p, q in zip(got[0][0], flat[0][0]):
                torch.testing.assert_close(p.float(), q.float(), rtol=1e-2, atol=1e-3)
            _close(got[0][1], flat[0][1], f"{shape}")
        wire = runs[0][1]
        R, S = shape
        if R > 1:
            assert wire.get("replicas.reduce_scatter", 0) > 0
        if S > 1:
            assert wire.get("reduce_scatter", 0) > 0 and wire.get("all_gather", 0) > 0


def test_random_arrival_orders_give_the_same_bits():
    """The row's and the column's averages of each bucket launch from backward's hooks,
    the column's once the row's landed: ranks sleeping at random points (another order
    of landings each run) must pair the same collectives and give the same bits."""
    first = [_load(r[0]) for r in run_ranks(_job_train, 4, (2, 2), 2, 0.001, 1)]
    for seed in (2, 3):
        again = [_load(r[0]) for r in run_ranks(_job_train, 4, (2, 2), 2, 0.001, seed)]
        for r in range(4):
            _same(again[r], first[r], f"jitter seed {seed} rank {r}")
    plain = [_load(r[0]) for r in run_ranks(_job_train, 4, (2, 2), 2, 0.001, None)]
    _same(plain[0], first[0], "no jitter")


# -- checkpoints: every path reshards between the shapes --------------------------------
KINDS = ("state_dict", "checkpoint", "dcp")


def _job_save(rank, world, layout, root):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    import zero_triton as zt
    torch.manual_seed(0)
    model = Net()
    opt = _build(layout, model, bucket_cap_mb=0.001)
    _train(model, opt, rank, 3)
    params = [p.detach().clone() for p in model.parameters()]
    if rank == 0:  # on one rank alone (the others at a barrier): the shard servers answer
        torch.save({"optim": opt.state_dict(), "params": params}, os.path.join(root, "sd.pt"))
    if world > 1:
        dist.barrier()
    zt.checkpoint.save(os.path.join(root, "ckpt"), opt)
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=os.path.join(root, "dcp"))
    full = opt.consolidated_state_dict(to_rank=None) if world > 1 else opt.state_dict()
    return _dump(full)


def _job_load(rank, world, layout, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    import zero_triton as zt
    saved = torch.load(os.path.join(root, "sd.pt"), weights_only=False)
    out = {}
    for kind in KINDS:
        torch.manual_seed(1)  # other initial values: the load must bring everything
        model = Net()
        with torch.no_grad():
            for p, q in zip(model.parameters(), saved["params"]):
                p.copy_(q)
        opt = _build(layout, model, bucket_cap_mb=0.001)
        if kind == "state_dict":
            opt.load_state_dict(saved["optim"])
        elif kind == "checkpoint":
            zt.checkpoint.load(os.path.join(root, "ckpt"), opt)
        else:
            sd = {"optim": get_optimizer_state_dict(model, opt)}
            dcp.load(sd, checkpoint_id=os.path.join(root, "dcp"))
            set_optimizer_state_dict(model, opt, sd["optim"])
        out[kind] = opt.consolidated_state_dict(to_rank=None) if world > 1 else opt.state_dict()
    return _dump(out)


def _ranks(layout):
    return layout[0] * layout[1] if isinstance(layout, tuple) else layout


@pytest.mark.parametrize("saved_at", [(2, 2), 2], ids=["saved-at-2x2", "saved-at-2"])
def test_every_checkpoint_path_reshards_between_the_shapes(tmp_path, saved_at):
    root = str(tmp_path)
    saved = _load(run_ranks(_job_save, _ranks(saved_at), saved_at, root)[0])
    targets = [(1, 4), (4, 1), 2, 1] if saved_at == (2, 2) else [(2, 2)]
    for layout in targets:
        loaded = run_ranks(_job_load, _ranks(layout), layout, root)
        for r, blob in enumerate(loaded):
            got = _load(blob)
            for kind in KINDS:
                _same(got[kind]["state"], saved["state"], f"{kind} saved at {saved_at}, "
                      f"loaded at {layout}, rank {r}")


# -- bad input ---------------------------------------------------------------------------
def _job_refusals(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    import zero_triton as zt
    model = torch.nn.Linear(8, 8)
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    said = {}

    def refused(name, **kw):
        try:
            zt.ZeroAdamW(params, **kw)
        except (ValueError, TypeError) as exc:
            said[name] = f"{type(exc).__name__}: {exc}"
        else:
            said[name] = None

    refused("swapped", device_mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "replicate")))
    refused("other dims", device_mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    refused("3-D", device_mesh=init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "b", "c")))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    refused("both", device_mesh=mesh, process_group=dist.group.WORLD)
    refused("not a mesh", device_mesh=[[0, 1], [2, 3]])
    part = DeviceMesh("cpu", [[0, 1]], mesh_dim_names=("replicate", "shard"))
    if rank < 2:
        refused("part of the ranks", device_mesh=part)
    else:
        refused("not in it", device_mesh=part)
    meta = torch.nn.Linear(8, 8, device="meta")
    try:
        zt.ZeroAdamW(meta.parameters(), device_mesh=mesh)
    except ValueError as exc:
        said["device"] = f"ValueError: {exc}"
    unchanged = all(torch.equal(p, q) for p, q in zip(params, before))
    return said, unchanged


def test_bad_meshes_are_refused_with_the_fix_before_anything_changes():
    for rank, (said, unchanged) in enumerate(run_ranks(_job_refusals, 4)):
        assert unchanged
        assert "(replicate, shard)" in said["swapped"] and "mesh_dim_names=('replicate', 'shard')" in said["swapped"]
        assert "('dp', 'tp')" in said["other dims"] and "name them" in said["other dims"]
        assert "3 dims" in said["3-D"] and "mesh['dp_replicate', 'dp_shard']" in said["3-D"]
        assert "not both" in said["both"]
        assert said["not a mesh"].startswith("TypeError: device_mesh must be")
        key = "part of the ranks" if rank < 2 else "not in it"
        assert "does not cover the ranks" in said[key], said[key]
        assert "meta" in said["device"] and "init_device_mesh('meta'" in said["device"]
