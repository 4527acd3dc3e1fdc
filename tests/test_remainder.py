"""master_weights="remainder": the fp32 master of bf16 parameters as the parameters' 16
bits and an int16 beside them. The split and join are exact; each kernel, with each
moments format, is bitwise its backend's fp32-master step; the optimizers keep the same
master as master_weights=True, bit for bit, at every world size and bucket size, through
checkpoints and state dicts of either kind; a parameter the user writes keeps its master
where it still pairs with it; refusals with the fix."""
import contextlib
import os

import pytest
import torch

import zero_triton as zt
from zero_triton.kernels import quant, remainder
from zero_triton.native import backends

from adam_cases import spelled_step
from dist_utils import run_ranks
from lowbit_cases import (SHAPES, assert_refused, assert_same, bf16_zero_job, disagreeing_ranks_job,
                          gpu_backends, held_isa, mean_grads, moment_operands)

BACKENDS = ["torch"] + [b for b in ("cpu", "triton")
                        if backends.why_not(b, torch.device("cpu")) is None]
KW = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True, amsgrad=False,
          maximize=False)
SPECIAL = [0, 0x00008000, 0x00007FFF, 0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF,
           0x7F800000, 0xFF800000, 0x80000000, 0x80008000, 0xBF808000, 0x00000001,
           0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0xFF80FFFF]


def _floats(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2 ** 32, (n,), generator=gen, dtype=torch.int64)
    bits = torch.cat([bits, torch.tensor(SPECIAL, dtype=torch.int64)])
    return torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32).view(torch.float32)


def test_split_then_join_is_exact_and_the_parameter_is_the_master_rounded():
    x = _floats(1 << 20)
    p, r = remainder.split(x)
    back = remainder.join(p, r)
    nan = torch.isnan(x)
    assert torch.equal(back[~nan].view(torch.int32), x[~nan].view(torch.int32))
    assert torch.isnan(back[nan]).all() and torch.isnan(p[nan]).all()
    # The parameter is round-to-nearest; it differs from torch's (ties to even) only at
    # exact ties, where it rounds away from zero.
    low = x.view(torch.int32).to(torch.int64) & 0xFFFF
    differs = (p.view(torch.int16) != x.to(torch.bfloat16).view(torch.int16)) & ~nan
    assert differs.any() and (low[differs] == 0x8000).all()
    assert (p[differs].float().abs() > x[differs].abs()).all()


def test_a_written_parameter_keeps_the_remainder_only_where_they_still_pair():
    p = torch.tensor([0.0, -0.0, 1.0, float("inf"), 2.0], dtype=torch.bfloat16)
    r = torch.tensor([-5, -5, -5, -5, 7], dtype=torch.int16)
    kept = remainder.consistent(p, r)
    # +-0 with a rounded-up remainder would join to a NaN: dropped; the others pair.
    assert kept.tolist() == [0, 0, -5, -5, 7]
    assert not torch.isnan(remainder.join(p, kept)).any()


KERNELS = [b for b in BACKENDS if b != "cpu"] + (
    [f"cpu:{isa}" for isa in ("default", "avx2", "avx512")] if "cpu" in BACKENDS else [])


@pytest.fixture
def kernel(request):
    """A backend's name, with the C++ kernel held to one instruction-set variant."""
    name, _, isa = request.param.partition(":")
    with held_isa(isa) if isa else contextlib.nullcontext():
        yield name


