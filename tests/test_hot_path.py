"""The step allocates nothing and (on CUDA) never syncs the host."""
import pytest
import torch
from conftest import requires_cuda
from torch.profiler import ProfilerActivity, profile

import zero_triton
from zero_triton.native import backends


def _optimizer(device, dtype, backend):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, device=device).to(dtype)) for n in (1, 1000, 37)]
    for p in params:
        p.grad = torch.randn_like(p)  # moved into the flat buffer: .grad is its view from here
    opt = zero_triton.FusedAdam(params, backend=backend, weight_decay=0.1, amsgrad=True)
    opt.step()  # first step: compiles, loads the extension, allocates nothing later
    # Everything a step can be handed: GradScaler's tensors and a clip coefficient.
    opt.grad_scale = torch.tensor([2.0], device=device)
    opt.found_inf = torch.tensor([0.0], device=device)
    return opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_step_allocates_nothing(dtype):
    reason = backends.why_not("cpu", torch.device("cpu"))
    if reason is not None:
        pytest.skip(f"native cpu backend unavailable: {reason}")
    def allocations(fn):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        return [(e.name, e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage > 0]

    # Control: the profiler does see a 4-byte allocation, so an empty list below means
    # the step allocated nothing, not that nothing was recorded.
    assert allocations(lambda: torch.ones(1)), "the profiler records no CPU allocations here"
    opt = _optimizer("cpu", dtype, "cpu")
    opt.clip_grad_norm_(1.0)
    allocs = allocations(opt.step)
    assert allocs == [], f"the step allocated: {allocs}"


@requires_cuda
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_step_allocates_nothing_and_never_syncs(backend, dtype):
    reason = backends.why_not(backend, torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"backend {backend} unavailable: {reason}")
    opt = _optimizer("cuda", dtype, backend)
    opt.clip_grad_norm_(1.0)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()["allocation.all.allocated"]
    assert after == before, f"the step made {after - before} CUDA allocations"


def _first_step_largest_allocation(rank, world_size, stage):
    """The largest single allocation of ZeroAdamW's first step (the one-time checks
    run there), and the largest bucket's bytes (buckets hold one parameter each here)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Tanh(), torch.nn.Linear(2048, 1024))
    opt = zero_triton.ZeroAdamW(model.parameters(), stage=stage, bucket_cap_mb=0.5)
    model(torch.randn(8, 1024)).square().mean().backward()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.step()
    allocations = [e.cpu_memory_usage for e in prof.events()
                   if e.name.startswith("aten::empty") and e.cpu_memory_usage > 0]
    return max(allocations), max(p.numel() for p in model.parameters()) * 4


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_first_step_makes_no_full_size_temporary(stage):
    """The first step's check that DDP did not average the gradients already took a
    float64 copy of the whole gradient buffer and its square (4x the gradients); it
    reads them a chunk at a time now: nothing larger than a bucket is allocated."""
    from dist_utils import run_ranks
    for largest, bucket in run_ranks(_first_step_largest_allocation, 2, stage, timeout=180):
        assert largest <= bucket, (largest, bucket)
