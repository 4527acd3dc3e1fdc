"""Nothing silently wrong, nothing hangs: what users do to the tensors the optimizer keeps
copies of, and what one rank does that the others do not (docs/reliability.md).

Each test names the docs/reliability.md guarantee it holds. The multi-rank ones run on gloo ranks
with a hard timeout: on a build without the agreement they hang and fail by it.
"""
import collections
import copy
import io
import threading
import time

import pytest
import torch

from dist_utils import delay_gathers, run_ranks
from zero_triton import FusedAdam, FusedAdamW, ZeroAdamW

LOW = [(torch.bfloat16, 1e-2), (torch.float16, 1e-3)]


def _mlp(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 8)).to(dtype)


def _train(model, opt, steps, dtype, seed=1, between=None):
    g = torch.Generator().manual_seed(seed)
    for it in range(steps):
        x = torch.randn(4, 16, generator=g).to(dtype)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if between is not None:
            between(model, opt, it)


# -- item 1: writes to low-precision parameters after construction ------------------------
@pytest.mark.parametrize("dtype,tol", LOW)
@pytest.mark.parametrize("write", ["load_state_dict", "nn.init", "copy_", "data="])
def test_writes_after_construction_are_what_the_step_starts_from(dtype, tol, write):
    """A bf16/fp16 parameter written after the optimizer was built (a pretrained
    load_state_dict, nn.init, copy_, .data replaced) is stepped from the written values,
    as torch.optim.AdamW steps it; the fp32 master is seeded again from it."""
    model, ref = _mlp(dtype), _mlp(dtype)
    opt = FusedAdamW(model.parameters(), lr=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4)
    for m in (model, ref):
        with torch.no_grad():
            if write == "load_state_dict":
                m.load_state_dict({k: torch.full_like(v, 0.5) for k, v in m.state_dict().items()})
            elif write == "nn.init":
                for p in m.parameters():
                    torch.nn.init.constant_(p, 0.5)
            elif write == "copy_":
                for p in m.parameters():
                    p.copy_(torch.full_like(p, 0.5))
            else:
                for p in m.parameters():
                    p.data = torch.full_like(p, 0.5)
    _train(model, opt, 1, dtype)
    _train(ref, ref_opt, 1, dtype)
    for i, (a, b) in enumerate(zip(model.parameters(), ref.parameters())):
        assert abs(a.float().mean().item() - 0.5) < 1e-2, (write, i, a.float().mean().item())
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=0, msg=f"{write} param {i}")


@pytest.mark.parametrize("dtype,tol", LOW)
def test_inplace_constraints_after_each_step_hold(dtype, tol):
    """WGAN's clamp_ and pruning's mul_(mask) after every step are what the next step
    starts from: the pruned entries stay zero (they came back from the master before)."""
    model = _mlp(dtype)
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    mask = (torch.rand(16, 16, generator=torch.Generator().manual_seed(3)) > 0.5).to(dtype)

    def constrain(m, _opt, _it):
        with torch.no_grad():
            m[0].weight.mul_(mask)
            for p in m.parameters():
                p.clamp_(-0.01, 0.01)

    constrain(model, opt, -1)
    _train(model, opt, 4, dtype, between=constrain)
    w = model[0].weight.float()
    assert (w[mask == 0] == 0).all(), "pruned entries came back"
    # One step after the constraints moves each weight by about lr: never past it.
    _train(model, opt, 1, dtype)
    assert model[0].weight.float().abs().max().item() <= 0.01 + 1.5e-2


# -- item 4: edits of opt.state and param_groups -------------------------------------------
@pytest.mark.parametrize("edit", ["assign_exp_avg", "reset_step", "clear", "replace", "del"])
def test_edits_of_opt_state_are_followed_as_torch_follows_them(edit):
    model, ref = _mlp(), _mlp()
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

    def edit_state(m, o, it):
        if it != 1:
            return
        w = m[0].weight
        if edit == "assign_exp_avg":
            o.state[w]["exp_avg"] = torch.zeros_like(w)
        elif edit == "reset_step":
            o.state[w]["step"] = torch.tensor(0.0)
        elif edit == "clear":
            o.state.clear()
        elif edit == "replace":
            o.state = collections.defaultdict(dict)
        else:
            del o.state[w]

    _train(model, opt, 4, torch.float32, between=edit_state)
    _train(ref, ref_opt, 4, torch.float32, between=edit_state)
    for i, (a, b) in enumerate(zip(model.parameters(), ref.parameters())):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=f"{edit}: param {i}")
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    for k in ref_sd["state"]:
        assert float(sd["state"][k]["step"]) == float(ref_sd["state"][k]["step"]), (edit, k)