@pytest.mark.parametrize("fmt", ["fp32", "int8", "bf16"])
@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
def test_each_kernel_is_the_fp32_master_step_split_again(kernel, fmt):
    """Over more elements than one thread of the C++ kernel takes, special values
    included (ties, zeros, infinities, NaN, the largest floats)."""
    backend, n, seed, index = kernel, 70_000, 7, 3
    master = _floats(n - len(SPECIAL), seed=2)
    master = torch.where(torch.isfinite(master), master.clamp(-4, 4), master)[:n]
    master[:64] = torch.randn(64)  # and some ordinary values
    gen = torch.Generator().manual_seed(0)
    g = (torch.randn(n, generator=gen) * 1e-2).bfloat16()
    step, lr = torch.tensor([5.0]), torch.tensor([1e-3])
    ops = moment_operands(fmt, n)
    want_ops = [o.clone() if o is not None else None for o in ops]
    keyed = {"seed": seed, "index": index} if fmt == "bf16" else {}
    want = master.clone()
    spelled_step(backend, fmt)(want, g, *want_ops, None, step, lr, **KW, **keyed)
    p, r = remainder.split(master)
    spelled_step(backend, fmt)(p, g, *ops, None, step, lr, **KW, **keyed, remainder=r)
    got = remainder.join(p, r)
    nan = torch.isnan(want)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
    assert torch.isnan(got[nan]).all()
    assert torch.equal(p.view(torch.int16)[~nan], remainder.split(want)[0].view(torch.int16)[~nan])
    for a, b in zip(ops, want_ops):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernels_refuse_a_remainder_they_cannot_step(backend):
    n = 64
    p, g = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n)
    m, v = torch.zeros(n), torch.zeros(n)
    step, lr = torch.tensor([1.0]), torch.tensor([1e-3])
    fn = spelled_step(backend, "fp32")
    if backend == "torch":
        pytest.skip("the torch fallback checks nothing (the optimizers hand it checked operands)")
    with pytest.raises((ValueError, TypeError, RuntimeError), match="remainder"):
        fn(p, g, m, v, None, None, step, lr, **KW, remainder=torch.zeros(n, dtype=torch.int32))
    with pytest.raises((ValueError, RuntimeError), match="pass one"):
        fn(p, g, m, v, None, None, step, lr, **KW, stochastic=True,
           remainder=torch.zeros(n, dtype=torch.int16))


def _train(master_weights, moments="fp32", backend="auto", steps=6, write=None):
    torch.manual_seed(0)
    shapes = [(37, 19), (300,), (5,), (64, 33)]
    params = [torch.nn.Parameter(torch.randn(s).bfloat16()) for s in shapes]
    opt = zt.FusedAdamW(params, lr=1e-2, weight_decay=0.1, master_weights=master_weights,
                        moments=moments, backend=backend)
    for t in range(steps):
        gen = torch.Generator().manual_seed(t)
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).bfloat16()
        opt.step()
        if write is not None:
            write(t, params)
    return params, opt


def _masters(opt):
    return torch.cat([e["master_param"].reshape(-1) for e in opt.state_dict()["state"].values()])


@pytest.mark.parametrize("moments", ["fp32", "int8"])
def test_the_same_master_as_master_weights_true_for_two_bytes(moments):
    exact, a = _train(None, moments)
    two, b = _train("remainder", moments)
    assert torch.equal(_masters(a).view(torch.int32), _masters(b).view(torch.int32))
    pa = torch.cat([p.detach().reshape(-1) for p in exact])
    pb = torch.cat([p.detach().reshape(-1) for p in two])
    master = _masters(b)
    ties = (master.view(torch.int32) & 0xFFFF) == 0x8000
    assert torch.equal(pa[~ties], pb[~ties])  # the parameters: the master's rounding
    report_a, report_b = a.memory_report(), b.memory_report()
    assert report_b["master"] * 2 == report_a["master"]
    assert report_b["master"] == sum(p.numel() for p in two) * 2 + 2 * b._shards.groups[0][0].layout.padding


def test_a_parameter_written_with_its_own_value_keeps_its_exact_master():
    """An EMA swapped in and back, or the same weights loaded again: the remainder stays;
    zeros written do not turn into NaN; a new value is stepped from."""
    saved = {}

    def write(t, params):
        with torch.no_grad():
            if t == 2:  # swap in other weights, then the same ones back
                saved["w"] = [p.detach().clone() for p in params]
                for p in params:
                    p.copy_(torch.zeros_like(p))
                for p, w in zip(params, saved["w"]):
                    p.copy_(w)
    straight, a = _train("remainder")
    swapped, b = _train("remainder", write=write)
    assert torch.equal(_masters(a).view(torch.int32), _masters(b).view(torch.int32))

    def zero(t, params):
        if t == 2:
            with torch.no_grad():
                params[1].zero_()
    zeroed, c = _train("remainder", write=zero)
    assert torch.isfinite(_masters(c)).all()
    assert not torch.equal(zeroed[1], straight[1])


def test_state_dicts_move_between_remainder_and_an_fp32_master_exactly():
    """A torch-format state dict (master_param exact) saved with one loads into the other
    and both continue bit for bit; the straight run of either is the reference."""
    for first, second in (("remainder", None), (None, "remainder")):
        _, straight = _train(second, steps=6)
        params, opt = _train(first, steps=3)
        sd = opt.state_dict()
        again = [torch.nn.Parameter(p.detach().clone()) for p in params]
        other = zt.FusedAdamW(again, lr=1e-2, weight_decay=0.1, master_weights=second)
        other.load_state_dict(sd)
        for t in range(3, 6):
            gen = torch.Generator().manual_seed(t)
            for p in again:
                p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).bfloat16()
            other.step()
        assert torch.equal(_masters(other).view(torch.int32), _masters(straight).view(torch.int32))


