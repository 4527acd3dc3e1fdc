"""Gradient release (FusedAdam(grad_release=True), zero_triton.optim.release): each
parameter stepped in backward as its gradient is made, the gradient freed; the bits of
the plain step, gradient accumulation through no_sync(), and the refusals of what
needs every gradient first."""
import copy

import pytest
import torch

import zero_triton as zt
from conftest import interpreter_on

FORMATS = [  # (parameter dtype, keywords)
    (torch.float32, {}),
    (torch.bfloat16, {}),
    (torch.bfloat16, {"master_weights": "remainder8", "moments": "int8"}),
    (torch.bfloat16, {"master_weights": "stochastic", "moments": "bf16"}),
    (torch.float32, {"amsgrad": True, "weight_decay": 0.1}),
]


class Net(torch.nn.Module):
    """Two layers, a parameter backward reaches only on odd steps, a tied one used twice,
    an empty one and a complex one (float32 only)."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 16)
        self.sometimes = torch.nn.Parameter(torch.randn(16))
        self.empty = torch.nn.Parameter(torch.zeros(0))
        self.to(dtype)
        self.complex = torch.nn.Parameter(torch.randn(16, dtype=torch.complex64)) \
            if dtype == torch.float32 else None

    def forward(self, x, t):
        y = self.b(torch.nn.functional.gelu(self.a(x)))
        y = y + self.b.bias  # a parameter reached twice: one final gradient
        if t % 2:
            y = y * self.sometimes
        if self.complex is not None:
            y = y + (self.complex * self.complex.conj()).real
        return y.float().pow(2).mean() + self.empty.sum()


def _train(opt, model, steps, micro, dtype, *, seen=None):
    for t in range(steps):
        for k in range(micro):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * t + k)).to(dtype)
            last = k == micro - 1
            with (opt.no_sync() if not last else torch.enable_grad()):
                model(x, t).backward()
            if seen is not None:
                seen.append(sum(p.grad is not None for p in model.parameters()))
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("dtype,kw", FORMATS, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_release_is_the_plain_step_bit_for_bit(dtype, kw, backend):
    """Micro-batches accumulated, then released in the last backward: parameters and
    every state tensor equal the plain step's, and backward left no gradient."""
    plain, released = Net(dtype), Net(dtype)
    a = zt.FusedAdamW(plain.parameters(), lr=1e-2, backend=backend, **kw)
    b = zt.FusedAdamW(released.parameters(), lr=1e-2, backend=backend, grad_release=True, **kw)
    _train(a, plain, 3, 2, dtype)
    seen = []
    _train(b, released, 3, 2, dtype, seen=seen)
    assert seen[1::2] == [0, 0, 0]  # every gradient freed by the last backward
    assert seen[0::2] == [sum(1 for p in released.parameters() if p.requires_grad) - (t % 2 == 0)
                          for t in range(3)]  # kept while accumulating
    for p, q in zip(plain.parameters(), released.parameters()):
        assert torch.equal(p, q)
    sa, sb = a.state_dict(), b.state_dict()
    for i in sa["state"]:
        for key, value in sa["state"][i].items():
            assert torch.equal(value, sb["state"][i][key]), (i, key)
    assert b.memory_report()["grads"] == 0


def test_triton_kernel_releases_as_the_plain_step():
    pytest.importorskip("triton")
    if not interpreter_on():
        pytest.skip("the Triton kernels run on CPU tensors under TRITON_INTERPRET=1 only")
    plain, released = Net(torch.bfloat16), Net(torch.bfloat16)
    a = zt.FusedAdamW(plain.parameters(), lr=1e-2, backend="triton", moments="int8")
    b = zt.FusedAdamW(released.parameters(), lr=1e-2, backend="triton", moments="int8",
                      grad_release=True)
    _train(a, plain, 2, 1, torch.bfloat16)
    _train(b, released, 2, 1, torch.bfloat16)
    for p, q in zip(plain.parameters(), released.parameters()):
        assert torch.equal(p, q)


def test_one_gradient_held_at_a_time():
    """Each hook finds no other parameter's gradient still held: the step took it."""
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])
    opt = zt.FusedAdamW(model.parameters(), lr=1e-3, backend="torch", grad_release=True)
    held = []
    for p in model.parameters():  # registered after the optimizer's: runs after its step
        p.register_post_accumulate_grad_hook(
            lambda _: held.append(sum(q.grad is not None for q in model.parameters())))
    model(torch.randn(8, 32)).pow(2).mean().backward()
    assert len(held) == 12 and max(held) == 0
    assert all(s["step"].item() == 1 for s in opt.state.values())


