"""FusedAdam / FusedAdamW held to PyTorch's own optimizer tests.

torch ships its optimizer test data in the wheel: ``optim_db`` in
``torch.testing._internal.common_optimizers`` holds, for Adam and AdamW, every constructor
configuration torch tests (with its ``differentiable`` and ``fused`` variants on CPU) and
every error input with the exception type and message regex. Each configuration here runs
against torch's own class over several steps (parameters and state compared, as torch's
``_compare_between`` does), each error input must raise what torch raises, and the
behaviours of torch's ``TestOptimRenewed`` that a drop-in must share (complex and float64
parameters, hooks, state dicts, named parameters, deepcopy, schedulers, tensor lr) run
on the installed torch's data. Named differences (docs/api.md, Features vs torch.optim.Adam)
are the only exceptions, each marked where it applies.
"""
import copy
import functools
import io

import pytest
import torch
from torch.nn import Parameter

from zero_triton import FusedAdam, FusedAdamW

co = pytest.importorskip("torch.testing._internal.common_optimizers",
                         reason="torch's optimizer test data needs expecttest (pip install expecttest)")

OURS = {torch.optim.Adam: FusedAdam, torch.optim.AdamW: FusedAdamW}
INFOS = [pytest.param(info, id=info.optim_cls.__name__) for info in co.optim_db
         if info.optim_cls in OURS]


def _inputs(info, dtype=torch.float32, skip=()):
    """torch's configurations, with the global flags it adds on CPU (differentiable, fused)."""
    return co._get_optim_inputs_including_global_cliquey_kwargs("cpu", dtype, info, skip=skip)


def _model(dtype):
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1),
                               torch.nn.Sigmoid()).to(dtype)


def _tolerance(dtype):
    return {torch.float64: dict(rtol=1e-12, atol=1e-14)}.get(dtype, dict(rtol=2e-5, atol=2e-6))


def _run_seven(make, kwargs, dtype):
    """torch's _compare_between: 7 steps, a layer frozen at step 3 and back at 5, no
    backward at step 2 (a no-op step), a 0-dim parameter with a gradient set by hand."""
    model = _model(dtype)
    empty = torch.full((), 0.25, dtype=dtype, requires_grad=True)  # torch's test: a 0-dim last one
    empty.grad = torch.full_like(empty, 0.5)
    params = list(model.parameters()) + [empty]
    opt = make(params, **kwargs)
    x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=dtype).reshape(3, 2)
    history = []
    for i in range(7):
        opt.zero_grad()
        if i == 3:
            model[2].requires_grad_(False)
        if i == 5:
            model[2].requires_grad_(True)
        if i != 2:
            model(x).sum().backward()
        opt.step()
        history.append(([p.detach().clone() for p in params],
                        [{k: v.detach().clone() for k, v in opt.state[p].items()} for p in params]))
    return history


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("info", INFOS)
def test_every_torch_configuration_steps_as_torch(info, dtype):
    for oi in _inputs(info, dtype, skip=("differentiable",)):  # torch's refuses leaf parameters
        ours = _run_seven(OURS[info.optim_cls], oi.kwargs, dtype)
        theirs = _run_seven(info.optim_cls, oi.kwargs, dtype)
        tol = _tolerance(dtype)
        for step, ((p_ours, s_ours), (p_theirs, s_theirs)) in enumerate(zip(ours, theirs)):
            where = f"{oi.desc}, step {step}"
            for i, (a, b) in enumerate(zip(p_ours, p_theirs)):
                torch.testing.assert_close(a, b, **tol, msg=f"{where}: parameter {i}")
            for i, (a, b) in enumerate(zip(s_ours, s_theirs)):
                assert set(b) <= set(a), f"{where}: parameter {i} state keys {set(a)} lack {set(b) - set(a)}"
                for k in b:
                    torch.testing.assert_close(a[k].reshape(b[k].shape), b[k], **tol,
                                               msg=f"{where}: state {k} of parameter {i}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("info", INFOS)
def test_fused_matches_forloop_in_low_precision(info, dtype):
    # torch compares its fused step to its for-loop one; ours is one step either way (an fp32
    # master for bf16/fp16: torch keeps none, so the values are compared among ours).
    for oi in info.optim_inputs_func(device="cpu", dtype=dtype):
        a = _run_seven(OURS[info.optim_cls], {**oi.kwargs, "fused": False}, dtype)
        b = _run_seven(OURS[info.optim_cls], {**oi.kwargs, "fused": True}, dtype)
        for (pa, sa), (pb, sb) in zip(a, b):
            for x, y in zip(pa, pb):
                assert torch.equal(x, y), oi.desc
            for x, y in zip(sa, sb):
                assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), oi.desc


