"""master_weights="stochastic": bf16 parameters stepped without an fp32 master, rounded
back stochastically by a hash of (flat buffer, step, the parameter's stream, canonical
index). Each kernel bitwise against "widen, the fp32-master step, round"; updates far
below a bf16 ulp still move the parameters on average; the same numbers at every world
size and bucket size; resumes bit for bit; refusals with the fix."""
import os

import pytest
import torch

import zero_triton as zt
from zero_triton.kernels import quant, rounding
from zero_triton.native import backends

from adam_cases import spelled_step
from dist_utils import run_ranks
from lowbit_cases import assert_refused, assert_same, bf16_zero_job, gpu_backends, moment_operands

BACKENDS = ["torch"] + [b for b in ("cpu", "triton")
                        if backends.why_not(b, torch.device("cpu")) is None]
KW = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True, amsgrad=False,
          maximize=False)


@pytest.mark.parametrize("fmt", ["fp32", "int8", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_each_kernel_is_the_master_step_then_stochastic_rounding(backend, fmt):
    n, seed, index = 5000, 7, 2 ** 32 + 3
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen).bfloat16()
    g = (torch.randn(n, generator=gen) * 1e-2).bfloat16()
    step, lr = torch.tensor([5.0]), torch.tensor([1e-3])
    ops = moment_operands(fmt, n)
    want_p, want_ops = p.clone(), [o.clone() if o is not None else None for o in ops]
    master = want_p.float()
    keyed = {"seed": seed, "index": index} if fmt == "bf16" else {}
    spelled_step(backend, fmt)(master, g, *want_ops, None, step, lr, **KW, **keyed)
    bits = rounding.random_bits(rounding.key(seed, 5, rounding.PARAM_STREAM), index, n, "cpu")
    want_p.copy_(rounding.to_bf16_stochastic(master, bits))
    spelled_step(backend, fmt)(p, g, *ops, None, step, lr, **KW, stochastic=True,
                                         seed=seed, index=index)
    assert torch.equal(p, want_p)
    for a, b in zip(ops, want_ops):
        assert (a is None and b is None) or torch.equal(a, b)


def test_updates_below_a_bf16_ulp_still_move_the_parameters():
    """Round-to-nearest would keep 1.0 where it is (an ulp of bf16 at 1.0 is 2^-7); the
    stochastic parameters drift down by about what fp32 ones do."""
    def run(master_weights):
        p = torch.nn.Parameter(torch.ones(20_000, dtype=torch.bfloat16))
        opt = zt.FusedAdam([p], lr=1e-4, master_weights=master_weights)
        for _ in range(50):
            p.grad = torch.ones_like(p)
            opt.step()
        return p.detach().float().mean().item()
    exact = 1.0 - 50 * 1e-4  # 0.995, between the bf16 values 0.9921875 and 0.99609375
    assert run("stochastic") == pytest.approx(exact, abs=2e-4)  # on average
    # with an fp32 master, each bf16 parameter is the master rounded to nearest
    assert run(True) == torch.tensor(exact).bfloat16().item()


def test_trains_like_an_fp32_master_with_int8_moments_at_2_bytes():
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(32, 300), torch.nn.GELU(), torch.nn.Linear(300, 10)).bfloat16()
    b = torch.nn.Sequential(torch.nn.Linear(32, 300), torch.nn.GELU(), torch.nn.Linear(300, 10)).bfloat16()
    b.load_state_dict(a.state_dict())
    ours = zt.FusedAdamW(a.parameters(), lr=3e-3, master_weights="stochastic", moments="int8")
    ref = zt.FusedAdamW(b.parameters(), lr=3e-3)
    x, y = torch.randn(96, 32).bfloat16(), torch.randint(0, 10, (96,))
    for model, opt in ((a, ours), (b, ref)):
        for _ in range(60):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.final = loss.item()
    assert abs(a.final - b.final) <= 0.1 * b.final + 0.01, (a.final, b.final)
    report = ours.memory_report()
    assert report["master"] == 0
    assert report["moments"] == ours._shards.groups[0][0].layout.padded_numel * (2 + 8 / 256)
    assert "master_param" not in ours.state_dict()["state"][0]  # no master to save


