"""A param group's own state formats: ``{"params": ..., "moments": ..., "master_weights": ...}``
over the optimizer's. Each group's shards are built, stepped, stored and counted in its
formats, bit for bit as an optimizer built with those formats alone; torch's format,
the compact form, checkpoint files and DCP carry every group's state, and resharding
keeps the bits; bad formats, formats changed by hand and ranks that disagree are refused
before anything changes."""
import os

import pytest
import torch

import zero_triton as zt
from zero_triton.optim.compact import expand

from dist_utils import run_ranks
from lowbit_cases import assert_same, mean_grads

SHAPES = [(300, 19), (64,), (37, 256), (5,)]
# embeddings and norms (0, 1) in fp32 with an fp32 master; the rest in int8 with a 24-bit one
MIXED = [{"moments": "fp32", "master_weights": None}, {}]
DEFAULTS = dict(moments="int8", master_weights="remainder8")


def _params(seed=1234):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).bfloat16()) for s in SHAPES]


def _groups(params, formats=MIXED):
    return [{"params": params[:2], **formats[0]}, {"params": params[2:], **formats[1]}]


def _steps(params, opt, steps, first=0):
    for t in range(first, first + steps):
        for p, g in zip(params, mean_grads(0, 1, t, SHAPES)):
            p.grad = g.bfloat16()
        opt.step()


def _same_state(a: dict, b: dict) -> None:
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        for n in a["state"][k]:
            assert torch.equal(a["state"][k][n], b["state"][k][n]), (k, n)


def test_each_group_is_stepped_and_stored_as_its_formats_alone():
    params = _params()
    opt = zt.FusedAdamW(_groups(params), lr=1e-2, **DEFAULTS)
    _steps(params, opt, 4)
    alone = _params()
    first = zt.FusedAdamW(alone[:2], lr=1e-2, moments="fp32", master_weights=None)
    second = zt.FusedAdamW(alone[2:], lr=1e-2, **DEFAULTS)
    for t in range(4):
        for p, g in zip(alone, mean_grads(0, 1, t, SHAPES)):
            p.grad = g.bfloat16()
        first.step()
        second.step()
    for p, q in zip(params, alone):
        assert torch.equal(p, q)
    state = opt.state_dict()["state"]
    for k, e in first.state_dict()["state"].items():
        for n, v in e.items():
            assert torch.equal(state[k][n], v)
    for k, e in second.state_dict()["state"].items():
        for n, v in e.items():
            assert torch.equal(state[k + 2][n], v)
    kinds = [(s.state.moments.format, s.master_format) for _, s in opt._shards.listed(opt.param_groups)]
    assert kinds == [("fp32", "fp32"), ("int8", "remainder8")]
    report, a, b = opt.memory_report(), first.memory_report(), second.memory_report()
    for key in ("master", "moments"):
        assert report[key] == a[key] + b[key]
    assert opt.param_groups[0]["moments"] == "fp32" and "moments" not in opt.param_groups[1]


def test_torch_format_and_compact_state_dicts_carry_every_groups_state():
    """The compact form names both formats and expands to torch's; either loads into the
    same groups and resumes bit for bit; torch's format loads into other formats too,
    and a load keeps this optimizer's formats (its groups' format keys are its own)."""
    params = _params()
    opt = zt.FusedAdamW(_groups(params), lr=1e-2, **DEFAULTS)
    _steps(params, opt, 3)
    full, compact = opt.state_dict(), opt.state_dict(compact=True)
    assert compact["compact"]["moments"] == ["fp32", "int8"]
    assert "exp_avg_codes" in compact["state"][2] and compact["state"][0]["exp_avg"].dtype == torch.float32
    _same_state(expand(compact), full)
    straight = _params()
    ref = zt.FusedAdamW(_groups(straight), lr=1e-2, **DEFAULTS)
    _steps(straight, ref, 5)
    for sd in (full, compact):
        again = [torch.nn.Parameter(p.detach().clone()) for p in params]
        other = zt.FusedAdamW(_groups(again), lr=1e-2, **DEFAULTS)
        other.load_state_dict(sd)
        _steps(again, other, 2, first=3)
        for p, q in zip(again, straight):
            assert torch.equal(p, q)
        _same_state(other.state_dict(), ref.state_dict())
    swapped = [torch.nn.Parameter(p.detach().clone()) for p in params]
    other = zt.FusedAdamW(_groups(swapped, [{"moments": "bf16"}, {"moments": "fp32"}]), lr=1e-2,
                          **DEFAULTS)
    other.load_state_dict(full)
    assert other.param_groups[0]["moments"] == "bf16" and other.param_groups[1]["moments"] == "fp32"
    kinds = [s.state.moments.format for _, s in other._shards.listed(other.param_groups)]
    assert kinds == ["bf16", "fp32"]
    got = other.state_dict()["state"]
    assert torch.equal(got[3]["exp_avg"], full["state"][3]["exp_avg"])  # int8's values, now fp32