@pytest.mark.parametrize("info", INFOS)
def test_every_torch_error_input_raises_what_torch_raises(info):
    cls = OURS[info.optim_cls]
    for err in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
        oi = err.optimizer_error_input
        if err.error_on == co.OptimizerErrorEnum.CONSTRUCTION_ERROR:
            if issubclass(err.error_type, Warning):
                with pytest.warns(err.error_type, match=err.error_regex):
                    cls(oi.params, **oi.kwargs)
            else:
                with pytest.raises(err.error_type, match=err.error_regex):
                    cls(oi.params, **oi.kwargs)
        else:
            opt = cls(oi.params, **oi.kwargs)
            with pytest.raises(err.error_type, match=err.error_regex):
                opt.step()


@pytest.mark.parametrize("info", INFOS)
def test_complex_parameters_step_as_their_real_views(info):
    # torch's test_complex: complex parameters (and a real one beside them) step exactly as
    # their view_as_real twins, every intermediate step included.
    cls = OURS[info.optim_cls]
    for oi in _inputs(info, torch.complex64, skip=("differentiable", "fused")):
        torch.manual_seed(0)
        cplx = [torch.randn(10, 5, dtype=torch.complex64, requires_grad=True),
                torch.randn(10, dtype=torch.complex64, requires_grad=True),
                torch.randn(10, 5, requires_grad=True)]
        real = [(torch.view_as_real(p) if p.is_complex() else p).detach().clone().requires_grad_()
                for p in cplx]
        opt_c, opt_r = cls(cplx, **oi.kwargs), cls(real, **oi.kwargs)
        for _ in range(3):
            for p, q in zip(cplx, real):
                g = torch.randn_like(q)
                q.grad = g
                p.grad = torch.view_as_complex(g.clone()) if p.is_complex() else g.clone()
            opt_c.step()
            opt_r.step()
            for p, q in zip(cplx, real):
                assert torch.equal(torch.view_as_real(p) if p.is_complex() else p, q), oi.desc
        assert opt_c.state[cplx[0]]["exp_avg"].dtype == torch.complex64


def test_complex_2d_matches_real_and_imaginary_parts():
    # torch's test_complex_2d: one complex parameter against its real and imaginary parts.
    def rosenbrock(t):
        x, y = t
        return (1 - x) ** 2 + 100 * (y - x ** 2) ** 2
    torch.manual_seed(2024)
    a1 = torch.randn(2, dtype=torch.complex64, requires_grad=True)
    re, im = a1.real.detach().clone().requires_grad_(), a1.imag.detach().clone().requires_grad_()
    o1, o2 = FusedAdam([a1], lr=1e-2), FusedAdam([re, im], lr=1e-2)
    for _ in range(5):
        o1.zero_grad()
        o2.zero_grad()
        rosenbrock(a1).abs().backward()
        rosenbrock(torch.complex(re, im)).abs().backward()
        torch.testing.assert_close(a1.grad.real, re.grad)
        o1.step()
        o2.step()
        torch.testing.assert_close(a1.real, re)
        torch.testing.assert_close(a1.imag, im)


