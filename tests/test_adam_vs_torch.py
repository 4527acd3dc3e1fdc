"""FusedAdam / FusedAdamW against torch.optim.Adam / AdamW, every backend usable here
("torch"; "triton" under the interpreter on CPU tensors, conftest sets
TRITON_INTERPRET=1; "cpu" when the native extension loads): fp32, schedules,
closures, param groups, names and frozen parameters, fp16/bf16 with an fp32 master,
clip_grad_norm_.
Each test feeds identical gradients to both optimizers, so any difference is the
optimizer's own; tensors stay small (one interpreted program per step)."""
import copy
import math

import pytest
import torch
from torch import nn

from zero_triton import FusedAdam, FusedAdamW
from zero_triton.reference import rne_cast, torch_adam_step_

from adam_cases import (assert_bitwise, assert_close, compare_to_torch, feed, FP32_ROWS, FP32_TOL,
                        inside, LP_ROWS, make_params, require_backend, SHAPES, step_grads, twins,
                        WD_MODES)


# -- fp32 vs torch.optim ----------------------------------------------------------------
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
    for i, (p, flat) in enumerate(zip(ours, [opt._shards.groups[0][0]] * 2 + [opt._shards.groups[1][0]] * 2)):
        assert inside(p.grad, flat.flat_grad), f"param {i}: .grad stopped being a view of the flat buffer"


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
    assert not any(inside(frozen, f.flat_param) for fl in opt._shards.groups for f in fl), \
        "a frozen parameter was moved into a flat buffer"


# -- fp16 / bf16 with fp32 master -----------------------------------------------------------
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
