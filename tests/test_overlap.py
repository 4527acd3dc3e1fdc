"""Buckets and overlap (zero_triton.comm.buckets, zero_triton.comm.prefetch) on 2-4 gloo ranks.

What is checked, each against a run that differs in one knob only:
- the parameters, the losses and the optimizer state after several steps are bitwise
  the same for every bucket size and with the parameter all-gathers overlapped with
  the forward or not, on a model with two param groups, fp32 and bf16 layers (bf16
  averaged in fp32), a tied weight, a frozen layer, an unused layer and clipping;
- they equal torch.optim.AdamW on the whole batch, within float tolerance;
- reduce-scatters really start during backward (from the second step on), not under
  no_sync; micro-batches with no_sync equal micro-batches without (bitwise), and
  gradients changed after backward (GradScaler.unscale_, by hand) are averaged again;
- a checkpoint saved with one bucket size and world size loads with any other;
- a rank that raises with buckets in flight fails the others with the bucket named;
- hooks go when the optimizer goes, and step() without backward does not hang.

Spawning ranks costs seconds here, so each rank runs every configuration in one go.
"""
import gc
import io
import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
# Imported before any ZeroAdam is built, as scripts import them at the top: the names keep
# the function objects of that moment, which ZeroAdam's routing must reach all the same.
from torch.nn.utils import clip_grad_norm_ as clip_imported_early
from torch.nn.utils import clip_grads_with_norm_ as clip_with_imported_early
from torch.nn.utils import get_total_norm as norm_imported_early

ROUTED_AT_IMPORT = any(getattr(f, "_zero_triton_routes", False) for f in (
    clip_imported_early, clip_with_imported_early, norm_imported_early))

sys.path.insert(0, os.path.dirname(__file__))
from dist_utils import RankError, delay_gathers, run_ranks  # noqa: E402

import zero_triton  # noqa: E402
from zero_triton import ZeroAdamW, checkpoint  # noqa: E402

STEPS = 4
VOCAB, WIDTH = 40, 24
TINY = 0.0015  # MiB: about 400 fp32 elements, so most layers get a bucket of their own