def test_a_parameter_appended_to_param_groups_is_refused_with_the_fix():
    model = _mlp()
    opt = FusedAdam(list(model[0].parameters()), lr=1e-2)
    _train(model, opt, 1, torch.float32)
    before = [p.clone() for p in model.parameters()]
    opt.param_groups[0]["params"].append(model[2].weight)
    model(torch.randn(2, 16)).sum().backward()
    with pytest.raises(RuntimeError, match="add_param_group"):
        opt.step()
    for a, b in zip(model.parameters(), before):
        assert torch.equal(a, b), "a refused step changed a parameter"


# -- item 5: what state_dict() handed out comes back ----------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_self_load_keeps_the_state(dtype):
    model = _mlp(dtype)
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2, dtype)
    want = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(opt.state_dict())
    got = opt.state_dict()
    for k, entry in want["state"].items():
        for name, t in entry.items():
            assert torch.equal(got["state"][k][name], t), (k, name)
    assert got["state"][0]["exp_avg"].abs().max() > 0


def test_dcp_resume_continues_from_the_saved_moments(tmp_path):
    """torch.distributed.checkpoint's documented flow (a fresh model and optimizer,
    get_optimizer_state_dict, dcp.load, set_optimizer_state_dict) resumes exactly."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    model = _mlp()
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2, torch.float32)
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=str(tmp_path))
    _train(model, opt, 2, torch.float32, seed=5)

    fresh = _mlp(seed=9)
    fresh_opt = FusedAdamW(fresh.parameters(), lr=1e-2)
    sd = {"model": fresh.state_dict(), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(sd, checkpoint_id=str(tmp_path))
    fresh.load_state_dict(sd["model"])
    set_optimizer_state_dict(fresh, fresh_opt, sd["optim"])
    _train(fresh, fresh_opt, 2, torch.float32, seed=5)
    for i, (a, b) in enumerate(zip(fresh.parameters(), model.parameters())):
        assert torch.equal(a, b), f"param {i}: {(a - b).abs().max().item()}"


def _zero_dcp(rank, world, path):
    """get_optimizer_state_dict on a trained ZeroAdamW, then the DCP round trip."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    model = _mlp()
    opt = ZeroAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=0.0005)
    _train(model, opt, 2, torch.float32, seed=rank)
    before = copy.deepcopy(opt.state_dict())
    saved = get_optimizer_state_dict(model, opt)
    after = opt.state_dict()
    untouched = all(torch.equal(after["state"][k][name], t)
                    for k, entry in before["state"].items() for name, t in entry.items())
    dcp.save({"optim": saved}, checkpoint_id=path)
    _train(model, opt, 2, torch.float32, seed=10 + rank)
    fresh = _mlp(seed=9)
    fresh.load_state_dict(model.state_dict())
    fresh_opt = ZeroAdamW(fresh.parameters(), lr=1e-2, bucket_cap_mb=0.0005)
    sd = {"optim": get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(sd, checkpoint_id=path)
    set_optimizer_state_dict(fresh, fresh_opt, sd["optim"])
    loaded = fresh_opt.state_dict()
    resumed = all(torch.equal(loaded["state"][k][name], t)
                  for k, entry in before["state"].items() for name, t in entry.items())
    return untouched, resumed, sorted({float(e["step"]) for e in after["state"].values()})


def test_zero_get_optimizer_state_dict_leaves_the_state_alone(tmp_path):
    """torch's get_optimizer_state_dict steps an optimizer whose ``optimizer.state`` is
    empty (zero gradients, lr 0) to make its state; a ZeroAdam at several ranks lists no
    per-parameter tensors there, and was stepped: its step count moved on and its moments
    decayed. Now its state counts as present: the call changes nothing, and the DCP round
    trip restores exactly what was saved."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    del dcp
    for untouched, resumed, steps in run_ranks(_zero_dcp, 2, str(tmp_path / "ckpt"), timeout=300):
        assert untouched and steps == [2.0], steps
        assert resumed


# -- under ZeRO: the same, agreed over the ranks -----------------------------------------------
def _zero_writes(rank, world, stage):
    """Item 1 and 4 under ZeroAdamW: bf16 writes after construction on every rank, and
    opt.state.clear() on every rank (followed); a clear on one rank only (refused)."""
    out = {}
    model = _mlp(torch.bfloat16)
    opt = ZeroAdamW(model.parameters(), lr=1e-4, stage=stage, bucket_cap_mb=0.0005)
    model.load_state_dict({k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()})
    _train(model, opt, 1, torch.bfloat16, seed=rank)
    out["mean"] = [p.float().mean().item() for p in model.parameters()]
    opt.state.clear()
    _train(model, opt, 1, torch.bfloat16, seed=rank)
    out["steps"] = sorted({float(e["step"]) for e in opt.state_dict()["state"].values()})
    if rank == 0:
        opt.state.clear()
    try:
        _train(model, opt, 1, torch.bfloat16, seed=rank)
        out["one_rank_clear"] = "trained"
    except RuntimeError as exc:
        out["one_rank_clear"] = str(exc)
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_follows_writes_and_resets_agreed_on_every_rank(stage):
    results = run_ranks(_zero_writes, 2, stage, timeout=180)
    for rank, out in enumerate(results):
        assert all(abs(m - 0.5) < 5e-3 for m in out["mean"]), (rank, out["mean"])
        assert out["steps"] == [1.0], (rank, out["steps"])
        assert "on ranks [0] only" in out["one_rank_clear"], (rank, out["one_rank_clear"])


def _grad_edit_on_one_rank(rank, world, scaler_inf):
    """Item 6: rank 0 edits its .grad after backward (default buckets, launched during
    backward): every rank averages again, so the step is Adam on the mean of the final
    gradients; with GradScaler, an inf written into rank 0's gradient skips the step on
    every rank."""
    model, ref = _mlp(), _mlp()
    opt = ZeroAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=0.0005)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0) if scaler_inf else None
    for it in range(3):
        g = torch.Generator().manual_seed(10 + it)
        xs = torch.randn(world, 4, 16, generator=g)
        loss = model(xs[rank]).pow(2).mean()
        (scaler.scale(loss) if scaler else loss).backward()
        if rank == 0:
            with torch.no_grad():
                scale = scaler.get_scale() if scaler else 1.0  # the gradients are scaled
                model[0].weight.grad[0, 0] += float("inf") if scaler_inf and it == 1 else scale
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        if scaler_inf and it == 1:
            continue  # skipped on every rank: the reference skips it too
        grads = []
        for r in range(world):
            ref.zero_grad()
            ref(xs[r]).pow(2).mean().backward()
            gs = [p.grad.clone() for p in ref.parameters()]
            if r == 0:
                gs[0][0, 0] += 1.0
            grads.append(gs)
        for p, *gs in zip(ref.parameters(), *grads):
            p.grad = sum(gs) / world
        ref_opt.step()
    return max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("scaler_inf", [False, True])
def test_one_ranks_grad_edit_is_averaged_again_on_every_rank(scaler_inf):
    diffs = run_ranks(_grad_edit_on_one_rank, 2, scaler_inf, timeout=120, pg_timeout_s=60)
    assert max(diffs) < 1e-5, diffs


def _rank_local(rank, world, case, stage, bucket_cap_mb):
    """Item 6 and 7: one rank does what the others do not. Returns (seconds, message)."""
    model = _mlp()
    opt = ZeroAdamW(model.parameters(), lr=1e-2, stage=stage, bucket_cap_mb=bucket_cap_mb)
    start = time.monotonic()
    try:
        for it in range(4):
            model(torch.randn(4, 16)).pow(2).mean().backward()
            if case == "zero_grad" and rank == 0 and it == 2:
                opt.zero_grad()
            if not (case == "skip_step" and rank == 1 and it == 1):
                opt.step()
            opt.zero_grad()
            if case == "save_on_rank0" and rank == 0 and it == 1:
                torch.save(opt.state_dict(), "/dev/null")
        if case in ("zero_grad", "save_on_rank0"):
            return "trained", [p.detach().sum().item() for p in model.parameters()]
    except RuntimeError as exc:
        return time.monotonic() - start, str(exc)
    return "no error", None


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("bucket_cap_mb", [None, 0.0005])
def test_one_ranks_skipped_step_fails_every_rank_within_seconds(bucket_cap_mb, stage):
    """A step skipped on one rank raises on every rank at once, naming the ranks' calls
    and the fix (it hung until the process-group timeout)."""
    results = run_ranks(_rank_local, 2, "skip_step", stage, bucket_cap_mb, timeout=90, pg_timeout_s=600)
    for rank, (seconds, message) in enumerate(results):
        assert seconds != "no error", f"rank {rank} trained on"
        assert seconds < 30, (rank, seconds)
        assert "different calls" in message, (rank, message)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("bucket_cap_mb", [25, None])
def test_state_dict_on_rank_0_alone_mid_training_trains_on(bucket_cap_mb, stage):
    """``if rank == 0: torch.save(opt.state_dict())`` between steps while the other rank
    goes on to its next backward: both train on, level (it raised on every rank; before
    that, it hung)."""
    results = run_ranks(_rank_local, 2, "save_on_rank0", stage, bucket_cap_mb, timeout=90,
                        pg_timeout_s=600)
    assert results[0][0] == "trained" and results[0][1] == results[1][1], results


def _one_rank_state_dict(rank, world, stage, dtype_name):
    """Train; the state dict taken on every rank; then on rank 0 alone while the others
    wait in ``dist.barrier()`` (PyTorch's DDP tutorial's save), before and after
    parameters were written on every rank; then resume from rank 0's state dict on every
    rank. Returns what the test compares."""
    import torch.distributed as dist
    dtype = getattr(torch, dtype_name)
    model = _mlp(dtype)
    opt = ZeroAdamW(model.parameters(), lr=1e-2, stage=stage, bucket_cap_mb=0.0005)

    def train(steps, seed):
        g = torch.Generator().manual_seed(seed + rank)
        for _ in range(steps):
            model(torch.randn(4, 16, generator=g).to(dtype)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    train(3, 10)
    every = copy.deepcopy(opt.state_dict())  # every rank calls it
    alone, seconds = None, None
    if rank == 0:
        start = time.monotonic()
        alone = copy.deepcopy(opt.state_dict())
        seconds = time.monotonic() - start
    dist.barrier()
    with torch.no_grad():  # written on every rank: the master of these follows them
        model[0].weight.mul_(0.5)
    written_alone = copy.deepcopy(opt.state_dict()) if rank == 0 else None
    dist.barrier()
    written_every = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in model.parameters()]
    train(2, 20)
    trained = [p.detach().clone() for p in model.parameters()]
    saved = [written_alone]
    dist.broadcast_object_list(saved, src=0)  # rank 0's file, loaded on every rank
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights):
            p.copy_(w)  # the model's checkpoint
    opt.load_state_dict(saved[0])
    train(2, 20)
    resumed = [p.detach().clone() for p in model.parameters()]
    out = io.BytesIO()  # bytes: tensors sent back through the queue outlive the rank
    torch.save((every, alone, seconds, written_every, written_alone, trained, resumed), out)
    return out.getvalue()


def _same_state(a, b) -> bool:
    return a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys() and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for x, y in ((a["state"][i], b["state"][i]) for i in a["state"]))


@pytest.mark.parametrize("stage,dtype,world", [(1, "float32", 2), (2, "float32", 2),
                                               (1, "bfloat16", 3), (2, "bfloat16", 2)])
def test_state_dict_on_rank_0_alone_while_the_others_wait_in_a_barrier(stage, dtype, world):
    """``if rank == 0: torch.save(opt.state_dict())`` then ``dist.barrier()`` on every
    rank: rank 0 gets the whole state at once, the same bits as every rank's call, the
    master of parameters written since the last step taken from them; resuming from it
    on every rank continues exactly. (It hung until the process group's timeout: the
    agreement waited for the others, who waited in the barrier.)"""
    results = [torch.load(io.BytesIO(b), weights_only=False) for b in
               run_ranks(_one_rank_state_dict, world, stage, dtype, timeout=180, pg_timeout_s=600)]
    every, alone, seconds, written_every, written_alone, _, _ = results[0]
    assert seconds < 20, seconds
    assert _same_state(alone, every)
    assert _same_state(written_alone, written_every)
    if dtype == "bfloat16":
        assert not _same_state(written_alone, alone)  # the written master moved
    for rank, r in enumerate(results):
        assert all(torch.equal(a, b) for a, b in zip(r[5], r[6])), f"rank {rank}: resume differs"
        assert all(torch.equal(a, b) for a, b in zip(r[5], results[0][5])), f"rank {rank} differs"


def _saved_at_the_end(rank, world, who, delay):
    """The script's last lines: ``opt.state_dict()`` on every rank (``who`` "every") or
    on rank 0 alone ("rank0"); rank 0 gets there ``delay`` seconds after rank 1, which
    then returns (its process exits)."""
    model = _mlp()
    opt = ZeroAdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2, torch.float32)
    if rank == 0:
        time.sleep(delay)
    if rank == 0 or who == "every":
        sd = opt.state_dict()
        return sorted(float(e["exp_avg"].abs().sum()) for e in sd["state"].values())
    return None


@pytest.mark.parametrize("who", ["every", "rank0"])
def test_saving_at_the_end_of_the_script_waits_for_the_slowest(who):
    """``sd = opt.state_dict(); if rank == 0: torch.save(sd)`` or ``if rank == 0:
    torch.save(opt.state_dict())`` as a script's last lines, rank 0 the slower: a rank
    done first stays (its shard server answers) until rank 0 has its state dict, then
    both exit (rank 0 failed with "connection closed")."""
    results = run_ranks(_saved_at_the_end, 2, who, 3.0, timeout=90, pg_timeout_s=60)
    assert results[0] is not None and len(results[0]) == 4, results
    if who == "every":
        assert results[0] == results[1], results


def _asked_while_being_built(rank, world):
    """Rank 1 asks for the state as soon as its constructor returns (accelerate's
    prepare does); rank 0's optimizer registers with its server a second later."""
    from zero_triton.comm import serve
    if rank == 0:
        register = serve.ShardServer.register

        def late(self, ordinal, provider):
            time.sleep(1.0)
            register(self, ordinal, provider)
        serve.ShardServer.register = late
    model = _mlp()
    opt = ZeroAdamW(model.parameters(), lr=1e-2)
    return sorted(tuple(e["exp_avg"].shape) for e in opt.state_dict()["state"].values())


def test_state_dict_asked_of_a_rank_still_building_the_optimizer_waits_for_it():
    results = run_ranks(_asked_while_being_built, 2, timeout=90, pg_timeout_s=60)
    assert results[0] == results[1] and len(results[0]) == 4, results


def _skipped_then_saved(rank, world):
    import torch.distributed as dist
    model = _mlp()
    opt = ZeroAdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 1, torch.float32)
    if rank == 0:  # as if rank 0 had stepped once more (only the counts are compared)
        opt._ranks.agreement.steps += 1
    message = None
    if rank == 0:
        start = time.monotonic()
        try:
            opt.state_dict()
        except RuntimeError as exc:
            message = (time.monotonic() - start, str(exc))
    dist.barrier()
    return message


