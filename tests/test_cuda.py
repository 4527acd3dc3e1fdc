"""The Triton kernel on an NVIDIA GPU against torch.optim.Adam: fp32, fp16/bf16 with
an fp32 master, GradScaler. Skipped without a GPU."""
import math

import pytest
import torch
from torch import nn

from conftest import requires_cuda
from zero_triton import FusedAdam
from zero_triton.reference import rne_cast, torch_adam_step_

from adam_cases import (assert_bitwise, assert_close, compare_to_torch, feed, FP32_TOL,
                        make_params, require_backend, SHAPES, snapshot, step_grads, twins, WD_MODES)


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
        before = snapshot(opt, ours)
        scaler.step(opt)
        tscaler.step(topt)
        scaler.update()
        tscaler.update()
        if step == 3:
            for j, (a, b) in enumerate(zip(snapshot(opt, ours), before)):
                assert_bitwise(a, b, f"cuda step 3 (inf): tensor {j} changed")
        compare_to_torch(opt, topt, ours, theirs, rtol, atol, f"cuda step {step}")
