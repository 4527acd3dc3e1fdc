"""Sharded checkpoint save/load time and size vs torch.save of torch.optim.Adam's state.

    python bench/checkpoint_bench.py                      # 100M parameters, 2 and 4 ranks
    python bench/checkpoint_bench.py --params 10e6 --ranks 2 --json out.json

Model: a stack of square Linear layers (bias-free) with ``--params`` parameters in all.
zero_triton: bf16 parameters + fp32 master (backend="torch"), one step to fill the
state, then ``zero_triton.checkpoint.save`` / ``load`` on N gloo ranks in spawned CPU
processes (time = slowest rank, barrier to barrier). Baseline: the same model in fp32
with torch.optim.Adam after one step, ``torch.save({"model", "optimizer"})`` and
``torch.load`` + ``load_state_dict`` in one process. Files go to ``--dir`` (default a
temporary directory beside the current one) and are removed afterwards. Loads read
what was just written: the page cache is warm, as it is for a restart on one machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def build(total: float, dtype: torch.dtype) -> torch.nn.Module:
    width = 4096
    layers = max(1, round(total / (width * width)))
    torch.manual_seed(0)
    with torch.device("cpu"):
        net = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    return net.to(dtype)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def fill_grads(net):
    g = torch.Generator().manual_seed(1)
    for p in net.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype) * 1e-3


def _rank(rank, world_size, port, total, path, queue):
    from zero_triton import ZeroAdam, checkpoint
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        net = build(total, torch.bfloat16)
        opt = ZeroAdam(net.parameters(), lr=1e-4, backend="torch")
        fill_grads(net)
        opt.step()
        times = {}
        for what in ("save", "load"):
            dist.barrier()
            t0 = time.perf_counter()
            if what == "save":
                checkpoint.save(path, opt, net)
            else:
                checkpoint.load(path, opt, net)
            dist.barrier()
            times[what] = time.perf_counter() - t0
        every = [None] * world_size
        dist.all_gather_object(every, times)
        if rank == 0:
            queue.put({k: max(t[k] for t in every) for k in times})
    finally:
        dist.destroy_process_group()


def zero_triton_case(total, world_size, root):
    path = os.path.join(root, f"zt{world_size}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world_size, port, total, path, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    times = queue.get(timeout=1800)
    for p in procs:
        p.join()
    size = dir_bytes(path)
    shutil.rmtree(path)
    return times, size


def torch_case(total, root):
    net = build(total, torch.float32)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    fill_grads(net)
    opt.step()
    path = os.path.join(root, "torch_adam.pt")
    t0 = time.perf_counter()
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict()}, path)
    save = time.perf_counter() - t0
    t0 = time.perf_counter()
    sd = torch.load(path, weights_only=True)
    net.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optimizer"])
    load = time.perf_counter() - t0
    size = os.path.getsize(path)
    os.remove(path)
    return {"save": save, "load": load}, size


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="ckbench-", dir=args.dir or os.getcwd())
    n = sum(p.numel() for p in build(args.params, torch.bfloat16).parameters())
    rows = []
    try:
        for ws in args.ranks:
            times, size = zero_triton_case(args.params, ws, root)
            rows.append({"case": f"zero_triton ZeroAdam bf16+fp32 master, {ws} ranks", **times, "bytes": size})
        times, size = torch_case(args.params, root)
        rows.append({"case": "torch.save torch.optim.Adam fp32 (1 process)", **times, "bytes": size})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{n:,} parameters; torch {torch.__version__}; {os.cpu_count()} CPUs")
    print(f"{'case':<48} {'save s':>7} {'load s':>7} {'on disk MB':>11} {'save GB/s':>10}")
    for r in rows:
        print(f"{r['case']:<48} {r['save']:7.2f} {r['load']:7.2f} {r['bytes'] / 1e6:11.1f} "
              f"{r['bytes'] / r['save'] / 1e9:10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": n, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