def test_opt_state_shows_the_live_moments_and_takes_what_is_assigned():
    """The master is joined on demand (no view to show); fp32 moments are views, as
    torch's, and a tensor assigned to one is stepped from."""
    params, opt = _train("remainder", steps=1)
    p = params[1]
    assert sorted(opt.state[p]) == ["exp_avg", "exp_avg_sq", "step"]
    opt.state[p]["exp_avg_sq"] = torch.ones(p.shape)
    p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.allclose(opt.state_dict()["state"][1]["exp_avg_sq"], torch.full(p.shape, 0.999))
    _, int8 = _train("remainder", moments="int8", steps=1)
    assert sorted(int8.state[int8.param_groups[0]["params"][0]]) == ["step"]


@pytest.mark.parametrize("kwargs,dtype,match", [
    ({"master_weights": "remainder"}, torch.float32, "their own master"),
    ({"master_weights": "remainder"}, torch.float16, "bfloat16 only"),
    ({"master_weights": "remainder", "differentiable": True}, torch.bfloat16, "differentiable"),
])
def test_refused_before_anything_changes(kwargs, dtype, match):
    assert_refused(kwargs, dtype, match)


def _job(rank, world_size, bucket_cap_mb, stage, master_weights, moments, steps, save_to,
         load_from):
    return bf16_zero_job(rank, world_size, bucket_cap_mb, stage, master_weights, moments, steps,
                         save_to, load_from)


def _job_masters(result) -> torch.Tensor:
    """The master_param bits of a ``bf16_zero_job`` result."""
    return torch.cat([torch.from_numpy(e["master_param"]).reshape(-1)
                      for _, e in sorted(result[1].items())]).view(torch.int32)


def test_ranks_that_disagree_on_master_weights_are_refused_on_every_rank():
    for message in run_ranks(disagreeing_ranks_job, 2, torch.bfloat16,
                             {"master_weights": "remainder"}, {"master_weights": None}):
        assert message is not None and "master_weights=" in message and "['remainder', True]" in message


@pytest.mark.parametrize("moments", ["int8", "fp32"])
def test_bitwise_the_fp32_master_at_every_world_size_and_bucket_size(moments):
    """The same master as master_weights=True, and the same parameters at 1, 2 and 4
    ranks (stage 1 and 2, one bucket or many)."""
    one = run_ranks(_job, 1, None, 1, "remainder", moments, 4, None, None)[0]
    exact = run_ranks(_job, 1, None, 1, True, moments, 4, None, None)[0]
    assert torch.equal(_job_masters(one), _job_masters(exact))
    for world_size, cap, stage in [(2, 0.002, 2), (4, 0.001, 1)]:
        assert_same(run_ranks(_job, world_size, cap, stage, "remainder", moments, 4, None, None)[0],
              one, f"{world_size} ranks")


def test_a_checkpoint_saved_at_two_resumes_at_one_and_four_bitwise(tmp_path):
    straight = run_ranks(_job, 1, None, 1, "remainder", "int8", 5, None, None)[0]
    path = os.fspath(tmp_path / "ckpt")
    run_ranks(_job, 2, 0.002, 1, "remainder", "int8", 3, path, None)
    for world_size in (1, 4):
        resumed = run_ranks(_job, world_size, 0.001 if world_size > 1 else None, 1, "remainder",
                            "int8", 2, None, path)[0]
        assert_same(resumed, straight, f"resumed at {world_size}")


def _job_dcp(rank, world_size, path, save, optimizer_first):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    gen = torch.Generator().manual_seed(1234)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s, generator=gen).bfloat16())
                                    for s in SHAPES])
    opt = zt.ZeroAdamW(model.parameters(), lr=1e-2, master_weights="remainder", moments="int8",
                       bucket_cap_mb=0.002 if world_size == 2 else 0.001)
    steps = range(0, 3) if save else range(3, 5)
    if not save:
        sd = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(sd, checkpoint_id=path)
        if optimizer_first:  # the weights written after the master: the same values, kept
            set_optimizer_state_dict(model, opt, sd["optim"])
            model.load_state_dict(sd["model"])
        else:
            model.load_state_dict(sd["model"])
            set_optimizer_state_dict(model, opt, sd["optim"])
    for t in steps:
        for p, g in zip(model, mean_grads(rank, world_size, t, SHAPES)):
            p.grad = g.bfloat16()
        opt.step()
        opt.zero_grad()
    if save:
        dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=path)
    sd = opt.state_dict()
    return ([p.detach().float().numpy().copy() for p in model],
            {k: {n: v.numpy().copy() for n, v in e.items()} for k, e in sd["state"].items()})