def test_state_dict_from_a_rank_at_another_step_is_refused_naming_the_steps():
    results = run_ranks(_skipped_then_saved, 2, timeout=90, pg_timeout_s=20)
    seconds, message = results[0]
    assert seconds < 30 and "has taken 1 steps and this rank 2" in message, results[0]


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_grad_between_backward_and_step_on_one_rank_is_agreed(stage):
    results = run_ranks(_rank_local, 2, "zero_grad", stage, 0.0005, timeout=90, pg_timeout_s=600)
    assert results[0][0] == "trained" and results[0][1] == results[1][1], results


def _rank_hyperparameters(rank, world, case, stage):
    """One rank's learning rate moves apart from the others'. Returns (iteration, message,
    parameters unchanged by that step) at the step that raised."""
    model = _mlp()
    opt = ZeroAdamW(model.parameters(), lr=1e-2, stage=stage, bucket_cap_mb=0.0005)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    g = torch.Generator().manual_seed(rank)
    for it in range(4):
        model(torch.randn(4, 16, generator=g)).pow(2).mean().backward()
        before = [p.detach().clone() for p in model.parameters()]
        try:
            opt.step()
        except RuntimeError as exc:
            return it, str(exc), all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        opt.zero_grad()
        if case == "plateau_on_a_local_metric":  # rank 0's metric stalls, rank 1's improves
            plateau.step(1.0 if rank == 0 else -float(it))
        elif rank == 0:  # "rank_0_sets_lr"
            opt.param_groups[0]["lr"] = 5e-3
    return "trained", None, None


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("case", ["plateau_on_a_local_metric", "rank_0_sets_lr"])
def test_hyperparameters_that_differ_between_ranks_are_refused_on_every_rank(case, stage):
    """ReduceLROnPlateau fed each rank's own loss, or a learning rate set on one rank:
    each rank would step its shard at its own rate, silently (DDP's replicas drift apart
    the same way). The next step raises on every rank, naming the group, the values and
    the ranks, before anything is stepped."""
    for it, message, unchanged in run_ranks(_rank_hyperparameters, 2, case, stage, timeout=90):
        assert it in (1, 2), (it, message)
        assert "different hyperparameters" in message and "param group 0's lr" in message, message
        assert unchanged