class Net(nn.Module):
    """Embedding tied to the output head, three residual blocks (the middle one in
    bf16), a frozen layer and a layer that forward never calls."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(),
                          nn.Linear(2 * WIDTH, WIDTH)) for _ in range(3))
        self.blocks[1].to(torch.bfloat16)
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(WIDTH, 3)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            dtype = block[1].weight.dtype
            h = h + block(h.to(dtype)).to(h.dtype)
        h = h + self.frozen(h)
        return self.head(h)


def param_groups(model):
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def batch(rank, step, n=6, seq=5):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randint(0, VOCAB, (n, seq), generator=g)
    return x, torch.randint(0, VOCAB, (n, seq), generator=g)


def loss_of(model, x, y):
    return nn.functional.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))


def train(rank, world_size, bucket_cap_mb, use_overlap, stage=1, accumulate=1, no_sync=True,
          touch_grads=False, steps=STEPS, scaler=False, inf_at=None, device="cpu", clip="opt",
          offload=None, grad_release=False):
    """Train a fresh Net; returns losses, parameters and the consolidated state. ``clip``:
    "opt" (max_grad_norm=0.5), "torch" (torch.nn.utils.clip_grad_norm_ after backward,
    after GradScaler.unscale_ with a scaler: nanoGPT's loop), "log" (max_grad_norm=0.5
    and, after unscale_, torch's clip_grad_norm_ with max_norm inf, as HF Trainer logs
    the norm), "accelerate" (accelerate's ``Accelerator.clip_grad_norm_``, the
    Accelerator made after the optimizer), "imported" (torch's clip_grad_norm_ by a name
    imported before the optimizer was built), "split" (torch's two calls by such names:
    get_total_norm over each ``.grad``, then clip_grads_with_norm_), "split_opt" (the norm
    from the optimizer's total_grad_norm, then torch's clip_grads_with_norm_), "none",
    or "unscale" (no clipping, GradScaler.unscale_ after backward). ``offload`` and
    ``grad_release``: ZeroAdamW's; ``held``: the gradient bytes (``memory_report``) after
    the last backward, before its step."""
    model = Net().to(device)
    opt = ZeroAdamW(param_groups(model), lr=3e-3, betas=(0.9, 0.95),
                    max_grad_norm=0.5 if clip in ("opt", "log") else None,
                    reduce_dtype=torch.float32, backend="torch", bucket_cap_mb=bucket_cap_mb,
                    stage=stage, offload=offload, grad_release=grad_release)
    amp = torch.amp.GradScaler(device, init_scale=2.0 ** 10) if scaler else None
    handle = zero_triton.overlap(model, opt) if use_overlap else None
    losses, launched, norms = [], [], []
    for step in range(steps):
        x, y = (t.to(device) for t in batch(rank, step))
        for k, (xs, ys) in enumerate(zip(x.chunk(accumulate), y.chunk(accumulate))):
            last = k == accumulate - 1
            loss = loss_of(model, xs, ys)
            if step == inf_at and rank == 0:  # one rank overflows: every rank must skip
                loss = loss * float("inf")
            scaled = amp.scale(loss) if amp is not None else loss
            if not last and no_sync:
                with opt.no_sync():
                    scaled.backward()
            else:
                scaled.backward()
            losses.append(float(loss.detach()) if last else None)
        launched.append(sum(b.launched for b in opt._reducer.buckets))
        held = opt.memory_report()["grads"]
        if touch_grads:  # after backward: what GradScaler.unscale_ or a user does
            for p in model.blocks[0].parameters():
                p.grad.mul_(0.5)
        if clip in ("torch", "log", "unscale", "imported", "split", "split_opt") and amp is not None:
            amp.unscale_(opt)
        if clip in ("torch", "log"):  # "log": HF Trainer's grad-norm logging, max_norm inf
            max_norm = 0.5 if clip == "torch" else float("inf")
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        if clip == "imported":
            norms.append(clip_imported_early(model.parameters(), 0.5).item())
        if clip in ("split", "split_opt"):
            total = (opt.total_grad_norm() if clip == "split_opt" else norm_imported_early(
                [p.grad for p in model.parameters() if p.grad is not None]))
            clip_with_imported_early(model.parameters(), 0.5, total)
            norms.append(total.item())
        if clip == "accelerate":  # made after the optimizer, as HF Trainer makes it
            if step == 0:
                from accelerate import Accelerator
                accelerator = Accelerator(cpu=True)
            norms.append(accelerator.clip_grad_norm_(model.parameters(), 0.5).item())
        if amp is not None:
            amp.step(opt)
            amp.update()
        else:
            opt.step()
        opt.zero_grad()
    opt.wait_params()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = opt.consolidated_state_dict(to_rank=0)
    if handle is not None:
        handle.remove()
    unused = {id(opt._reducer.bucket_of_param[id(p)]) for p in model.unused.parameters()}
    return {"losses": losses, "params": params, "state": state, "launched": launched, "norms": norms,
            "buckets": len(opt._reducer.buckets), "unused_buckets": len(unused),
            "memory": opt.memory_report(), "held": held, "scale": amp.get_scale() if amp is not None else None,
            "made": {role: n for (role, _), n in opt._reducer.made.items()}}


def packed(fn):
    """Rank results as bytes: tensors sent through a queue by a rank that then exits
    cannot be received (their file descriptors go with it)."""
    def job(rank, world_size, *args):
        buf = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buf)
        return buf.getvalue()
    job.__name__ = job.__qualname__ = fn.__name__
    job.__module__ = fn.__module__
    return job


def ranks(fn, world_size, *args, **kwargs):
    return [torch.load(io.BytesIO(r), weights_only=False)
            for r in run_ranks(fn, world_size, *args, **kwargs)]


CONFIGS = [(None, False, 1), (TINY, False, 1), (TINY, True, 1), (0.01, True, 1), (25, True, 1),
           (None, False, 2), (TINY, False, 2), (TINY, True, 2)]


@packed
def _job_knobs(rank, world_size):
    return {cfg: train(rank, world_size, *cfg) for cfg in CONFIGS}


def assert_bitwise(a, b, what):
    assert a["losses"] == b["losses"], f"{what}: losses {a['losses']} vs {b['losses']}"
    for n in a["params"]:
        x, y = a["params"][n], b["params"][n]
        assert torch.equal(x, y), f"{what}: parameter {n} differs by {(x.float() - y.float()).abs().max()}"
    if a["state"] is not None:
        for i, entry in a["state"]["state"].items():
            for k, v in entry.items():
                assert torch.equal(v, b["state"]["state"][i][k]), f"{what}: state {i} {k} differs"


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_bucket_size_and_overlap_change_no_bit(world_size):
    results = ranks(_job_knobs, world_size, timeout=240)
    for rank, by_cfg in enumerate(results):
        base = by_cfg[CONFIGS[0]]
        assert by_cfg[(TINY, False, 1)]["buckets"] > 8, "the tiny cap should cut many buckets"
        assert base["buckets"] == 4, "one bucket per flat buffer (2 groups x fp32, bf16)"
        for cfg in CONFIGS[1:]:
            assert_bitwise(by_cfg[cfg], base, f"rank {rank}, {world_size} ranks, bucket_cap_mb="
                           f"{cfg[0]}, overlap={cfg[1]}, stage {cfg[2]} vs one bucket, stage 1")
        # Every rank holds the same model after every configuration.
        for n, p in base["params"].items():
            assert torch.equal(p, results[0][CONFIGS[0]]["params"][n]), f"rank {rank}: {n} differs from rank 0"
        # From the second step on, backward launched every bucket but those holding the
        # unused layer (reduced at step).
        for stage in (1, 2):
            tiny = by_cfg[(TINY, True, stage)]
            if stage == 1:
                assert tiny["launched"][0] == 0, \
                    "stage 1 must not launch during the first backward (order unknown)"
            assert all(n == tiny["buckets"] - tiny["unused_buckets"] for n in tiny["launched"][1:]), \
                f"rank {rank}, stage {stage}: buckets launched during backward per step " \
                f"{tiny['launched']} of {tiny['buckets']}"


@packed
def _job_reference(rank, world_size):
    out = train(rank, world_size, TINY, True)
    # Every rank's batches, gathered, for a single-process torch.optim.AdamW run.
    return out


def test_equals_torch_adamw_on_the_whole_batch():
    world_size = 2
    results = ranks(_job_reference, world_size, timeout=120)
    model = Net()
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    masters = {id(p): p.detach().float().clone().requires_grad_() for p in decay + rest}
    opt = torch.optim.AdamW([{"params": [masters[id(p)] for p in decay], "weight_decay": 0.1},
                             {"params": [masters[id(p)] for p in rest], "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95))
    for step in range(STEPS):
        grads = {}
        for rank in range(world_size):
            for p in decay + rest:
                p.grad = None
            loss_of(model, *batch(rank, step)).backward()
            for p in decay + rest:
                if p.grad is not None:
                    grads[id(p)] = grads.get(id(p), 0) + p.grad.float() / world_size
        for p in decay + rest:  # never reached (the unused layer): not stepped, as in torch
            masters[id(p)].grad = grads.get(id(p))
        torch.nn.utils.clip_grad_norm_(list(masters.values()), 0.5)
        opt.step()
        with torch.no_grad():
            for p in decay + rest:
                p.copy_(masters[id(p)])
    for n, p in model.named_parameters():
        got = results[0]["params"][n]
        tol = dict(rtol=2e-2, atol=2e-2) if p.dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.float(), p.detach().float(), **tol, msg=f"parameter {n}")


@packed
def _job_accumulation(rank, world_size):
    with_sync = train(rank, world_size, TINY, False, accumulate=3, no_sync=True)
    without = train(rank, world_size, TINY, False, accumulate=3, no_sync=False)
    one_bucket = train(rank, world_size, None, False, accumulate=3, no_sync=True)
    touched = train(rank, world_size, TINY, True, touch_grads=True)
    touched_ref = train(rank, world_size, None, False, touch_grads=True)
    stage2 = train(rank, world_size, TINY, True, stage=2, accumulate=3)
    scaled = {stage: train(rank, world_size, TINY, True, stage=stage, scaler=True, inf_at=1)
              for stage in (1, 2)}
    return with_sync, without, one_bucket, touched, touched_ref, stage2, scaled


def test_no_sync_and_grads_changed_after_backward():
    for rank, (with_sync, without, one_bucket, touched, touched_ref, stage2, scaled) in enumerate(
            ranks(_job_accumulation, 3, timeout=300)):
        # no_sync: nothing launched in the accumulating backward passes, the last one
        # launches everything (from the second step).
        expect = with_sync["buckets"] - with_sync["unused_buckets"]
        assert with_sync["launched"][1:] == [expect] * (STEPS - 1), with_sync["launched"]
        assert_bitwise(without, with_sync, f"rank {rank}: accumulating without no_sync vs with")
        assert_bitwise(one_bucket, with_sync, f"rank {rank}: accumulation, one bucket vs tiny buckets")
        assert_bitwise(touched, touched_ref, f"rank {rank}: .grad halved after backward, buckets vs one")
        assert not all(torch.equal(touched["params"][n], touched_ref["params"][n]) and
                       torch.equal(touched["params"][n], one_bucket["params"][n])
                       for n in touched["params"]), "the touched run should differ from the plain one"
        # Stage 2 averages every micro-batch and adds the averages: the same sum in
        # another order, so equal within float tolerance, not bitwise.
        assert stage2["launched"][1:] == [stage2["buckets"] - stage2["unused_buckets"]] * (STEPS - 1)
        for n, p in with_sync["params"].items():
            # Adam turns rounding differences of small gradients into differences of
            # up to lr per step: 4 steps at lr 3e-3 moved the parameters by 1e-5 here.
            tol = dict(rtol=1e-2, atol=4e-3) if p.dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(stage2["params"][n].float(), p.float(), **tol,
                                       msg=f"rank {rank}: stage 2 accumulation vs stage 1, {n}")
        # GradScaler with an overflow on rank 0 at step 1: both stages skip it together,
        # back the scale off once, and end bitwise equal.
        assert scaled[1]["scale"] == scaled[2]["scale"] == 2.0 ** 9, (scaled[1]["scale"], scaled[2]["scale"])
        assert_bitwise(scaled[2], scaled[1], f"rank {rank}: GradScaler with an inf, stage 2 vs 1")


@packed
def _job_checkpoint(rank, world_size, path, save_cfg, load_world):
    cap, steps = save_cfg
    if world_size != max(2, load_world):
        raise AssertionError("unexpected world size")
    group = dist.new_group(list(range(2)))
    state = None
    if rank < 2:  # save at 2 ranks with one bucket size
        model = Net()
        opt = ZeroAdamW(param_groups(model), lr=1e-2, bucket_cap_mb=cap, backend="torch",
                        reduce_dtype=torch.float32, process_group=group)
        zero_triton.overlap(model, opt)
        for step in range(steps):
            loss_of(model, *batch(rank, step)).backward()
            opt.step()
            opt.zero_grad()
        checkpoint.save(path, opt, model)  # waits for the gathers left in flight
        state = opt.consolidated_state_dict(to_rank=0)
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    dist.barrier()
    loaded = {}
    for cap2, stage in ((None, 1), (TINY, 1), (TINY, 2)):  # other bucket sizes, world size, stage
        sub = dist.new_group(list(range(load_world)))
        if rank < load_world:
            model2 = Net()
            with torch.no_grad():
                for p in model2.parameters():
                    p.add_(1.0)
            opt2 = ZeroAdamW(param_groups(model2), lr=1.0, bucket_cap_mb=cap2, backend="torch",
                             reduce_dtype=torch.float32, process_group=sub, stage=stage)
            checkpoint.load(path, opt2, model2)
            loaded[(cap2, stage)] = (opt2.consolidated_state_dict(to_rank=0),
                                     {n: p.detach().clone() for n, p in model2.named_parameters()})
            if stage == 2:  # and it trains on, and saves what stage 1 reads back
                loss_of(model2, *batch(rank, 9)).backward()
                opt2.step()
                checkpoint.save(path + "-s2", opt2, model2)
                again = opt2.consolidated_state_dict(to_rank=0)
                model3 = Net()
                opt3 = ZeroAdamW(param_groups(model3), lr=1.0, backend="torch", process_group=sub,
                                 reduce_dtype=torch.float32)
                checkpoint.load(path + "-s2", opt3, model3)
                loaded["stage 2 saved"] = (again, opt3.consolidated_state_dict(to_rank=0))
        dist.barrier()
    return state, params if rank < 2 else None, loaded


@pytest.mark.parametrize("load_world", [3, 4])
def test_checkpoint_loads_with_any_bucket_size_and_world_size(tmp_path, load_world):
    path = str(tmp_path / "ck")
    results = ranks(_job_checkpoint, load_world, path, (TINY, 2), load_world, timeout=180)
    state, params, _ = results[0]
    again, reread = results[0][2].pop("stage 2 saved")
    for i, entry in again["state"].items():
        for k, v in entry.items():
            assert torch.equal(reread["state"][i][k], v), f"saved at stage 2, loaded at stage 1: {i} {k}"
    for cap2, (got, got_params) in results[0][2].items():
        for n in params:
            assert torch.equal(got_params[n], params[n]), f"bucket_cap_mb={cap2}: parameter {n}"
        assert got["param_groups"][0]["lr"] == 1e-2
        for i, entry in state["state"].items():
            for k, v in entry.items():
                assert torch.equal(got["state"][i][k], v), \
                    f"saved with bucket_cap_mb={TINY} at 2 ranks, loaded with {cap2} at " \
                    f"{load_world}: state {i} {k} differs"


def _job_fault(rank, world_size):
    model = Net()
    opt = ZeroAdamW(param_groups(model), lr=1e-2, bucket_cap_mb=TINY, backend="torch")
    for step in range(2):
        loss = loss_of(model, *batch(rank, step))
        if step == 1 and rank == 1:
            raise RuntimeError("rank 1 gives up before its backward")
        loss.backward()
        opt.step()
        opt.zero_grad()
    return "finished"


def test_a_rank_that_raises_mid_step_fails_the_others_naming_the_bucket():
    with pytest.raises(RankError) as info:
        run_ranks(_job_fault, 2, timeout=120, pg_timeout_s=8)
    errors = info.value.errors
    assert "gives up" in errors[1]
    assert 0 in errors, f"rank 0 did not fail: {errors}"
    assert "bucket" in errors[0] and "failed on rank 0" in errors[0], errors[0]


def _job_dies_in_backward(rank, world_size, report, stage):
    """Rank 1 dies (no Python error, no goodbye) half-way through its second backward,
    while rank 0's buckets are in flight."""
    model = Net()
    opt = ZeroAdamW(param_groups(model), lr=1e-2, bucket_cap_mb=TINY, backend="torch", stage=stage)
    at = {"step": 0}
    if rank == 1:  # a middle layer: later layers' buckets went already
        model.blocks[1][1].weight.register_post_accumulate_grad_hook(
            lambda p: os._exit(3) if at["step"] == 1 else None)
    for step in range(2):
        at["step"] = step
        try:
            loss_of(model, *batch(rank, step)).backward()
            opt.step()
        except RuntimeError as exc:
            with open(report, "w") as f:
                f.write(str(exc))
            raise
        opt.zero_grad()
    return "finished"


