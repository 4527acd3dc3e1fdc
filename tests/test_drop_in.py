"""A drop-in by PyTorch's measure (docs/api.md, Features vs torch.optim.Adam): ``.grad`` is
torch's (None after ``zero_grad()`` and after a backward that did not reach the
parameter; ``zero_grad(set_to_none=False)`` keeps zero gradients, which are stepped),
checked against torch.optim.AdamW at world size 1 and ZeroAdamW on two gloo ranks; and
what users met besides: a resume with a scheduler, ``info --help``, channels_last
parameters, a compiled training step. torch's own optimizer tests: test_torch_optim_db.py.
"""
import pytest
import torch

from dist_utils import run_ranks
from zero_triton import FusedAdamW, ZeroAdamW
from zero_triton.native import backends

CPU_BACKEND = "cpu" if backends.why_not("cpu", torch.device("cpu")) is None else "torch"


class _Net(torch.nn.Module):
    """A trunk used every step and a side layer used on even steps only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        self.side = torch.nn.Linear(8, 4)

    def forward(self, x, use_side: bool):
        y = self.trunk(x)
        return y + self.side(x) if use_side else y


def _batch(step: int) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(100 + step))


def _grad_none(model) -> list:
    return [p.grad is None for p in model.parameters()]


def _run(model, opt, steps: int, set_to_none: bool, log: list | None = None):
    """Train with the side layer on even steps; log .grad None-ness at each point."""
    for step in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        if log is not None:
            log.append(("after zero_grad", step, _grad_none(model)))
        model(_batch(step), use_side=step % 2 == 0).pow(2).mean().backward()
        if log is not None:
            log.append(("after backward", step, _grad_none(model)))
        opt.step()
        if log is not None:
            log.append(("after step", step, _grad_none(model)))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_grad_is_none_exactly_where_torchs_is_and_the_steps_match(set_to_none):
    ours, theirs = _Net(), _Net()
    opt = FusedAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, backend=CPU_BACKEND)
    topt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    assert _grad_none(ours) == _grad_none(theirs) == [True] * 6, "a .grad before any backward"
    our_log, their_log = [], []
    _run(ours, opt, 6, set_to_none, our_log)
    _run(theirs, topt, 6, set_to_none, their_log)
    for a, b in zip(our_log, their_log):
        assert a == b, f"{a[0]} at step {a[1]}: .grad is None {a[2]}, torch {b[2]}"
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"{name} differs from torch")
    # The side layer got a zero gradient on odd steps with set_to_none=False: stepped.
    assert (opt.state[ours.side.weight]["step"].item()
            == topt.state[theirs.side.weight]["step"].item() == (6 if not set_to_none else 3))


def test_gradients_accumulate_over_micro_batches_from_none():
    ours, theirs = _Net(), _Net()
    opt = FusedAdamW(ours.parameters(), lr=1e-2, backend=CPU_BACKEND)
    topt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    for model, o in ((ours, opt), (theirs, topt)):
        for step in range(3):
            o.zero_grad()
            for micro in range(3):
                model(_batch(10 * step + micro), use_side=micro == 1).pow(2).mean().backward()
            o.step()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(p.grad, q.grad)


def test_a_gradient_set_by_hand_after_zero_grad_is_stepped():
    ours, theirs = _Net(), _Net()
    opt = FusedAdamW(ours.parameters(), lr=1e-2, backend=CPU_BACKEND)
    topt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    for model, o in ((ours, opt), (theirs, topt)):
        o.zero_grad()
        model.side.weight.grad = torch.ones_like(model.side.weight)  # nothing else has one
        o.step()
        assert [p.grad is None for p in model.parameters()] == [True] * 4 + [False, True]
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def _zero_job(rank, world, stage, set_to_none):
    """Every rank trains on the same batches, so the average is the local gradient and
    torch.optim.AdamW in this process is the reference."""
    ours, theirs = _Net(), _Net()
    opt = ZeroAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, stage=stage, bucket_cap_mb=0.0005,
                    backend=CPU_BACKEND)
    topt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    our_log, their_log = [], []
    _run(ours, opt, 6, set_to_none, our_log)
    _run(theirs, topt, 6, set_to_none, their_log)
    diff = max((p - q).abs().max().item() for p, q in zip(ours.parameters(), theirs.parameters()))
    return {"diff": diff, "ours": our_log, "torch": their_log}


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_steps_what_torch_steps(stage, set_to_none):
    for out in run_ranks(_zero_job, 2, stage, set_to_none, timeout=180):
        assert out["diff"] < 1e-5, f"ZeroAdamW stage {stage} differs from torch by {out['diff']}"
        if stage == 1:  # stage 2 hands every gradient to the optimizer: .grad is None after backward
            for a, b in zip(out["ours"], out["torch"]):
                assert a == b, f"{a[0]} at step {a[1]}: .grad is None {a[2]}, torch {b[2]}"


# -- frictions -----------------------------------------------------------------------------
def test_resume_with_a_scheduler_is_silent_and_a_changed_hyperparameter_is_named(tmp_path):
    import warnings

    from zero_triton import checkpoint
    model = _Net()
    opt = FusedAdamW(model.parameters(), lr=1e-2, backend=CPU_BACKEND)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=20)
    _run(model, opt, 3, True)
    for _ in range(3):
        sched.step()
    checkpoint.save(tmp_path / "ck", opt, model)
    resumed = _Net()
    opt2 = FusedAdamW(resumed.parameters(), lr=1e-2, backend=CPU_BACKEND)
    sched2 = torch.optim.lr_scheduler.OneCycleLR(opt2, max_lr=1e-2, total_steps=20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the normal resume: no warning
        checkpoint.load(tmp_path / "ck", opt2, resumed)
    sched2.load_state_dict(sched.state_dict())
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    opt3 = FusedAdamW(_Net().parameters(), lr=1e-2, weight_decay=0.5, backend=CPU_BACKEND)
    torch.optim.lr_scheduler.OneCycleLR(opt3, max_lr=1e-2, total_steps=20)
    with pytest.warns(UserWarning, match="weight_decay: 0.01 \\(was 0.5\\)"):
        checkpoint.load(tmp_path / "ck", opt3)


def test_info_help_prints_help():
    from dist_utils import run_python
    out = run_python(["-m", "zero_triton", "info", "--help"], timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("usage: python -m zero_triton info")
    assert "backend" not in out.stdout.split("\n", 3)[0], "info ran instead of printing its help"


# -- channels_last -------------------------------------------------------------------------
def _convnet():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))


def _conv_steps(model, opt, steps=3):
    x = torch.randn(2, 3, 10, 10, generator=torch.Generator().manual_seed(5))
    x = x.to(memory_format=torch.channels_last)
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("when", ["before", "after"])
def test_channels_last_is_kept_and_steps_as_torch(when):
    cl = torch.channels_last
    ours, theirs = _convnet(), _convnet().to(memory_format=cl)
    if when == "before":
        ours.to(memory_format=cl)
    opt = FusedAdamW(ours.parameters(), lr=1e-2, backend=CPU_BACKEND)
    if when == "after":
        ours.to(memory_format=cl)
    topt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    _conv_steps(ours, opt)
    _conv_steps(theirs, topt)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert p.stride() == q.stride(), f"{tuple(p.shape)}: strides {p.stride()}, torch's {q.stride()}"
        assert p.grad.stride() == p.stride() and opt.state[p]["exp_avg"].stride() == p.stride()
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], topt.state[q]["exp_avg_sq"])
    # torch's state dict (channels_last moments) loads into ours and back, value for value
    again = _convnet().to(memory_format=cl)
    opt2 = FusedAdamW(again.parameters(), lr=1e-2, backend=CPU_BACKEND)
    opt2.load_state_dict(topt.state_dict())
    for i, s in opt2.state_dict()["state"].items():
        assert torch.equal(s["exp_avg"], topt.state_dict()["state"][i]["exp_avg"])


def test_channels_last_checkpoints_resume_and_consolidate(tmp_path):
    from zero_triton import checkpoint
    cl = torch.channels_last
    model = _convnet().to(memory_format=cl)
    opt = FusedAdamW(model.parameters(), lr=1e-2, backend=CPU_BACKEND)
    _conv_steps(model, opt)
    checkpoint.save(tmp_path / "ck", opt, model)
    state, weights = checkpoint.consolidate(tmp_path / "ck")
    for i, p in enumerate(model.parameters()):
        assert torch.equal(state["state"][i]["exp_avg"], opt.state[p]["exp_avg"])
    for name, p in model.named_parameters():
        assert torch.equal(weights[name], p)
    resumed = _convnet().to(memory_format=cl)
    opt2 = FusedAdamW(resumed.parameters(), lr=1e-2, backend=CPU_BACKEND)
    checkpoint.load(tmp_path / "ck", opt2, resumed)
    _conv_steps(model, opt, 2)
    _conv_steps(resumed, opt2, 2)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    plain = _convnet()
    with pytest.raises(Exception, match="strides.*channels_last on one side only"):
        checkpoint.load(tmp_path / "ck", FusedAdamW(plain.parameters(), backend=CPU_BACKEND), plain)


# -- torch.compile ---------------------------------------------------------------------------
def test_a_compiled_training_step_names_no_extension_symbol_and_matches_eager():
    import warnings
    torch._dynamo.reset()
    ours, twin = _Net(), _Net()
    opt = FusedAdamW(ours.parameters(), lr=1e-2, backend=CPU_BACKEND)
    opt2 = FusedAdamW(twin.parameters(), lr=1e-2, backend=CPU_BACKEND)

    @torch.compile
    def train(x):
        ours(x, True).square().mean().backward()
        opt.step()
        opt.zero_grad()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            train(_batch(step))
            twin(_batch(step), True).square().mean().backward()
            opt2.step()
            opt2.zero_grad()
    # Dynamo's "does not know how to trace the builtin ..." naming our extension (torch
    # 2.7's inductor says the same of its own generated kernels: not ours, not counted).
    named = [str(w.message)[:200] for w in caught if "zero_triton" in str(w.message)]
    assert not named, named
    for p, q in zip(ours.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def _explained(make_opt, clip: bool):
    """torch._dynamo.explain of a compiled training step (forward, backward, clipping,
    step, zero_grad, a forward after the step) over ``make_opt``'s optimizer."""
    torch._dynamo.reset()
    model = _Net()
    opt = make_opt(model.parameters())

    def train(x):
        model(x, True).square().mean().backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return model(x, False).sum()

    for step in range(2):
        train(_batch(step))
    return torch._dynamo.explain(train)(_batch(2))


