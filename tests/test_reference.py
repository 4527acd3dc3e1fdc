"""Tests of the shared oracle, zero_triton/reference.py.

The oracle is what every backend is held to, so it is itself held to independent
sources: the seed example, ordinary Adam on the mean gradient, torch.optim.Adam, and
torch's / numpy's own casts.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from zero_triton.reference import (
    adam_update,
    init_states,
    rne_cast,
    shard_ranges,
    torch_adam_step_,
    zero_step,
)


def first_mismatch(actual, expected, rtol=0.0, atol=0.0):
    """'' when close, else where the first mismatch is and the values there."""
    a = np.asarray(actual, dtype=np.float64).ravel()
    e = np.asarray(expected, dtype=np.float64).ravel()
    if a.shape != e.shape:
        return f"shape {a.shape} != {e.shape}"
    bad = ~np.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
    if not bad.any():
        return ""
    i = int(np.argmax(bad))
    return (f"{int(bad.sum())}/{a.size} elements differ; first at flat index {i}: "
            f"got {a[i]!r}, expected {e[i]!r} (|diff| {abs(a[i] - e[i]):.3g})")


# --------------------------------------------------------------------------------------
# numpy seed API
# --------------------------------------------------------------------------------------

SEED_GRADS = [np.array([0.2, 0.4, 0.6, 0.8, 1.0]), np.array([0.4, 0.0, 0.2, -0.8, 3.0])]


def test_seed_example_one_step():
    states = init_states(5, 2)
    assert [(m.shape, v.shape) for m, v in states] == [((3,), (3,)), ((2,), (2,))]

    new_p, new_states = zero_step(np.ones(5), SEED_GRADS, states, t=1, lr=0.1)

    # 0.9 up to eps: the first step moves by lr * g / (|g| + eps).
    msg = first_mismatch(new_p, [0.9, 0.9, 0.9, 1.0, 0.9], atol=1e-7)
    assert not msg, msg
    # Parameter 3 has a mean gradient of exactly 0 and must not move at all.
    assert new_p[3] == 1.0
    # Worker 0 keeps m, v of length 3, worker 1 of length 2: the memory saving.
    assert [len(m) for m, _ in new_states] == [3, 2]
    assert [len(v) for _, v in new_states] == [3, 2]
    # The reduce-scatter delivered the mean of each slice: m = (1 - 0.9) * mean grad.
    msg = first_mismatch(new_states[0][0], 0.1 * np.array([0.3, 0.2, 0.4]), atol=1e-15)
    assert not msg, msg
    msg = first_mismatch(new_states[1][0], 0.1 * np.array([0.0, 2.0]), atol=1e-15)
    assert not msg, msg


def test_zero_step_does_not_modify_inputs():
    param = np.ones(5)
    grads = [g.copy() for g in SEED_GRADS]
    states = init_states(5, 2)
    zero_step(param, grads, states, t=1, lr=0.1)
    assert (param == 1).all()
    assert all((g == s).all() for g, s in zip(grads, SEED_GRADS))
    assert all((m == 0).all() and (v == 0).all() for m, v in states)


@given(n=st.integers(0, 80), workers=st.integers(1, 12))
@settings(max_examples=60, deadline=None)
def test_shard_ranges_match_array_split(n, workers):
    expected = np.array_split(np.arange(n), workers)
    got = shard_ranges(n, workers)
    assert len(got) == workers
    for i, ((a, b), idx) in enumerate(zip(got, expected)):
        assert list(range(a, b)) == idx.tolist(), f"worker {i}: [{a}, {b}) vs {idx}"


@given(
    n=st.integers(1, 60),
    workers=st.integers(1, 10),
    steps=st.integers(3, 5),
    lr=st.sampled_from([1e-3, 1e-2, 0.1]),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=80, deadline=None)
def test_zero_step_equals_adam_on_mean_gradient(n, workers, steps, lr, seed):
    rng = np.random.default_rng(seed)
    param = rng.standard_normal(n)
    ref_p, ref_m, ref_v = param.copy(), np.zeros(n), np.zeros(n)
    states = init_states(n, workers)
    sizes = [len(s) for s in np.array_split(np.arange(n), workers)]
    for t in range(1, steps + 1):
        # Scales spread over orders of magnitude, with exact zeros mixed in.
        grads = [rng.standard_normal(n) * 10.0 ** rng.integers(-4, 3, n)
                 * (rng.random(n) > 0.1) for _ in range(workers)]
        param, states = zero_step(param, grads, states, t, lr=lr)
        # The mean as a reduce computes it: sum over workers in rank order, / N.
        mean = sum(grads[1:], grads[0].copy()) / workers
        assert not first_mismatch(mean, np.mean(np.stack(grads), axis=0), 1e-14, 1e-300)
        ref_p, ref_m, ref_v = adam_update(ref_p, mean, ref_m, ref_v, t, lr=lr)
        # Shards keep their sizes (empty when there are more workers than params).
        assert [(len(m), len(v)) for m, v in states] == [(s, s) for s in sizes], \
            f"step {t}: shard sizes changed"
        # "Exactly ordinary Adam": the update is elementwise, so equality is bitwise.
        for name, got, exp in (("param", param, ref_p),
                               ("m", np.concatenate([m for m, _ in states]), ref_m),
                               ("v", np.concatenate([v for _, v in states]), ref_v)):
            msg = first_mismatch(got, exp)
            assert not msg, f"step {t}, {name} (n={n}, N={workers}): {msg}"


def test_adam_update_first_step_moves_by_lr():
    # With bias correction the first step is lr * sign(g) (up to eps) for any g != 0.
    g = np.array([0.5, -5.0, 2.0, 0.0])
    p, m, v = adam_update(np.zeros(4), g, np.zeros(4), np.zeros(4), t=1, lr=0.1)
    msg = first_mismatch(p, [-0.1, 0.1, -0.1, 0.0], atol=1e-7)
    assert not msg, msg


@pytest.mark.parametrize("call, match", [
    (lambda: zero_step(np.ones(5), SEED_GRADS, init_states(5, 3), 1),
     "2 gradients but 3 worker states"),
    (lambda: zero_step(np.ones(5), [np.ones(5), np.ones(4)], init_states(5, 2), 1),
     r"grads\[1\] has shape \(4,\), expected \(5,\)"),
    (lambda: zero_step(np.ones(5), SEED_GRADS, init_states(4, 2), 1),
     r"worker 0 m shard has shape \(2,\), expected \(3,\).*init_states\(5, 2\)"),
    (lambda: zero_step(np.ones((5, 1)), SEED_GRADS, init_states(5, 2), 1),
     "1-D vector"),
    (lambda: zero_step(np.ones(5), [], [], 1), "grads is empty"),
    (lambda: zero_step(np.ones(5), SEED_GRADS, init_states(5, 2), 0), "t=1"),
    (lambda: init_states(5, 0), "n_workers must be an int >= 1"),
    (lambda: init_states(-1, 2), "n_params must be an int >= 0"),
    (lambda: adam_update(np.ones(3), np.ones(2), np.ones(3), np.ones(3), 1),
     "grad has shape"),
])
def test_bad_inputs_raise_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --------------------------------------------------------------------------------------
# torch reference step vs torch.optim.Adam
# --------------------------------------------------------------------------------------

SHAPES = [(1,), (7,), (37,), (3, 129)]  # one element, tiny, prime, not a block multiple

WD_MODES = {
    "none": dict(weight_decay=0.0),
    "l2": dict(weight_decay=0.1),
    "decoupled": dict(weight_decay=0.1, decoupled_weight_decay=True),
}


@pytest.mark.parametrize("dtype, rtol, atol", [
    (torch.float32, 1e-5, 1e-6),
    (torch.float64, 1e-12, 1e-13),
])
@pytest.mark.parametrize("wd", list(WD_MODES))
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
def test_torch_adam_step_matches_torch_optim(dtype, rtol, atol, wd, amsgrad, maximize):
    gen = torch.Generator().manual_seed(1234)
    params = [torch.randn(s, generator=gen, dtype=dtype) for s in SHAPES]
    theirs = [p.clone().requires_grad_(True) for p in params]
    hp = dict(lr=3e-2, betas=(0.9, 0.99), eps=1e-8, amsgrad=amsgrad, maximize=maximize)
    opt = torch.optim.Adam(theirs, foreach=False, **hp, **WD_MODES[wd])
    state = [dict(m=torch.zeros_like(p), v=torch.zeros_like(p), mv=torch.zeros_like(p))
             for p in params]
    for step in range(1, 21):
        grads = [torch.randn(p.shape, generator=gen, dtype=dtype)
                 * 10.0 ** (step % 5 - 3) for p in params]
        for p, g, s in zip(params, grads, state):
            torch_adam_step_(p, g, s["m"], s["v"], s["mv"] if amsgrad else None, step,
                             lr=hp["lr"], beta1=0.9, beta2=0.99, eps=1e-8,
                             weight_decay=WD_MODES[wd]["weight_decay"],
                             adamw=wd == "decoupled", amsgrad=amsgrad,
                             maximize=maximize)
        for p, g in zip(theirs, grads):
            p.grad = g.clone()
        opt.step()
        for i, (p, q, s) in enumerate(zip(params, theirs, state)):
            ts = opt.state[q]
            pairs = [("param", p, q.detach()), ("exp_avg", s["m"], ts["exp_avg"]),
                     ("exp_avg_sq", s["v"], ts["exp_avg_sq"])]
            if amsgrad:
                pairs.append(("max_exp_avg_sq", s["mv"], ts["max_exp_avg_sq"]))
            for name, a, b in pairs:
                msg = first_mismatch(a.numpy(), b.numpy(), rtol, atol)
                assert not msg, f"step {step}, tensor {i} {SHAPES[i]}, {name}: {msg}"


def test_torch_adam_step_matches_adamw_class():
    # AdamW is the other spelling of decoupled weight decay; hold the oracle to it too.
    gen = torch.Generator().manual_seed(7)
    p = torch.randn(37, generator=gen, dtype=torch.float64)
    q = p.clone().requires_grad_(True)
    opt = torch.optim.AdamW([q], lr=1e-2, weight_decay=0.05, foreach=False)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for step in range(1, 11):
        g = torch.randn(37, generator=gen, dtype=torch.float64)
        torch_adam_step_(p, g, m, v, None, step, lr=1e-2, beta1=0.9, beta2=0.999,
                         eps=1e-8, weight_decay=0.05, adamw=True, amsgrad=False,
                         maximize=False)
        q.grad = g.clone()
        opt.step()
        msg = first_mismatch(p.numpy(), q.detach().numpy(), 1e-12, 1e-13)
        assert not msg, f"step {step}: {msg}"


def test_torch_step_agrees_with_numpy_adam_update():
    # The two halves of the oracle are one Adam: keep them from drifting apart.
    rng = np.random.default_rng(3)
    p_np = rng.standard_normal(50)
    m_np, v_np = np.zeros(50), np.zeros(50)
    p, m, v = (torch.from_numpy(a.copy()) for a in (p_np, m_np, v_np))
    for t in range(1, 6):
        g = rng.standard_normal(50)
        p_np, m_np, v_np = adam_update(p_np, g, m_np, v_np, t, lr=1e-2)
        torch_adam_step_(p, torch.from_numpy(g), m, v, None, t, lr=1e-2, beta1=0.9,
                         beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=False,
                         amsgrad=False, maximize=False)
        msg = first_mismatch(p.numpy(), p_np, 1e-13, 1e-14)
        assert not msg, f"step {t}: {msg}"


def _fresh(n=33, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen, dtype=dtype),
            torch.randn(n, generator=gen, dtype=dtype),
            torch.rand(n, generator=gen, dtype=dtype),
            torch.rand(n, generator=gen, dtype=dtype),
            torch.rand(n, generator=gen, dtype=dtype))


HP = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True,
          amsgrad=True, maximize=False)


@pytest.mark.parametrize("found_inf", [1.0, torch.tensor([1.0]), torch.tensor(float("inf"))])
def test_found_inf_skips_everything(found_inf):
    tensors = _fresh()
    before = [t.clone() for t in tensors]
    p, g, m, v, mv = tensors
    torch_adam_step_(p, g, m, v, mv, 3, lr=0.1, found_inf=found_inf, **HP)
    for name, a, b in zip(("param", "grad", "exp_avg", "exp_avg_sq", "max"), tensors,
                          before):
        assert torch.equal(a, b), f"{name} changed although found_inf was set"


@pytest.mark.parametrize("found_inf", [0.0, torch.tensor([0.0])])
def test_found_inf_zero_steps(found_inf):
    p, g, m, v, mv = _fresh()
    p0 = p.clone()
    torch_adam_step_(p, g, m, v, mv, 3, lr=0.1, found_inf=found_inf, **HP)
    assert not torch.equal(p, p0)


@pytest.mark.parametrize("dtype, rtol, atol", [(torch.float64, 1e-14, 1e-15)])
def test_grad_scale_clip_coef_and_tensor_lr(dtype, rtol, atol):
    # Unscaling by s and clipping by c must equal stepping on g * c / s directly;
    # lr as a 1-element tensor must equal lr as a float.
    s, c = 1024.0, 0.25
    a = _fresh(dtype=dtype)
    b = [t.clone() for t in a]
    g_scaled = a[1] * s
    torch_adam_step_(a[0], g_scaled, *a[2:], 4, lr=torch.tensor([0.05], dtype=dtype),
                     grad_scale=torch.tensor(s), clip_coef=c, **HP)
    torch_adam_step_(b[0], b[1] * c, *b[2:], 4, lr=0.05, **HP)
    for name, x, y in zip(("param", "exp_avg", "exp_avg_sq", "max"), a[:1] + a[2:],
                          b[:1] + b[2:]):
        msg = first_mismatch(x.numpy(), y.numpy(), rtol, atol)
        assert not msg, f"{name}: {msg}"


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_grad_is_upcast_exactly(grad_dtype):
    a = _fresh()
    b = [t.clone() for t in a]
    g = a[1].to(grad_dtype)
    torch_adam_step_(a[0], g, *a[2:], 2, lr=0.01, **HP)
    torch_adam_step_(b[0], g.double(), *b[2:], 2, lr=0.01, **HP)
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(param_dtype=torch.bfloat16), TypeError, "fp32 master"),
    (dict(amsgrad_none=True), ValueError, "needs max_exp_avg_sq"),
    (dict(step=0), ValueError, "t=1"),
    (dict(lr=torch.tensor([0.1, 0.2])), ValueError, "1-element tensor"),
    (dict(grad_shape=(5,)), ValueError, "grad has shape"),
])
def test_torch_step_bad_inputs(kwargs, exc, match):
    p, g, m, v, mv = _fresh(n=4)
    if "param_dtype" in kwargs:
        p = p.to(kwargs["param_dtype"])
    if "grad_shape" in kwargs:
        g = torch.zeros(kwargs["grad_shape"])
    hp = dict(HP, amsgrad=True)
    with pytest.raises(exc, match=match):
        torch_adam_step_(p, g, m, v, None if "amsgrad_none" in kwargs else mv,
                         kwargs.get("step", 1), lr=kwargs.get("lr", 0.1), **hp)


# --------------------------------------------------------------------------------------
# rne_cast: bit-exact against torch's and numpy's own casts
# --------------------------------------------------------------------------------------

def _special_fp32():
    """Random bit patterns (every class: subnormal, normal, inf, NaN) plus ties."""
    gen = torch.Generator().manual_seed(99)
    rand_bits = torch.randint(-2**31, 2**31 - 1, (200_000,), generator=gen,
                              dtype=torch.int32)
    hi = torch.randint(0, 2**16, (20_000,), generator=gen, dtype=torch.int64)
    # bf16 ties: low half exactly 0x8000, with even and odd kept bits.
    bf16_ties = ((hi << 16) | 0x8000)
    # fp16 normal ties: low 13 bits exactly 0x1000, exponents in the fp16 range.
    exp = torch.randint(113, 143, (20_000,), generator=gen, dtype=torch.int64)
    man = torch.randint(0, 2**10, (20_000,), generator=gen, dtype=torch.int64)
    fp16_ties = (exp << 23) | (man << 13) | 0x1000
    ints = torch.cat([bf16_ties, fp16_ties, fp16_ties | (1 << 31)])
    ints = torch.where(ints >= 2**31, ints - 2**32, ints).to(torch.int32)
    edges = torch.tensor([
        0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"),
        1e-45, -1e-45, 1.1754942e-38, 1.1754944e-38,          # fp32 subnormal edges
        2.0**-25, 2.0**-24, 1.5 * 2.0**-24, 2.5 * 2.0**-24,   # fp16 subnormal ties
        3.0 * 2.0**-26, 2.0**-14, 2.0**-14 - 2.0**-25,        # fp16 normal/subnormal
        65504.0, 65519.996, 65520.0, 65536.0, -65520.0,       # fp16 overflow edge
        3.3895314e38, 3.4028235e38, -3.4028235e38,            # bf16 overflow edge
    ], dtype=torch.float32)
    small = torch.randn(20_000, generator=gen) * 2.0**-20     # fp16 subnormal range
    tiny = torch.randn(20_000, generator=gen) * 1e-39         # fp32/bf16 subnormals
    return torch.cat([rand_bits.view(torch.float32), ints.view(torch.float32), edges,
                      small, tiny])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rne_cast_bitwise_equals_torch(dtype):
    x = _special_fp32()
    got, exp = rne_cast(x, dtype), x.to(dtype)
    assert got.dtype == dtype and got.shape == x.shape
    nan = torch.isnan(x)
    assert torch.equal(torch.isnan(got), nan), "NaN not preserved as NaN"
    bad = (got.view(torch.int16) != exp.view(torch.int16)) & ~nan
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        pytest.fail(f"{int(bad.sum())} mismatches; first at {i}: x={x[i].item()!r} "
                    f"(bits {x.view(torch.int32)[i].item() & 0xFFFFFFFF:#010x}) -> "
                    f"{got.view(torch.int16)[i].item() & 0xFFFF:#06x}, torch gives "
                    f"{exp.view(torch.int16)[i].item() & 0xFFFF:#06x}")


def test_rne_cast_fp16_equals_numpy():
    x = _special_fp32()
    with np.errstate(over="ignore", invalid="ignore"):
        exp = x.numpy().astype(np.float16).view(np.int16)
    got = rne_cast(x, torch.float16).view(torch.int16).numpy()
    bad = (got != exp) & ~np.isnan(x.numpy())
    assert not bad.any(), f"first mismatch at {int(np.argmax(bad))}"


def test_rne_cast_ties_go_to_even():
    # 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125 (odd mantissa 1): rounds down;
    # 1 + 3 * 2^-8 is halfway between 1.0078125 and 1.015625: rounds up to even.
    # The same in fp16 one ulp (2^-10) finer.
    x = torch.tensor([1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-11, 1 + 3 * 2.0**-11])
    assert rne_cast(x[:2], torch.bfloat16).float().tolist() == [1.0, 1.015625]
    assert rne_cast(x[2:], torch.float16).float().tolist() == [1.0, 1 + 2.0**-9]


def test_rne_cast_keeps_shape_and_reads_strided_input():
    x = torch.randn(6, 8)[:, ::2]
    y = rne_cast(x, torch.bfloat16)
    assert y.shape == (6, 4)
    assert torch.equal(y.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("x, dtype, exc", [
    (torch.ones(3, dtype=torch.float64), torch.bfloat16, TypeError),
    (torch.ones(3), torch.float32, ValueError),
])
def test_rne_cast_bad_inputs(x, dtype, exc):
    with pytest.raises(exc):
        rne_cast(x, dtype)


def test_the_seeds_worked_example_runs_as_written():
    """The seed's example (5 parameters, 2 workers) in ``zero_triton.reference``'s
    docstring, run as a doctest; and the paths users reach it by."""
    import doctest
    import importlib
    import subprocess
    import sys

    import zero_triton
    import zero_triton.reference as reference
    result = doctest.testmod(reference)
    assert result.attempted >= 6 and result.failed == 0, result
    assert zero_triton.reference is reference and callable(zero_triton.checkpoint.save)
    # The path it had for a while still works, with a warning naming the new one.
    code = ("import warnings; warnings.simplefilter('error')\n"
            "try:\n    import zero_triton.tools.reference\nexcept DeprecationWarning as w:\n"
            "    print(w)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "moved to zero_triton.reference" in out.stdout, out.stdout + out.stderr
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert importlib.import_module("zero_triton.tools.reference").zero_step is reference.zero_step
    # zero_triton.checkpoint.main, the checkpoint command line, moved to tools: an alias.
    from zero_triton.tools.checkpoint import main
    with pytest.warns(DeprecationWarning, match="zero_triton.tools.checkpoint.main"):
        assert zero_triton.checkpoint.main is main
    with pytest.raises(AttributeError):
        zero_triton.checkpoint.no_such_name
