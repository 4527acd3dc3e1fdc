"""What the FusedAdam tests share: the backends and shapes they run, gradients,
twin parameters fed the same gradients as torch.optim's, and comparisons that say
where the first difference is (``assert_close``, ``assert_bitwise``)."""

import pytest
import torch
from torch import nn

from zero_triton.kernels.args import Operands, StepArgs
from zero_triton.native import backends

BACKENDS = ("torch", "triton", "cpu")

# One element, below one block, a prime, a multi-dim parameter.
SHAPES = [(1,), (7,), (1009,), (13, 17)]

WD_MODES = {
    "none": dict(weight_decay=0.0),
    "l2": dict(weight_decay=0.1),
    "decoupled": dict(weight_decay=0.1, decoupled_weight_decay=True),
}


# -- helpers ---------------------------------------------------------------------------
def require_backend(name, device="cpu"):
    """Skip (with the reason) unless backend ``name`` can step ``device`` tensors here.
    Evaluated inside the test, not at collection: loading the native extension may
    compile it."""
    try:
        reason = backends.why_not(name, torch.device(device))
    except Exception as exc:  # the extension's loader not there yet, or broken
        reason = f"{type(exc).__name__}: {exc}"
    if reason is not None:
        pytest.skip(f"backend {name!r} unavailable on {device}: {reason}")


def first_mismatch(actual, expected, rtol=0.0, atol=0.0):
    """'' when close, else how many differ, where the first is and its values."""
    a = actual.detach().to("cpu", torch.float64).reshape(-1)
    e = expected.detach().to("cpu", torch.float64).reshape(-1)
    if a.shape != e.shape:
        return f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    bad = ~torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
    if not bad.any():
        return ""
    i = int(bad.nonzero()[0])
    idx = tuple(int(k) for k in torch.unravel_index(torch.tensor(i), tuple(actual.shape)))
    return (f"{int(bad.sum())}/{a.numel()} elements differ; first at index {idx}: "
            f"got {a[i].item()!r}, expected {e[i].item()!r} "
            f"(|diff| {abs(a[i] - e[i]).item():.3g}, rtol {rtol}, atol {atol})")


def assert_close(actual, expected, rtol, atol, what):
    msg = first_mismatch(actual, expected, rtol, atol)
    assert not msg, f"{what}: {msg}"


def assert_bitwise(actual, expected, what):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a = actual.detach().cpu().reshape(-1)
    e = expected.detach().cpu().reshape(-1)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    bad = a.view(bits) != e.view(bits)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{a.numel()} elements differ bitwise; first at flat "
            f"index {i}: got {a[i].item()!r} (0x{int(a.view(bits)[i]) & 0xFFFFFFFF:x}), "
            f"expected {e[i].item()!r} (0x{int(e.view(bits)[i]) & 0xFFFFFFFF:x})")


def make_params(shapes, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(device, dtype) for s in shapes]


def step_grads(params, step, dtype=None):
    """Deterministic gradients for ``step``: magnitudes spread over orders of magnitude
    (eps matters at the small end) with exact zeros mixed in."""
    gen = torch.Generator().manual_seed(1000 + step)
    out = []
    for p in params:
        g = torch.randn(p.shape, generator=gen) * 10.0 ** (step % 5 - 3)
        g = g * (torch.rand(p.shape, generator=gen) > 0.1)
        out.append(g.to(p.device, dtype or p.dtype))
    return out


def twins(tensors, requires_grad=True):
    """Two independent leaf copies of ``tensors``: (ours, theirs)."""
    a = [nn.Parameter(t.clone(), requires_grad=requires_grad) for t in tensors]
    b = [nn.Parameter(t.clone(), requires_grad=requires_grad) for t in tensors]
    return a, b


def feed(ours, theirs, grads):
    """Identical gradients: ours written into the flat-buffer views, theirs assigned."""
    for p, q, g in zip(ours, theirs, grads):
        with torch.no_grad():
            p.grad = g.to(p.dtype).clone()
        q.grad = g.clone()


def compare_to_torch(opt, topt, ours, theirs, rtol, atol, label):
    for i, (p, q) in enumerate(zip(ours, theirs)):
        assert_close(p, q, rtol, atol, f"{label}, param {i} {tuple(p.shape)}")
        s, ts = opt.state[p], topt.state[q]
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in ts:
                assert_close(s[key], ts[key], rtol, atol, f"{label}, param {i}, {key}")
        assert float(s["step"]) == float(ts["step"]), f"{label}, param {i}: step"


# fp32 vs torch.optim: the torch backend runs torch's own formula (lerp, bias
# corrections in float64 on the host) and agrees to a few ulps; the kernels compute
# beta1*m + (1-beta1)*g and the bias corrections in fp32, so exp_avg near a sign
# change (cancellation) differs by ~1e-7 absolute. Observed worst cases over 22 steps
# are about 0.4x these tolerances.
FP32_TOL = [pytest.param(torch.float32, 2e-5, 1e-6, id="fp32")]  # a kernel backend alone
FP32_ROWS = [
    pytest.param("torch", torch.float32, 2e-6, 1e-7, id="torch-fp32"),
    pytest.param("triton", torch.float32, 2e-5, 1e-6, id="triton-fp32"),
    pytest.param("cpu", torch.float32, 2e-5, 1e-6, id="cpu-fp32"),
]



# The fp32 master vs the float64 reference (rounded to fp32 once per step): fp32
# rounding only, whatever the parameter dtype; observed worst case ~0.5x (kernels) and
# ~0.2x (torch backend). The low-precision parameter itself is checked bit for bit.
LP_ROWS = [pytest.param(backend, dtype, 2e-5, 1e-6, id=f"{backend}-{name}")
           for backend in BACKENDS
           for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"))]


def inside(t, flat):
    start = flat.data_ptr()
    end = start + flat.numel() * flat.element_size()
    return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= end


def launcher_args(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen)
    exp_avg = torch.randn(n, generator=gen) * 0.1
    exp_avg_sq = torch.rand(n, generator=gen) * 0.1
    return [param, grad, exp_avg, exp_avg_sq, None, None, torch.tensor([3.0]), torch.tensor([1e-2])]


LAUNCH_KW = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True,
                  amsgrad=False, maximize=False)


def snapshot(opt, params):
    out = [p.detach().clone() for p in params]
    for p in params:
        s = opt.state.get(p, {})
        out += [v.detach().clone() for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def spelled(fn):
    """Step function ``fn`` (``fn(ops, args)``: ``zero_triton.kernels.args``) called with
    its arguments spelled out, for tests that build them one by one: ``(param, grad,
    m1, m2, m3, param_lp, step, lr, *, remainder=None, scratch=None, **StepArgs)``, where
    ``m1, m2, m3`` are the moment store's operands."""
    def call(param, grad, m1, m2, m3, param_lp, step, lr, *, remainder=None, scratch=None, **kw):
        return fn(Operands(param, grad, (m1, m2, m3), param_lp, step, lr, remainder, scratch),
                  StepArgs(**kw))
    return call


def spelled_step(name: str, fmt: str = "fp32"):
    """``backends.step_function(name, fmt)``, ``spelled``."""
    return spelled(backends.step_function(name, fmt))