@pytest.mark.parametrize("info", INFOS)
def test_state_dict_and_load_hooks_run_as_torchs(info):
    cls = OURS[info.optim_cls]

    def pre(opt):
        opt.state["test"] = 1

    def post(opt, sd):
        sd["ran_pre"] = sd["state"].pop("test", None) == 1
        return sd

    def load_pre(opt, sd):
        sd = copy.deepcopy(sd)
        sd["param_groups"][0]["lr"] = 0.003
        return sd

    def load_post(opt):
        opt.state["ran_load_post"] = opt.param_groups[0]["lr"] == 0.003

    for oi in _inputs(info):
        param = torch.rand(2, 3, requires_grad=True)
        opt = cls([param], **oi.kwargs)
        opt.register_state_dict_pre_hook(pre)
        assert opt.state_dict()["state"]["test"] == 1, oi.desc  # extra keys are kept
        opt.register_state_dict_post_hook(post)
        sd = opt.state_dict()
        assert sd["ran_pre"] and "test" not in sd["state"], oi.desc
        opt.register_load_state_dict_pre_hook(load_pre)
        opt.register_load_state_dict_post_hook(load_post)
        opt.load_state_dict(sd)
        assert opt.param_groups[0]["lr"] == 0.003 and opt.state["ran_load_post"], oi.desc


@pytest.mark.parametrize("info", INFOS)
def test_step_hooks_local_and_global_run_in_torchs_order(info):
    cls = OURS[info.optim_cls]
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    for oi in _inputs(info):
        params = [torch.tensor([1.0, 1.0])]
        opt, sgd = cls(params, **oi.kwargs), torch.optim.SGD(params)
        data = []
        handles = [register_optimizer_step_pre_hook(lambda *a: data.append(0)),
                   register_optimizer_step_post_hook(lambda *a: data.append(5))]
        for o in (opt, sgd):
            handles += [o.register_step_pre_hook(lambda *a: data.append(1)),
                        o.register_step_post_hook(lambda *a: data.append(2))]
        opt.step()
        sgd.step()
        opt.step()
        for h in handles:
            h.remove()
        opt.step()
        assert data == [0, 1, 2, 5] * 3, oi.desc


def _fwd_bwd(opt, w, b, x):
    opt.zero_grad()
    loss = (w.mv(x) + b).pow(2).sum()
    loss.backward()
    return loss


@pytest.mark.parametrize("named", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["plain", "named-to-plain", "plain-to-named", "named"])
@pytest.mark.parametrize("info", INFOS)
def test_state_dict_is_deterministic_and_repeated_groups_are_numbered_as_torch(info, named):
    cls = OURS[info.optim_cls]
    for oi in _inputs(info, skip=("differentiable",)):
        torch.manual_seed(0)
        w, b = Parameter(torch.randn(2, 3)), Parameter(torch.randn(2))
        x = torch.randn(3)

        def given(ps, is_named):
            return [(f"name{i}", p) for i, p in enumerate(ps)] if is_named else ps
        opt = cls(given([w, b], named[0]), **oi.kwargs)
        for _ in range(5):
            _fwd_bwd(opt, w, b, x)
            opt.step()
        with torch.no_grad():
            wc, bc = Parameter(w.clone()), Parameter(b.clone())
        opt_c = cls(given([wc, bc], named[1]), **oi.kwargs)
        opt_c.load_state_dict(copy.deepcopy(opt.state_dict()))
        for _ in range(5):
            _fwd_bwd(opt, w, b, x)
            _fwd_bwd(opt_c, wc, bc, x)
            opt.step()
            opt_c.step()
            assert torch.equal(w, wc) and torch.equal(b, bc), oi.desc

        def unnamed(sd):
            sd = copy.deepcopy(sd)
            for g in sd["param_groups"]:
                g.pop("param_names", None)
            return sd
        torch.testing.assert_close(unnamed(opt.state_dict()), unnamed(opt_c.state_dict()))
        if named[0] or named[1]:
            assert opt_c.state_dict()["param_groups"][0]["param_names"] == ["name0", "name1"]
        opt_c.param_groups.extend(opt_c.param_groups)  # repeated groups: torch issue #36831
        assert (unnamed(opt.state_dict())["param_groups"][-1]
                == unnamed(opt_c.state_dict())["param_groups"][-1]), oi.desc


