"""The optimizer step on FSDP2's DTensor parameters, FusedAdamW beside torch's AdamW.

    python bench/dtensor_step.py [--ranks 2] [--layers 8] [--width 512] [--rounds 7]

One model (``layers`` blocks of two Linear layers, width ``width``, each block and the
root ``fully_shard``ed over ``ranks`` gloo ranks, one thread each), gradients made once
by a backward (then set to random values of a usual scale); then each configuration steps that model's parameters ``steps`` times per
round, rounds interleaved across configurations, and the table gives the slowest rank's
time per step (median and min-max over rounds) and its ratio to torch's fused AdamW:

- fp32 parameters: ``zero_triton.FusedAdamW`` against ``torch.optim.AdamW(fused=True)``
  and ``(foreach=True)``, both stepping the DTensors;
- bf16 parameters (the model cast before ``fully_shard``) with an fp32 master:
  FusedAdamW (master, moments and the bf16 write in one kernel) against torch's
  composite of fp32 master DTensors (cast the gradients up, ``AdamW(fused=True)`` on the
  masters, copy them down), and, for reference, torch's fused AdamW on the bf16
  DTensors without a master (what torch offers there, at bf16 precision).

Per rank it also prints the bytes of optimizer state and of parameters each holds: no
rank keeps a full-size copy of any parameter.
"""
import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _model(layers, width, dtype, mesh):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                  torch.nn.Linear(4 * width, width)) for _ in range(layers)]
    model = torch.nn.Sequential(*blocks).to(dtype)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.randn(4, width, dtype=dtype)).float().square().mean().backward()
    # Gradients of a usual scale: a deep stack's own are tiny, and their squares would be
    # subnormal floats, which CPUs step many times slower (both optimizers alike).
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            local = p.grad._local_tensor
            local.copy_(torch.randn(local.shape, generator=g) * 1e-2)
    return model


class _TorchComposite:
    """torch's way to an fp32 master for bf16 DTensors: fp32 copies, AdamW(fused) on them,
    gradients cast up and parameters copied down around its step."""

    def __init__(self, params, **kwargs):
        self.params = list(params)
        self.masters = [torch.nn.Parameter(p.detach().float()) for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, fused=True, **kwargs)

    @torch.no_grad()
    def step(self):
        for m, p in zip(self.masters, self.params):
            m.grad = p.grad.float()
        self.opt.step()
        for m, p in zip(self.masters, self.params):
            p.copy_(m)


def _configs(model_fp32, model_bf16):
    from zero_triton import FusedAdamW
    kw = dict(lr=1e-4, weight_decay=0.01)
    return {
        "fp32 FusedAdamW": lambda: FusedAdamW(model_fp32.parameters(), **kw),
        "fp32 torch AdamW(fused)": lambda: torch.optim.AdamW(model_fp32.parameters(), fused=True, **kw),
        "fp32 torch AdamW(foreach)": lambda: torch.optim.AdamW(model_fp32.parameters(), foreach=True, **kw),
        "bf16 FusedAdamW + fp32 master": lambda: FusedAdamW(model_bf16.parameters(), **kw),
        "bf16 torch composite (fp32 master)": lambda: _TorchComposite(model_bf16.parameters(), **kw),
        "bf16 torch AdamW(fused), no master": lambda: torch.optim.AdamW(model_bf16.parameters(), fused=True, **kw),
    }


def _state_bytes(opt):
    inner = getattr(opt, "opt", opt)
    total = 0
    for entry in inner.state.values():
        for v in entry.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                v = getattr(v, "_local_tensor", v)
                total += v.numel() * v.element_size()
    if inner is not opt:  # the composite's masters
        total += sum(m._local_tensor.numel() * 4 for m in opt.masters)
    return total


def _rank(rank, world_size, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,))
    fp32 = _model(args.layers, args.width, torch.float32, mesh)
    bf16 = _model(args.layers, args.width, torch.bfloat16, mesh)
    configs = _configs(fp32, bf16)
    opts = {name: make() for name, make in configs.items()}
    for opt in opts.values():  # state made, first steps out of the way
        for _ in range(2):
            opt.step()
    times = {name: [] for name in opts}
    for _ in range(args.rounds):
        for name, opt in opts.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                opt.step()
            times[name].append((time.perf_counter() - t0) / args.steps)
    local = sum(p._local_tensor.numel() for p in fp32.parameters())
    full = sum(p.numel() for p in fp32.parameters())
    info = {"state_bytes": {n: _state_bytes(o) for n, o in opts.items()},
            "local_params": local, "full_params": full}
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (times, info))
    if rank == 0:
        queue.put(gathered)
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args, queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    gathered = queue.get(timeout=3600)
    for p in procs:
        p.join()
    per_rank = [t for t, _ in gathered]
    info = gathered[0][1]
    names = list(per_rank[0])
    # the slowest rank's time in each round
    rounds = {n: [max(r[n][i] for r in per_rank) for i in range(args.rounds)] for n in names}
    print(f"FSDP2, {args.ranks} gloo ranks, {args.layers} blocks of width {args.width}: "
          f"{info['full_params'] / 1e6:.1f}M parameters, {info['local_params'] / 1e6:.2f}M per rank; "
          f"{args.rounds} interleaved rounds of {args.steps} steps")
    print(f"{'configuration':38s} {'ms/step':>8s} {'min-max':>15s} {'x torch fused':>14s} {'state MB/rank':>14s}")
    for n in names:
        base = "fp32 torch AdamW(fused)" if n.startswith("fp32") else "bf16 torch composite (fp32 master)"
        ratios = [a / b for a, b in zip(rounds[n], rounds[base])]
        med = statistics.median(rounds[n]) * 1e3
        print(f"{n:38s} {med:8.2f} {min(rounds[n]) * 1e3:7.2f}-{max(rounds[n]) * 1e3:<7.2f} "
              f"{statistics.median(ratios):7.2f} ({min(ratios):.2f}-{max(ratios):.2f}) "
              f"{info['state_bytes'][n] / 2**20:8.1f}")
    print("x torch fused: the median of per-round ratios (min-max) to torch's fused AdamW on the "
          "same DTensors; for bf16, to torch's fp32-master composite")


if __name__ == "__main__":
    main()