@pytest.mark.parametrize("clip", [False, True])
def test_a_compiled_training_step_breaks_where_torchs_fused_adam_breaks(clip):
    """torch.optim.AdamW(fused=True) runs its kernel outside the graph; ours runs its
    whole step so, and autograd's calls into our gradient hooks are not traced: the same
    graphs and breaks as torch's, and none inside zero_triton but the step's entry."""
    theirs = _explained(lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), clip)
    ours = _explained(lambda ps: FusedAdamW(ps, lr=1e-2, backend=CPU_BACKEND), clip)
    inside = [(r.reason[:80], r.user_stack[-1].filename, r.user_stack[-1].lineno)
              for r in ours.break_reasons if "zero_triton" in r.user_stack[-1].filename]
    # the one break of ours is the step's entry, where torch's wrapper has its own
    assert all("skipped" in reason and where.endswith("optim/fused.py") for reason, where, _ in inside), inside
    assert (ours.graph_count, ours.graph_break_count) == (theirs.graph_count, theirs.graph_break_count), (
        [r.reason[:80] for r in ours.break_reasons], [r.reason[:80] for r in theirs.break_reasons])


def test_torch_compile_of_opt_step_matches_eager():
    torch._dynamo.reset()
    ours, twin = _Net(), _Net()
    opt = FusedAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, backend=CPU_BACKEND)
    opt2 = FusedAdamW(twin.parameters(), lr=1e-2, weight_decay=0.1, backend=CPU_BACKEND)
    step = torch.compile(opt.step)
    for k in range(3):
        ours(_batch(k), k % 2 == 0).square().mean().backward()
        twin(_batch(k), k % 2 == 0).square().mean().backward()
        step()
        opt2.step()
        opt.zero_grad()
        opt2.zero_grad()
    for p, q in zip(ours.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def _op_args(n, amsgrad=False, lp=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g), torch.randn(n, generator=g), torch.zeros(n), torch.zeros(n),
            torch.zeros(n) if amsgrad else None, torch.empty(n, dtype=lp) if lp else None,
            torch.ones(1), torch.full((1,), 1e-2)]