@pytest.mark.parametrize("info", INFOS)
def test_older_and_nontensor_step_state_dicts_load(info):
    cls = OURS[info.optim_cls]
    for oi in _inputs(info, skip=("differentiable",)):
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Conv2d(4, 2, 1, stride=2), torch.nn.BatchNorm2d(2))
        x = torch.rand(1, 4, 16, 16)
        opt = cls(model.parameters(), **oi.kwargs)
        for _ in range(3):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        old = copy.deepcopy(opt.state_dict())
        for g in old["param_groups"]:
            for flag in info.not_og_supported_flags:
                g.pop(flag, None)
        for s in old["state"].values():
            s["step"] = s["step"].item()
        opt.load_state_dict(old)
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        buf = io.BytesIO()
        sd = opt.state_dict()
        torch.save(sd, buf)
        buf.seek(0)
        torch.testing.assert_close(torch.load(buf, weights_only=True), sd)


@pytest.mark.parametrize("info", INFOS)
def test_deepcopy_printing_and_state_as_torchs(info):
    cls = OURS[info.optim_cls]
    for oi in _inputs(info, skip=("differentiable",)):  # torch's refuses leaf parameters
        params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
        for p in params:
            p.grad = torch.rand_like(p)
        opt = cls(params, **oi.kwargs)
        repr(opt)
        for _ in range(3):
            opt.step()
        public = {k for k in opt.__dict__ if not k.startswith("_")}
        assert public == {k for k in copy.deepcopy(opt).__dict__ if not k.startswith("_")}, oi.desc
        assert all(len(s) > 0 for s in opt.state.values()), oi.desc


@pytest.mark.parametrize("info", INFOS)
def test_steps_without_gradients_or_with_zero_ones_leave_parameters_alone(info):
    cls = OURS[info.optim_cls]
    for oi in _inputs(info):
        kwargs = dict(oi.kwargs)
        frozen = [torch.randn(2, 3) for _ in range(2)]  # requires_grad=False
        cls(frozen, **kwargs).step(lambda: torch.tensor([1.0]))
        if kwargs.get("weight_decay", 0) != 0:
            continue
        if info.optim_cls is torch.optim.AdamW:
            kwargs["lr"] = 1e-5
        param = torch.randn(5, 1, requires_grad=True)
        before = param.detach().clone()
        params = [param.clone()] if kwargs.get("differentiable") else [param]
        opt = cls(params, **kwargs)
        params[0].grad = torch.zeros_like(params[0])
        opt.step(lambda: torch.tensor([1.0]))
        torch.testing.assert_close(params[0].detach(), before, msg=oi.desc)  # AdamW decays by 1e-7


@pytest.mark.parametrize("info", INFOS)
def test_schedulers_tensor_lr_and_param_groups_go_the_right_way(info):
    cls = OURS[info.optim_cls]
    for schedulers in info.scheduler_inputs:
        for oi in info.optim_inputs_func(device="cpu"):
            torch.manual_seed(0)
            w, b = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10))
            x = torch.randn(5)
            opt = cls([w, b], **oi.kwargs)
            scheds = [s(opt) for s in schedulers]
            first = _fwd_bwd(opt, w, b, x).item()
            for _ in range(20):
                loss = _fwd_bwd(opt, w, b, x)
                opt.step()
                for s in scheds:
                    s.step(loss) if isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau) else s.step()
            last = _fwd_bwd(opt, w, b, x).item()
            assert (last > first) if oi.kwargs.get("maximize") else (last < first), oi.desc
    for oi in _inputs(info, skip=("differentiable",)):
        torch.manual_seed(0)
        w, b = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10))
        wt, bt = Parameter(w.detach().clone()), Parameter(b.detach().clone())
        x = torch.randn(5)
        kwargs = {**oi.kwargs, "lr": 1e-3}
        ref = cls([w, b], **kwargs)
        opt = cls([wt, bt], **{**kwargs, "lr": torch.tensor(1e-3)})
        for _ in range(5):
            for o, (p, q) in ((ref, (w, b)), (opt, (wt, bt))):
                _fwd_bwd(o, p, q, x)
                o.step()
            torch.testing.assert_close(w, wt)
        irrelevant = Parameter(torch.randn(2))
        kept = irrelevant.detach().clone()
        opt = cls([{"params": [w, b], **oi.kwargs, "lr": 1e-3}, {"params": [irrelevant]}], lr=1e-28)
        for _ in range(5):
            _fwd_bwd(opt, w, b, x)
            irrelevant.grad = torch.rand_like(irrelevant)
            opt.step()
        assert torch.equal(irrelevant, kept), oi.desc


