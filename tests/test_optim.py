"""FusedAdam / FusedAdamW against torch.optim.Adam / AdamW and the shared reference.

Every backend usable here is held to the same function: "torch" always, "triton" under
the interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1), "cpu" when the
native extension loads. Each test feeds identical gradients to both optimizers, so any
difference is the optimizer's own. Tensors stay small (one interpreted program per
step) to keep the whole file fast.
"""
import copy
import io
import math

import pytest
import torch
from torch import nn

from conftest import interpreter_on, requires_cuda
from zero_triton import FusedAdam, FusedAdamW
from zero_triton.native import ext as _ext
from zero_triton.native import backends
from zero_triton.reference import rne_cast, torch_adam_step_

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


# -- fp32 vs torch.optim ----------------------------------------------------------------
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


@pytest.mark.parametrize("backend, dtype, rtol, atol", FP32_ROWS)
@pytest.mark.parametrize("wd", list(WD_MODES))
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("maximize", [False, True], ids=["min", "max"])
def test_matches_torch_adam(backend, dtype, rtol, atol, wd, amsgrad, maximize):
    require_backend(backend)
    ours, theirs = twins(make_params(SHAPES, dtype))
    hp = dict(betas=(0.9, 0.99), eps=1e-8, amsgrad=amsgrad, maximize=maximize)
    # Two groups with their own lr and weight decay.
    wd0 = WD_MODES[wd]
    wd1 = {**wd0, "weight_decay": 0.3 if wd0["weight_decay"] else 0.0}
    groups = lambda ps: [{"params": ps[:2], "lr": 1e-2, **wd0},  # noqa: E731
                         {"params": ps[2:], "lr": 3e-3, **wd1}]
    opt = FusedAdam(groups(ours), backend=backend, **hp)
    topt = torch.optim.Adam(groups(theirs), foreach=False, **hp)
    for step in range(1, 23):
        feed(ours, theirs, step_grads(ours, step))
        opt.step()
        topt.step()
        compare_to_torch(opt, topt, ours, theirs, rtol, atol, f"{backend} step {step}")
    for i, (p, flat) in enumerate(zip(ours, [opt._flats[0][0]] * 2 + [opt._flats[1][0]] * 2)):
        assert _inside(p.grad, flat.flat_grad), f"param {i}: .grad stopped being a view of the flat buffer"


@pytest.mark.parametrize("backend, dtype, rtol, atol", FP32_ROWS)
def test_adamw_matches_torch_adamw(backend, dtype, rtol, atol):
    require_backend(backend)
    ours, theirs = twins(make_params(SHAPES, dtype))
    # Class defaults (weight_decay=1e-2) on both sides, plus a group overriding them.
    opt = FusedAdamW([{"params": ours[:3]}, {"params": ours[3:], "weight_decay": 0.5}],
                     lr=2e-2, backend=backend)
    topt = torch.optim.AdamW([{"params": theirs[:3]}, {"params": theirs[3:], "weight_decay": 0.5}],
                             lr=2e-2, foreach=False)
    for step in range(1, 21):
        feed(ours, theirs, step_grads(ours, step))
        opt.step()
        topt.step()
        compare_to_torch(opt, topt, ours, theirs, rtol, atol, f"{backend} step {step}")


def _inside(t, flat):
    start = flat.data_ptr()
    end = start + flat.numel() * flat.element_size()
    return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= end


@pytest.mark.parametrize("backend, dtype, rtol, atol", FP32_ROWS)
def test_tensor_lr_matches_torch(backend, dtype, rtol, atol):
    # torch.optim.Adam (foreach=False) takes a tensor lr; so do we, read on the device.
    require_backend(backend)
    ours, theirs = twins(make_params(SHAPES, dtype))
    opt = FusedAdam(ours, lr=torch.tensor(1e-2), backend=backend)
    topt = torch.optim.Adam(theirs, lr=torch.tensor(1e-2), foreach=False)
    for step in range(1, 6):
        feed(ours, theirs, step_grads(ours, step))
        opt.step()
        topt.step()
        compare_to_torch(opt, topt, ours, theirs, rtol, atol, f"{backend} step {step}")


# -- schedules, closures, groups, names, frozen params ------------------------------------
@pytest.mark.parametrize("backend, dtype, rtol, atol", FP32_ROWS)
@pytest.mark.parametrize("schedule", ["step", "lambda"])
def test_lr_scheduler(backend, schedule, dtype, rtol, atol):
    require_backend(backend)
    ours, theirs = twins(make_params(SHAPES, dtype))
    opt = FusedAdam(ours, lr=1e-2, backend=backend)
    topt = torch.optim.Adam(theirs, lr=1e-2, foreach=False)

    def scheduler(o):
        if schedule == "step":
            return torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5)
        return torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e))

    sched, tsched = scheduler(opt), scheduler(topt)
    lrs = []
    for step in range(1, 11):
        feed(ours, theirs, step_grads(ours, step))
        opt.step()
        topt.step()
        sched.step()
        tsched.step()
        lrs.append(opt.param_groups[0]["lr"])
        assert lrs[-1] == topt.param_groups[0]["lr"], f"step {step}: lr"
        compare_to_torch(opt, topt, ours, theirs, rtol, atol, f"{backend} step {step}")
    assert len(set(lrs)) > 2, f"the schedule never changed lr: {lrs}"


