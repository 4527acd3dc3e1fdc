"""Uneven inputs: ZeroAdam under torch.distributed.algorithms.join.Join (docs/integrations.md, Uneven
inputs). A rank that runs out of batches shadows the others' iterations, stepping its
shard with zero gradients, so every rank ends holding what a single process would have
trained: at each iteration, AdamW on the sum of the gradients of the ranks that still had
inputs over the world size (DDP's ``divide_by_initial_world_size=True``), clipped as the
loop clips it, at the learning rate the loop's scheduler set."""
import importlib.util

import pytest
import torch

from dist_utils import run_ranks

STEPS = {2: [3, 6], 3: [2, 5, 3], 4: [4, 2, 5, 3]}  # batches per rank


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batch(rank, i, micro):
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * rank + 10 * i + micro))


def _uneven(rank, world, case):
    import zero_triton
    from torch.distributed.algorithms.join import Join
    stage, cap = case.get("stage", 1), case.get("bucket_cap_mb", 0.0005)
    micro, clip = case.get("micro", 1), case.get("clip")
    model, ref = _model(), _model()
    mesh = {}
    if case.get("mesh"):  # hybrid sharding: Join's all-reduces and ours over every rank
        from torch.distributed.device_mesh import init_device_mesh
        mesh["device_mesh"] = init_device_mesh("cpu", case["mesh"],
                                               mesh_dim_names=("replicate", "shard"))
    opt = zero_triton.ZeroAdamW(model.parameters(), lr=1e-2, stage=stage, bucket_cap_mb=cap, **mesh)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.7)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, 0.7)
    net, joinables, stepper, backward = model, [opt], opt, torch.Tensor.backward
    clip_fn = torch.nn.utils.clip_grad_norm_
    if case.get("ddp"):
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)
        net.register_comm_hook(None, zero_triton.ddp_local_grads_hook)
        joinables = [net, opt]
    if case.get("accelerate"):  # what accelerate.join_uneven_inputs runs on GPUs
        import os
        from accelerate import Accelerator
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          ACCELERATE_USE_CPU="true", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT="1")  # read, not used: the group is up
        acc = Accelerator(cpu=True)  # the process group is up already
        net, stepper = acc.prepare(model, opt)  # a DDP wrapper, an AcceleratedOptimizer
        assert isinstance(net, torch.nn.parallel.DistributedDataParallel), type(net)
        net.register_comm_hook(None, zero_triton.ddp_local_grads_hook)
        joinables, backward, clip_fn = [net, stepper.optimizer], acc.backward, acc.clip_grad_norm_
    if case.get("overlap"):
        zero_triton.overlap(model, opt)
    counts = STEPS[world]
    data = 0 if case.get("same_batches") else None  # every rank draws rank 0's batches
    with Join(joinables):
        for i in range(counts[rank]):
            for m in range(micro):
                x = _batch(rank if data is None else data, i, m)
                if case.get("no_sync") and m < micro - 1:
                    with opt.no_sync():
                        backward(net(x).pow(2).mean())
                else:
                    backward(net(x).pow(2).mean())
            if clip is not None:
                clip_fn(model.parameters(), clip)
            stepper.step()
            stepper.zero_grad()
            sched.step()
    opt.wait_params()
    for i in range(max(counts)):  # one process: the ranks that had a batch at iteration i
        summed = [torch.zeros_like(p) for p in ref.parameters()]
        for r in range(world):
            if i < counts[r]:
                ref.zero_grad()
                for m in range(micro):
                    ref(_batch(r if data is None else data, i, m)).pow(2).mean().backward()
                for s, p in zip(summed, ref.parameters()):
                    s += p.grad
        for s, p in zip(summed, ref.parameters()):
            p.grad = s / world
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
        ref_sched.step()
    return max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))