@pytest.mark.parametrize("stage", [1, 2])
def test_a_rank_that_dies_in_backward_fails_the_others_naming_where_they_waited(tmp_path, stage):
    report = str(tmp_path / "report")
    with pytest.raises(RuntimeError, match=r"ranks \[1\] died without reporting"):
        run_ranks(_job_dies_in_backward, 2, report, stage, timeout=120, pg_timeout_s=10)
    msg = open(report).read()
    # Rank 0 fails where it first waits on rank 1: a bucket's average it needs a buffer
    # back from, or (no receive scratch at two ranks, ZeRO-1) the step's agreement.
    assert "failed on rank 0" in msg and "peer rank" in msg, msg
    assert "of bucket" in msg or "step failed" in msg, msg


class FunctionalHead(nn.Module):
    """Reads ``proj.weight`` in its own forward without calling ``proj`` (which it does
    not own): no forward pre-hook of an owner runs before the read."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.proj = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, x):
        return nn.functional.linear(self.emb(x), self.proj.weight)


def _job_unwaited_forward(rank, world_size, case):
    """Two steps with overlap; the second forward does not wait for the all-gathers."""
    torch._dynamo.reset()
    model = FunctionalHead() if case == "functional" else Net()
    opt = ZeroAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=TINY, backend="torch")
    if case != "compiled before overlap":
        zero_triton.overlap(model, opt)
    fwd = model if case == "functional" else torch.compile(model, backend="aot_eager")
    try:
        for step in range(3):
            loss_of(fwd, *batch(rank, step)).backward()
            opt.step()
            opt.zero_grad()
            if step == 0 and case == "compiled before overlap":
                zero_triton.overlap(model, opt)  # the compiled graph skips these hooks
    except RuntimeError as exc:
        return str(exc)
    finally:
        opt.wait_params()
    return "trained"


@pytest.mark.parametrize("case", ["functional", "compiled before overlap", "overlap before compile"])
def test_a_forward_that_did_not_wait_for_the_all_gathers_is_refused(case):
    """The forward read parameters whose all-gather was never waited for (stale values,
    silently, before): backward refuses, naming both causes and their fixes. A model
    compiled after overlap() waits (the compiled graph runs the hooks) and trains; so does
    a module reading another's weight functionally (the first forward after overlap()
    learns which module reads it, whose pre-hook then waits for it)."""
    for rank, msg in enumerate(run_ranks(_job_unwaited_forward, 2, case, timeout=180)):
        if case in ("overlap before compile", "functional"):
            assert msg == "trained", f"rank {rank}: {msg}"
            continue
        assert msg.startswith("zero_triton.overlap: backward reached a parameter of bucket") and \
            "call overlap() before the first forward" in msg and "wait_params()" in msg, \
            f"rank {rank}, {case}: {msg}"


class _UserMode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _job_reads_between_step_and_forward(rank, world_size, stage):
    """After each overlapped step, before the next forward: what users read parameters
    for (an EMA by swa_utils and by torch._foreach_lerp_, a clone, a norm, repr,
    tolist, a copy moved by .to()) against the values once the gathers are waited, and
    a write by ``p.data =`` kept. Rank 1
    starts its gathers late, so without the wait rank 0 reads its shard half-gathered."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    from torch.overrides import _get_current_function_mode_stack as modes
    model = Net()
    opt = ZeroAdamW(param_groups(model), lr=1e-2, stage=stage, bucket_cap_mb=TINY, backend="torch")
    zero_triton.overlap(model, opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5), use_buffers=False)
    lerped = [p.detach().clone() for p in model.parameters()]
    out = {"stale": [], "hidden": [], "stacks": []}
    if rank == 1:
        delay_gathers(opt, 0.1)
    with torch.device("cpu"):  # a DeviceContext at the bottom of the stack stays there
        for step in range(3):
            loss_of(model, *batch(rank, step)).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with _UserMode():  # a mode around step() pops its own on exit
                opt.step()
            sched.step()
            opt.zero_grad()
            x, y = batch(rank, step + 1)
            guard = opt._reducer.reads.latest
            out["hidden"].append(guard is not None and guard.active)  # nothing above waited
            out["stacks"].append([type(m).__name__ for m in modes()])
            if step == 1:  # a write by assignment, kept (the gather landed before it)
                bias = model.blocks[0][1].bias  # (shape and dtype: metadata, no wait)
                bias.data = torch.full(tuple(bias.shape), 0.5, dtype=bias.dtype)
            params = list(model.parameters())
            ema_before = [e.detach().clone() for e in ema.parameters()]
            lerp_before = [t.clone() for t in lerped]
            seen = {"clone": [p.detach().clone() for p in params] if step != 1 else None,
                    "norm": torch.cat([p.detach().float().flatten() for p in params]).norm()
                    if step == 1 else None,
                    "repr": repr(params[-1]) if step == 2 else None,
                    "tolist": params[0].tolist() if step == 2 else None}
            if step == 0:
                moved = [p.to(torch.float64) for p in params]
            ema.update_parameters(model)
            torch._foreach_lerp_(lerped, [p.detach() for p in params], 0.5)
            opt.wait_params()
            now = [p.detach().clone() for p in model.parameters()]
            ok = all(torch.equal(e, torch.lerp(b, n, 0.5)) for e, b, n in zip(ema.parameters(), ema_before, now)) \
                if step else True
            ok &= all(torch.equal(t, torch.lerp(b, n, 0.5)) for t, b, n in zip(lerped, lerp_before, now))
            if seen["clone"] is not None:
                ok &= all(torch.equal(a, b) for a, b in zip(seen["clone"], now))
            if seen["norm"] is not None:
                ok &= bool(seen["norm"] == torch.cat([n.float().flatten() for n in now]).norm())
            if seen["repr"] is not None:
                ok &= seen["repr"] == repr(model.head.weight if params[-1] is model.head.weight else params[-1])
                ok &= seen["tolist"] == now[0].tolist()
            if step == 0:
                ok &= all(torch.equal(m, n.to(torch.float64)) for m, n in zip(moved, now))
            if step == 1:
                ok &= bool((model.blocks[0][1].bias == 0.5).all())
            out["stale"].append(not ok)
            loss_of(model, x, y)  # the next forward
            out["stacks"].append([type(m).__name__ for m in modes()])
    out["stacks"].append([type(m).__name__ for m in modes()])
    return out


