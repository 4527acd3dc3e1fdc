"""torch.amp.GradScaler with FusedAdam: an inf step skipped and then torch's
trajectory, the attributes it reads on low-precision parameters, bf16 autocast."""
import copy
import math

import pytest
import torch
from torch import nn

from zero_triton import FusedAdam
from zero_triton.reference import rne_cast, torch_adam_step_

from adam_cases import (assert_bitwise, assert_close, compare_to_torch, feed, FP32_ROWS, LP_ROWS,
                        make_params, require_backend, SHAPES, snapshot, step_grads, twins)


# -- GradScaler ----------------------------------------------------------------------------


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
        before = snapshot(opt, ours)
        scaler.step(opt)
        tscaler.step(topt)
        scaler.update()
        tscaler.update()
        if step in inf_steps:
            after = snapshot(opt, ours)
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
        before = snapshot(opt, ours)
        opt.step()
        del opt.grad_scale, opt.found_inf
        if skip:
            for j, (a, b) in enumerate(zip(snapshot(opt, ours), before)):
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
        before = snapshot(opt, list(model.parameters()))
        scaler.step(opt)
        tscaler.step(topt)
        scaler.update()
        tscaler.update()
        if step == 2:
            for j, (a, b) in enumerate(zip(snapshot(opt, list(model.parameters())), before)):
                assert_bitwise(a, b, f"{backend} step 2 (inf): tensor {j} changed")
        compare_to_torch(opt, topt, list(model.parameters()), list(tmodel.parameters()),
                         rtol, atol, f"{backend} step {step}")