@pytest.mark.parametrize("kwargs,dtype,match", [
    ({"master_weights": "stochastic"}, torch.float32, "their own master"),
    ({"master_weights": "stochastic"}, torch.float16, "bfloat16 only"),
    ({"master_weights": "stochastic", "differentiable": True}, torch.bfloat16, "differentiable"),
    ({"master_weights": "exact"}, torch.bfloat16, "must be True or False .None: True., or 'stochastic'"),
])
def test_refused_before_anything_changes(kwargs, dtype, match):
    assert_refused(kwargs, dtype, match)


def _job(rank, world_size, bucket_cap_mb, stage, moments, steps, save_to, load_from):
    return bf16_zero_job(rank, world_size, bucket_cap_mb, stage, "stochastic", moments, steps,
                         save_to, load_from)


@pytest.mark.parametrize("moments", ["int8", "fp32"])
def test_bitwise_the_same_at_every_world_size_and_bucket_size(moments):
    one = run_ranks(_job, 1, None, 1, moments, 4, None, None)[0]
    for world_size, cap, stage in [(2, 0.002, 2), (4, 0.001, 1)]:
        assert_same(run_ranks(_job, world_size, cap, stage, moments, 4, None, None)[0], one,
              f"{world_size} ranks")


def test_a_checkpoint_saved_at_two_resumes_at_one_and_four_bitwise(tmp_path):
    straight = run_ranks(_job, 1, None, 1, "int8", 5, None, None)[0]
    path = os.fspath(tmp_path / "ckpt")
    run_ranks(_job, 2, 0.002, 1, "int8", 3, path, None)
    for world_size in (1, 4):
        resumed = run_ranks(_job, world_size, 0.001 if world_size > 1 else None, 1, "int8", 2,
                            None, path)[0]
        assert_same(resumed, straight, f"resumed at {world_size}")


@pytest.mark.parametrize("fmt", ["fp32", "int8", "bf16"])
@pytest.mark.parametrize("backend", gpu_backends())
def test_stochastic_kernels_on_cuda_match_the_cpu_definition(backend, fmt):
    """Five steps on CUDA tensors against the torch backend on CPU (the GPU contracts
    multiply-adds, so a rounding may land one bf16 place apart on a few elements); the
    same run split at a block boundary is bitwise the same as in one launch."""
    n = quant.BLOCK * 400 + 9

    def run(name, device, split=None):
        gen = torch.Generator().manual_seed(0)
        p = torch.randn(n, generator=gen).bfloat16().to(device)
        g = (torch.randn(n, generator=gen) * 1e-2).bfloat16().to(device)
        ops = [o.to(device) if o is not None else None for o in moment_operands(fmt, n)]
        fn = spelled_step(name, fmt)
        for t in range(1, 6):
            step, lr = torch.tensor([float(t)], device=device), torch.tensor([1e-2], device=device)
            for a, b in ([(0, n)] if split is None else [(0, split), (split, n)]):
                sub = (ops[0][a:b], ops[1][a:b],
                       None if ops[2] is None else ops[2][a // quant.BLOCK:a // quant.BLOCK + quant.blocks(b - a)])
                fn(p[a:b], g[a:b], *sub, None, step, lr, **KW, stochastic=True, seed=5, index=a)
        return p.float().cpu(), [o.cpu() if o is not None else None for o in ops]
    want, _ = run("torch", "cpu")
    got, got_ops = run(backend, "cuda")
    close = (got - want).abs() <= want.abs() * 2 ** -7 + 1e-6
    assert close.float().mean() > 0.99 and (got - want).abs().max() < 0.1
    split, split_ops = run(backend, "cuda", split=quant.BLOCK * 100)
    assert torch.equal(split, got)
    for x, y in zip(split_ops, got_ops):
        assert (x is None and y is None) or torch.equal(x, y)