def test_step_steps_what_backward_left_and_keeps_the_schedule():
    """A .grad set by hand is stepped by step() (as torch's); an lr changed by a scheduler
    is the next backward's."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64))
    q = torch.nn.Parameter(p.detach().clone())
    ref = torch.optim.AdamW([q], lr=0.1)
    opt = zt.FusedAdamW([p], lr=0.1, backend="torch", grad_release=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, 1, gamma=0.5)
    g = torch.randn(64)
    p.grad, q.grad = g.clone(), g.clone()
    opt.step(), ref.step()
    assert p.grad is not None  # kept for zero_grad, as torch keeps it
    opt.zero_grad(), ref.zero_grad()
    sched.step(), ref_sched.step()
    for _ in range(2):
        (p * g).sum().backward()
        (q * g).sum().backward()
        ref.step(), ref.zero_grad()
        opt.step(), opt.zero_grad()  # nothing left to step
        sched.step(), ref_sched.step()
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert opt.state[p]["step"].item() == 3


def test_a_model_moved_after_construction_is_followed():
    """model.to(bfloat16) after a step: that backward keeps the gradients (they no longer
    fit the shard), step() re-homes and steps them, and the next backward releases."""
    plain, released = Net(torch.float32), Net(torch.float32)
    for m in (plain, released):
        m.complex = None
    a = zt.FusedAdamW(plain.parameters(), lr=1e-2, backend="torch")
    b = zt.FusedAdamW(released.parameters(), lr=1e-2, backend="torch", grad_release=True)
    for opt, m in ((a, plain), (b, released)):
        _train(opt, m, 1, 1, torch.float32)
        m.to(torch.bfloat16)
        _train(opt, m, 3, 1, torch.bfloat16)
    for p, q in zip(plain.parameters(), released.parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q)


def test_copies_and_state_dicts_keep_releasing():
    model = torch.nn.Linear(8, 8).to(torch.bfloat16)
    opt = zt.FusedAdamW(model.parameters(), lr=1e-2, backend="torch", grad_release=True)
    model(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
    twin = copy.deepcopy({"m": model, "o": opt})
    twin["m"](torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
    assert all(p.grad is None for p in twin["m"].parameters())
    assert all(s["step"].item() == 2 for s in twin["o"].state.values())
    other = zt.FusedAdamW(model.parameters(), lr=1e-2, backend="torch")
    other.load_state_dict(opt.state_dict())  # the formats' state, whoever steps it


def test_checkpoint_resumes_bit_for_bit(tmp_path):
    def make():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)).to(torch.bfloat16)
        return m, zt.FusedAdamW(m.parameters(), lr=1e-2, backend="torch", moments="int8",
                                master_weights="remainder8", grad_release=True)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    a, oa = make()
    a(x).float().pow(2).sum().backward()
    zt.checkpoint.save(str(tmp_path), oa, model=a)
    b, ob = make()
    zt.checkpoint.load(str(tmp_path), ob, model=b)
    for m in (a, b):
        m(x).float().pow(2).sum().backward()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kw,words", [
    ({"max_grad_norm": 1.0}, "max_grad_norm cannot"),
    ({"capturable": True}, "capturable=True"),
    ({"offload": "cpu"}, "offload='cpu'"),
    ({"grad_release": "yes"}, "grad_release"),
    ({"zero": True}, "ZeroAdam.grad_release=True. needs stage=2"),
])
def test_refused_at_construction(kw, words):
    p = torch.nn.Parameter(torch.randn(4))
    cls = zt.ZeroAdamW if kw.pop("zero", False) else zt.FusedAdamW
    with pytest.raises((ValueError, TypeError), match=words):
        cls([p], backend="torch", **{"grad_release": True, **kw})
    assert p.grad is None


def test_clipping_and_grad_scaler_refused_with_why():
    model = torch.nn.Linear(8, 8)
    opt = zt.FusedAdamW(model.parameters(), backend="torch", grad_release=True)
    model(torch.randn(2, 8)).sum().backward()
    with pytest.raises(RuntimeError, match="every gradient of the step before any parameter"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match="Clipping by the global"):
        opt.clip_grad_norm_(1.0)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(2, 8)).sum()).backward()
    with pytest.raises(RuntimeError, match="GradScaler cannot be used with grad_release"):
        scaler.step(opt)


def test_the_norm_is_measured_not_clipped_by():
    """The gradient norm asked for after a releasing backward (HF Trainer asks
    clip_grad_norm_(params, inf) at every step, max_grad_norm=0 or not) is the norm of the
    gradients the step took: torch's get_total_norm of the plain run's gradients, step
    after step (kept per step, not summed over steps), with a .grad kept by no_sync()
    counted; the steps the same bits as the plain run. Clipping by a finite norm, through
    either of torch's functions, and another norm_type are refused."""
    models = [torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
              for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    plain, released = (zt.FusedAdamW(m.parameters(), lr=1e-2, backend="torch", grad_release=r)
                       for m, r in zip(models, (False, True)))
    for t in range(4):
        x = torch.randn(6, 16, generator=torch.Generator().manual_seed(t))
        models[0](x).square().mean().backward()
        expected = torch.nn.utils.get_total_norm([p.grad for p in models[0].parameters()])
        plain.step()
        plain.zero_grad()
        if t == 3:  # the last one accumulated: its .grad kept, stepped by step()
            with released.no_sync():
                models[1](x).square().mean().backward()
        else:
            models[1](x).square().mean().backward()
        measured = torch.nn.utils.clip_grad_norm_(models[1].parameters(), float("inf"))
        torch.testing.assert_close(measured, expected, rtol=1e-6, atol=0)
        torch.testing.assert_close(torch.nn.utils.get_total_norm(
            [p.grad for p in models[1].parameters() if p.grad is not None] or [torch.zeros(1)]) if t == 3
            else expected, expected, rtol=1e-6, atol=0)
        released.step()
        models[1].zero_grad()  # the model's, as HF Trainer calls it: the norms end with step()
        assert all(torch.equal(a, b) for a, b in zip(*(m.parameters() for m in models))), t
    for t in range(3):  # a loop that never calls step(): the norms of the last backward alone
        x = torch.randn(6, 16, generator=torch.Generator().manual_seed(100 + t))
        snapshot = copy.deepcopy(models[1])  # the parameters this backward's gradients are at
        models[1](x).square().mean().backward()
    grads = torch.autograd.grad(snapshot(x).square().mean(), list(snapshot.parameters()))
    torch.testing.assert_close(released.total_grad_norm(), torch.nn.utils.get_total_norm(grads),
                               rtol=1e-6, atol=0)
    assert len(released._clipping.norms) == 4  # this backward's: one a parameter
    before = [p.detach().clone() for p in models[1].parameters()]
    with pytest.raises(RuntimeError, match="Clipping by the global"):
        torch.nn.utils.clip_grad_norm_(models[1].parameters(), 1e-3)
    total = released.total_grad_norm()
    with pytest.raises(RuntimeError, match="Clipping by the global"):
        torch.nn.utils.clip_grads_with_norm_(models[1].parameters(), 1e-3, total)
    with pytest.raises(RuntimeError, match="norm_type=1.0 under grad_release"):
        released.clip_grad_norm_(float("inf"), norm_type=1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, models[1].parameters()))