@pytest.mark.parametrize("backend, dtype, rtol, atol", FP32_ROWS)
def test_closure(backend, dtype, rtol, atol):
    require_backend(backend)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(9, 13), nn.Tanh(), nn.Linear(13, 3))
    tmodel = copy.deepcopy(model)
    opt = FusedAdam(model.parameters(), lr=1e-2, backend=backend)
    topt = torch.optim.Adam(tmodel.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(5)
    for step in range(1, 8):
        x = torch.randn(4, 9, generator=gen)

        def closure(m=model, o=opt):
            o.zero_grad()
            loss = m(x).square().mean()
            loss.backward()
            return loss

        def tclosure(m=tmodel, o=topt):
            o.zero_grad()
            loss = m(x).square().mean()
            loss.backward()
            return loss

        loss, tloss = opt.step(closure), topt.step(tclosure)
        assert isinstance(loss, torch.Tensor), f"step {step}: step(closure) must return the loss"
        assert_close(loss, tloss, rtol, atol, f"step {step}: loss")
        compare_to_torch(opt, topt, list(model.parameters()), list(tmodel.parameters()),
                         rtol, atol, f"{backend} step {step}")


@pytest.mark.parametrize("backend, dtype, rtol, atol", FP32_ROWS)
def test_add_param_group_mid_training(backend, dtype, rtol, atol):
    require_backend(backend)
    ours, theirs = twins(make_params(SHAPES, dtype))
    opt = FusedAdam(ours[:2], lr=1e-2, backend=backend)
    topt = torch.optim.Adam(theirs[:2], lr=1e-2, foreach=False)
    for step in range(1, 4):
        feed(ours[:2], theirs[:2], step_grads(ours[:2], step))
        opt.step()
        topt.step()
    opt.add_param_group({"params": ours[2:], "lr": 5e-3, "weight_decay": 0.1, "amsgrad": True})
    topt.add_param_group({"params": theirs[2:], "lr": 5e-3, "weight_decay": 0.1, "amsgrad": True})
    assert len(opt.param_groups) == 2
    for step in range(4, 10):
        feed(ours, theirs, step_grads(ours, step))
        opt.step()
        topt.step()
        compare_to_torch(opt, topt, ours, theirs, rtol, atol, f"{backend} step {step}")


@pytest.mark.parametrize("dtype, rtol, atol", FP32_TOL)
def test_named_parameters_and_frozen_params(dtype, rtol, atol):
    backend = "torch"  # the group plumbing is backend independent
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 2))
    model[0].bias.requires_grad_(False)
    tmodel = copy.deepcopy(model)
    frozen_before = model[0].bias.detach().clone()
    opt = FusedAdam(model.named_parameters(), lr=1e-2, weight_decay=0.1, backend=backend)
    topt = torch.optim.Adam(tmodel.named_parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    assert opt.param_groups[0].get("param_names") == topt.param_groups[0].get("param_names")
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 6):
        x = torch.randn(3, 5, generator=gen)
        for m, o in ((model, opt), (tmodel, topt)):
            o.zero_grad()
            m(x).sum().backward()
            o.step()
        trainable = [p for p in model.parameters() if p.requires_grad]
        ttrainable = [p for p in tmodel.parameters() if p.requires_grad]
        compare_to_torch(opt, topt, trainable, ttrainable, rtol, atol, f"step {step}")
    frozen = model[0].bias
    assert_bitwise(frozen, frozen_before, "frozen parameter changed")
    assert frozen.grad is None, "a frozen parameter got a gradient"
    assert frozen not in opt.state, "a frozen parameter got optimizer state"
    assert not any(_inside(frozen, f.flat_param) for fl in opt._flats for f in fl), \
        "a frozen parameter was moved into a flat buffer"


# -- zero_grad and views ------------------------------------------------------------------
@pytest.mark.parametrize("backend, dtype, rtol, atol", FP32_ROWS)
def test_zero_grad_sets_none_and_backward_lands_in_the_flat_buffer(backend, dtype, rtol, atol):
    # torch's .grad: None after zero_grad(); backward's gradient moves into the flat
    # buffer and .grad is its view from then on, so micro-batches accumulate in place.
    require_backend(backend)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 11), nn.ReLU(), nn.Linear(11, 1))
    opt = FusedAdam(model.parameters(), backend=backend)
    flat = opt._flats[0][0]
    x = torch.randn(4, 6)
    model(x).sum().backward()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters()), "zero_grad() must set .grad to None"
    model(x).sum().backward()
    once = [p.grad.clone() for p in model.parameters()]
    ptrs = [p.grad.data_ptr() for p in model.parameters()]
    for i, p in enumerate(model.parameters()):
        assert _inside(p.grad, flat.flat_grad), f"param {i}: .grad is not its flat-buffer view"
    model(x).sum().backward()
    for i, (p, g, ptr) in enumerate(zip(model.parameters(), once, ptrs)):
        assert p.grad.data_ptr() == ptr, f"param {i}: autograd replaced the .grad view"
        assert_close(p.grad, 2 * g, rtol, atol, f"param {i}: accumulated gradient")
    assert_close(flat.flat_grad[flat.layout.offsets[0]:][:once[0].numel()], 2 * once[0].reshape(-1),
                 rtol, atol, "the flat buffer does not hold the accumulated gradient")
    opt.zero_grad(set_to_none=False)
    for i, (p, ptr) in enumerate(zip(model.parameters(), ptrs)):
        assert p.grad is not None and p.grad.data_ptr() == ptr and not p.grad.any(), \
            f"param {i}: zero_grad(set_to_none=False) must keep a zeroed .grad"


def _choose_grad_check(opt, check):
    """'native': the C loop of zero_triton._C finds replaced grads; 'python': the loop."""
    for flats in opt._flats:
        for flat in flats:
            if check == "python":
                flat.grad_buffer.check_flat = None
            elif flat.grad_buffer.check_flat is None:
                pytest.skip("the native extension is not loaded here: "
                            f"{_ext.unavailable_reason() or 'only the cpu backend loads it'}")


@pytest.mark.parametrize("check", ["native", "python"])
@pytest.mark.parametrize("backend, dtype, rtol, atol", FP32_ROWS)
def test_module_zero_grad_set_to_none_then_backward(backend, dtype, rtol, atol, check):
    # model.zero_grad() sets .grad to None; autograd then allocates fresh tensors. The
    # step must pick them up and point .grad back at the flat buffer.
    require_backend(backend)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 11), nn.Tanh(), nn.Linear(11, 2))
    tmodel = copy.deepcopy(model)
    opt = FusedAdam(model.parameters(), lr=1e-2, backend=backend)
    _choose_grad_check(opt, check)
    topt = torch.optim.Adam(tmodel.parameters(), lr=1e-2, foreach=False)
    flat = opt._flats[0][0]
    gen = torch.Generator().manual_seed(11)
    for step in range(1, 7):
        x = torch.randn(5, 6, generator=gen)
        model.zero_grad()  # set_to_none=True
        assert all(p.grad is None for p in model.parameters())
        if step == 3:
            # Parameters with no gradient at all this step (a detached branch): neither
            # optimizer touches them (torch.optim.Adam's rule), steps included.
            loss = model[2](torch.tanh(model[0](x)).detach()).sum()
        else:
            loss = model(x).sum()
        loss.backward()
        tmodel.zero_grad()
        for p, q in zip(model.parameters(), tmodel.parameters()):
            q.grad = None if p.grad is None else p.grad.clone()
        opt.step()
        topt.step()
        for i, (p, q) in enumerate(zip(model.parameters(), tmodel.parameters())):
            assert (p.grad is None) == (q.grad is None), f"step {step}: param {i} .grad None-ness"
            assert p.grad is None or _inside(p.grad, flat.flat_grad), \
                f"step {step}: param {i} .grad not moved into the flat buffer"
        compare_to_torch(opt, topt, list(model.parameters()), list(tmodel.parameters()),
                         rtol, atol, f"{backend} step {step}")


