"""zero_triton._C.adam_step, called directly, against a float64 torch oracle.

Each step the oracle starts from the kernel's own fp32 state (upcast), so every step is
checked tightly and a failure names its step; a separate test runs free against
torch.optim.Adam for many steps.
"""
import math

import pytest
import torch

from zero_triton.native import ext as _ext

BETAS = (0.9, 0.999)
EPS = 1e-8
STEPS = 20


@pytest.fixture(scope="module")
def C():
    mod = _ext.load()
    if mod is None:
        pytest.skip(reason=f"zero_triton._C unavailable: {_ext.unavailable_reason()}")
    return mod


def device_or_skip(device, C):
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip(reason="no CUDA device (torch.cuda.is_available() is False)")
        if not _ext.cuda_available():
            pytest.skip(reason="zero_triton._C was built without CUDA kernels "
                               "(ZERO_TRITON_BUILD_EXT=1 on a machine with nvcc)")
    return torch.device(device)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def ref_step(p32, g_in, m, v, vmax, t, lr, wd, adamw, amsgrad, maximize, scale, clip):
    """The documented math: gradient preprocessing in fp32, the Adam update in float64.

    p32 and g_in are the kernel's fp32 parameter and (widened) gradient; m, v, vmax are
    float64 copies. The preprocessing (unscale, clip, maximize, L2) is done in fp32, in
    the kernel's order, because g + wd*p can cancel to a few ulps of wd*p, and
    lr*g/(|g| + eps) then amplifies that rounding past any useful tolerance: judged
    against float64 there, every fp32 implementation fails.
    """
    b1, b2 = BETAS
    g = g_in.float()
    if scale is not None:
        g = g / scale
    if clip is not None:
        g = g * clip
    if maximize:
        g = -g
    if wd != 0 and not adamw:
        g = g + wd * p32.float()
    g = g.double()
    p = p32.double()
    if wd != 0 and adamw:
        p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    bc1 = 1 - b1**t
    bc2 = 1 - b2**t
    if amsgrad:
        vmax = torch.maximum(vmax, v)
        vhat = vmax
    else:
        vhat = v
    denom = vhat.sqrt() / math.sqrt(bc2) + EPS
    p = p - (lr / bc1) * m / denom
    return p, m, v, vmax


def bits(x):
    """The raw bits, so that -0.0 vs 0.0 and NaN payloads count as changes."""
    return x.view(torch.int32 if x.element_size() == 4 else torch.int16)


def assert_close(name, step, got, want, rtol, atol):
    got64 = got.double()
    bad = ~torch.isclose(got64, want, rtol=rtol, atol=atol)
    if bad.any():
        i = int(bad.nonzero()[0])
        err = (got64 - want).abs().max().item()
        raise AssertionError(
            f"step {step}: `{name}` differs at {int(bad.sum())} of {got.numel()} elements; "
            f"first at [{i}]: got {got64[i].item()!r}, want {want[i].item()!r} "
            f"(max abs err {err:.3e}, rtol={rtol}, atol={atol})")


# (option set) -- combined with every dtype row below.
CONFIGS = {
    "adam": dict(wd=0.0, adamw=False, amsgrad=False, maximize=False, amp=False),
    "l2_maximize": dict(wd=0.1, adamw=False, amsgrad=False, maximize=True, amp=False),
    "adamw_amsgrad": dict(wd=0.05, adamw=True, amsgrad=True, maximize=False, amp=False),
    "adamw_amp": dict(wd=0.01, adamw=True, amsgrad=False, maximize=False, amp=True),
    "everything": dict(wd=0.1, adamw=False, amsgrad=True, maximize=True, amp=True),
}