@pytest.mark.parametrize("amsgrad,lp", [(False, None), (True, torch.bfloat16)])
def test_the_step_operator_traces_fullgraph_and_matches_torchs_adamw(amsgrad, lp):
    """torch.ops.zero_triton.adam_step_: torch's operator checks (schema, fake tensor,
    AOT dispatch), one step equal to torch.optim.AdamW's, and a fullgraph-compiled
    function around it giving eager's bits."""
    import zero_triton.native.ops  # noqa: F401  registers the operator
    op = torch.ops.zero_triton.adam_step_
    hyper = (0.9, 0.999, 1e-8, 0.1, True, amsgrad, False)
    for backend in {CPU_BACKEND, "torch"}:
        checks = torch.library.opcheck(op, (*_op_args(64, amsgrad, lp), *hyper),
                                       {"clip_coef": torch.full((1,), 0.5), "backend": backend})
        assert set(checks.values()) == {"SUCCESS"}, checks
    eager = _op_args(257, amsgrad, lp)
    p0, g0 = eager[0].clone(), eager[1].clone()
    op(*eager, *hyper, backend=CPU_BACKEND)
    ref = torch.nn.Parameter(p0)
    ref.grad = g0
    torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, foreach=False).step()
    torch.testing.assert_close(eager[0], ref.detach(), rtol=1e-6, atol=1e-7)

    @torch.compile(fullgraph=True)
    def traced(param, grad, m, v, vmax, low, step, lr):
        step.add_(1)
        op(param, grad * 2, m, v, vmax, low, step, lr, *hyper, backend=CPU_BACKEND)
        return param.sum()

    torch._dynamo.reset()
    compiled = _op_args(257, amsgrad, lp)
    compiled[1].div_(2)
    compiled[6].zero_()
    traced(*compiled)
    for k in (0, 2, 3, 4, 5, 6):  # what the step writes, and the step count
        if eager[k] is not None:
            assert torch.equal(eager[k], compiled[k]), k
    with pytest.raises(ValueError, match="`exp_avg` has 3 elements, `param` 257"):
        op(*eager[:2], torch.zeros(3), *eager[3:], *hyper)