@pytest.mark.parametrize("optimizer_first", [False, True])
def test_dcp_reshards_the_exact_master_from_two_ranks_to_four(tmp_path, optimizer_first):
    """ZeroAdamW's sharded state (the joined master, dequantized moments) saved by DCP at
    2 ranks loads at 4, the model's weights before or after the optimizer's state, and
    continues exactly as one run of 5 steps."""
    straight = run_ranks(_job, 1, None, 1, "remainder", "int8", 5, None, None)[0]
    path = os.fspath(tmp_path / "dcp")
    run_ranks(_job_dcp, 2, path, True, optimizer_first)
    assert_same(run_ranks(_job_dcp, 4, path, False, optimizer_first)[0], straight, "DCP 2 -> 4")


def _job_fsdp2(rank, world_size, master_weights):
    """FSDP2 DTensor parameters in bf16: the masters (joined, full) after 4 steps on
    gradients that do not depend on the parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 300), torch.nn.Linear(300, 7)).bfloat16()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = zt.FusedAdamW(model.parameters(), lr=1e-2, master_weights=master_weights,
                        moments="int8")
    for t in range(4):
        gen = torch.Generator().manual_seed(t)
        for p in model.parameters():
            full = (torch.randn(p.shape, generator=gen) * 1e-2).bfloat16()
            p.grad = torch.distributed.tensor.distribute_tensor(full, mesh, p.placements)
        opt.step()
    sd = opt.state_dict()
    return [e["master_param"].full_tensor().view(torch.int32).numpy().copy()
            for _, e in sorted(sd["state"].items())]


def test_fsdp2_dtensor_parameters_keep_the_fp32_master_exactly():
    pytest.importorskip("torch.distributed.fsdp")
    exact = run_ranks(_job_fsdp2, 2, None, timeout=300)[0]
    two = run_ranks(_job_fsdp2, 2, "remainder", timeout=300)[0]
    for a, b in zip(exact, two):
        assert (a == b).all()


@pytest.mark.parametrize("fmt", ["fp32", "int8", "bf16"])
@pytest.mark.parametrize("backend", gpu_backends())
def test_remainder_kernels_on_cuda_match_the_cpu_definition(backend, fmt):
    """Five steps on CUDA tensors against the torch backend on CPU (not bitwise: the GPU
    contracts multiply-adds and the torch backend computes the update in other steps, so
    a master lands a place apart now and then, and a moment's code with it); the join is
    the master the fp32-master kernel of the same backend computes, bitwise; a run split
    at a block boundary is bitwise the same as one launch."""
    n = quant.BLOCK * 400 + 9

    def run(name, device, mode, split=None):
        gen = torch.Generator().manual_seed(0)
        master = torch.randn(n, generator=gen).to(device)
        g = (torch.randn(n, generator=gen) * 1e-2).bfloat16().to(device)
        ops = [o.to(device) if o is not None else None for o in moment_operands(fmt, n)]
        p, r = remainder.split(master)
        fn = spelled_step(name, fmt)
        for t in range(1, 6):
            step, lr = torch.tensor([float(t)], device=device), torch.tensor([1e-2], device=device)
            for a, b in ([(0, n)] if split is None else [(0, split), (split, n)]):
                sub = (ops[0][a:b], ops[1][a:b],
                       None if ops[2] is None else ops[2][a // quant.BLOCK:a // quant.BLOCK + quant.blocks(b - a)])
                keyed = {"seed": 5, "index": a} if fmt == "bf16" else {}
                if mode == "remainder":
                    fn(p[a:b], g[a:b], *sub, None, step, lr, **KW, **keyed, remainder=r[a:b])
                else:
                    fn(master[a:b], g[a:b], *sub, None, step, lr, **KW, **keyed)
        return (remainder.join(p, r) if mode == "remainder" else master).cpu()
    want = run("torch", "cpu", "remainder")
    got = run(backend, "cuda", "remainder")
    moved = (got - want).abs()
    assert (moved <= 1e-4).float().mean() > 0.99 and moved.max() < 5e-3, moved.max()
    assert torch.equal(got.view(torch.int32), run(backend, "cuda", "master").view(torch.int32))
    split = run(backend, "cuda", "remainder", split=quant.BLOCK * 100)
    assert torch.equal(split.view(torch.int32), got.view(torch.int32))
