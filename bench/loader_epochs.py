#!/usr/bin/env python
"""Epochs of a DataLoader with worker processes beside ZeroAdamW, against torch's AdamW
in the same ranks, the way a torchrun script runs them.

    python bench/loader_epochs.py --ranks 2 --workers 4 --epochs 3   # launches itself under torchrun

Each rank trains a small model for ``--epochs`` epochs of a DataLoader with ``--workers``
worker processes (forked: the default on Linux, and a new set every epoch, as
``persistent_workers=False`` makes them), once with torch.optim.AdamW and once with
ZeroAdamW, and prints each epoch's seconds, its loader's end included (the workers'
exit). A forked worker that ended on the parent's side channel took 5 s to end.
"""
import argparse
import os
import subprocess
import sys
import time


class Batches:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import torch
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, generator=g), torch.randn(4, generator=g)


def epochs(make_opt, args, rank) -> list:
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    opt = make_opt(model.parameters())
    sampler = torch.utils.data.DistributedSampler(Batches(args.items), shuffle=False)
    loader = torch.utils.data.DataLoader(Batches(args.items), batch_size=8, sampler=sampler,
                                         num_workers=args.workers, multiprocessing_context="fork")
    seconds = []
    for _ in range(args.epochs):
        start = time.perf_counter()
        for x, y in loader:  # the loader's iterator ends its workers when it is exhausted
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        seconds.append(time.perf_counter() - start)
    return seconds


def ranked(args) -> int:
    import torch
    import torch.distributed as dist

    from zero_triton import ZeroAdamW
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    rows = {"torch AdamW": epochs(lambda ps: torch.optim.AdamW(ps, lr=1e-2), args, rank),
            "ZeroAdamW": epochs(lambda ps: ZeroAdamW(ps, lr=1e-2), args, rank)}
    for name, seconds in rows.items():
        print(f"rank {rank} {name:12s} epochs (s): " + " ".join(f"{s:.2f}" for s in seconds), flush=True)
    ratio = max(rows["ZeroAdamW"]) / max(max(rows["torch AdamW"]), 1e-9)
    print(f"rank {rank} slowest epoch: ZeroAdamW {ratio:.2f}x torch AdamW's", flush=True)
    dist.destroy_process_group()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--items", type=int, default=256, help="dataset items (all ranks)")
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:
        return ranked(args)
    return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc-per-node={args.ranks}", __file__, *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