def test_differentiable_step_is_torchs_graph():
    # torch's TestDifferentiableOptimizer: gradcheck through one step from given state.
    def step_fn(p, grad, m, v, cls, kwargs):
        p = p.clone()
        p.grad = grad
        opt = cls([p], differentiable=True, **kwargs)
        opt.state[p].update({"step": torch.tensor(10.0), "exp_avg": m.clone(), "exp_avg_sq": v.clone()})
        opt.step()
        return (p,) + tuple(t for t in opt.state[p].values()
                            if isinstance(t, torch.Tensor) and t.requires_grad)
    for cls, tcls in ((FusedAdam, torch.optim.Adam), (FusedAdamW, torch.optim.AdamW)):
        for kwargs in (dict(lr=0.9, weight_decay=0.1), dict(lr=0.9, amsgrad=True, maximize=True)):
            args = [torch.rand(10, dtype=torch.float64, requires_grad=True) for _ in range(4)]
            if kwargs.get("amsgrad"):
                kwargs = {k: v for k, v in kwargs.items() if k != "amsgrad"}
            assert torch.autograd.gradcheck(functools.partial(_call, step_fn, cls, kwargs), tuple(args))
            ours = step_fn(*args, cls, kwargs)
            theirs = step_fn(*args, tcls, kwargs)
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def _call(fn, cls, kwargs, *args):
    return fn(*args, cls, kwargs)


