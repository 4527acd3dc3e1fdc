"""ZeroAdam(stage=2, grad_release=True) (zero_triton.optim.zero_release): each bucket's
shard of the state stepped in backward as its average lands, the average let go; the
bits of the plain stage-2 step at 3 ranks, in the CPU mode and the GPU mode's host logic,
with micro-batches, a tied embedding, a frozen and an unused layer; and the refusals of
what needs every average first, or would step a shard twice."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from conftest import requires_cuda  # noqa: E402
from dist_utils import run_ranks  # noqa: E402
from test_overlap import TINY, Net, assert_bitwise, batch, loss_of, packed, ranks, train  # noqa: E402
from test_side_stream import HostSide  # noqa: E402

import zero_triton  # noqa: E402
import zero_triton.comm.streams  # noqa: E402
from zero_triton import ZeroAdamW  # noqa: E402

RUNS = {
    "one backward a step, overlap()": dict(bucket_cap_mb=TINY, use_overlap=True, stage=2, clip="none"),
    "micro-batches under no_sync": dict(bucket_cap_mb=TINY, use_overlap=False, stage=2, clip="none",
                                        accumulate=3),
}


def _bits(rank, world_size):
    out = {}
    for name, kwargs in RUNS.items():
        out[name] = [train(rank, world_size, **kwargs, grad_release=release) for release in (False, True)]
    # The GPU mode's host logic: averages on a "side stream" whose events pass 2 launches
    # later, each bucket stepped behind its average there (``Bucket.watch``).
    original = zero_triton.comm.streams.side_stream
    log = {"backward_waits": 0, "runs": 0, "landed": 0}
    zero_triton.comm.streams.side_stream = lambda device: HostSide(log, 2)
    try:
        out["gpu mode"] = train(rank, world_size, **RUNS["micro-batches under no_sync"], grad_release=True)
    finally:
        zero_triton.comm.streams.side_stream = original
    out["gpu mode"]["log"] = log
    return out


@packed
def _three(rank, world_size):
    """Every check at 3 ranks, in one start of the ranks (each start costs seconds)."""
    return {"bits": _bits(rank, world_size), "groups": _groups(rank, world_size),
            "moved": _moved_and_frozen(rank, world_size),
            "schedules": _schedules(rank, world_size, (1, 2))}


@pytest.fixture(scope="module")
def three():
    return ranks(_three, 3, timeout=600)


def test_release_over_ranks_is_the_plain_step_bit_for_bit(three):
    """Losses, parameters and the whole state equal stage 2's without release; after the
    releasing backward a rank holds at most the averages still in flight (on CPUs the
    newest), not its whole gradient shard."""
    for rank, out in enumerate(r["bits"] for r in three):
        for name in RUNS:
            plain, released = out[name]
            assert_bitwise(released, plain, f"rank {rank}, {name}")
            assert 0 < released["held"] < plain["held"] / 2, (name, released["held"], plain["held"])
        gpu = out["gpu mode"]
        assert gpu["log"]["landed"] > 0, gpu["log"]  # stepped behind the averages
        assert_bitwise(gpu, out["micro-batches under no_sync"][0], f"rank {rank}, GPU mode")


@packed
def _job_cuda(rank, world_size):
    torch.cuda.set_device(0)  # one GPU: both gloo ranks on it, the averages on side streams
    out = {}
    for release in (False, True):
        result = train(rank, world_size, device="cuda", **RUNS["micro-batches under no_sync"],
                       grad_release=release, steps=3)  # the first step releases nothing here
        torch.cuda.synchronize()
        out[release] = {"losses": result["losses"], "state": None, "held": result["held"],
                        "params": {n: p.cpu() for n, p in result["params"].items()}}
    return out


@requires_cuda
def test_cuda_release_on_side_streams_is_the_plain_step():
    """Two gloo ranks on one GPU: each bucket stepped on the side stream behind its
    average, its average freed there; the same bits as stage 2 without release."""
    for rank, out in enumerate(ranks(_job_cuda, 2, timeout=300)):
        assert_bitwise(out[True], out[False], f"rank {rank}: released on CUDA side streams")
        assert out[True]["held"] < out[False]["held"], out


class _Sometimes(torch.nn.Module):
    """bf16 layers, and a parameter backward reaches on odd steps only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(64, 32)
        self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)
        self.sometimes = torch.nn.Parameter(torch.randn(32))
        self.to(torch.bfloat16)

    def forward(self, x, t):
        y = self.b(torch.nn.functional.gelu(self.a(self.emb(x))))
        return (y * self.sometimes if t % 2 else y).float().pow(2).mean()