def _compiled_zero_job(rank, world_size):
    """Per stage: the largest difference from eager of the compiled step, without and with
    overlap()."""
    from zero_triton import overlap
    return {stage: _compiled_zero_stage(rank, stage, overlap) for stage in (1, 2)}


def _compiled_zero_stage(rank, stage, overlap):
    out = []
    for compiled, overlapped in ((False, False), (True, False), (True, True)):
        torch._dynamo.reset()
        model = _Net()
        opt = ZeroAdamW(model.parameters(), lr=1e-2, stage=stage, bucket_cap_mb=0.0005,
                        backend=CPU_BACKEND)
        if overlapped:
            overlap(model, opt)

        def train(x, k):
            model(x, k % 2 == 0).square().mean().backward()
            opt.step()
            opt.zero_grad()

        run = torch.compile(train) if compiled else train
        for k in range(4):
            run(_batch(10 * rank + k), k)
        opt.wait_params()
        out.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    return [float((o - out[0]).abs().max()) for o in out[1:]]


def test_a_compiled_training_step_with_zero_adamw_matches_eager():
    """Backward's bucket hooks and overlap()'s forward waits run as they are inside a
    compiled step: the parameters end where eager's do (to the compiled forward's
    rounding), with and without overlap(), at stage 1 and 2 (one start of the ranks)."""
    for rank, by_stage in enumerate(run_ranks(_compiled_zero_job, 2, timeout=400)):
        for stage, diffs in by_stage.items():
            assert max(diffs) < 1e-6, (rank, stage, diffs)