# (grad dtype, param_lp dtype, rtol, atol): one-step error of fp32 math vs float64;
# atol covers cancellation in beta1*m + (1-beta1)*g (terms of order 1).
DTYPES = [
    (torch.float32, None, 2e-6, 1e-6),
    (torch.float16, None, 2e-6, 1e-6),
    (torch.bfloat16, None, 2e-6, 1e-6),
    (torch.float32, torch.float16, 2e-6, 1e-6),
    (torch.float16, torch.float16, 2e-6, 1e-6),
    (torch.bfloat16, torch.bfloat16, 2e-6, 1e-6),
    (torch.float32, torch.bfloat16, 2e-6, 1e-6),
]


def make_state(n, device, amsgrad, lp_dtype, gen):
    p = torch.randn(n, generator=gen).to(device)
    m = torch.zeros(n, device=device)
    v = torch.zeros(n, device=device)
    vmax = torch.zeros(n, device=device) if amsgrad else None
    lp = p.to(lp_dtype) if lp_dtype is not None else None
    return p, m, v, vmax, lp


def check_indices(n, gen):
    """All elements of small buffers; for large ones a random sample plus both ends and
    the middle (where the two threads' chunks meet), to keep the float64 oracle cheap.
    The low-precision copy is still compared in full."""
    if n <= 4096:
        return None
    edges = torch.cat([torch.arange(0, 256), torch.arange(n // 2 - 256, n // 2 + 256),
                       torch.arange(n - 256, n), torch.randint(0, n, (16384,), generator=gen)])
    return torch.unique(edges)


def run_and_check(C, device, n, grad_dtype, lp_dtype, rtol, atol, cfg, steps=STEPS):
    gen = torch.Generator().manual_seed(n * 7 + 3)
    idx = check_indices(n, gen)

    def sel(x):
        x = x.cpu()
        return x if idx is None else x[idx]

    p, m, v, vmax, lp = make_state(n, device, cfg["amsgrad"], lp_dtype, gen)
    lr_value = 1e-2
    step = torch.zeros(1, device=device)
    lr = torch.full((1,), lr_value, device=device)
    scale_value, clip_value = (1024.0, 0.5) if cfg["amp"] else (None, None)
    scale = torch.full((1,), scale_value, device=device) if cfg["amp"] else None
    clip = torch.full((1,), clip_value, device=device) if cfg["amp"] else None
    found_inf = torch.zeros(1, device=device) if cfg["amp"] else None
    for t in range(1, steps + 1):
        g32 = torch.randn(n, generator=gen) * (scale_value or 1.0)
        g = g32.to(grad_dtype).to(device)
        before = [sel(x).clone() if x is not None else None for x in (p, m, v, vmax)]
        step += 1
        lr.fill_(lr_value * (0.5 if t > steps // 2 else 1.0))  # a schedule, no rebuild
        C.adam_step(p, g, m, v, vmax, lp, step, lr, BETAS[0], BETAS[1], EPS, cfg["wd"],
                    cfg["adamw"], cfg["amsgrad"], cfg["maximize"], scale, found_inf, clip)
        m64, v64 = before[1].double(), before[2].double()
        vmax64 = before[3].double() if before[3] is not None else None
        want = ref_step(before[0], sel(g), m64, v64, vmax64, t,
                        lr.item(), cfg["wd"], cfg["adamw"], cfg["amsgrad"], cfg["maximize"],
                        scale_value, clip_value)
        assert_close("exp_avg", t, sel(m), want[1], rtol, atol)
        assert_close("exp_avg_sq", t, sel(v), want[2], rtol, atol)
        if cfg["amsgrad"]:
            assert_close("max_exp_avg_sq", t, sel(vmax), want[3], rtol, atol)
        assert_close("param", t, sel(p), want[0], rtol, atol)
        if lp is not None:
            expected = p.to(lp_dtype)  # torch rounds to nearest even
            same = lp.view(torch.int16) == expected.view(torch.int16)
            assert bool(same.all()), (
                f"step {t}: `param_lp` is not master rounded to nearest even; first at "
                f"[{int((~same).nonzero()[0])}]")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype,lp_dtype,rtol,atol", DTYPES)
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("n", [1, 7, 31])
def test_small_sizes(C, device, n, config, grad_dtype, lp_dtype, rtol, atol):
    dev = device_or_skip(device, C)
    run_and_check(C, dev, n, grad_dtype, lp_dtype, rtol, atol, CONFIGS[config])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype,lp_dtype,config,rtol,atol", [
    (torch.float32, None, "adam", 2e-6, 1e-6),
    (torch.bfloat16, torch.bfloat16, "everything", 2e-6, 1e-6),
    (torch.float16, torch.float16, "adamw_amp", 2e-6, 1e-6),
    (torch.float32, torch.bfloat16, "l2_maximize", 2e-6, 1e-6),
])
def test_large_prime_multithreaded(C, device, grad_dtype, lp_dtype, config, rtol, atol):
    dev = device_or_skip(device, C)
    run_and_check(C, dev, 1_000_003, grad_dtype, lp_dtype, rtol, atol, CONFIGS[config])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("adamw,amsgrad,maximize,wd,rtol,atol", [
    (False, False, False, 0.0, 1e-5, 1e-7),
    (False, True, True, 0.1, 1e-5, 1e-7),
    (True, False, False, 0.05, 1e-5, 1e-7),
    (True, True, False, 0.05, 1e-5, 1e-7),
])
def test_matches_torch_adam_many_steps(C, device, adamw, amsgrad, maximize, wd, rtol, atol):
    dev = device_or_skip(device, C)
    n, steps, lr = 1031, 50, 1e-3
    gen = torch.Generator().manual_seed(5)
    ours = torch.randn(n, generator=gen).to(dev)
    theirs = torch.nn.Parameter(ours.clone())
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([theirs], lr=lr, betas=BETAS, eps=EPS, weight_decay=wd, amsgrad=amsgrad,
              maximize=maximize, foreach=False)
    m, v = torch.zeros_like(ours), torch.zeros_like(ours)
    vmax = torch.zeros_like(ours) if amsgrad else None
    step = torch.zeros(1, device=dev)
    lr_t = torch.full((1,), lr, device=dev)
    for t in range(1, steps + 1):
        g = torch.randn(n, generator=gen).to(dev)
        theirs.grad = g.clone()
        opt.step()
        step += 1
        C.adam_step(ours, g, m, v, vmax, None, step, lr_t, BETAS[0], BETAS[1], EPS, wd,
                    adamw, amsgrad, maximize, None, None, None)
        want = theirs.detach().double().cpu()
        assert_close("param", t, ours.cpu(), want, rtol, atol)


@pytest.mark.parametrize("device", DEVICES)
def test_found_inf_leaves_everything_bit_identical(C, device):
    dev = device_or_skip(device, C)
    n = 1000
    gen = torch.Generator().manual_seed(1)
    p, m, v, vmax, lp = make_state(n, dev, True, torch.bfloat16, gen)
    m += torch.rand(n, generator=gen).to(dev)
    v += torch.rand(n, generator=gen).to(dev)
    vmax += 2.0
    g = torch.randn(n, generator=gen).to(dev).half()
    tensors = [p, m, v, vmax, lp]
    before = [x.clone() for x in tensors]
    one = torch.ones(1, device=dev)
    C.adam_step(p, g, m, v, vmax, lp, one.clone(), one * 1e-2, 0.9, 0.999, EPS, 0.1, True,
                True, False, one * 1024, one.clone(), one * 0.5)
    for name, x, y in zip(["param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "param_lp"],
                          tensors, before):
        assert torch.equal(bits(x), bits(y)), \
            f"`{name}` changed although found_inf=1"


@pytest.mark.parametrize("device", DEVICES)
def test_padding_zeros_stay_zero(C, device):
    dev = device_or_skip(device, C)
    n = 64
    z = [torch.zeros(n, device=dev) for _ in range(4)]
    lp = torch.zeros(n, device=dev, dtype=torch.bfloat16)
    step = torch.zeros(1, device=dev)
    for adamw in (False, True):
        for _ in range(5):
            step += 1
            C.adam_step(z[0], torch.zeros(n, device=dev), z[1], z[2], z[3], lp, step,
                        torch.full((1,), 0.1, device=dev), 0.9, 0.999, EPS, 0.1, adamw,
                        True, True, None, None, None)
    for name, x in zip(["param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "param_lp"],
                       z + [lp]):
        assert bool((bits(x) == 0).all()), f"`{name}` padding is no longer +0.0"


def test_cpu_isa_variants_bit_identical(C):
    """Every instruction-set variant this CPU runs gives the same bits."""
    variants = ["default"]
    for isa in ("avx2", "avx512"):
        try:
            C._set_cpu_isa(isa)
            variants.append(isa)
        except (ValueError, RuntimeError):
            pass
    n = 4099
    results = {}
    try:
        for isa in variants:
            C._set_cpu_isa(isa)
            assert C.cpu_isa() == isa
            gen = torch.Generator().manual_seed(9)
            p, m, v, vmax, lp = make_state(n, "cpu", True, torch.float16, gen)
            step = torch.zeros(1)
            for _ in range(3):
                step += 1
                g = (torch.randn(n, generator=gen) * 1e3).half()
                C.adam_step(p, g, m, v, vmax, lp, step, torch.tensor([1e-2]), 0.9, 0.999,
                            EPS, 0.1, False, True, True, torch.tensor([8.0]), None,
                            torch.tensor([0.7]))
            results[isa] = [x.clone() for x in (p, m, v, vmax, lp)]
    finally:
        C._set_cpu_isa("")
    base = results["default"]
    for isa, got in results.items():
        for name, x, y in zip(["param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq",
                               "param_lp"], got, base):
            assert torch.equal(x, y), f"`{name}` differs between '{isa}' and 'default'"


def test_lowp_conversions_round_to_nearest_even(C):
    """Special values through param_lp: ties, subnormals, overflow, inf, NaN."""
    vals = torch.tensor([1.0 + 2**-11, 1.0 + 3 * 2**-11, 1.0 + 2**-8, 1.0 + 3 * 2**-8,
                         65504.0, 65520.0, 1e6, -1e-7, 6e-8, 2**-24 * 1.5, 3e38,
                         float("inf"), float("-inf"), float("nan"), 0.0, -0.0])
    n = vals.numel()
    for lp_dtype in (torch.float16, torch.bfloat16):
        p = vals.clone()
        lp = torch.empty(n, dtype=lp_dtype)
        # lr = 0 and zero grad: param passes through unchanged, then is cast.
        C.adam_step(p, torch.zeros(n), torch.zeros(n), torch.zeros(n), None, lp,
                    torch.ones(1), torch.zeros(1), 0.9, 0.999, EPS, 0.0, False, False,
                    False, None, None, None)
        want = vals.to(lp_dtype)
        nan = want.isnan()
        assert bool((lp.isnan() == nan).all())
        assert torch.equal(lp[~nan].view(torch.int16), want[~nan].view(torch.int16)), (
            f"{lp_dtype}: got {lp.tolist()}, want {want.tolist()}")


def test_fp16_grad_widening_is_exact(C):
    """Every finite fp16 bit pattern widens exactly (grad passes through m with beta1=0)."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    g = bits.view(torch.float16)
    g = g[g.isfinite()].contiguous()
    n = g.numel()
    m = torch.zeros(n)
    C.adam_step(torch.zeros(n), g, m, torch.zeros(n), None, None, torch.ones(1),
                torch.zeros(1), 0.0, 0.5, EPS, 0.0, False, False, False, None, None, None)
    assert torch.equal(m, g.float())


# ---- bad input: an error naming the argument, and nothing modified ----

def good_args(n=16, dtype=torch.float32):
    return dict(param=torch.randn(n), grad=torch.randn(n).to(dtype), exp_avg=torch.rand(n),
                exp_avg_sq=torch.rand(n), max_exp_avg_sq=None, param_lp=None,
                step=torch.ones(1), lr=torch.full((1,), 1e-2))


def call(C, a, amsgrad=False):
    C.adam_step(a["param"], a["grad"], a["exp_avg"], a["exp_avg_sq"], a["max_exp_avg_sq"],
                a["param_lp"], a["step"], a["lr"], 0.9, 0.999, EPS, 0.0, False, amsgrad,
                False, None, None, None)


BAD = {
    "exp_avg float64": (lambda a: a.update(exp_avg=a["exp_avg"].double()), "`exp_avg`"),
    "grad int32": (lambda a: a.update(grad=torch.ones(16, dtype=torch.int32)), "`grad`"),
    "param float16": (lambda a: a.update(param=a["param"].half()), "`param`"),
    "exp_avg non-contiguous": (lambda a: a.update(exp_avg=torch.rand(32)[::2]), "`exp_avg`"),
    "exp_avg_sq size": (lambda a: a.update(exp_avg_sq=torch.rand(15)), "`exp_avg_sq`"),
    "grad size": (lambda a: a.update(grad=torch.randn(17)), "`grad`"),
    "exp_avg device": (lambda a: a.update(exp_avg=torch.empty(16, device="meta")), "`exp_avg`"),
    "lr device": (lambda a: a.update(lr=torch.empty(1, device="meta")), "`lr`"),
    "lr float64": (lambda a: a.update(lr=torch.ones(1, dtype=torch.float64)), "`lr`"),
    "step two elements": (lambda a: a.update(step=torch.ones(2)), "`step`"),
    "param 2-D": (lambda a: a.update(param=a["param"].view(4, 4)), "`param`"),
    "param_lp float32": (lambda a: a.update(param_lp=torch.zeros(16)), "`param_lp`"),
    "max_exp_avg_sq without amsgrad": (lambda a: a.update(max_exp_avg_sq=torch.zeros(16)),
                                       "`max_exp_avg_sq`"),
    "aliasing m and v": (lambda a: a.update(exp_avg_sq=a["exp_avg"]), "`exp_avg`"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_names_argument_and_changes_nothing(C, case):
    a = good_args()
    mutate, needle = BAD[case]
    mutate(a)
    before = {k: v.clone() for k, v in a.items() if v is not None and v.device.type == "cpu"}
    with pytest.raises((RuntimeError, ValueError, TypeError)) as info:
        call(C, a)
    assert needle in str(info.value), f"message does not name {needle}: {info.value}"
    for k, v in before.items():
        assert torch.equal(a[k], v), f"`{k}` was modified by a refused call ({case})"


def test_amsgrad_requires_max_exp_avg_sq(C):
    a = good_args()
    before = a["param"].clone()
    with pytest.raises((RuntimeError, ValueError), match="max_exp_avg_sq"):
        call(C, a, amsgrad=True)
    assert torch.equal(a["param"], before)


@pytest.mark.parametrize("beta1,beta2,eps,wd,needle", [
    (1.0, 0.999, EPS, 0.0, "beta1"), (0.9, -0.1, EPS, 0.0, "beta2"),
    (0.9, 0.999, -1.0, 0.0, "eps"), (0.9, 0.999, EPS, float("nan"), "weight_decay"),
])
def test_bad_hyperparameters(C, beta1, beta2, eps, wd, needle):
    a = good_args()
    before = a["param"].clone()
    with pytest.raises((RuntimeError, ValueError), match=needle):
        C.adam_step(a["param"], a["grad"], a["exp_avg"], a["exp_avg_sq"], None, None,
                    a["step"], a["lr"], beta1, beta2, eps, wd, False, False, False,
                    None, None, None)
    assert torch.equal(a["param"], before)


def test_empty_tensors_are_a_no_op(C):
    e = torch.empty(0)
    C.adam_step(e, e.clone(), e.clone(), e.clone(), None, None, torch.ones(1), torch.ones(1),
                0.9, 0.999, EPS, 0.0, False, False, False, None, None, None)


def test_unavailable_reason_is_none_when_loaded(C):
    assert _ext.unavailable_reason() is None
    assert isinstance(_ext.cuda_available(), bool)