def _groups(rank, world_size):
    """Per-group formats (int8 moments and a 24-bit master for the matrices, fp32 for the
    rest), micro-batches under no_sync() whose launches stop at the bucket of a parameter
    they miss (stage 2 then averages every bucket again at step()): released and not."""
    out = []
    for release in (False, True):
        model = _Sometimes()
        matrices = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        opt = ZeroAdamW([{"params": matrices, "moments": "int8", "master_weights": "remainder8"},
                         {"params": rest, "weight_decay": 0.0}], lr=1e-2, backend="torch",
                        stage=2, bucket_cap_mb=0.004, grad_release=release)
        for t in range(4):
            x = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(100 * t + rank))
            with opt.no_sync():
                model(x, t).backward()
            model(x.flip(0), t).backward()
            opt.step()
            opt.zero_grad()
        sd = opt.state_dict()
        out.append([p.detach().clone() for p in model.parameters()]
                   + [v for e in sd["state"].values() for v in e.values()])
    return all(torch.equal(a, b) for a, b in zip(*out))


def test_per_group_formats_and_micro_batches_that_miss_a_parameter_step_as_stage_2(three):
    assert all(r["groups"] for r in three)


@pytest.mark.parametrize("kw,words", [
    ({"stage": 1}, "needs stage=2"),
    ({"bucket_cap_mb": None}, "bucket_cap_mb=None"),
    ({"max_grad_norm": 1.0}, "max_grad_norm cannot"),
    ({"offload": "cpu"}, "offload='cpu'"),
    ({"capturable": True}, "capturable=True"),
])
@pytest.mark.parametrize("flag", [True, 1])
def test_refused_at_construction_before_any_collective(kw, words, flag):
    p = torch.nn.Parameter(torch.randn(4))  # no process group: refused before needing one
    with pytest.raises(ValueError, match=words):  # 1 is a flag too, as torch's flags take it
        ZeroAdamW([p], backend="torch", **{"stage": 2, "grad_release": flag, **kw})


def _refusals(rank, world_size):
    """Each refusal on a fresh optimizer: what it said, and whether anything changed."""
    out = {}

    def build():
        model = Net()
        return model, ZeroAdamW(model.parameters(), lr=1e-2, backend="torch", stage=2,
                                bucket_cap_mb=TINY, grad_release=True)

    def state(model, opt):
        sd = opt.state_dict()
        return [p.detach().clone() for p in model.parameters()], \
            [v.clone() for e in sd["state"].values() for v in e.values()]

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1]))

    x, y = batch(rank, 0)
    model, opt = build()  # different lrs on the ranks: refused at backward, nothing stepped
    loss_of(model, x, y).backward()
    opt.step()
    opt.zero_grad()
    opt.param_groups[0]["lr"] = 0.1 * (rank + 1)
    before = state(model, opt)
    with pytest.raises(RuntimeError, match="different hyperparameters") as err:
        loss_of(model, x, y).backward()
    out["hyper"] = (str(err.value), same(before, state(model, opt)))

    model, opt = build()  # a second backward outside no_sync before step()
    loss_of(model, x, y).backward()  # the first step learns the order: nothing released
    opt.step()
    loss_of(model, x, y).backward()
    with pytest.raises(RuntimeError, match="opt.no_sync.. before step") as err:
        loss_of(model, x, y).backward()
        opt.step()
    out["twice"] = str(err.value)

    model, opt = build()  # clipping, Join and GradScaler need every average first
    loss_of(model, x, y).backward()
    with pytest.raises(RuntimeError, match="every gradient of the step before any parameter"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(ValueError, match="under torch's Join"):
        from torch.distributed.algorithms.join import Join
        with Join([opt]):
            pass
    opt.step()  # still usable: the refusals changed nothing
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # (a scaled backward would have stepped scaled averages)
    with pytest.raises(RuntimeError, match="GradScaler cannot be used with grad_release"):
        scaler.step(opt)
    return out


def test_what_needs_every_average_or_would_step_twice_is_refused():
    for out in run_ranks(_refusals, 2, timeout=180):
        message, unchanged = out["hyper"]
        assert "lr is 0.1 on rank 0 and 0.2 on rank 1" in message and unchanged, out
        assert "opt.no_sync()" in out["twice"], out


def _moved_and_frozen(rank, world_size):
    """Users' ways at stage 2, released and not: ``model.to(torch.bfloat16)`` after the
    optimizer was built (against the optimizer built after it), and a layer frozen
    halfway through training and thawed again (against release off)."""
    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                   torch.nn.GELU(), torch.nn.Linear(64, 8))

    def train_(release, way):
        model = net()
        if way == "bf16 first":
            model.to(torch.bfloat16)
        opt = ZeroAdamW(model.parameters(), lr=1e-2, backend="torch", stage=2, bucket_cap_mb=0.01,
                        grad_release=release)
        if way == "bf16 after":
            model.to(torch.bfloat16)  # the buckets were made for fp32 gradients
        dtype = next(model.parameters()).dtype
        for t in range(6):
            if way == "freeze" and t in (2, 4):
                model[2].requires_grad_(t == 4)
            x = torch.randn(6, 32, generator=torch.Generator().manual_seed(1000 * t + rank))
            model(x.to(dtype)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        sd = opt.state_dict()
        return [p.detach().clone() for p in model.parameters()] + \
            [v for e in sd["state"].values() for v in e.values() if torch.is_tensor(v)]

    def same(a, b):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))

    return {release: {"bf16": same(train_(release, "bf16 after"), train_(release, "bf16 first")),
                      "freeze": same(train_(release, "freeze"), train_(False, "freeze"))}
            for release in (False, True)}


