"""The step's CPU time where the kernel is cheap: what the optimizer's Python around it costs.

    python bench/step_overhead.py

FusedAdamW on 40 small tensors (67K elements, one thread): the minimum and median over 9
samples of 500 steps, in fp32 and bf16 + master; then ZeroAdamW stage 1 on 2 gloo ranks
(300 steps with new gradients each, rank 0's wall time, communication included). Only
public names are imported, so the same file times another checkout of the package:
``PYTHONPATH=OTHER_CHECKOUT python bench/step_overhead.py``; run the two alternately and
compare the ratios, as one run drifts with the machine's load.
"""
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = [(64, 64)] * 12 + [(64,)] * 24 + [(256, 16)] * 4


def _params(dtype):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(dtype)
    return params


def fused_us(dtype, samples=9, steps=500):
    from zero_triton import FusedAdamW
    opt = FusedAdamW(_params(dtype), lr=1e-3)
    for _ in range(200):
        opt.step()
    times = []
    for _ in range(samples):
        t0 = time.process_time()
        for _ in range(steps):
            opt.step()
        times.append((time.process_time() - t0) / steps * 1e6)
    return min(times), statistics.median(times)


def _zero_rank(rank, port, queue, steps):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from zero_triton import ZeroAdamW
    params = _params(torch.float32)
    opt = ZeroAdamW(params, lr=1e-3, bucket_cap_mb=1)

    def step():
        for p in params:
            p.grad = torch.full_like(p, rank + 1.0)  # rank-dependent: nothing DDP-like
        opt.step()
    for _ in range(30):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if rank == 0:
        queue.put((time.perf_counter() - t0) / steps * 1e6)
    dist.destroy_process_group()


def zero_us(steps=300):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_zero_rank, args=(r, port, queue, steps)) for r in range(2)]
    for p in procs:
        p.start()
    us = queue.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    return us


if __name__ == "__main__":
    torch.set_num_threads(1)
    for name, dtype in (("fp32", torch.float32), ("bf16+master", torch.bfloat16)):
        best, median = fused_us(dtype)
        print(f"FusedAdamW {name:12s} min {best:7.1f} us  median {median:7.1f} us per step (CPU)")
    print(f"ZeroAdamW  2 gloo ranks   {zero_us():9.1f} us per step (wall, rank 0)")
