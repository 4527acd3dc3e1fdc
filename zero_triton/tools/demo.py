"""The demo: the seed's 3-layer MLP trained with ZeroAdam on N ranks.

``python -m zero_triton demo`` spawns ``--world-size`` ranks (gloo on CPU, NCCL when
there are that many GPUs); under ``torchrun --nproc_per_node=N -m zero_triton demo``
it uses the ranks torchrun started. Each rank trains on its own batches; ZeroAdam
averages the gradients. Beside it every rank runs torch.optim.Adam on an fp32 replica
fed the same averaged gradient (one extra all-reduce, for the check only), and the
demo prints the largest difference between the two at the end.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist

from zero_triton.native.backends import NAMES
from zero_triton.optim.interface import internals
from zero_triton.tools.console import run, silence_stdout
from zero_triton.tools.profiling import launch
from zero_triton.tools.units import positive_number, rank_count, whole_number

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_mlp(seed: int = 0) -> torch.nn.Module:
    """The seed's 3-layer MLP (same weights on every rank: same seed)."""
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 10))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[-1]) ** 0.5)
    return model


def _batch(step: int, rank: int, device):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 32, generator=g)
    # Labels from a fixed random teacher: a task the MLP can learn, so the loss falls.
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(12345))
    y = (x @ teacher).argmax(dim=1)
    return x.to(device), y.to(device)


def _say(*lines) -> None:
    """Print (rank 0). A reader that went away (``demo | head``) silences this rank, not
    its training: the other ranks wait for it in every collective."""
    try:
        print(*lines, sep="\n", flush=True)
    except BrokenPipeError:
        silence_stdout()


def _max_difference(opt, model, replica, world_size: int, device) -> torch.Tensor:
    """The largest difference over every rank from unsharded Adam (``replica``'s): fp32
    parameters directly; fp16/bf16 through the fp32 master this rank owns (the
    parameters are its rounding)."""
    from zero_triton import flatten_params

    diff = torch.zeros((), device=device)
    twin = {id(p): q for p, q in zip(model.parameters(), replica.parameters())}
    for _, flat in internals(opt).shards():
        # The reference laid out like this flat buffer, so the shards line up.
        ref_flat, _ = flatten_params([twin[id(p)].detach() for p in flat.params],
                                     world_size=world_size, bucket_numel=flat.bucket_numel)
        master = flat.state.master.checkpointed()  # float32, in state order
        for lo, hi, s0 in flat.segments:
            diff = torch.maximum(diff, (master[s0:s0 + hi - lo] - ref_flat[lo:hi]).abs().max())
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff


def train(args, rank: int, world_size: int, device) -> dict:
    """Run the demo on this rank; returns the figures rank 0 prints."""
    from zero_triton import ZeroAdam
    from zero_triton.memory.model import format_table, memory_table

    dtype = DTYPES[args.dtype]
    model = build_mlp().to(device=device, dtype=dtype)
    replica = build_mlp().to(device=device)        # fp32, for torch.optim.Adam
    with torch.no_grad():                             # start from the same rounded weights
        for p, q in zip(model.parameters(), replica.parameters()):
            q.copy_(p.float())
    # Low-precision gradients are averaged in fp32 (reduce_dtype), as production runs do.
    opt = ZeroAdam(model.parameters(), lr=args.lr, backend=args.backend,
                   reduce_dtype=torch.float32 if dtype != torch.float32 else None)
    ref = torch.optim.Adam(replica.parameters(), lr=args.lr, foreach=False)
    n_params = sum(p.numel() for p in model.parameters())
    lines = []
    for step in range(1, args.steps + 1):
        x, y = _batch(step, rank, device)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x.to(dtype)).float(), y)
        loss.backward()
        # The check's reference: the mean gradient, applied by torch.optim.Adam.
        with torch.no_grad():
            for p, q in zip(model.parameters(), replica.parameters()):
                q.grad = p.grad.float().clone()
                dist.all_reduce(q.grad, op=dist.ReduceOp.SUM)
                q.grad /= world_size
        opt.step()
        ref.step()
        mean_loss = loss.detach().float().clone()
        dist.all_reduce(mean_loss, op=dist.ReduceOp.SUM)
        lines.append(f"step {step:3d}  loss {mean_loss.item() / world_size:.6f}")
        if rank == 0:
            _say(lines[-1])
    diff = _max_difference(opt, model, replica, world_size, device)
    report = opt.memory_report()
    if rank == 0:
        master = "fp32" if dtype != torch.float32 else "none"
        table = memory_table(n_params, world_size, master_dtype=master)
        formula = {s["stage"]: s for s in table["stages"]}
        held = "exp_avg + exp_avg_sq" if dtype == torch.float32 else "fp32 master + exp_avg + exp_avg_sq"
        shard = sum(flat.layout.shard_numel for _, flat in internals(opt).shards())
        _say("", format_table(table), "",
             f"optimizer state per rank ({held}), {n_params:,} params, {world_size} ranks:",
             f"  DDP formula      {formula['ddp']['optimizer_bytes']:>12,} bytes  (every rank holds all)",
             f"  ZeRO-1 formula   {formula['zero1']['optimizer_bytes']:>12,} bytes  (1/{world_size})",
             f"  ZeRO-1 measured  {report['optimizer_state']:>12,} bytes  on rank 0 "
             f"(a shard of {shard:,} elements incl. alignment padding)",
             f"  padding          {report['padding']:>12,} bytes  (params + grads, held by every rank)",
             "",
             f"max |ZeroAdam - torch.optim.Adam on the mean gradient| = {diff.item():.3e} "
             f"({'fp32 params' if dtype == torch.float32 else 'fp32 master'}, {args.steps} steps, "
             f"{world_size} ranks, backend {opt.backend})")
    return {"max_diff": diff.item(), "memory": report, "losses": lines}


def _worker(rank, caller, world_size, port, args, use_nccl):
    launch.as_the_caller(caller)
    backend = "nccl" if use_nccl else "gloo"
    if use_nccl:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        train(args, rank, world_size, torch.device("cuda", rank) if use_nccl else torch.device("cpu"))
        # No rank tears gloo down while a peer is still in its last collective (that
        # aborts the process at exit: "terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()
    _leave()


def _leave() -> None:
    """Exit a rank that finished without interpreter finalisation: gloo's threads can
    still hold tensors then, and releasing them there aborted a rank now and then
    ("terminate called without an active exception", about 1 run in 20 on 2 loaded
    cores). A rank that raised never gets here: its error reaches the launcher."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_parser(prog="python -m zero_triton demo"):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=rank_count("4"), default=4,
                   help="ranks to spawn (default 4; at most what this machine can run)")
    p.add_argument("--steps", type=whole_number(1, "20"), default=20)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--lr", type=positive_number("learning rate", "1e-2"), default=1e-2)
    p.add_argument("--backend", choices=NAMES, default="auto", help="kernel backend (default auto)")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if launch.start_env_problem():
        parser.error(launch.start_env_problem())
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:   # started by torchrun
        use_nccl = torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"])
        if use_nccl:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if use_nccl else "gloo",
                                timeout=datetime.timedelta(seconds=120))
        try:
            rank, world = dist.get_rank(), dist.get_world_size()
            device = torch.device("cuda", torch.cuda.current_device()) if use_nccl else torch.device("cpu")
            if rank == 0:
                _say(f"zero_triton demo: {world} ranks from torchrun, "
                     f"{'nccl' if use_nccl else 'gloo'}, {args.dtype}")
            train(args, rank, world, device)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        _leave()
    use_nccl = torch.cuda.is_available() and torch.cuda.device_count() >= args.world_size
    print(f"zero_triton demo: spawning {args.world_size} ranks, {'nccl' if use_nccl else 'gloo'}, "
          f"{args.dtype}, {args.steps} steps", flush=True)
    import torch.multiprocessing as mp
    ctx, caller = launch.start_context("cuda" if use_nccl else "cpu")  # CPU: forked, torch imported once
    mp.start_processes(_worker, args=(caller, args.world_size, _free_port(), args, use_nccl),
                       nprocs=args.world_size, join=True, start_method=ctx.get_start_method())
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