def _stalled_rank(rank, world, bucket_cap_mb):
    """Rank 1 stalls (no collective) for 6 s before its backward and step, on a group made
    with a 2 s timeout. Returns (what happened, wall-clock time it happened, message)."""
    import datetime

    import torch.distributed as dist
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    model = _mlp()
    opt = ZeroAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=bucket_cap_mb, process_group=group)
    _train(model, opt, 1, torch.float32)
    if rank == 1:
        time.sleep(6)
        woke = time.time()
    try:
        _train(model, opt, 1, torch.float32)
    except RuntimeError as exc:
        return "raised", woke if rank == 1 else time.time(), str(exc)
    return "trained", time.time(), ""


@pytest.mark.parametrize("bucket_cap_mb", [None, 0.0005])
def test_a_stalled_rank_fails_the_others_within_the_groups_own_timeout(bucket_cap_mb):
    """The agreement waits for a peer as long as the user's process group would (its
    ``timeout=``), not torch's 30-minute default: a rank stuck outside any collective
    fails the others after the group's 2 s, while it is still stuck."""
    (what0, when0, message0), (_, woke1, _) = run_ranks(
        _stalled_rank, 2, bucket_cap_mb, timeout=120, pg_timeout_s=600)
    assert what0 == "raised", "rank 0 waited for the stalled rank and trained on"
    assert when0 < woke1, "rank 0 raised only once the stalled rank came back"
    assert "within the process group's timeout (2 s)" in message0, message0