class _ModesSeen(torch.utils.data.Dataset):
    """Each item: how many torch function modes and open side channels the worker process
    that made it holds."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        from torch.overrides import _get_current_function_mode_stack

        from zero_triton.comm import side
        return torch.tensor([len(_get_current_function_mode_stack()), len(side.open_channels())])


def _job_fork_after_step(rank, world_size):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    opt = ZeroAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=TINY)
    zero_triton.overlap(model, opt)
    if rank == 1:
        delay_gathers(opt, 0.2)
    out = {}
    for epoch in range(2):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        out[f"guarded {epoch}"] = opt._reducer.reads.latest is not None
        # An epoch's iter(loader) forks its workers right after the last step().
        loader = torch.utils.data.DataLoader(_ModesSeen(), batch_size=2, num_workers=1,
                                             multiprocessing_context="fork")
        out[f"worker modes {epoch}"] = [int(b[:, 0].max()) for b in loader]
        out[f"worker channels {epoch}"] = [int(b[:, 1].max()) for b in loader]
    opt.wait_params()
    return out


def test_a_process_forked_after_step_holds_no_guard_and_no_side_channel():
    """A DataLoader worker forked between step() and the next forward (each epoch's
    iter(loader)) drops the guard it inherits: it has no gathers to wait for, and its
    operations are not checked against the parent's buffers. Nor does it hold the
    parent's side channel: at its end it left it, an all-gather none of its threads
    ran, and each worker's end took 5 s (20 s an epoch with four workers)."""
    for rank, out in enumerate(run_ranks(_job_fork_after_step, 2, timeout=120)):
        for epoch in range(2):
            assert out[f"guarded {epoch}"], (rank, out)  # the parent holds one
            assert out[f"worker modes {epoch}"] == [0, 0], (rank, out)
            assert out[f"worker channels {epoch}"] == [0, 0], (rank, out)