def test_differentiable_is_a_class_of_its_own_checked_as_fused_adam():
    """``FusedAdam(differentiable=True)`` is a ``DifferentiableAdam``: FusedAdamW's
    defaults (weight decay 1e-2, decoupled), FusedAdam's checks and messages, torch's
    face and nothing of the fused one; GradScaler unscales its gradients as torch's
    AdamW(differentiable=True)'s, to the same bits."""
    import inspect

    from zero_triton.optim.differentiable import DifferentiableAdam
    for ours, theirs in ((FusedAdam, torch.optim.Adam), (FusedAdamW, torch.optim.AdamW)):
        # the class's signature is its constructor's (as torch's is), not the dispatch's
        sig, torch_sig = inspect.signature(ours).parameters, inspect.signature(theirs).parameters
        assert set(torch_sig) <= set(sig) or "kwargs" in sig, (ours, set(torch_sig) - set(sig))
        assert sig["weight_decay"].default == torch_sig["weight_decay"].default, ours
    p = torch.rand(4, requires_grad=True).clone()
    opt = FusedAdamW([p], lr=0.1, differentiable=True)
    assert type(opt) is DifferentiableAdam and isinstance(opt, torch.optim.Optimizer)
    assert opt.defaults["weight_decay"] == 1e-2 and opt.defaults["decoupled_weight_decay"]
    assert not hasattr(opt, "clip_grad_norm_") and not hasattr(opt, "memory_report")
    with pytest.raises(ValueError, match="Invalid learning rate"):
        FusedAdam([p], lr=-1.0, differentiable=True)
    with pytest.raises(ValueError, match="moments='int8' cannot be used with differentiable=True"):
        FusedAdam([p], moments="int8", differentiable=True)
    with pytest.raises(TypeError, match=r"FusedAdamW.__init__\(\) got an unexpected keyword argument 'bogus'"):
        FusedAdamW([p], differentiable=True, bogus=1)
    with pytest.raises(ValueError, match="compact=True"):
        opt.state_dict(compact=True)
    results = []
    for cls in (FusedAdamW, torch.optim.AdamW):
        w = torch.linspace(-1, 1, 8, dtype=torch.float64, requires_grad=True)
        q = w.clone()
        o = cls([q], lr=0.1, differentiable=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        for k in range(4):  # the third step's gradients overflow: skipped by both
            q.grad = scaler.scale(torch.full((8,), float("inf") if k == 2 else 0.5 + k,
                                             dtype=torch.float64))
            scaler.step(o)
            scaler.update()
        results.append((q.detach(), scaler.get_scale()))
    assert results[0][1] == 2.0 ** 7  # the skipped step halved the scale
    assert torch.equal(results[0][0], results[1][0]) and results[0][1] == results[1][1]
    assert not torch.equal(results[0][0], torch.linspace(-1, 1, 8, dtype=torch.float64))


def test_fused_on_meta_parameters_raises_torchs_error_at_step():
    # Built over a model on the meta device, the optimizer refuses a step with gradients
    # with torch's message; after zero_grad its (meta) parameters have none and a step is
    # a no-op, as torch's. to_empty() makes new Parameter objects: build the optimizer then.
    with torch.device("meta"):
        model = _model(torch.float32)
    opt = FusedAdamW(model.parameters(), fused=True)
    with torch.device("meta"):
        for p in model.parameters():
            p.grad = torch.rand_like(p)
    with pytest.raises(RuntimeError, match="`fused=True` requires all the params to be floating point "
                                           "Tensors.*meta device.*to_empty"):
        opt.step()
    opt.zero_grad(set_to_none=True)
    model.to_empty(device="cpu")
    for p in model.parameters():
        p.grad = torch.rand_like(p)
    opt.step()
    opt = FusedAdamW(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))


def _zero_error_inputs(rank, world_size):
    """Every torch error input against ZeroAdam/ZeroAdamW on this rank: the mismatches."""
    import re
    import warnings

    from zero_triton import ZeroAdam, ZeroAdamW
    zero = {torch.optim.Adam: ZeroAdam, torch.optim.AdamW: ZeroAdamW}
    wrong = []
    for info in co.optim_db:
        if info.optim_cls not in zero:
            continue
        cls = zero[info.optim_cls]
        for err in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
            oi = err.optimizer_error_input
            try:
                with warnings.catch_warnings():  # a warning torch expects counts as raised
                    if issubclass(err.error_type, Warning):
                        warnings.simplefilter("error", err.error_type)
                    opt = cls(oi.params, **oi.kwargs)
                    if err.error_on == co.OptimizerErrorEnum.STEP_ERROR:
                        opt.step()
                got = "no error"
            except Exception as exc:  # noqa: BLE001 - the type is what is compared
                got = f"{type(exc).__name__}: {exc}"
            if not (got.startswith(err.error_type.__name__ + ":") and re.search(err.error_regex, got)):
                wrong.append(f"{cls.__name__}, {oi.desc}: wanted {err.error_type.__name__} "
                             f"/{err.error_regex}/, got {got[:160]}")
    return wrong


def test_zero_adam_raises_what_torch_raises_on_each_rank_before_any_collective():
    """torch's error inputs against ZeroAdam(W) on 2 ranks: torch's exception types and
    messages, in torch's order (the hyperparameters before the parameters: it read
    params=None first, and iterated one tensor's rows), each rank failing alone before
    the constructor's first collective (no hang)."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from dist_utils import run_ranks
    for rank, wrong in enumerate(run_ranks(_zero_error_inputs, 2, timeout=120)):
        assert wrong == [], (rank, wrong)
