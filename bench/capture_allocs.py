"""What a warmed-up step dispatches, per communicator, without and with capturable=True.

    python bench/capture_allocs.py [--steps 5]

ZeroAdamW at 2 gloo ranks (4 for the hybrid mesh) over a small MLP, buckets of 10 KiB,
real backward passes: rank 0's ops of one step (``zero_triton.tools.dispatch``), how many
of them allocate and how many bytes, how many read a value on the host, and whether the
next step ran the same ops on the same addresses. Then the step's CPU time, default
against capturable=True in the same process (median of ``--timed`` steps).
"""
import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONFIGS = [  # (name, world size, ZeroAdamW keywords, parameter dtype)
    ("stage 1", 2, {}, torch.float32),
    ("stage 2", 2, dict(stage=2), torch.float32),
    ("stage 1, max_grad_norm", 2, dict(max_grad_norm=1.0), torch.float32),
    ("int8 average + gather, bf16", 2, dict(reduce_dtype="int8", gather_dtype="int8"), torch.bfloat16),
    ("int8 average, stage 2", 2, dict(stage=2, reduce_dtype="int8"), torch.float32),
    ("hybrid 2x2", 4, {"mesh": True}, torch.float32),
    ("hybrid 2x2, int8 average", 4, {"mesh": True, "reduce_dtype": "int8"}, torch.float32),
]


def _rank(rank, world, port, queue, kw, dtype, steps, timed):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from zero_triton import ZeroAdamW
    from zero_triton.tools.dispatch import record
    kw = dict(kw)
    if kw.pop("mesh", False):
        from torch.distributed.device_mesh import init_device_mesh
        kw["device_mesh"] = init_device_mesh("cpu", (2, world // 2))
    rows = []
    for capturable in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(),
                                    torch.nn.Linear(256, 256), torch.nn.Tanh(),
                                    torch.nn.Linear(256, 16)).to(dtype)
        opt = ZeroAdamW(model.parameters(), lr=torch.tensor(1e-3), bucket_cap_mb=0.01,
                        capturable=capturable, **kw)
        recs, times = [], []
        for t in range(steps + timed):
            x = torch.randn(8, 256, generator=torch.Generator().manual_seed(100 * t + rank)).to(dtype)
            model(x).float().pow(2).mean().backward()
            if steps - 2 <= t < steps:
                recs.append(record(opt.step))
            else:
                t0 = time.perf_counter()
                opt.step()
                if t >= steps:
                    times.append(time.perf_counter() - t0)
            opt.zero_grad(set_to_none=False)
        first, second = recs
        rows.append((len(first.ops), len(first.allocations), first.allocated_bytes(),
                     len(first.host_reads), first.first_difference(second) is None,
                     statistics.median(times) * 1e3))
    dist.barrier()
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="steps before the two recorded")
    parser.add_argument("--timed", type=int, default=30, help="steps timed after them")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    print(f"{'communicator':32} {'mode':11} {'ops':>5} {'allocating':>10} {'bytes':>8} "
          f"{'host reads':>10} {'same steps':>10} {'step ms':>8}")
    for name, world, kw, dtype in CONFIGS:
        queue = ctx.Queue()
        port = _port()
        procs = [ctx.Process(target=_rank, args=(r, world, port, queue, kw, dtype,
                                                 args.steps, args.timed)) for r in range(world)]
        for p in procs:
            p.start()
        rows = queue.get(timeout=600)
        for p in procs:
            p.join()
        for mode, (ops, allocs, nbytes, reads, same, ms) in zip(("default", "capturable"), rows):
            print(f"{name:32} {mode:11} {ops:5d} {allocs:10d} {nbytes:8d} {reads:10d} "
                  f"{'yes' if same else 'no':>10} {ms:8.2f}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