@pytest.mark.parametrize("world, phase, overrides", [
    (3, "gather_params", {"stage": 1, "offload": False, "mesh": None, "bucket_cap_mb": 0.004}),
    (4, "agreement", {"stage": 2, "offload": True, "mesh": [2, 2], "bucket_cap_mb": 0.02}),
    (3, "serve", {"stage": 2, "offload": False, "mesh": None, "bucket_cap_mb": 0.004}),
])
def test_a_peer_killed_at_a_collective_of_step_fails_every_survivor_within_seconds(world, phase, overrides):
    """A dead peer at any collective of ``step()`` (docs/reliability.md): SIGKILLed at one
    of its third step's calls of the named phase (plain processes, no launcher), every
    survivor raises within seconds naming what failed, and exits. At 3 ranks a gather of
    one broadcast per rank held a survivor for the process group's timeout (60 s here).
    ``"serve"``: killed sending a chunk of its shard server's answer to a ``state_dict()``
    rank 0 calls alone; the asking rank waited again for a receive it had finished, which
    ended only at the timeout. ``bench/kill_soak.py`` draws the phase and the call at
    2-8 ranks."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "bench" / "kill_soak.py"
    spec = importlib.util.spec_from_file_location("kill_soak", path)
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    result = soak.run_one(7, world, pg_timeout=60.0, limit=90.0, phase=phase, **overrides)
    assert not result["bad"], result
    assert phase in result["phase"], result["phase"]
    assert len(result["raise"]) == world - 1 and max(result["raise"]) < 10, result
    assert len(result["exit"]) == world - 1 and max(result["exit"]) < 15, result
    named = ("failed on rank", "asked rank 2 for its shards")
    assert all(any(n in m for n in named) for m in result["messages"]), result["messages"]


# -- items 2 and 3: overlap() and what touches parameters between step and forward -------------
class _Stat(torch.nn.Module):
    """A parent whose forward reads its children's weights outside their forward, under
    no_grad (a statistic) and detached (a stop-gradient tied weight), before calling them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 8)

    def forward(self, x):
        with torch.no_grad():
            scale = self.a.weight.abs().mean()
        tied = self.b.weight.detach()
        h = torch.tanh(self.a(x)) * scale
        return self.b(h) + torch.nn.functional.linear(h, tied)


