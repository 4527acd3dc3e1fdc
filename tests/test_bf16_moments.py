"""moments="bf16": bfloat16 moments written back by stochastic rounding keyed by (seed,
step, moment, canonical index): the rounding itself, each kernel bitwise against "widen,
the fp32 kernel of the same backend, round", training, and the same numbers at every
world size and bucket size."""
import pytest
import torch

import zero_triton as zt
from zero_triton.kernels import rounding
from zero_triton.native import backends

from adam_cases import spelled_step
from dist_utils import run_ranks
from lowbit_cases import mean_grads

CPU = backends.why_not("cpu", torch.device("cpu")) is None
TRITON = backends.why_not("triton", torch.device("cpu")) is None


def test_stochastic_rounding_is_unbiased_and_exact_on_bf16_values():
    x = torch.full((200_000,), 1.0 + 2 ** -10)  # a quarter of the way between two bf16
    bits = rounding.random_bits(rounding.key(3, 7, 1), 0, x.numel(), "cpu")
    y = rounding.to_bf16_stochastic(x, bits).float()
    assert set(y.unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    assert abs((y == 1.0 + 2 ** -7).float().mean().item() - 0.125) < 0.005
    exact = torch.tensor([1.5, -2.0, 0.0, float("inf"), -float("inf")])
    got = rounding.to_bf16_stochastic(exact, rounding.random_bits(5, 0, 5, "cpu"))
    assert torch.equal(got.float(), exact)
    assert torch.isnan(rounding.to_bf16_stochastic(torch.tensor([float("nan")]),
                                                   torch.zeros(1, dtype=torch.int64))).all()
    # The bits depend on the element and the key only: any run split gives the same bits.
    whole = rounding.random_bits(99, 1000, 64, "cpu")
    assert torch.equal(torch.cat([rounding.random_bits(99, 1000, 10, "cpu"),
                                  rounding.random_bits(99, 1010, 54, "cpu")]), whole)
    assert rounding.key(0, 1, 1) != rounding.key(0, 2, 1) != rounding.key(1, 1, 1)


def _composed(fp32_step, p, g, m, v, lp, step, lr, seed, index, **kw):
    mf, vf = m.float(), v.float()
    fp32_step(p, g, mf, vf, None, lp, step, lr, **kw)
    t = int(step.item())
    for out, x, stream in ((m, mf, rounding.FIRST_STREAM), (v, vf, rounding.SECOND_STREAM)):
        out.copy_(rounding.to_bf16_stochastic(
            x, rounding.random_bits(rounding.key(seed, t, stream), index, x.numel(), "cpu")))


@pytest.mark.parametrize("backend", ["torch"] + (["cpu"] if CPU else []) + (["triton"] if TRITON else []))
@pytest.mark.parametrize("n,lp_dtype", [(1000, None), (70_001, torch.bfloat16)])
def test_each_kernel_is_widen_fp32_step_round(backend, n, lp_dtype):
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen)
    g = (torch.randn(n, generator=gen) * 1e-2).to(lp_dtype or torch.float32)
    m = (torch.randn(n, generator=gen) * 1e-3).bfloat16()
    v = (torch.randn(n, generator=gen) * 1e-2).square().bfloat16()
    lp = torch.zeros(n, dtype=lp_dtype) if lp_dtype else None
    kw = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True, amsgrad=False,
              maximize=False)
    step, lr = torch.tensor([5.0]), torch.tensor([1e-3])
    want = [t.clone() if t is not None else None for t in (p, m, v, lp)]
    _composed(spelled_step(backend, "fp32"), want[0], g, want[1], want[2], want[3],
              step, lr, seed=11, index=2 ** 33 + 5, **kw)
    spelled_step(backend, "bf16")(p, g, m, v, None, lp, step, lr, seed=11,
                                            index=2 ** 33 + 5, **kw)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "param_lp"), (p, m, v, lp), want):
        assert (a is None and b is None) or torch.equal(a, b), name


def test_bf16_moments_train_like_fp32_and_keep_4_bytes():
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(32, 300), torch.nn.GELU(), torch.nn.Linear(300, 10))
    b = torch.nn.Sequential(torch.nn.Linear(32, 300), torch.nn.GELU(), torch.nn.Linear(300, 10))
    b.load_state_dict(a.state_dict())
    ours = zt.FusedAdamW(a.parameters(), lr=3e-3, moments="bf16")
    ref = torch.optim.AdamW(b.parameters(), lr=3e-3)
    x, y = torch.randn(96, 32), torch.randint(0, 10, (96,))
    for model, opt in ((a, ours), (b, ref)):
        for _ in range(60):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.final = loss.item()
    assert abs(a.final - b.final) <= 0.05 * b.final + 0.01, (a.final, b.final)
    flat = ours._shards.groups[0][0]
    assert ours.memory_report()["moments"] == 4 * flat.layout.padded_numel
    sd = ours.state_dict()["state"][0]
    assert sd["exp_avg"].dtype == torch.float32  # torch's format


SHAPES = [(37, 19), (300,), (5,), (64, 33)]


def _job(rank, world_size, bucket_cap_mb, stage):
    gen = torch.Generator().manual_seed(1234)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    opt = zt.ZeroAdamW(params, lr=1e-2, moments="bf16", bucket_cap_mb=bucket_cap_mb, stage=stage)
    for t in range(4):
        for p, g in zip(params, mean_grads(rank, world_size, t, SHAPES)):
            p.grad = g
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    return ([p.detach().numpy().copy() for p in params],
            {k: {n: v.numpy().copy() for n, v in e.items()} for k, e in sd["state"].items()})


def test_bf16_moments_are_bitwise_the_same_at_every_world_size():
    one = run_ranks(_job, 1, None, 1)[0]
    for world_size, bucket_cap_mb, stage in [(2, 0.002, 1), (4, 0.001, 2)]:
        got = run_ranks(_job, world_size, bucket_cap_mb, stage)[0]
        for x, y in zip(got[0], one[0]):
            assert torch.equal(torch.from_numpy(x), torch.from_numpy(y)), world_size
        for k in one[1]:
            for n in one[1][k]:
                assert torch.equal(torch.from_numpy(got[1][k][n]), torch.from_numpy(one[1][k][n]))


def test_bf16_refusals():
    p = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="float64"):
        zt.FusedAdamW([p], moments="bf16")
    with pytest.raises(ValueError, match="amsgrad"):
        zt.FusedAdamW([torch.nn.Parameter(torch.randn(4))], moments="bf16", amsgrad=True)