def test_formats_named_by_a_group_are_checked_and_a_change_by_hand_is_refused():
    p = torch.nn.Parameter(torch.randn(40, 3).bfloat16())
    storage = p.data_ptr()
    for group, match in [({"moments": "int2"}, "moments must be one of"),
                         ({"master_weights": "remainder9"}, "'remainder8'"),
                         ({"master_weights": "remainder8", "params": [torch.nn.Parameter(
                             torch.randn(3))]}, "their own master")]:
        with pytest.raises(ValueError, match=match):
            zt.FusedAdamW([{"params": [p], **group}], lr=1e-2)
        assert p.data_ptr() == storage
    with pytest.raises(ValueError, match="differentiable=True"):
        zt.FusedAdamW([{"params": [torch.nn.Parameter(torch.randn(3))], "moments": "int8"}],
                      differentiable=True)
    params = _params()
    opt = zt.FusedAdamW(_groups(params), lr=1e-2, **DEFAULTS)
    _steps(params, opt, 1)
    before = [q.detach().clone() for q in params]
    opt.param_groups[1]["master_weights"] = "remainder"
    with pytest.raises(RuntimeError, match="param group 1's master_weights= was changed by hand"):
        _steps(params, opt, 1, first=1)
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    del opt.param_groups[1]["master_weights"]
    _steps(params, opt, 1, first=1)  # put back: it steps
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(8, 256).bfloat16())],
                         "moments": "bf16"})
    assert opt._shards.groups[2][0].state.moments.format == "bf16"


def _job(rank, world_size, stage, bucket_cap_mb, steps, save_to, load_from, dcp_path=None):
    """ZeroAdamW over ``SHAPES`` in the two groups of ``MIXED``: (the parameters, the
    state dict's state) after ``steps`` steps, from step 3 after loading ``load_from``
    (zero_triton.checkpoint) or ``dcp_path`` (DCP); saving to either at the end."""
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    import torch.distributed.checkpoint as dcp
    params = _params()
    opt = zt.ZeroAdamW(_groups(params), lr=1e-2, stage=stage, bucket_cap_mb=bucket_cap_mb,
                       **DEFAULTS)
    model = torch.nn.ParameterList(params)
    first = 0
    if load_from:
        zt.checkpoint.load(load_from, opt)
        first = 3
    if dcp_path and not save_to:
        sd = {"optim": get_optimizer_state_dict(model, opt)}
        dcp.load(sd, checkpoint_id=dcp_path)
        set_optimizer_state_dict(model, opt, sd["optim"])
        first = 3
    for t in range(first, first + steps):
        for p, g in zip(params, mean_grads(rank, world_size, t, SHAPES)):
            p.grad = g.bfloat16()
        opt.step()
        opt.zero_grad()
    if save_to and dcp_path:
        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=dcp_path)
    elif save_to:
        zt.checkpoint.save(save_to, opt)
    sd = opt.state_dict()
    return ([p.detach().float().numpy().copy() for p in params],
            {k: {n: v.numpy().copy() for n, v in e.items()} for k, e in sd["state"].items()})


def test_zero_steps_the_same_bits_at_every_world_size_and_reshards_them(tmp_path):
    """1 rank, 2 (stage 2, many buckets) and 4 (stage 1): the same parameters and state;
    zero_triton.checkpoint and DCP saved at 2 ranks resume at 4 as the straight run."""
    one = run_ranks(_job, 1, 1, None, 5, None, None)[0]
    assert_same(run_ranks(_job, 2, 2, 0.002, 5, None, None)[0], one, "2 ranks")
    ckpt, dcp_dir = os.fspath(tmp_path / "ckpt"), os.fspath(tmp_path / "dcp")
    run_ranks(_job, 2, 1, 0.002, 3, ckpt, None)
    assert_same(run_ranks(_job, 4, 1, 0.001, 2, None, ckpt)[0], one, "checkpoint 2 -> 4")
    run_ranks(_job, 2, 1, 0.002, 3, True, None, dcp_dir)
    assert_same(run_ranks(_job, 4, 1, 0.001, 2, None, None, dcp_dir)[0], one, "DCP 2 -> 4")


def _disagreeing(rank, world_size):
    p = torch.nn.Parameter(torch.randn(40).bfloat16())
    try:
        zt.ZeroAdamW([{"params": [p], "moments": "int8" if rank == 0 else "fp32"}])
    except RuntimeError as exc:
        return str(exc)
    return None


def test_ranks_that_disagree_on_a_groups_formats_are_refused_on_every_rank():
    for message in run_ranks(_disagreeing, 2):
        assert message is not None and "param groups' formats" in message


def _fsdp2(rank, world_size):
    """FSDP2 DTensor parameters in two groups: the biases in fp32 moments with an fp32
    master, the weights in int8 with the 24-bit one; the masters after 4 steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.Linear(256, 8)).bfloat16()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = zt.FusedAdamW([{"params": biases, "moments": "fp32", "master_weights": None},
                         {"params": weights}], lr=1e-2, **DEFAULTS)
    for t in range(4):
        gen = torch.Generator().manual_seed(t)
        for p in model.parameters():
            full = (torch.randn(p.shape, generator=gen) * 1e-2).bfloat16()
            p.grad = torch.distributed.tensor.distribute_tensor(full, mesh, p.placements)
        opt.step()
    kinds = sorted({(s.state.moments.format, s.master_format) for _, s in opt._shards.listed(opt.param_groups)})
    sd = opt.state_dict()
    return kinds, [e["master_param"].full_tensor().view(torch.int32).numpy().copy()
                   for _, e in sorted(sd["state"].items())]


def test_fsdp2_groups_keep_their_formats_and_the_same_bits_at_one_and_two_ranks():
    pytest.importorskip("torch.distributed.fsdp")
    one = run_ranks(_fsdp2, 1, timeout=300)[0]
    two = run_ranks(_fsdp2, 2, timeout=300)[0]
    assert one[0] == two[0] and ("int8", "remainder8") in one[0] and ("fp32", "fp32") in one[0]
    for a, b in zip(one[1], two[1]):
        assert (a == b).all()