def _overlap_job(rank, world, stage):
    import zero_triton
    out = {}
    # Item 3: the same losses with and without overlap().
    for use_overlap in (False, True):
        model = _Stat()
        opt = ZeroAdamW(model.parameters(), lr=1e-2, stage=stage, bucket_cap_mb=0.0005)
        if use_overlap:
            zero_triton.overlap(model, opt)
        losses = []
        for it in range(4):
            if use_overlap and it == 2 and rank == 1:
                delay_gathers(opt, 0.05)
            g = torch.Generator().manual_seed(100 * rank + it)
            loss = model(torch.randn(4, 16, generator=g)).pow(2).mean()
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
        opt.wait_params()
        out[f"losses_{use_overlap}"] = losses
    # Item 2: model.load_state_dict right after an overlapped step keeps what was loaded.
    model = _Stat()
    opt = ZeroAdamW(model.parameters(), lr=1e-2, stage=stage, bucket_cap_mb=0.0005)
    zero_triton.overlap(model, opt)
    loaded = {k: torch.full_like(v, 0.25) for k, v in model.state_dict().items()}
    torch.manual_seed(rank)
    for it in range(2):
        if it == 1 and rank == 1:
            delay_gathers(opt, 0.05)
        model(torch.randn(4, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    model.load_state_dict(loaded)
    out["kept"] = all(torch.equal(p, loaded[n]) for n, p in model.named_parameters())
    # Another write in that window waits for the gathers first (a torch operation on a
    # parameter, zero_triton.comm.pending_reads) and is kept ...
    model(torch.randn(4, 16)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        model.a.weight.copy_(torch.zeros_like(model.a.weight))
    model(torch.randn(4, 16))
    out["write_kept"] = bool((model.a.weight == 0).all())
    # ... and one from another thread (the wait is per thread) is refused at the next wait.
    model(torch.randn(4, 16)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()

    def write():
        with torch.no_grad():
            model.b.weight.copy_(torch.zeros_like(model.b.weight))
    t = threading.Thread(target=write)
    t.start()
    t.join()
    try:
        model(torch.randn(4, 16))
        out["write"] = "no error"
    except RuntimeError as exc:
        out["write"] = str(exc)
    # A parameter replaced from another thread (p.data = x) in that window: the gathered
    # values copied over x would undo the assignment silently; refused alike.
    opt.wait_params()
    model(torch.randn(4, 16)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()

    def replace():
        model.b.weight.data = torch.zeros_like(model.b.weight.data)
    t = threading.Thread(target=replace)
    t.start()
    t.join()
    try:
        model(torch.randn(4, 16))
        out["replace"] = "no error" + ("" if bool((model.b.weight == 0).all()) else ", the assignment undone")
    except RuntimeError as exc:
        out["replace"] = str(exc)
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_overlap_reads_and_writes_between_step_and_forward(stage):
    """Under overlap(): a parent's no_grad/detached read of its children's weights sees the
    updated values (the losses equal a run without overlap), and model.load_state_dict()
    between step() and the next forward is never overwritten by that step's gathers;
    another write in that window waits for them and is kept; one from another thread (a
    write or a ``p.data = x``) is refused with the fix."""
    for rank, out in enumerate(run_ranks(_overlap_job, 2, stage, timeout=180)):
        assert out["losses_True"] == out["losses_False"], (rank, out)
        assert out["kept"], f"rank {rank}: the load was overwritten by in-flight gathers"
        assert out["write_kept"], f"rank {rank}: the write was overwritten by in-flight gathers"
        assert "optimizer.wait_params()" in out["write"], (rank, out["write"])
        assert "optimizer.wait_params()" in out["replace"], (rank, out["replace"])


# -- items 10-13: files and arguments ---------------------------------------------------------
def test_consolidate_refuses_an_output_inside_the_checkpoint(tmp_path, capsys):
    """``checkpoint consolidate CKPT OUT`` with OUT (or --model) inside CKPT would
    overwrite the only copy of the training state: refused, nothing written."""
    from zero_triton import checkpoint
    from zero_triton.tools import checkpoint as tools
    model = _mlp()
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 1, torch.float32)
    ck = tmp_path / "ck"
    checkpoint.save(ck, opt, model)
    before = {p.name: p.read_bytes() for p in ck.iterdir()}
    for argv in ([str(ck), str(ck / "manifest.json")], [str(ck), str(ck / "rank00000.bin")],
                 [str(ck), str(tmp_path / "out.pt"), "--model", str(ck / "model.bin")],
                 [str(ck), str(ck)], [str(ck), str(ck / "sub" / "x.pt")]):
        assert tools.main(["consolidate", *argv]) == 1, argv
        err = capsys.readouterr().err
        assert "inside the checkpoint" in err and "outside it" in err, (argv, err)
    assert {p.name: p.read_bytes() for p in ck.iterdir()} == before
    assert not (tmp_path / "out.pt").exists()


def test_bench_out_replaces_planted_links_never_follows_them(tmp_path):
    """``bench --out D``: a link planted at an output name is replaced by the output; the
    file it pointed to is left as it was."""
    out = tmp_path / "out"
    out.mkdir()
    notes = tmp_path / "notes.txt"
    notes.write_text("a user's notes\n")
    for name in ("step_cpu.json", "step_cpu.csv", "step_cpu.png"):
        (out / name).symlink_to(notes)
    from dist_utils import run_python
    proc = run_python(["-m", "zero_triton", "bench", "--quick", "--cases", "fp32",
                       "--providers", "zt-cpu", "--out", out], timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert notes.read_text() == "a user's notes\n"
    for name in ("step_cpu.json", "step_cpu.csv"):
        assert not (out / name).is_symlink() and (out / name).stat().st_size > 0, name
    assert not [p for p in out.iterdir() if p.name.startswith(".")], list(out.iterdir())


def test_output_writer_replaces_a_link_and_leaves_nothing_on_error(tmp_path):
    from zero_triton.tools import outputs
    target = tmp_path / "victim"
    target.write_text("keep\n")
    link = tmp_path / "report.json"
    link.symlink_to(target)
    with outputs.replacing(link, "w") as fh:
        fh.write("{}\n")
    assert target.read_text() == "keep\n" and not link.is_symlink() and link.read_text() == "{}\n"
    with pytest.raises(ZeroDivisionError):
        with outputs.replacing(tmp_path / "other.json", "w") as fh:
            fh.write("half")
            1 / 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "victim"]


@pytest.mark.parametrize("command", ["demo", "profile"])
def test_a_world_size_the_machine_cannot_run_is_refused_before_spawning(command):
    from dist_utils import run_python
    start = time.monotonic()
    proc = run_python(["-m", "zero_triton", command, "--world-size", "100000"], timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert "more than this machine can run" in lines[-1] and "pass e.g." in lines[-1], lines
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("kwargs,match", [
    (dict(params="module"), "pass model.parameters()"),
    (dict(params=None), "iterable of tensors"),
    (dict(params=3), "iterable of tensors"),
    (dict(amsgrad="no"), "amsgrad must be True or False"),
    (dict(maximize="yes"), "maximize must be True or False"),
    (dict(master_weights="yes"), "master_weights must be True or False"),
    (dict(lr=float("nan")), "Invalid learning rate"),
    (dict(eps=float("nan")), "Invalid epsilon"),
    (dict(weight_decay=-1.0), "weight_decay"),
    (dict(betas=(float("nan"), 0.9)), "beta parameter"),
    (dict(max_grad_norm=float("nan")), "max_grad_norm"),
    (dict(max_grad_norm=-1.0), "max_grad_norm"),
    (dict(backend="gpu"), "unknown backend"),
])
def test_bad_constructor_arguments_name_the_argument_and_the_fix(kwargs, match):
    model = _mlp()
    kwargs = dict(kwargs)
    params = kwargs.pop("params", model.parameters())
    if params == "module":
        params = model
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises((TypeError, ValueError), match=match):
        FusedAdam(params, **kwargs)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b) and p.grad is None


def _zero_bad_arguments(rank, world):
    out = {}
    model = _mlp()
    cases = {"module": dict(params=model), "process_group": dict(process_group="gloo"),
             "bucket inf": dict(bucket_cap_mb=float("inf")), "bucket nan": dict(bucket_cap_mb=float("nan")),
             "reduce int": dict(reduce_dtype=torch.int32), "reduce str": dict(reduce_dtype="float32"),
             "stage": dict(stage=3), "stage float": dict(stage=2.0)}
    for name, kwargs in cases.items():
        kwargs = dict(kwargs)
        params = kwargs.pop("params", model.parameters())
        try:
            ZeroAdamW(params, **kwargs)
            out[name] = "accepted"
        except (TypeError, ValueError) as exc:
            out[name] = str(exc)
    return out


def _outside_the_group(rank, world):
    import torch.distributed as dist
    group = dist.new_group([0])  # on rank 1, torch hands back a placeholder
    model = _mlp()
    try:
        opt = ZeroAdamW(model.parameters(), lr=1e-2, process_group=group)
    except ValueError as exc:
        return str(exc)
    _train(model, opt, 1, torch.float32)
    return "trained"


def test_a_rank_outside_the_process_group_is_told_so():
    """``new_group(ranks)`` returns a placeholder (-100) on the other ranks; building
    a ZeroAdam over it there said "must be a ProcessGroup ... got -100"."""
    inside, outside = run_ranks(_outside_the_group, 2, timeout=120)
    assert inside == "trained", inside
    assert "is not one of the group's ranks" in outside, outside


def test_zero_bad_arguments_name_the_argument_and_the_fix():
    out = run_ranks(_zero_bad_arguments, 1, timeout=120)[0]
    assert "pass model.parameters()" in out["module"], out
    assert "ProcessGroup" in out["process_group"] and "init_process_group" in out["process_group"], out
    assert "bucket_cap_mb" in out["bucket inf"] and "None for one bucket" in out["bucket nan"], out
    assert "reduce_dtype" in out["reduce int"] and "reduce_dtype" in out["reduce str"], out
    assert "stage must be 1" in out["stage"] and "stage must be 1" in out["stage float"], out