@pytest.mark.parametrize("check", ["native", "python"])
def test_one_replaced_grad_among_views_is_copied_in(check):
    # Only the third parameter's .grad is replaced (and the fourth set to None): the
    # check must find it past a run of intact views, copy it in, and zero the missing one.
    params = [nn.Parameter(torch.randn(5)) for _ in range(5)]
    for p in params:
        p.grad = torch.full((5,), 1.0)
    opt = FusedAdam(params, backend="cpu" if backends.why_not("cpu", torch.device("cpu")) is None
                    else "torch")
    _choose_grad_check(opt, check)
    flat = opt._flats[0][0]
    params[2].grad = torch.full((5,), 7.0)
    params[3].grad = None
    flat.sync_grads()
    assert flat.stepped == [True, True, True, False, True]
    for i, p in enumerate(params):
        if i == 3:
            assert p.grad is None, "a parameter without a gradient got one"
            assert not flat.grad_buffer.views[3].any(), "its view was not zeroed"
            continue
        assert _inside(p.grad, flat.flat_grad), f"param {i}: .grad is not the flat view"
        want = {2: 7.0}.get(i, 1.0)
        assert torch.equal(p.grad, torch.full((5,), want)), f"param {i}: {p.grad} != {want}"


# -- fp16 / bf16 with fp32 master -----------------------------------------------------------
# The fp32 master vs the float64 reference (rounded to fp32 once per step): fp32
# rounding only, whatever the parameter dtype; observed worst case ~0.5x (kernels) and
# ~0.2x (torch backend). The low-precision parameter itself is checked bit for bit.
LP_ROWS = [pytest.param(backend, dtype, 2e-5, 1e-6, id=f"{backend}-{name}")
           for backend in BACKENDS
           for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"))]


@pytest.mark.parametrize("backend, dtype, rtol, atol", LP_ROWS)
@pytest.mark.parametrize("wd", ["none", "l2", "decoupled"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
def test_low_precision_master(backend, dtype, rtol, atol, wd, amsgrad):
    require_backend(backend)
    ours = [nn.Parameter(t) for t in make_params(SHAPES, dtype)]
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, amsgrad=amsgrad, maximize=False)
    opt = FusedAdam(ours, backend=backend, **hp, **WD_MODES[wd])
    # The reference starts from the same master: the parameters upcast.
    ref = [dict(p=p.detach().float().clone(), m=torch.zeros(p.shape), v=torch.zeros(p.shape),
                mv=torch.zeros(p.shape)) for p in ours]
    for step in range(1, 21):
        grads = step_grads(ours, step)  # in the parameters' dtype
        for p, g, r in zip(ours, grads, ref):
            with torch.no_grad():
                p.grad = g.to(p.dtype).clone()
            torch_adam_step_(r["p"], g.float(), r["m"], r["v"], r["mv"] if amsgrad else None, step,
                             lr=hp["lr"], beta1=0.9, beta2=0.99, eps=1e-8,
                             weight_decay=WD_MODES[wd]["weight_decay"], adamw=wd == "decoupled",
                             amsgrad=amsgrad, maximize=False)
        opt.step()
        for i, (p, r) in enumerate(zip(ours, ref)):
            s = opt.state[p]
            label = f"{backend} {dtype} step {step}, param {i} {tuple(p.shape)}"
            assert s["master_param"].dtype == torch.float32
            assert_close(s["master_param"], r["p"], rtol, atol, f"{label}, master")
            assert_close(s["exp_avg"], r["m"], rtol, atol, f"{label}, exp_avg")
            assert_close(s["exp_avg_sq"], r["v"], rtol, atol, f"{label}, exp_avg_sq")
            # The Triton kernel rounds bf16 with integer ops, so this is exact on every
            # backend, the interpreter included.
            assert_bitwise(p.detach(), rne_cast(s["master_param"], dtype),
                           f"{label}, param != rne(master)")


# -- GradScaler ----------------------------------------------------------------------------
def _snapshot(opt, params):
    out = [p.detach().clone() for p in params]
    for p in params:
        s = opt.state.get(p, {})
        out += [v.detach().clone() for v in s.values() if isinstance(v, torch.Tensor)]
    return out


@pytest.mark.parametrize("backend, dtype, rtol, atol", FP32_ROWS)
def test_grad_scaler_skips_inf_then_matches_torch(backend, dtype, rtol, atol):
    require_backend(backend)
    ours, theirs = twins(make_params(SHAPES, dtype))
    opt = FusedAdam(ours, lr=1e-2, weight_decay=0.1, backend=backend)
    topt = torch.optim.Adam(theirs, lr=1e-2, weight_decay=0.1, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    tscaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    inf_steps = {3, 7}
    for step in range(1, 12):
        grads = step_grads(ours, step)
        if step in inf_steps:
            grads[2][5] = math.inf if step == 3 else math.nan
        # scale() of a loss is what initialises a scaler; the loss itself is not needed.
        scale = float(scaler.scale(torch.ones(())))
        assert scale == float(tscaler.scale(torch.ones(()))), f"step {step}: the scalers diverged"
        # Power-of-two scale: scaling and unscaling are exact.
        feed(ours, theirs, [g * scale for g in grads])
        before = _snapshot(opt, ours)
        scaler.step(opt)
        tscaler.step(topt)
        scaler.update()
        tscaler.update()
        if step in inf_steps:
            after = _snapshot(opt, ours)
            for j, (a, b) in enumerate(zip(after, before)):
                assert_bitwise(a, b, f"{backend} step {step} (inf grads): tensor {j} changed")
        compare_to_torch(opt, topt, ours, theirs, rtol, atol, f"{backend} step {step}")
    assert float(opt.state[ours[0]]["step"]) == 11 - len(inf_steps)


@pytest.mark.parametrize("backend, dtype, rtol, atol", [p for p in LP_ROWS if "bf16" in p.id])
def test_grad_scaler_attributes_low_precision(backend, dtype, rtol, atol):
    # What GradScaler does for an optimizer with _step_supports_amp_scaling: set
    # grad_scale and found_inf, call step(). An inf step changes nothing, master and
    # the bf16 parameter included.
    require_backend(backend)
    ours = [nn.Parameter(t) for t in make_params(SHAPES, dtype)]
    opt = FusedAdam(ours, lr=1e-2, backend=backend)
    ref = [dict(p=p.detach().float().clone(), m=torch.zeros(p.shape), v=torch.zeros(p.shape))
           for p in ours]
    t = 0
    for step in range(1, 7):
        skip = step == 2
        grads = step_grads(ours, step, torch.float32)
        for p, g in zip(ours, grads):
            with torch.no_grad():
                p.grad = (g * 256.0).to(dtype)
        opt.grad_scale = torch.tensor(256.0)
        opt.found_inf = torch.tensor(1.0 if skip else 0.0)
        before = _snapshot(opt, ours)
        opt.step()
        del opt.grad_scale, opt.found_inf
        if skip:
            for j, (a, b) in enumerate(zip(_snapshot(opt, ours), before)):
                assert_bitwise(a, b, f"{backend} step {step} (found_inf): tensor {j} changed")
            continue
        t += 1
        for p, r in zip(ours, ref):
            torch_adam_step_(r["p"], p.grad.float() / 256.0, r["m"], r["v"], None, t, lr=1e-2,
                             beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=False,
                             amsgrad=False, maximize=False)
        for i, (p, r) in enumerate(zip(ours, ref)):
            s = opt.state[p]
            label = f"{backend} step {step}, param {i}"
            assert float(s["step"]) == t, f"{label}: step {float(s['step'])} != {t}"
            assert_close(s["master_param"], r["p"], rtol, atol, f"{label}, master")
            assert_bitwise(p.detach(), rne_cast(s["master_param"], dtype), f"{label}, param")


@pytest.mark.parametrize("backend, dtype, rtol, atol", FP32_ROWS)
def test_grad_scaler_with_bf16_autocast_model(backend, dtype, rtol, atol):
    require_backend(backend)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    tmodel = copy.deepcopy(model)
    opt = FusedAdam(model.parameters(), lr=1e-2, backend=backend)
    topt = torch.optim.Adam(tmodel.parameters(), lr=1e-2, foreach=False)
    scaler, tscaler = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    gen = torch.Generator().manual_seed(2)
    for step in range(1, 6):
        x = torch.randn(6, 8, generator=gen)
        if step == 2:
            x[0, 0] = math.inf  # an overflowing batch: both scalers skip the step
        for m, o, sc in ((model, opt, scaler), (tmodel, topt, tscaler)):
            o.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = m(x).float().square().mean()
            sc.scale(loss).backward()
        for i, (p, q) in enumerate(zip(model.parameters(), tmodel.parameters())):
            assert_bitwise(p.grad, q.grad, f"step {step}: grads of param {i} differ before the step")
        before = _snapshot(opt, list(model.parameters()))
        scaler.step(opt)
        tscaler.step(topt)
        scaler.update()
        tscaler.update()
        if step == 2:
            for j, (a, b) in enumerate(zip(_snapshot(opt, list(model.parameters())), before)):
                assert_bitwise(a, b, f"{backend} step 2 (inf): tensor {j} changed")
        compare_to_torch(opt, topt, list(model.parameters()), list(tmodel.parameters()),
                         rtol, atol, f"{backend} step {step}")


# -- state dict ------------------------------------------------------------------------------
def _through_bytes(sd):
    """A save/load cycle, so that no tensor is shared between two optimizers."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf)


@pytest.mark.parametrize("backend, dtype, rtol, atol", FP32_ROWS)
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
def test_state_dict_round_trip_with_torch(backend, amsgrad, dtype, rtol, atol):
    require_backend(backend)
    init = make_params(SHAPES, dtype)
    ours, theirs = twins(init)
    hp = dict(lr=1e-2, weight_decay=0.05, amsgrad=amsgrad)
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3}]  # noqa: E731
    opt = FusedAdam(groups(ours), backend=backend, **hp)
    topt = torch.optim.Adam(groups(theirs), foreach=False, **hp)
    for step in range(1, 5):
        feed(ours, theirs, step_grads(ours, step))
        opt.step()
        topt.step()

    # Format: torch.optim.Adam's keys, one step tensor per parameter.
    sd, tsd = opt.state_dict(), topt.state_dict()
    assert set(sd["state"]) == set(tsd["state"]) == set(range(len(SHAPES)))
    for i in sd["state"]:
        assert set(sd["state"][i]) == set(tsd["state"][i]), f"param {i}: state keys"
        st = sd["state"][i]["step"]
        assert isinstance(st, torch.Tensor) and st.dtype == torch.float32 and st.numel() == 1
        assert float(st) == 4
    steps = [sd["state"][i]["step"] for i in sd["state"]]
    assert len({s.data_ptr() for s in steps}) == len(steps), "parameters share one step tensor"
    for g, tg in zip(sd["param_groups"], tsd["param_groups"]):
        assert set(g) == set(tg), f"param group keys {sorted(set(g) ^ set(tg))}"
        assert g["params"] == tg["params"]

    # ours -> torch, and torch -> ours: both continue like the uninterrupted pair.
    b = [nn.Parameter(p.detach().clone()) for p in ours]     # torch, loaded from ours
    c = [nn.Parameter(q.detach().clone()) for q in theirs]   # ours, loaded from torch
    torch_from_ours = torch.optim.Adam(groups(b), foreach=False, **hp)
    torch_from_ours.load_state_dict(_through_bytes(opt.state_dict()))
    ours_from_torch = FusedAdam(groups(c), backend=backend, **hp)
    ours_from_torch.load_state_dict(_through_bytes(topt.state_dict()))
    for step in range(5, 11):
        grads = step_grads(ours, step)
        feed(ours, theirs, grads)
        feed(c, b, grads)
        for o in (opt, topt, torch_from_ours, ours_from_torch):
            o.step()
        compare_to_torch(opt, torch_from_ours, ours, b, rtol, atol, f"ours->torch, step {step}")
        compare_to_torch(ours_from_torch, topt, c, theirs, rtol, atol, f"torch->ours, step {step}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_state_dict_low_precision_resume_is_exact(backend, dtype):
    # Save after 4 steps, load into a fresh optimizer over fresh parameters, run 4
    # more: bit for bit what the uninterrupted run does (same backend, same inputs).
    require_backend(backend)
    ours = [nn.Parameter(t) for t in make_params(SHAPES, dtype)]
    opt = FusedAdam(ours, lr=1e-2, weight_decay=0.1, amsgrad=True, backend=backend)
    for step in range(1, 5):
        for p, g in zip(ours, step_grads(ours, step)):
            with torch.no_grad():
                p.grad = g.to(p.dtype).clone()
        opt.step()
    sd = _through_bytes(opt.state_dict())
    for i, s in sd["state"].items():
        assert s["master_param"].dtype == torch.float32, f"param {i}: master dtype"
        assert set(s) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"}
        # The master is not just the parameter upcast (else it would be pointless).
    assert any(not torch.equal(s["master_param"].to(dtype).float(), s["master_param"])
               for s in sd["state"].values()), "the masters carry no information beyond the params"
    resumed = [nn.Parameter(p.detach().clone()) for p in ours]
    opt2 = FusedAdam(resumed, lr=1e-2, weight_decay=0.1, amsgrad=True, backend=backend)
    opt2.load_state_dict(sd)
    for step in range(5, 9):
        for ps in (ours, resumed):
            for p, g in zip(ps, step_grads(ours, step)):
                with torch.no_grad():
                    p.grad = g.to(p.dtype).clone()
        opt.step()
        opt2.step()
        for i, (p, q) in enumerate(zip(ours, resumed)):
            assert_bitwise(q, p, f"step {step}, param {i}")
            for k in ("master_param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                assert_bitwise(opt2.state[q][k], opt.state[p][k], f"step {step}, param {i}, {k}")


# -- clip_grad_norm_ ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend, dtype, rtol, atol", FP32_ROWS)
@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
def test_clip_grad_norm_matches_torch(backend, norm_type, dtype, rtol, atol):
    require_backend(backend)
    ours, theirs = twins(make_params(SHAPES, dtype))
    opt = FusedAdam(ours, lr=1e-2, backend=backend)
    topt = torch.optim.Adam(theirs, lr=1e-2, foreach=False)
    clipped = 0
    for step in range(1, 11):
        grads = step_grads(ours, step)
        feed(ours, theirs, grads)
        max_norm = 0.05 if step % 2 else 1e6  # odd steps clip, even steps do not
        norm = opt.clip_grad_norm_(max_norm, norm_type)
        tnorm = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type, foreach=False)
        assert_close(norm.reshape(()), tnorm, rtol, 0.0, f"step {step}: total norm")
        clipped += float(tnorm) > max_norm
        # The clip is applied inside the step: the gradients themselves stay unclipped.
        assert_close(ours[2].grad, grads[2], 0.0, 0.0, f"step {step}: grad modified by clip")
        opt.step()
        topt.step()
        compare_to_torch(opt, topt, ours, theirs, rtol, atol, f"{backend} step {step}")
    assert clipped >= 3, "the test never clipped"


# -- bad input: a clear error, nothing changed ----------------------------------------------------
def _state_fingerprint(opt, params):
    return ([p.detach().clone() for p in params], len(opt.param_groups),
            {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()})


def _assert_unchanged(opt, params, fingerprint):
    values, ngroups, state = fingerprint
    for i, (p, v) in enumerate(zip(params, values)):
        assert_bitwise(p.detach(), v, f"param {i} changed by a failed call")
    assert len(opt.param_groups) == ngroups, "a failed call changed param_groups"
    assert set(state) == {id(p) for p in opt.state}, "a failed call changed the state keys"
    for p, s in opt.state.items():
        for k, v in s.items():
            assert_bitwise(v, state[id(p)][k], f"state {k} changed by a failed call")


BAD_HYPERPARAMETERS = [
    (dict(lr=-1e-3), "Invalid learning rate.*>= 0"),
    (dict(eps=-1e-8), "Invalid epsilon.*>= 0"),
    (dict(betas=(1.0, 0.999)), r"Invalid beta parameter at index 0.*\[0, 1\)"),
    (dict(betas=(0.9, -0.1)), r"Invalid beta parameter at index 1.*\[0, 1\)"),
    (dict(weight_decay=-0.1), "Invalid weight_decay.*>= 0"),
    (dict(lr=torch.tensor([1e-3, 1e-3])), "Tensor lr must be 1-element"),
]


@pytest.mark.parametrize("kwargs, match", BAD_HYPERPARAMETERS)
def test_bad_hyperparameters(kwargs, match):
    ps = [nn.Parameter(t) for t in make_params(SHAPES[:2])]
    before = [p.detach().clone() for p in ps]
    with pytest.raises(ValueError, match=match):
        FusedAdam(ps, backend="torch", **kwargs)
    # A bad second group, after the first one was built: the first one's parameter
    # keeps its gradient (here a plain tensor), not a view of a dead buffer.
    g0 = torch.ones_like(ps[0])
    ps[0].grad = g0
    with pytest.raises(ValueError, match=match):
        FusedAdam([{"params": ps[:1]}, {"params": ps[1:], **kwargs}], backend="torch")
    assert ps[0].grad is g0 and ps[1].grad is None, "a failed constructor changed .grad"
    ps[0].grad = None
    # Through add_param_group on a live optimizer: nothing changes either.
    opt = FusedAdam(ps[:1], backend="torch")
    fp = _state_fingerprint(opt, ps)
    with pytest.raises(ValueError, match=match):
        opt.add_param_group({"params": ps[1:], **kwargs})
    _assert_unchanged(opt, ps, fp)
    for p, b in zip(ps, before):
        assert_bitwise(p.detach(), b, "a rejected constructor changed a parameter")


def test_unknown_backend():
    ps = [nn.Parameter(torch.randn(4))]
    before = ps[0].detach().clone()
    with pytest.raises(ValueError, match=r"unknown backend 'tpu'; choose one of .*'triton'"):
        FusedAdam(ps, backend="tpu")
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        backends.resolve("tpu", torch.device("cpu"))
    assert_bitwise(ps[0].detach(), before, "param changed")
    assert ps[0].grad is None, "a rejected optimizer attached a .grad view"


def test_triton_without_gpu_or_interpreter(monkeypatch):
    # CPU tensors with the interpreter off: Triton cannot step them, GPU or not.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1.*backend='cpu' or 'torch'"):
        backends.resolve("triton", torch.device("cpu"))
    ps = [nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(3))]
    before = [p.detach().clone() for p in ps]
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        FusedAdam(ps, backend="triton")
    for p, b in zip(ps, before):
        assert_bitwise(p.detach(), b, "param changed")
        assert p.grad is None, "a rejected optimizer attached a .grad view"
    # Through add_param_group (the first group holds only a frozen parameter, so it
    # needs no backend): the new group is not registered and nothing moves.
    frozen = nn.Parameter(torch.randn(2), requires_grad=False)
    opt = FusedAdam([frozen], backend="triton")
    fp = _state_fingerprint(opt, ps)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        opt.add_param_group({"params": ps})
    _assert_unchanged(opt, ps, fp)
    assert len(opt._flats) == 1 and all(p.grad is None for p in ps)


def test_launcher_refuses_cpu_tensors_without_interpreter(monkeypatch):
    from zero_triton.kernels import adam as kadam
    monkeypatch.setattr(kadam, "INTERPRET", False)
    args = _launcher_args(8)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1.*backend='cpu' or 'torch'"):
        kadam.adam_step(*args, **_LAUNCH_KW)


def test_parameter_in_two_groups():
    a, b = nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(3))
    match = "more than one parameter group.*already in another param group; give each parameter"
    with pytest.raises(ValueError, match=match):
        FusedAdam([{"params": [a]}, {"params": [b, a]}], backend="torch")
    # The first group was built before the second was rejected: its .grad is put back.
    assert a.grad is None and b.grad is None, "a failed constructor left .grad views behind"
    opt = FusedAdam([a], backend="torch")
    a.grad = torch.ones_like(a)
    opt.step()
    fp = _state_fingerprint(opt, [a, b])
    with pytest.raises(ValueError, match="already in another param group"):
        opt.add_param_group({"params": [b, a]})
    _assert_unchanged(opt, [a, b], fp)
    assert b.grad is None, "the rejected group's parameter got a .grad view"
    with pytest.warns(UserWarning, match="a parameter group with duplicate parameters"):
        opt.add_param_group({"params": [b, b]})  # torch.optim.Adam warns too
    assert opt.param_groups[-1]["params"] == [b], "the duplicate was not dropped"


def test_mixed_devices_in_one_group():
    second = "cuda" if torch.cuda.is_available() else "meta"
    a = nn.Parameter(torch.randn(5))
    b = nn.Parameter(torch.empty(3, device=second))
    before = a.detach().clone()
    with pytest.raises(ValueError, match="several devices.*one param group per device"):
        FusedAdam([a, b], backend="torch")
    assert_bitwise(a.detach(), before, "param changed")
    assert a.grad is None, "a rejected optimizer attached a .grad view"


def test_sparse_gradients():
    emb = nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    assert emb.weight.grad.is_sparse
    before = emb.weight.detach().clone()
    with pytest.raises(ValueError, match="sparse gradient; use torch.optim.SparseAdam"):
        FusedAdam(emb.parameters(), backend="torch")
    assert_bitwise(emb.weight.detach(), before, "param changed")

    # A sparse gradient arriving after construction (autograd stores its own sparse
    # tensor): refused at step, as torch.optim.Adam refuses it.
    emb.weight.grad = None
    opt = FusedAdam(emb.parameters(), backend="torch")
    emb(torch.tensor([3])).sum().backward()
    assert emb.weight.grad.is_sparse
    fp = _state_fingerprint(opt, [emb.weight])
    with pytest.raises(RuntimeError, match="sparse gradient.*SparseAdam"):
        opt.step()
    _assert_unchanged(opt, [emb.weight], fp)


def test_unsupported_parameter_dtype():
    p = nn.Parameter(torch.zeros(4, dtype=torch.complex32))
    with pytest.raises(ValueError, match=r"complex32; FusedAdam handles float32, float16, bfloat16, "
                                         r"float64, complex64 and complex128"):
        FusedAdam([p], backend="torch")
    assert p.grad is None


def test_master_weights_false_with_bf16():
    p = nn.Parameter(torch.randn(5).bfloat16())
    before, where = p.detach().clone(), p.data_ptr()
    with pytest.raises(ValueError, match="master_weights=False.*keep master_weights=None"):
        FusedAdam([p], backend="torch", master_weights=False)
    assert_bitwise(p.detach(), before, "param changed")
    assert p.data_ptr() == where, "the parameter was moved into a flat buffer before the error"


# -- the Triton launcher -------------------------------------------------------------------------
_LAUNCH_KW = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True,
                  amsgrad=False, maximize=False)


def _launcher_args(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen)
    exp_avg = torch.randn(n, generator=gen) * 0.1
    exp_avg_sq = torch.rand(n, generator=gen) * 0.1
    return [param, grad, exp_avg, exp_avg_sq, None, None, torch.tensor([3.0]), torch.tensor([1e-2])]


def _triton_launcher():
    require_backend("triton")
    from zero_triton.kernels.adam import adam_step
    return adam_step


@pytest.mark.parametrize("index, name, bad, match", [
    (0, "param", lambda t: torch.zeros(2 * t.numel())[::2],
     "`param` must be float32 and contiguous, got torch.float32 non-contiguous"),
    (2, "exp_avg", lambda t: torch.zeros(2 * t.numel())[::2], "`exp_avg` must be float32 and contiguous"),
    (3, "exp_avg_sq", lambda t: t.double(), "`exp_avg_sq` must be float32 and contiguous, got torch.float64"),
    (1, "grad", lambda t: t.to(torch.int32), "`grad` must be float32/float16/bfloat16"),
    (1, "grad", lambda t: torch.zeros(t.numel() + 1), r"`grad` has 34 elements, expected 33"),
    (2, "exp_avg", lambda t: torch.zeros(t.numel() - 1), r"`exp_avg` has 32 elements, expected 33"),
    (5, "param_lp", lambda t: torch.zeros(t.numel()), "`param_lp` must be float16/bfloat16"),
    (6, "step", lambda t: torch.tensor([1.0, 2.0]), r"`step` has 2 elements, expected 1"),
    (7, "lr", lambda t: torch.tensor([1e-2], dtype=torch.float64), "`lr` must be float32"),
])
def test_launcher_refuses_bad_arguments(index, name, bad, match):
    adam_step = _triton_launcher()
    args = _launcher_args(33)
    args[index] = bad(args[0])
    before = [a.clone() if a is not None else None for a in args]
    with pytest.raises(ValueError, match=match):
        adam_step(*args, **_LAUNCH_KW)
    for i, (a, b) in enumerate(zip(args, before)):
        if a is not None:
            assert_bitwise(a, b, f"argument {i} changed by a refused launch")


def test_launcher_amsgrad_needs_max_exp_avg_sq():
    adam_step = _triton_launcher()
    with pytest.raises(ValueError, match="amsgrad=True needs `max_exp_avg_sq`"):
        adam_step(*_launcher_args(8), **{**_LAUNCH_KW, "amsgrad": True})


@pytest.mark.parametrize("dtype, rtol, atol", FP32_TOL)
@pytest.mark.parametrize("n, block", [(1009, 64), (1, 16), (100, 128), (4096 + 3, 1024)])
def test_launcher_partial_last_block(monkeypatch, n, block, dtype, rtol, atol):
    # Several programs with a masked tail: sizes that are not a multiple of the block.
    adam_step = _triton_launcher()
    from zero_triton.kernels import adam as kadam
    monkeypatch.setattr(kadam, "_block_and_warps", lambda numel: (block, 4))
    args = _launcher_args(n)
    # A guard region past the end of each in-place target must stay untouched.
    guarded = [torch.full((n + 37,), 7.0) for _ in range(3)]
    for g, i in zip(guarded, (0, 2, 3)):
        g[:n].copy_(args[i])
        args[i] = g[:n]
    ref = [a.clone() for a in args[:4]]
    torch_adam_step_(ref[0], ref[1], ref[2], ref[3], None, 3, lr=1e-2, beta1=0.9, beta2=0.999,
                     eps=1e-8, weight_decay=0.01, adamw=True, amsgrad=False, maximize=False)
    adam_step(*args, **_LAUNCH_KW)
    for name, i in (("param", 0), ("exp_avg", 2), ("exp_avg_sq", 3)):
        assert_close(args[i], ref[i], rtol, atol, f"n={n}, block={block}: {name}")
    for g in guarded:
        assert (g[n:] == 7.0).all(), f"n={n}, block={block}: the kernel wrote past the end"


def test_launcher_offsets_are_64_bit():
    # A shard of more than 2**31 elements needs 2**31 * 28 bytes of buffers; too big
    # for a test. What can be checked here: the program offset is widened to int64
    # before it is multiplied by BLOCK (the multi-block path itself runs in
    # test_launcher_partial_last_block).
    import inspect
    from zero_triton.kernels import adam as kadam
    src = inspect.getsource(kadam._adam_kernel.fn)
    pid_line = next(line for line in src.splitlines() if "program_id" in line)
    assert "tl.int64" in pid_line, f"program id not widened to 64 bits: {pid_line.strip()}"
    offs_line = next(line for line in src.splitlines() if line.strip().startswith("offs ="))
    assert "pid" in offs_line


# -- CUDA --------------------------------------------------------------------------------------
@requires_cuda
@pytest.mark.parametrize("dtype, rtol, atol", FP32_TOL)
@pytest.mark.parametrize("wd", list(WD_MODES))
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float_lr", "tensor_lr"])
def test_cuda_triton_matches_torch_adam(dtype, rtol, atol, wd, amsgrad, tensor_lr):
    require_backend("triton", "cuda")
    device = "cuda"
    ours, theirs = twins(make_params(SHAPES, dtype, device))
    lr = (lambda v: torch.tensor(v, device=device)) if tensor_lr else float
    hp = dict(betas=(0.9, 0.99), eps=1e-8, amsgrad=amsgrad, maximize=False)
    groups = lambda ps: [{"params": ps[:2], "lr": lr(1e-2), **WD_MODES[wd]},  # noqa: E731
                         {"params": ps[2:], "lr": lr(3e-3), **WD_MODES[wd]}]
    opt = FusedAdam(groups(ours), backend="triton", **hp)
    topt = torch.optim.Adam(groups(theirs), foreach=False, **hp)
    for step in range(1, 23):
        feed(ours, theirs, step_grads(ours, step))
        opt.step()
        topt.step()
        compare_to_torch(opt, topt, ours, theirs, rtol, atol, f"cuda step {step}")


@requires_cuda
@pytest.mark.parametrize("dtype, rtol, atol", [
    pytest.param(torch.bfloat16, 2e-5, 1e-6, id="bf16"),
    pytest.param(torch.float16, 2e-5, 1e-6, id="fp16"),
])
def test_cuda_triton_low_precision_master(dtype, rtol, atol):
    require_backend("triton", "cuda")
    ours = [nn.Parameter(t) for t in make_params(SHAPES, dtype, "cuda")]
    opt = FusedAdam(ours, lr=1e-2, weight_decay=0.1, backend="triton")
    ref = [dict(p=p.detach().float().cpu(), m=torch.zeros(p.shape), v=torch.zeros(p.shape))
           for p in ours]
    for step in range(1, 21):
        grads = step_grads(ours, step)
        for p, g, r in zip(ours, grads, ref):
            with torch.no_grad():
                p.grad = g.to(p.dtype).clone()
            torch_adam_step_(r["p"], g.float().cpu(), r["m"], r["v"], None, step, lr=1e-2,
                             beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=False,
                             amsgrad=False, maximize=False)
        opt.step()
        for i, (p, r) in enumerate(zip(ours, ref)):
            s = opt.state[p]
            assert_close(s["master_param"], r["p"], rtol, atol, f"cuda step {step}, param {i}, master")
            assert_bitwise(p.detach(), rne_cast(s["master_param"], dtype),
                           f"cuda step {step}, param {i}, param != rne(master)")


@requires_cuda
@pytest.mark.parametrize("dtype, rtol, atol", FP32_TOL)
def test_cuda_grad_scaler_skips_inf(dtype, rtol, atol):
    require_backend("triton", "cuda")
    ours, theirs = twins(make_params(SHAPES, dtype, "cuda"))
    opt = FusedAdam(ours, lr=1e-2, backend="triton")
    topt = torch.optim.Adam(theirs, lr=1e-2, foreach=False)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10)
    tscaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10)
    for step in range(1, 7):
        grads = step_grads(ours, step)
        if step == 3:
            grads[2][5] = math.inf
        scale = float(scaler.scale(torch.ones((), device="cuda")))
        tscaler.scale(torch.ones((), device="cuda"))
        feed(ours, theirs, [g * scale for g in grads])
        before = _snapshot(opt, ours)
        scaler.step(opt)
        tscaler.step(topt)
        scaler.update()
        tscaler.update()
        if step == 3:
            for j, (a, b) in enumerate(zip(_snapshot(opt, ours), before)):
                assert_bitwise(a, b, f"cuda step 3 (inf): tensor {j} changed")
        compare_to_torch(opt, topt, ours, theirs, rtol, atol, f"cuda step {step}")


def test_interpreter_is_on_for_cpu_triton_tests():
    # conftest sets TRITON_INTERPRET=1 before zero_triton.kernels is imported; without
    # it every CPU triton test above would skip instead of run.
    if not interpreter_on():
        pytest.skip("TRITON_INTERPRET is set to something else by the caller")
    assert backends.why_not("triton", torch.device("cpu")) is None


@pytest.mark.parametrize("lp_dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_list_launcher_equals_one_launch_per_tensor(monkeypatch, lp_dtype, grad_dtype, amsgrad):
    """adam_step_list (the local shards of DTensor parameters, one launch) gives the
    bits adam_step gives tensor by tensor: several blocks per tensor, an empty tensor,
    a step count per tensor, GradScaler's scale and clipping, and nothing written past
    any tensor's end."""
    _triton_launcher()
    from zero_triton.kernels import adam as kadam
    monkeypatch.setattr(kadam, "_list_block", lambda numels: 16)
    sizes = [5, 100, 0, 33, 1]

    def make():
        g = torch.Generator().manual_seed(1)
        guarded = []

        def tensor(values):  # with 9 guard elements of 7.0 after it
            t = torch.full((values.numel() + 9,), 7.0, dtype=values.dtype)
            t[:values.numel()].copy_(values)
            guarded.append(t)
            return t[:values.numel()]
        out = {"params": [tensor(torch.randn(n, generator=g)) for n in sizes],
               "grads": [torch.randn(n, generator=g).to(grad_dtype) for n in sizes],
               "exp_avgs": [tensor(torch.randn(n, generator=g) * 0.1) for n in sizes],
               "exp_avg_sqs": [tensor(torch.rand(n, generator=g) * 0.1) for n in sizes],
               "max": [tensor(torch.rand(n, generator=g) * 0.2) for n in sizes] if amsgrad else None,
               "lp": [tensor(torch.randn(n, generator=g).to(lp_dtype)) for n in sizes] if lp_dtype else None,
               "steps": [torch.tensor([float(k + 2)]) for k in range(len(sizes))]}
        return out, guarded
    kw = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True, amsgrad=amsgrad,
              maximize=False, grad_scale=torch.tensor([2.0]), clip_coef=torch.tensor([0.5]),
              found_inf=torch.tensor([0.0]))
    lr = torch.tensor([1e-2])
    (one, _), (listed, guards) = make(), make()
    for i in range(len(sizes)):
        kadam.adam_step(one["params"][i], one["grads"][i], one["exp_avgs"][i], one["exp_avg_sqs"][i],
                        one["max"][i] if amsgrad else None, one["lp"][i] if lp_dtype else None,
                        one["steps"][i], lr, **kw)
    kadam.adam_step_list(listed["params"], listed["grads"], listed["exp_avgs"], listed["exp_avg_sqs"],
                         listed["max"], listed["lp"], listed["steps"], lr, **kw)
    for key in ("params", "exp_avgs", "exp_avg_sqs", "max", "lp"):
        if one[key] is not None:
            for i, (a, b) in enumerate(zip(one[key], listed[key])):
                assert_bitwise(b, a, f"{key}[{i}]")
    assert not torch.equal(listed["params"][1], make()[0]["params"][1]), "nothing was stepped"
    for t in guards:
        assert (t[-9:] == 7.0).all(), "the kernel wrote past a tensor's end"


def test_list_launcher_refuses_mixed_gradient_dtypes_and_short_lists():
    _triton_launcher()
    from zero_triton.kernels.adam import adam_step_list
    p = [torch.zeros(3), torch.zeros(4)]
    args = dict(exp_avgs=[torch.zeros(3), torch.zeros(4)], exp_avg_sqs=[torch.zeros(3), torch.zeros(4)],
                max_exp_avg_sqs=None, params_lp=None, steps=[torch.ones(1), torch.ones(1)],
                lr=torch.tensor([1e-3]))
    kw = {**_LAUNCH_KW}
    with pytest.raises(ValueError, match="several dtypes"):
        adam_step_list(p, [torch.zeros(3), torch.zeros(4).bfloat16()], **args, **kw)
    with pytest.raises(ValueError, match="one tensor per parameter"):
        adam_step_list(p, [torch.zeros(3)], **args, **kw)
    assert all((t == 0).all() for t in p)