@pytest.mark.parametrize("stage", [1, 2])
def test_reading_parameters_between_step_and_forward_waits_for_the_gathers(stage):
    """Under overlap(), reading a parameter after step() without wait_params() read
    values half gathered, silently. Any torch operation on a parameter in that window
    waits for the gathers first, while zero_grad, clipping, a scheduler and building the
    next batch wait for nothing (the gathers stay hidden behind the next forward); the
    mode that does it sits under the user's modes and is gone after the forward."""
    for rank, out in enumerate(run_ranks(_job_reads_between_step_and_forward, 2, stage, timeout=180)):
        assert out["stale"] == [False] * 3, (rank, out)
        assert out["hidden"] == [True] * 3, (rank, out)
        assert out["stacks"] == [["DeviceContext", "PendingReads"], ["DeviceContext"]] * 3 + [[]], (rank, out)


def _job_compiled_ema(rank, world_size):
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = ZeroAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=TINY)
    zero_triton.overlap(model, opt)
    ema = [p.detach().clone() for p in model.parameters()]

    @torch.compile(backend="inductor")
    def update(ema, params):
        for e, p in zip(ema, params):
            e.lerp_(p.detach(), 0.5)
    if rank == 1:
        delay_gathers(opt, 0.1)
    stale = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * rank + step)
        model(torch.randn(4, 16, generator=g)).pow(2).mean().backward()
        opt.step()
        before = [e.clone() for e in ema]
        update(ema, list(model.parameters()))
        opt.zero_grad()
        opt.wait_params()
        stale.append(not all(torch.equal(e, torch.lerp(b, p.detach(), 0.5))
                             for e, b, p in zip(ema, before, model.parameters())))
    return stale


