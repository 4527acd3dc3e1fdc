"""torch.nn.utils.clip_grad_norm_ under ZeroAdam (zero_triton.integrations.clip_grad), on gloo ranks.

- over model.parameters() it clips by the global norm of the averaged gradients: the
  same bits as max_grad_norm at stage 1 and 2, with tiny buckets and overlap, with
  GradScaler.unscale_ first (nanoGPT's loop), and the norm it returns is torch's norm of
  the whole batch's gradient; measuring the norm with it (max_norm inf, as HF Trainer
  logs it) leaves max_grad_norm in force; so does the function by a name imported before
  the optimizer was built, and torch's two calls (get_total_norm, clip_grads_with_norm_),
  whose norm of nothing at stage 2 is refused with the fix;
- GradScaler.unscale_ after backward averaged the buckets: they are averaged again;
- a subset of the optimizer's parameters, or two optimizers' at once, is refused with
  the fix, as is clip_grad_value_ (it would clamp local gradients, or find none); error_if_nonfinite is honoured; a second call sees the clipped gradients;
- anything else goes to torch's function unchanged: FusedAdam and world size 1, plain
  tensors, a ZeroAdam that was dropped; and the parameters stay picklable.
"""
import io
import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from dist_utils import run_ranks  # noqa: E402
from test_overlap import (STEPS, TINY, Net, assert_bitwise, batch, loss_of, packed,  # noqa: E402
                          param_groups, ranks, train)

import test_overlap  # noqa: E402

from zero_triton import FusedAdamW, ZeroAdamW  # noqa: E402

RUNS = {
    "stage 1": dict(bucket_cap_mb=TINY, use_overlap=True),
    "stage 2": dict(bucket_cap_mb=TINY, use_overlap=True, stage=2),
    "stage 1, one bucket": dict(bucket_cap_mb=None, use_overlap=False),
    "stage 1, GradScaler.unscale_ first": dict(bucket_cap_mb=TINY, use_overlap=False, scaler=True),
    "stage 2, GradScaler.unscale_ first": dict(bucket_cap_mb=TINY, use_overlap=False, stage=2,
                                               scaler=True),
}


@packed
def _job_same_bits(rank, world_size):
    return {(name, clip): train(rank, world_size, clip=clip, **kwargs)
            for name, kwargs in RUNS.items() for clip in ("opt", "torch", "log", "imported")}


def test_torch_clip_equals_max_grad_norm_and_returns_the_global_norm():
    results = ranks(_job_same_bits, 2, timeout=240)
    for rank, out in enumerate(results):
        for name in RUNS:
            assert_bitwise(out[name, "torch"], out[name, "opt"],
                           f"rank {rank}, {name}: torch.nn.utils.clip_grad_norm_ vs max_grad_norm")
            # by a name imported before the optimizer existed (each rank clipped by its
            # local norm at stage 1, and nothing at stage 2, before it was routed in place)
            assert_bitwise(out[name, "imported"], out[name, "opt"],
                           f"rank {rank}, {name}: clip_grad_norm_ imported early vs max_grad_norm")
            assert out[name, "imported"]["norms"] == out[name, "torch"]["norms"], (name, rank)
            # Measuring the norm with max_norm inf (HF Trainer's logging) leaves the
            # optimizer's own max_grad_norm in force, and reads the same norm.
            assert_bitwise(out[name, "log"], out[name, "opt"],
                           f"rank {rank}, {name}: max_grad_norm with the norm logged vs not")
            assert out[name, "log"]["norms"] == out[name, "torch"]["norms"], (name, rank)
            norms = out[name, "torch"]["norms"]
            assert len(norms) == STEPS and norms == results[0][name, "torch"]["norms"], \
                f"rank {rank}, {name}: every rank returns the same global norm, got {norms}"
    # The returned norm is torch's on the whole batch's gradient (first step: same weights).
    model = Net()
    params = [p for p in model.parameters() if p.requires_grad]
    for r in range(2):
        loss_of(model, *batch(r, 0)).backward()
    for p in params:
        if p.grad is not None:
            p.grad.div_(2)
    expect = torch.nn.utils.clip_grad_norm_(params, 0.5).item()
    got = results[0]["stage 1", "torch"]["norms"][0]
    assert got == pytest.approx(expect, rel=1e-2), f"global norm {got} vs torch's {expect}"
    assert got > 0.5, "the test must clip: the norm should exceed max_norm"


@packed
def _job_split(rank, world_size):
    out = {}
    for name, kwargs in RUNS.items():
        for clip in ("opt", "split", "split_opt"):
            try:
                out[name, clip] = train(rank, world_size, clip=clip, **kwargs)
            except ValueError as e:
                out[name, clip] = str(e)
    return out, test_overlap.ROUTED_AT_IMPORT