CASES = {
    "one_bucket_clip": dict(bucket_cap_mb=None, clip=0.05),
    "buckets_ddp_local_hook": dict(ddp=True),
    "stage2_overlap_clip": dict(stage=2, overlap=True, clip=0.05),
    "micro_batches_clip": dict(micro=2, clip=0.05),
    "micro_batches_no_sync": dict(micro=3, no_sync=True),
    # identical gradients on every rank at the first step, without DDP: not DDP's
    # average (the first step's check looked only at the gradients and refused Join)
    "same_batches_on_every_rank": dict(same_batches=True),
    # the same under a DDP with ddp_local_grads_hook: the hook is found on the wrapper
    "same_batches_ddp_local_hook": dict(same_batches=True, ddp=True),
    "stage2_micro_batches_overlap": dict(stage=2, micro=2, overlap=True),
}
if importlib.util.find_spec("accelerate") is not None:
    # accelerator.prepare's DDP and AcceleratedOptimizer, accelerator.backward and
    # clip_grad_norm_, under the Join accelerate's join_uneven_inputs builds (on GPUs;
    # on CPU processes it does nothing), given the optimizer inside the wrapper
    CASES["accelerate_prepared_clip"] = dict(accelerate=True, clip=0.05)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_rank_out_of_inputs_shadows_the_others_under_join(name):
    """Rank 0 has 3 batches and rank 1 has 6: under ``Join([optimizer])`` (or with a DDP
    wrapper, ``Join([ddp_model, optimizer])``) both end equal to the one-process
    reference, through a scheduler (the joined rank takes the others' learning rate),
    clipping and micro-batches (the joined rank makes the same calls). Without Join
    support, ``Join`` refused the optimizer (no ``join_hook``)."""
    diffs = run_ranks(_uneven, 2, CASES[name], timeout=120, pg_timeout_s=60)
    assert max(diffs) < 1e-5, diffs


def test_three_ranks_joining_at_different_iterations():
    diffs = run_ranks(_uneven, 3, dict(overlap=True, clip=0.05), timeout=180, pg_timeout_s=60)
    assert max(diffs) < 1e-5, diffs


def test_four_ranks_of_a_2x2_mesh_joining_at_different_iterations():
    diffs = run_ranks(_uneven, 4, dict(mesh=(2, 2), stage=2, clip=0.05), timeout=180,
                      pg_timeout_s=60)
    assert max(diffs) < 1e-5, diffs


def _refused(rank, world, case):
    import zero_triton
    from torch.distributed.algorithms.join import Join
    model = _model()
    opt = zero_triton.ZeroAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=0.0005)
    before = [p.detach().clone() for p in model.parameters()]
    if case == "divide":
        try:
            Join([opt], divide_by_initial_world_size=False)
        except ValueError as exc:
            return str(exc)
        return "accepted"
    scaler = torch.amp.GradScaler("cpu") if case == "scaler" else None
    net, joinables = model, [opt]
    if case == "ddp_all_reduce":  # torch's Join tutorial, ZeroAdamW for ZeroRedundancyOptimizer
        net = torch.nn.parallel.DistributedDataParallel(model)
        joinables = [net, opt]
    try:
        with Join(joinables):
            for i in range(STEPS[world][rank]):
                before = [p.detach().clone() for p in model.parameters()]
                loss = net(_batch(rank, i, 0)).pow(2).mean()
                if case == "ddp_all_reduce":
                    loss.backward()
                    opt.step()
                elif scaler is not None:
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                else:  # torch's two-call clipping: the second call has no agreement
                    loss.backward()
                    grads = [p.grad for p in model.parameters() if p.grad is not None]
                    norm = torch.nn.utils.get_total_norm(grads)
                    torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.05, norm)
                    opt.step()
                opt.zero_grad()
            before = [p.detach().clone() for p in model.parameters()]  # joined from here
    except RuntimeError as exc:
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        return str(exc), unchanged
    return "trained on", None


def test_what_a_joined_rank_cannot_shadow_is_refused_on_every_rank():
    """GradScaler's calls carry a device value a joined rank does not have, and torch's
    two-call clipping a max_norm that no agreement carries: at the first iteration a rank
    is joined, every rank raises naming Join and the fix, with that iteration's step not
    taken; DDP's divide_by_initial_world_size=False is refused when Join is built, and a
    DDP wrapper that averages the gradients too at the first step."""
    two_calls = ("two_call_clipping",) if hasattr(torch.nn.utils, "get_total_norm") else ()
    for case in ("scaler",) + two_calls:  # torch's two-call clipping: 2.6 and later
        for message, unchanged in run_ranks(_refused, 2, case, timeout=120, pg_timeout_s=60):
            assert "ran out of inputs under torch's Join" in message, (case, message)
            assert unchanged, case
    # A DDP wrapper that averages too: its buckets' all-reduces interleave with ours in
    # backward, where a joined rank shadows DDP's first (a deadlock until the timeout), and
    # with ours moved to step, a joined rank's zeros halve DDP's average (0.0019 off the
    # reference after 6 steps). Refused at the first step, on every rank.
    for message, unchanged in run_ranks(_refused, 2, "ddp_all_reduce", timeout=120, pg_timeout_s=60):
        assert "ddp_local_grads_hook" in message and "Join" in message, message
        assert unchanged
    for message in run_ranks(_refused, 2, "divide", timeout=120, pg_timeout_s=60):
        assert "divide_by_initial_world_size=False is not supported" in message, message