def test_a_compiled_read_between_step_and_forward_waits_too():
    """An EMA update compiled by inductor ran its graph without the wait (stale from its
    second call on): operations traced while the gathers are pending break the graph
    and run the check eagerly."""
    for rank, stale in enumerate(run_ranks(_job_compiled_ema, 2, timeout=300)):
        assert stale == [False] * 3, (rank, stale)


def _job_lifecycle(rank, world_size):
    model = Net()
    refused = []
    for bad in ({"stage": 3}, {"bucket_cap_mb": 0}, {"bucket_cap_mb": "25"}):
        try:
            ZeroAdamW(param_groups(model), lr=1e-2, backend="torch", **bad)
        except ValueError as exc:
            refused.append(str(exc))
    hooks_after_refusals = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    opt = ZeroAdamW(param_groups(model), lr=1e-2, bucket_cap_mb=TINY, backend="torch")
    zero_triton.overlap(model, opt)
    # step() without any backward, then with one: no hang, nothing stepped at first.
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    opt.zero_grad()
    unchanged = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    loss_of(model, *batch(rank, 0)).backward()
    opt.step()
    # A submodule's state_dict() right after an overlapped step holds the gathered
    # parameters (then the whole model's, which wait for the rest).
    block = {k: v.clone() for k, v in model.blocks[2].state_dict().items()}
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    same = all(torch.equal(sd[n], p) for n, p in model.named_parameters()) and \
        all(torch.equal(block[k], sd[f"blocks.2.{k}"]) for k in block)
    hooks = sum(len(p._post_accumulate_grad_hooks or {}) + len(p._backward_hooks or {})
                for p in model.parameters())
    module_hooks = sum(len(m._forward_pre_hooks) + len(m._state_dict_pre_hooks) for m in model.modules())
    del opt
    gc.collect()
    left = sum(len(p._post_accumulate_grad_hooks or {}) + len(p._backward_hooks or {})
               for p in model.parameters())
    module_left = sum(len(m._forward_pre_hooks) + len(m._state_dict_pre_hooks) for m in model.modules())
    return unchanged, same, hooks, left, module_hooks, module_left, refused, hooks_after_refusals