def test_torch_split_clipping_clips_by_the_global_norm_or_is_refused_with_the_fix():
    """torch's two calls, ``get_total_norm`` over each ``.grad`` then
    ``clip_grads_with_norm_``, by names imported before the optimizer was built: left to
    torch under ZeroAdam, each rank clipped its local gradients by its own norm (stage 1),
    or nothing at all (stage 2: no ``.grad``), without a word. At stage 1 they clip by the
    global norm, the same bits as max_grad_norm; at stage 2 the norm of nothing is refused
    naming the fix, and the optimizer's ``total_grad_norm`` with torch's
    ``clip_grads_with_norm_`` gives max_grad_norm's bits."""
    results = ranks(_job_split, 2, timeout=240)
    for rank, (out, routed_at_import) in enumerate(results):
        assert not routed_at_import, "the names were imported after the routing: untested"
        for name in RUNS:
            assert_bitwise(out[name, "split_opt"], out[name, "opt"],
                           f"rank {rank}, {name}: total_grad_norm + clip_grads_with_norm_")
            norms = out[name, "split_opt"]["norms"]
            assert norms == results[0][0][name, "split_opt"]["norms"] and norms[0] > 0.5, \
                f"rank {rank}, {name}: the global norm on every rank, above max_norm: {norms}"
            if name.startswith("stage 2"):
                message = out[name, "split"]
                assert isinstance(message, str) and "optimizer.total_grad_norm()" in message, \
                    (name, message)
            else:
                assert_bitwise(out[name, "split"], out[name, "opt"],
                               f"rank {rank}, {name}: get_total_norm + clip_grads_with_norm_")
                assert out[name, "split"]["norms"] == norms, (name, rank)


@packed
def _job_accelerate(rank, world_size):
    imported = "accelerate.accelerator" in sys.modules
    out = {(name, clip): train(rank, world_size, clip=clip, **RUNS[name])
           for name in ("stage 1", "stage 2") for clip in ("opt", "accelerate")}
    return out, imported


def test_accelerate_clip_equals_max_grad_norm_even_imported_after_the_optimizer():
    """accelerate's ``Accelerator.clip_grad_norm_`` without DDP: from accelerate 1.16 it
    takes the norm of each ``.grad`` itself, which under ZeroAdam clipped each rank by its
    local norm (stage 1) or nothing (stage 2). It clips by the global norm, with accelerate
    imported after the first ZeroAdam was built (the import is watched for)."""
    pytest.importorskip("accelerate", reason="accelerate is not installed (pip install accelerate)")
    results = ranks(_job_accelerate, 2, timeout=240)
    for rank, (out, imported) in enumerate(results):
        assert not imported, "accelerate was imported before the job: the import hook went untested"
        for name in ("stage 1", "stage 2"):
            assert_bitwise(out[name, "accelerate"], out[name, "opt"],
                           f"rank {rank}, {name}: Accelerator.clip_grad_norm_ vs max_grad_norm")
            norms = out[name, "accelerate"]["norms"]
            assert norms == results[0][0][name, "accelerate"]["norms"] and norms[0] > 0.5, \
                f"rank {rank}, {name}: the global norm on every rank, above max_norm: {norms}"


@packed
def _job_unscale(rank, world_size):
    kw = dict(bucket_cap_mb=TINY, use_overlap=True, scaler=True)
    return {clip: train(rank, world_size, clip=clip, **kw) for clip in ("none", "unscale")}


def test_grad_scaler_unscale_after_the_buckets_went():
    """GradScaler.unscale_ rescales .grad in place with an op that leaves the version
    counter alone, after backward has averaged the buckets from the scaled gradients:
    ZeroAdam must average them again (it used the scaled ones, 1024x too large)."""
    for rank, out in enumerate(ranks(_job_unscale, 2, timeout=120)):
        assert out["unscale"]["launched"][1:] == out["none"]["launched"][1:] != [0] * (STEPS - 1)
        assert_bitwise(out["unscale"], out["none"], f"rank {rank}: unscale_ then step vs step")