def _under_ddp(rank, world):
    import torch.distributed as dist
    lin = torch.nn.Linear(8, 8)
    if world > 1:
        try:
            zt.FusedAdamW(lin.parameters(), backend="torch", grad_release=True)
        except RuntimeError as exc:
            return str(exc)
        return "built"
    ddp = torch.nn.parallel.DistributedDataParallel(lin)
    opt = zt.FusedAdamW(lin.parameters(), backend="torch", grad_release=True)
    ddp(torch.randn(2, 8)).sum().backward()  # released, then DDP writes its average back
    before = [p.detach().clone() for p in lin.parameters()]
    try:
        opt.step()
    except RuntimeError as exc:
        same = all(torch.equal(a, b) for a, b in zip(before, lin.parameters()))
        return f"{exc} | unchanged={same} | step={opt.state[lin.weight]['step'].item()}"
    return "stepped twice"


def test_process_groups_and_ddp_refused():
    """At 2 ranks the constructor refuses (DDP would average after each parameter was
    stepped); at one rank under DDP, step() refuses the .grad DDP wrote back after
    backward released it (it would step the parameter twice), changing nothing."""
    from dist_utils import run_ranks
    two = run_ranks(_under_ddp, 2)
    assert all("process group of 2 ranks" in two[r] and "ZeroAdamW" in two[r] for r in (0, 1)), two
    one = run_ranks(_under_ddp, 1)[0]
    assert "DistributedDataParallel" in one and "unchanged=True" in one and "step=1.0" in one, one
