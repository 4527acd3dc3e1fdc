"""ZeroAdam on 1-4 gloo ranks (spawned CPU processes) against one process (issue 3).

Starting a gloo group costs seconds, so each world size is spawned once: the rank
function runs a batch of jobs (trajectories, clipping, GradScaler skips, a profiler
trace, the memory report) and sends back what every rank saw. The comparisons run
here in the parent, one test per parametrize row (the cases, the jobs and the
comparisons: ``tests/zero_cases.py``).

Rank r's gradient at step t comes from a torch.Generator seeded t*100 + r, so the
parent rebuilds every rank's gradient. Two checks per step:

* the averaged gradient ZeroAdam computed (its ranks' shards joined) against the exact
  mean: bitwise where the mean is exact (small multiples of 2^-8 on 1, 2, 4 ranks),
  else within the error bound of summing N floats in that dtype: gloo sums bf16 in
  bf16, so on 3 ranks the average can sit several bf16 ulps from the exact mean;
* the step on that average: every rank's parameters, master and moments bitwise equal
  to FusedAdam (one process, same backend) fed the same average, and close to
  torch.optim.Adam/AdamW in fp32.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks
from zero_triton import ZeroAdam, ZeroAdamW
from zero_triton.state.flat import FlatLayout

from zero_cases import (CLIPS, INF_STEPS, MEMORY, PROFILES, RANK_TIMEOUT_S, TRAJECTORIES, References,
                        as_flat, assert_close, assert_ulps, batch_results, check_average,
                        check_layout, check_step, mean_grads, skip_unavailable)


# -- tests ------------------------------------------------------------------------------
@pytest.mark.parametrize("case", TRAJECTORIES, ids=lambda c: c.name)
def test_zero_equals_fused_adam_and_torch_adam_on_the_mean_gradient(case):
    skip_unavailable(case)
    results = batch_results("trajectory", case)
    ref = References(case)
    layout = check_layout(case, results)
    for t in range(1, case.steps + 1):
        average = ref.gathered_average(results, t)
        check_average(case, ref, average, t)
        ref.step(average)
        check_step(case, ref, results, t)
    if case.reduce_dtype is not None:
        # The test means something only if a bf16 average would have lost bits.
        average = as_flat(ref.gathered_average(results, case.steps), layout, case.reduce_dtype)
        assert (average.to(case.dtype).to(case.reduce_dtype) != average).any()


@pytest.mark.parametrize("case", CLIPS, ids=lambda c: c.name)
def test_clip_grad_norm_equals_torch_clip_then_adam(case):
    results = batch_results("trajectory", case)
    ref = References(case)
    check_layout(case, results)
    clipped = unclipped = 0
    for t in range(1, case.steps + 1):
        max_norm = case.max_norms[(t - 1) % len(case.max_norms)]
        average = ref.gathered_average(results, t)
        check_average(case, ref, average, t)
        total = ref.step(average, max_norm)
        clipped += bool(total > max_norm)
        unclipped += bool(total <= max_norm)
        for rank, r in enumerate(results):
            assert_close(r["norms"][t - 1].reshape(()), total, case.norm_rtol, 0.0,
                         f"rank {rank}, step {t}: returned total norm vs torch's")
        # Master and moments against torch's clip + Adam (FusedAdam sums the squares in
        # another order, so it is no bitwise reference here).
        for key in ("master", "exp_avg", "exp_avg_sq"):
            gathered = torch.cat([r["steps"][t - 1][key] for r in results])
            assert_close(gathered, ref.torch_state(key), *case.torch_tol,
                         f"step {t}: {key} (all shards) vs torch clip_grad_norm_ + Adam")
        for rank, r in enumerate(results):
            for i, (p, q) in enumerate(zip(r["steps"][t - 1]["params"], ref.torch_params)):
                if case.dtype == torch.float32:
                    assert_close(p, q.detach(), *case.torch_tol,
                                 f"rank {rank}, step {t}: parameter {i} vs torch clip + Adam")
                else:  # the master matches to fp32 rounding: its bf16 rounding may differ by 1
                    assert_ulps(p, q.detach().to(case.dtype), 1,
                                f"rank {rank}, step {t}: parameter {i} vs torch clip + Adam")
    assert clipped and unclipped, \
        f"the case must clip on some steps and not on others ({clipped} clipped, {unclipped} not)"


@pytest.mark.parametrize("case", INF_STEPS, ids=lambda c: c.name)
def test_inf_on_one_rank_skips_the_step_on_every_rank(case):
    results = batch_results("inf_step", case)
    ref = References(case)
    keys = ("flat_param", "master", "exp_avg", "exp_avg_sq")
    finite = 0
    for t in range(1, case.steps + 1):
        scales = [r[t - 1]["scale"] for r in results]
        assert len(set(scales)) == 1, f"step {t}: the ranks' scales differ: {scales}"
        if t == case.inf_step:
            for rank, r in enumerate(results):
                before, after = r[t - 1]["before"], r[t - 1]["after"]
                where = f"rank {rank}, step {t} (inf on rank {case.inf_rank})"
                assert after["step"] == before["step"] == finite, \
                    f"{where}: step counter went {before['step']} -> {after['step']}, expected {finite}"
                for key in keys:
                    assert_ulps(after[key], before[key], 0, f"{where}: {key} changed on a skipped step")
            if case.amp in ("scaler", "torch_scaler"):
                assert scales[0] == 2.0 ** 7, f"step {t}: scale {scales[0]} after an inf, expected backoff to 128"
            continue
        finite += 1
        ref.step(mean_grads(case, t, ref.grad_dtype))  # exact: N is a power of two
        for rank, r in enumerate(results):
            after = r[t - 1]["after"]
            lo, hi = ref.layout.shard_range(rank)
            where = f"rank {rank}, step {t} ({finite} finite steps)"
            assert after["step"] == finite, f"{where}: step counter {after['step']}"
            for i, (p, q) in enumerate(zip(after["params"], ref.fused_params)):
                assert_ulps(p, q.detach(), 0, f"{where}: parameter {i} vs FusedAdam on the finite steps")
            for key in ("master", "exp_avg", "exp_avg_sq"):
                assert_ulps(after[key], ref.fused_state(key)[lo:hi], 0, f"{where}: {key} vs FusedAdam")


@pytest.mark.parametrize("case", PROFILES, ids=lambda c: c.name)
def test_profiler_trace_has_the_three_phases_in_order(case):
    for rank, events in enumerate(batch_results("profile", case)):
        starts = {}
        for name, start in events:
            starts.setdefault(name, start)
        phases = ["zero_triton.reduce_scatter", "zero_triton.adam_step", "zero_triton.all_gather"]
        missing = [p for p in phases if p not in starts]
        assert not missing, f"rank {rank}: the trace lacks {missing}; it has {sorted(starts)}"
        order = sorted(phases, key=starts.get)
        assert order == phases, f"rank {rank}: phases ran in the order {order}"


@pytest.mark.parametrize("case", MEMORY, ids=lambda c: c.name)
def test_memory_report_counts_shard_state_and_full_buffers(case):
    layout = FlatLayout.build(case.shapes, case.world_size)
    for rank, r in enumerate(batch_results("memory", case)):
        rep, s = r["built"], layout.shard_numel
        where = f"rank {rank} ({case.world_size} ranks, {case.dtype}, shard {s} of {layout.padded_numel})"
        master = 4 * s if case.dtype != torch.float32 else 0  # fp32 parameters are their own master
        assert rep["master"] == master, f"{where}: master {rep['master']} B, expected {master}"
        assert rep["moments"] == 8 * s, f"{where}: moments {rep['moments']} B, expected {8 * s}"
        if case.dtype != torch.float32:
            assert rep["optimizer_state"] == 12 * s, f"{where}: optimizer_state {rep['optimizer_state']} B"
        full = layout.padded_numel * r["element_size"]
        assert rep["params"] == full, f"{where}: params {rep['params']} B, expected the padded buffer {full}"
        # The local gradients (the padded buffer) and, over several ranks, the averaged
        # shard from the average to the step's kernel.
        averaged = full + (s * r["element_size"] if case.world_size > 1 else 0)
        for when, grads in (("built", full), ("averaged", averaged), ("stepped", full)):
            got = r[when]["grads"]
            assert got == grads, f"{where}: grads {got} B {when}, expected {grads}"


def _rank_mismatched_shapes(rank, world_size):
    # Only the last rank transposes parameter 1: every rank must still raise.
    shapes = [(3,), (13, 5) if rank < world_size - 1 else (5, 13), (7,)]
    ZeroAdam([torch.nn.Parameter(torch.zeros(s)) for s in shapes], backend="torch")
    return "constructed"


def test_mismatched_parameter_shapes_raise_on_every_rank():
    results, errors = run_ranks(_rank_mismatched_shapes, 3, timeout=90, pg_timeout_s=30,
                                allow_errors=True)
    assert not results, f"ranks {sorted(results)} constructed ZeroAdam despite the mismatch"
    for rank in range(3):
        msg = errors[rank]
        first_line = msg.splitlines()[0]
        assert first_line.startswith("RuntimeError"), f"rank {rank}: {first_line}"
        for needle in ("parameter 1", "[13, 5]", "[5, 13]"):
            assert needle in first_line, f"rank {rank}: {needle!r} not in the error: {first_line}"


def test_zero_adam_without_a_process_group_says_how_to_start_one():
    assert not (dist.is_available() and dist.is_initialized())
    with pytest.raises(RuntimeError) as info:
        ZeroAdam([torch.nn.Parameter(torch.zeros(3))])
    msg = str(info.value)
    assert "torchrun" in msg and "init_process_group" in msg, msg


def _rank_reduce_scatter(rank, world_size):
    from zero_triton.comm.group import GroupComm
    comm = GroupComm()
    n = 5 * world_size
    seen = {}
    for name, dtype, out_dtype in (("fp32", torch.float32, torch.float32),
                                   ("bf16 into fp32", torch.bfloat16, torch.float32)):
        inp = torch.randn(n, generator=torch.Generator().manual_seed(rank), dtype=torch.float32).to(dtype)
        before = inp.clone()
        recv = torch.full((comm.recv_numel(n),), float("nan"), dtype=dtype)
        out = torch.zeros(n // world_size, dtype=out_dtype)
        comm.reduce_scatter_avg(out, inp, recv, async_op=True).wait()
        total = torch.ones(n // world_size, dtype=out_dtype)
        comm.reduce_scatter_avg(total, inp, recv.clone(), async_op=True, accumulate=True).wait()
        needs = comm.needs_recv(out, inp)
        # Scratch sized for an average into the output, then one added to the output on
        # that scratch (it takes one chunk more) and one on no scratch at all.
        small = torch.full((comm.recv_numel(n, into_out=dtype == out_dtype),), float("nan"), dtype=dtype)
        into_out = torch.full_like(out, float("nan"))
        comm.reduce_scatter_avg(into_out, inp, small, async_op=True).wait()
        added = torch.ones(n // world_size, dtype=out_dtype)
        comm.reduce_scatter_avg(added, inp, small, async_op=True, accumulate=True).wait()
        bare = torch.ones(n // world_size, dtype=out_dtype)
        comm.reduce_scatter_avg(bare, inp, None, async_op=True, accumulate=True).wait()
        # Lists, not tensors: a tensor sent back shares its storage through a socket of
        # the rank's process, which may have exited by the time it is read.
        seen[name] = (out.tolist(), total.tolist(), torch.equal(inp, before), small.numel(), needs,
                      comm.needs_recv(out, inp, accumulate=True), into_out.tolist(), added.tolist(),
                      bare.tolist())
    return seen


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_gradient_average_sums_in_rank_order_on_the_scratch_it_asks_for(world_size):
    """reduce_scatter_avg gives every rank ((g0 + g1) + g2) / W of its chunk bitwise
    (and adds it to ``out`` with accumulate), leaves the input as it was, and on gloo
    asks for (W - 2) / W of the input as scratch into an output of the input's dtype
    (none at two ranks), (W - 1) / W into a wider one; an average added to the output on
    the smaller scratch, or on none, is still right (it takes what it lacks)."""
    per_rank = run_ranks(_rank_reduce_scatter, world_size, timeout=RANK_TIMEOUT_S)
    n = 5 * world_size
    for name, dtype, out_dtype in (("fp32", torch.float32, torch.float32),
                                   ("bf16 into fp32", torch.bfloat16, torch.float32)):
        grads = [torch.randn(n, generator=torch.Generator().manual_seed(r),
                             dtype=torch.float32).to(dtype) for r in range(world_size)]
        for rank in range(world_size):
            out, total, untouched, recv_numel, needs, needs_to_add, into_out, added, bare = (
                torch.tensor(x, dtype=out_dtype) if isinstance(x, list) else x
                for x in per_rank[rank][name])
            chunks = [g.view(world_size, -1)[rank].to(out_dtype) for g in grads]
            want = chunks[0] + chunks[1]
            for c in chunks[2:]:
                want = want + c
            want = want / world_size
            assert torch.equal(out, want), f"{name}, rank {rank}: not the sum in rank order"
            assert torch.equal(total, 1 + want), f"{name}, rank {rank}: accumulate"
            assert untouched, f"{name}, rank {rank}: the input changed"
            assert torch.equal(into_out, want), f"{name}, rank {rank}: on the scratch it asks for"
            assert torch.equal(added, 1 + want) and torch.equal(bare, 1 + want), f"{name}, rank {rank}"
            wide = dtype != out_dtype
            assert recv_numel == n // world_size * (world_size - 1 - (not wide)), (name, rank, recv_numel)
            # No scratch only at two ranks, into an output of the input's dtype, not added to.
            assert needs == (world_size > 2 or wide), (name, rank, needs)
            assert needs_to_add, (name, rank)


def _rank_float64(rank, world_size, stage):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(37, dtype=torch.float64)),
              torch.nn.Parameter(torch.randn(4, 5, dtype=torch.float64))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = ZeroAdamW(params, lr=0.01, weight_decay=0.1, stage=stage)
    ref = torch.optim.AdamW(twins, lr=0.01, weight_decay=0.1)
    kept = []
    for t in range(3):
        grads = [[torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * t + 10 * r + i),
                              dtype=torch.float64) for i, p in enumerate(params)] for r in range(world_size)]
        for p, g in zip(params, grads[rank]):
            p.grad = g.clone()
        given = [p.grad.clone() for p in params] if stage == 1 else None
        opt.step()
        if stage == 1:  # the local gradients, as they were given
            kept.append(all(torch.equal(p.grad, g) for p, g in zip(params, given)))
        opt.zero_grad()
        for i, q in enumerate(twins):
            q.grad = sum(g[i] for g in grads) / world_size
        ref.step()
        ref.zero_grad()
    return [float((p - q).abs().max()) for p, q in zip(params, twins)], kept


@pytest.mark.parametrize("stage", [1, 2])
def test_float64_parameters_equal_torch_adamw_on_the_mean_gradient(stage):
    """float64 parameters on 2 ranks (torch's ops step them in float64): the first step's
    check for DDP-averaged gradients squared float64 gradients in place (``.double()`` of a
    float64 tensor is that tensor), so stage 1 averaged their squares, silently."""
    for rank, (diffs, kept) in enumerate(run_ranks(_rank_float64, 2, stage, timeout=RANK_TIMEOUT_S)):
        assert max(diffs) < 1e-12, f"rank {rank}: float64 parameters off torch's by {diffs}"
        assert all(kept), f"rank {rank}: step() changed the local gradients: {kept}"


def _rank_averages_held(rank, world_size, stage, numel):
    """3 steps of ZeroAdamW against torch's AdamW on the mean gradient, and the bytes of
    gradients the optimizer holds after the average and after each step."""
    params = [torch.nn.Parameter(torch.linspace(-1, 1, numel)), torch.nn.Parameter(torch.ones(5, 3))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = ZeroAdamW(params, lr=0.01, weight_decay=0.1, stage=stage, bucket_cap_mb=None)
    ref = torch.optim.AdamW(twins, lr=0.01, weight_decay=0.1)
    held = []
    for t in range(3):
        grads = [[torch.full(p.shape, 0.1 * (r + 1) * (t + 1)) + 0.01 * i for i, p in enumerate(params)]
                 for r in range(world_size)]
        for p, g in zip(params, grads[rank]):
            p.grad = g.clone()
        opt.clip_grad_norm_(1e9)  # averages: the step's kernel reads the averages next
        averaged = opt.memory_report()["grads"]
        opt.step()
        held.append((averaged, opt.memory_report()["grads"]))
        opt.zero_grad()
        for i, q in enumerate(twins):
            q.grad = sum(g[i] for g in grads) / world_size
        ref.step()
        ref.zero_grad()
    layout = opt._shards.groups[0][0].layout
    diff = max(float((p - q).detach().abs().max()) for p, q in zip(params, twins))
    return diff, held, layout.padded_numel * 4, layout.shard_numel * 4


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("numel", [1000, 2**24 + 64], ids=["small", "over 32 MiB a rank"])
def test_averages_are_let_go_after_the_step_unless_too_large_for_the_c_heap(stage, numel):
    """Each bucket's averaged shard is made by the step's first average and let go once
    its kernel has read it, as DDP's .grad is let go by zero_grad: no rank holds it while
    the next forward's activations pile up. On CPUs a bucket's shard above 32 MiB is kept
    (glibc would map it afresh, page by page, every step); a kept one is written again,
    not added to, at the next step."""
    for rank, (diff, held, full, shard) in enumerate(
            run_ranks(_rank_averages_held, 2, stage, numel, timeout=RANK_TIMEOUT_S)):
        assert diff < 1e-6, f"rank {rank}: {diff} off torch's AdamW on the mean gradient"
        local = 0 if stage == 2 else full  # stage 1's local gradients (the padded buffer)
        kept = shard if shard > 32 * 2**20 else 0
        for t, (averaged, stepped) in enumerate(held):
            assert averaged >= local + shard, f"rank {rank}, step {t}: {averaged} B held after the average"
            assert stepped == local + kept, \
                f"rank {rank}, step {t}: {stepped} B held after the step, expected {local + kept}"


def _rank_group_added_after_the_average(rank, world_size, stage):
    a, b = torch.nn.Parameter(torch.linspace(-1, 1, 10)), torch.nn.Parameter(torch.ones(6))
    ta, tb = (torch.nn.Parameter(p.detach().clone()) for p in (a, b))
    opt = ZeroAdamW([a], lr=0.1, stage=stage)
    ref = torch.optim.AdamW([ta], lr=0.1)
    ga = [torch.full((10,), 1.0 + r) for r in range(world_size)]
    gb = [torch.full((6,), 2.0 + r) for r in range(world_size)]
    a.grad, b.grad = ga[rank].clone(), gb[rank].clone()
    opt.clip_grad_norm_(1e9)  # averages this step's gradients
    with pytest.raises(RuntimeError, match="before backward or after step"):
        opt.add_param_group({"params": [b]})
    refused_cleanly = len(opt.param_groups) == 1
    opt.step()  # the first group's step, unchanged by the refusal
    ta.grad = sum(ga) / world_size
    ref.step()
    opt.zero_grad()
    ref.zero_grad()
    opt.add_param_group({"params": [b]})  # after step(): taken, and stepped as torch's
    ref.add_param_group({"params": [tb]})
    a.grad, b.grad = ga[rank].clone(), gb[rank].clone()
    ta.grad, tb.grad = sum(ga) / world_size, sum(gb) / world_size
    opt.clip_grad_norm_(1e9)
    opt.step()
    ref.step()
    return refused_cleanly, [float((p - q).detach().abs().max()) for p, q in ((a, ta), (b, tb))]


@pytest.mark.parametrize("stage", [1, 2])
def test_a_group_added_after_the_average_is_refused_before_anything_changes(stage):
    """add_param_group between clip_grad_norm_ and step() left the new group out of the
    step's averages: its parameter was stepped as if its gradient were zero (weight decay
    only: 0.1 off torch's AdamW after one step), silently. It is refused on every rank, and the group added after step() trains."""
    for rank, (refused_cleanly, diffs) in enumerate(
            run_ranks(_rank_group_added_after_the_average, 2, stage, timeout=RANK_TIMEOUT_S)):
        assert refused_cleanly, f"rank {rank}: the refused group was added"
        assert max(diffs) < 1e-6, f"rank {rank}: off torch's AdamW by {diffs}"