@packed
def _job_refusals(rank, world_size):
    out = {}
    model = Net()
    opt = ZeroAdamW(param_groups(model), lr=1e-3, stage=2)
    loss_of(model, *batch(rank, 0)).backward()
    params = list(model.parameters())
    extra = nn.Parameter(torch.ones(2))
    extra.grad = torch.ones(2)
    for what, subset in {"subset": params[:3], "plus another model's gradient": params + [extra]}.items():
        try:
            torch.nn.utils.clip_grad_norm_(subset, 1.0)
            out[what] = "accepted"
        except ValueError as exc:
            out[what] = str(exc)
    # A second optimizer over another model: its parameters and ours in one call.
    other = Net()
    opt2 = ZeroAdamW(param_groups(other), lr=1e-3)
    loss_of(other, *batch(rank, 0)).backward()
    try:
        torch.nn.utils.clip_grad_norm_(list(model.parameters()) + list(other.parameters()), 1.0)
        out["two optimizers"] = "accepted"
    except ValueError as exc:
        out["two optimizers"] = str(exc)
    # Value clipping would clamp local gradients (stage 1: opt2) or find none (stage 2):
    # refused under both names, before any gradient changes.
    loss_of(other, *batch(rank, 1)).backward()
    local = [p.grad.clone() for p in other.parameters() if p.grad is not None]
    for what, fn, net in (("value, stage 2", torch.nn.utils.clip_grad_value_, model),
                          ("value, stage 1", torch.nn.utils.clip_grad.clip_grad_value_, other)):
        try:
            fn(net.parameters(), 1e-3)
            out[what] = "accepted"
        except ValueError as exc:
            out[what] = str(exc)
    out["value: untouched"] = all(torch.equal(p.grad, g) for p, g in zip(
        [p for p in other.parameters() if p.grad is not None], local))
    # The same module function also reached through torch.nn.utils.clip_grad.
    out["module function"] = float(torch.nn.utils.clip_grad.clip_grad_norm_(model.parameters(), 1e9))
    # A second call sees the clipped gradients: clip to 0.1, then measure.
    opt.zero_grad()
    loss_of(model, *batch(rank, 1)).backward()
    first = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1))
    second = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
    out["first, second"] = (first, second)
    # error_if_nonfinite
    opt.zero_grad()
    loss = loss_of(model, *batch(rank, 2)) * (float("inf") if rank == 0 else 1.0)
    loss.backward()
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        out["nonfinite"] = "accepted"
    except RuntimeError as exc:
        out["nonfinite"] = str(exc)
    opt.zero_grad()
    del opt2
    return out


def test_refusals_and_a_second_call():
    for rank, out in enumerate(ranks(_job_refusals, 2, timeout=120)):
        assert "missing from the call" in out["subset"] and "max_grad_norm=" in out["subset"], \
            out["subset"]
        assert "belong to no ZeroAdam" in out["plus another model's gradient"], out
        assert "several ZeroAdam optimizers" in out["two optimizers"], out["two optimizers"]
        assert out["module function"] > 0
        first, second = out["first, second"]
        assert first > 0.1 and second == pytest.approx(0.1, rel=1e-4), (rank, first, second)
        assert "non-finite" in out["nonfinite"], f"rank {rank}: {out['nonfinite']}"
        for what in ("value, stage 2", "value, stage 1"):
            assert "clip_grad_value_" in out[what] and "max_grad_norm=" in out[what], (rank, out[what])
        assert out["value: untouched"], f"rank {rank}: a refused clip_grad_value_ changed .grad"


def test_anything_else_goes_to_torch_unchanged():
    """World size 1 (FusedAdam): the .grad views are the gradients; torch clips them."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).pow(2).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    expect = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in before]))
    torch.testing.assert_close(norm, expect)
    for p, g in zip(model.parameters(), before):
        torch.testing.assert_close(p.grad, g * (0.01 / (expect + 1e-6)))  # scaled in place
    opt.step()
    plain = [torch.ones(3, requires_grad=True)]
    plain[0].grad = torch.full((3,), 2.0)
    assert float(torch.nn.utils.clip_grad_norm_(plain, 1.0)) == pytest.approx(12 ** 0.5)
    model(torch.randn(4, 8)).pow(2).sum().backward()  # and value clipping, as torch does
    torch.nn.utils.clip_grad_value_(model.parameters(), 1e-4)
    assert all(float(p.grad.abs().max()) <= 1e-4 for p in model.parameters())


@packed
def _job_dropped(rank, world_size):
    """A ZeroAdam that is gone no longer owns its parameters; they stay picklable."""
    model = Net()
    opt = ZeroAdamW(param_groups(model), lr=1e-3, stage=2)
    buf = io.BytesIO()
    torch.save(model, buf)  # a whole-module pickle: nothing unpicklable on the parameters
    del opt
    import gc
    gc.collect()
    loss_of(model, *batch(rank, 0)).backward()  # no hooks left: plain .grad
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))


def test_a_dropped_optimizer_leaves_torch_clip_alone():
    norms = run_ranks(_job_dropped, 2, timeout=120)
    assert norms[0] != norms[1], "each rank's own local norm, as torch computes it"