def test_a_model_moved_after_construction_and_a_layer_frozen_halfway_step_as_stage_2(three):
    """At 3 ranks (receive scratch per gradient dtype): a model cast to bf16 after the
    optimizer was built steps as one built after the cast (its first backward's bf16
    gradients are left in .grad for step() to re-home, not put into fp32 buckets: that was
    a KeyError), released and not; a layer frozen and thawed steps as without release."""
    for out in (r["moved"] for r in three):
        assert out == {False: {"bf16": True, "freeze": True}, True: {"bf16": True, "freeze": True}}, out


def _under_ddp(rank, world_size):
    """A DDP wrapper (as HF Trainer and accelerate's prepare add at 2+ processes), with
    and without ddp_local_grads_hook: refused at the first releasing backward."""
    out = {}
    for hooked in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        if hooked:
            ddp.register_comm_hook(None, zero_triton.ddp_local_grads_hook)
        opt = ZeroAdamW(model.parameters(), lr=1e-2, backend="torch", stage=2, bucket_cap_mb=TINY,
                        grad_release=True)
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(RuntimeError) as err:
            for _ in range(2):
                ddp(torch.randn(4, 16)).square().mean().backward()
                opt.step()
                opt.zero_grad()
        out[hooked] = (str(err.value), all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_a_ddp_wrapper_is_refused_before_the_releasing_backward_steps_anything(world):
    for out in run_ranks(_under_ddp, world, timeout=120):
        for hooked, said in out.items():
            message, unchanged = said
            assert "under a DistributedDataParallel wrapper" in message and unchanged, (hooked, said)


class _RandomLag(HostSide):
    """The GPU mode's host logic with each average's event passing after a seeded random
    number (0 to 4) of later launches, not a fixed two."""

    def __init__(self, log, rng):
        super().__init__(log, 0)
        self.rng, self.left = rng, []

    def run(self, start, landed=None):
        done = super().run(start, landed)
        done.passed = False  # HostSide passed it at lag 0: passes at its own count here
        self.left = [(n - 1, d) for n, d in self.left]
        for n, d in self.left:
            if n <= 0:
                d.passed = True
        self.left = [(n, d) for n, d in self.left if n > 0] + [(self.rng.randint(0, 4), done)]
        return done


def _schedules(rank, world_size, seeds):
    """Seeded schedules, different on every rank: sleeps (0 to 2 ms) before each gradient
    is taken by its bucket and before each landing is stepped, in the CPU mode; and, in
    the GPU mode's host logic, events that pass after a random number of launches."""
    import random
    import time

    from zero_triton.comm import hooks
    from zero_triton.optim import zero_release

    kwargs = RUNS["micro-batches under no_sync"]
    out = {"plain": train(rank, world_size, **kwargs)}
    taken, told = hooks.grad_taken, zero_release.ZeroReleasePipeline.told
    original = zero_triton.comm.streams.side_stream
    slept = out["slept"] = {"taken": 0, "told": 0}
    for seed in seeds:
        rng = random.Random(1000 * seed + rank)

        def grad_taken(*args):
            slept["taken"] += 1
            time.sleep(rng.random() * 2e-3)
            return taken(*args)

        def landed(self, *args):
            slept["told"] += 1
            time.sleep(rng.random() * 2e-3)
            return told(self, *args)

        hooks.grad_taken, zero_release.ZeroReleasePipeline.told = grad_taken, landed
        try:
            out["sleeps", seed] = train(rank, world_size, **kwargs, grad_release=True)
        finally:
            hooks.grad_taken, zero_release.ZeroReleasePipeline.told = taken, told
        log = {"backward_waits": 0, "runs": 0, "landed": 0}
        zero_triton.comm.streams.side_stream = lambda device: _RandomLag(log, rng)
        try:
            out["lags", seed] = {**train(rank, world_size, **kwargs, grad_release=True), "log": log}
        finally:
            zero_triton.comm.streams.side_stream = original
    return out


def test_random_schedules_of_the_landings_change_no_bit(three):
    for rank, out in enumerate(r["schedules"] for r in three):
        assert min(out.pop("slept").values()) > 0  # the schedules were the ones run
        for key, run in out.items():
            if key != "plain":
                assert_bitwise(run, out["plain"], f"rank {rank}, {key}")
                if key[0] == "lags":
                    assert run["log"]["landed"] > 0, run["log"]