def test_step_without_backward_and_hooks_go_with_the_optimizer():
    for rank, (unchanged, same, hooks, left, module_hooks, module_left, refused,
               hooks_after_refusals) in enumerate(run_ranks(_job_lifecycle, 2, timeout=120)):
        assert len(refused) == 3, refused
        assert "stage must be 1" in refused[0] and "bucket_cap_mb must be a number > 0" in refused[1]
        assert hooks_after_refusals == 0, "a refused constructor left hooks on the parameters"
        assert unchanged, f"rank {rank}: step() without backward changed a parameter"
        assert same, f"rank {rank}: model.state_dict() after an overlapped step is not the parameters"
        assert hooks > 0 and module_hooks > 0, "the optimizer should have put hooks on"
        assert left == 0, f"rank {rank}: {left} grad hooks left after the optimizer was dropped"
        assert module_left == 0, f"rank {rank}: {module_left} forward pre-hooks left"



class Routed(nn.Module):
    """Two experts; on odd steps rank 1 routes nothing to the second (data-dependent
    use, as a mixture of experts whose expert gets no tokens)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.inp = nn.Linear(8, 16)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x, use_b=True):
        h = torch.relu(self.inp(x))
        h = self.a(h) + (self.b(h) if use_b else 0)
        return self.out(h)


def _routed(rank, cap, steps=4, mismatch_at=None, skip_b=(1,)):
    """The ranks ``skip_b``'s backward skips ``b`` on odd steps. ``mismatch_at``: at that
    step rank 1 takes its launches for others (as if the ranks had launched different
    buckets), at step 0 where every rank has every gradient (the step's entry agreement
    finds it) or at step 1 where rank 1 lacks b's (the all-reduce that learns which finds
    it). Also counts the all-reduces each step ran on the data group, and whether b moved
    at a step where it had no gradient anywhere."""
    model = Routed()
    opt = ZeroAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=cap, backend="torch")
    all_reduce, calls, b_moved = dist.all_reduce, [], False

    def counted(*args, **kwargs):
        calls.append(1)
        return all_reduce(*args, **kwargs)
    for step in range(steps):
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(5, 8, generator=g)
        model(x, use_b=not (rank in skip_b and step % 2 == 1)).pow(2).mean().backward()
        if step == mismatch_at:
            opt._reducer.signature += rank
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        dist.all_reduce = counted
        try:
            opt.step()
        except RuntimeError as exc:
            unchanged = all(torch.equal(before[n], p) for n, p in model.named_parameters())
            return {"error": str(exc), "unchanged": unchanged}
        finally:
            dist.all_reduce = all_reduce
        if step % 2 == 1 and len(skip_b) == 2:
            b_moved = b_moved or any(not torch.equal(before[f"b.{n}"], p) for n, p in model.b.named_parameters())
        opt.zero_grad()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "all_reduces": len(calls), "b_moved": b_moved}


@packed
def _job_routed(rank, world_size):
    return (_routed(rank, 0.0003), _routed(rank, None), _routed(rank, 0.0003, skip_b=(0, 1)),
            _routed(rank, 0.0003, mismatch_at=0), _routed(rank, 0.0003, mismatch_at=1))


def test_rank_dependent_parameters_and_launches_that_differ():
    """A parameter reached on some ranks only: with one backward per step every rank
    still launches the buckets in the agreed order, so buckets change no bit. Only the
    steps where the ranks lack different gradients all-reduce (which parameters step);
    the others agree on the host, including steps where every rank lacks b's, which then
    do not move it. If the ranks did launch different buckets (simulated), the step is
    refused on every rank before it changes anything, whichever way it agreed."""
    for rank, (tiny, one, nowhere, *differ) in enumerate(ranks(_job_routed, 2, timeout=120)):
        for n, p in one["params"].items():
            assert torch.equal(tiny["params"][n], p), f"rank {rank}: {n} differs with buckets"
        for run in (tiny, one):  # 4 steps, rank 1 lacking b's gradient at 2 of them
            assert run["all_reduces"] == 2, f"rank {rank}: {run['all_reduces']} all-reduces in 4 steps"
        assert nowhere["all_reduces"] == 0 and not nowhere["b_moved"], (rank, nowhere["all_reduces"])
        for d in differ:
            assert "averaged different buckets" in d["error"] and "bucket_cap_mb=None" in d["error"], d
            assert d["unchanged"], f"rank {rank}: the refused step changed parameters"


def _moved_while_gathering(rank, wait_first):
    model = Net()
    opt = ZeroAdamW(param_groups(model), lr=1e-2, bucket_cap_mb=TINY, backend="torch")
    zero_triton.overlap(model, opt)
    for step in range(2):
        loss_of(model, *batch(rank, step)).backward()
        if step == 1 and rank == 1:  # rank 1 is slow to send its shards: rank 0's land late
            delay_gathers(opt, 0.05)
        opt.step()
        opt.zero_grad()
    if wait_first:
        opt.wait_params()
    model.to(torch.bfloat16)  # while (unless waited) the all-gathers are still in flight
    loss = loss_of(model, *batch(rank, 9))  # the forward waits; the moved parameters are put right
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss_of(model, *batch(rank, 10)).backward()
    opt.step()  # re-homes the moved parameters and trains on
    opt.wait_params()
    return float(loss.detach()), params, {n: p.detach().clone() for n, p in model.named_parameters()}


@packed
def _job_moved(rank, world_size):
    return _moved_while_gathering(rank, True), _moved_while_gathering(rank, False)


def test_model_to_while_the_all_gathers_are_in_flight():
    """model.to() between an overlapped step and the next forward copies parameters whose
    all-gather has not landed; the wait puts the gathered values into the moved ones, so
    the run equals one that waited first (bitwise), on every rank."""
    for rank, (waited, moved) in enumerate(ranks(_job_moved, 2, timeout=120)):
        assert moved[0] == waited[0], f"rank {rank}: loss after model.to {moved[0]} vs {waited[0]}"
        for k in (1, 2):
            for n, p in waited[k].items():
                assert torch.equal(moved[k][n], p), f"rank {rank}: {n} differs ({'before' if k == 1 else 'after'} the next step)"
