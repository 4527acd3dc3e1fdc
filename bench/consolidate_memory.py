"""Peak memory of ZeroAdam.consolidated_state_dict on the receiving rank.

Spawns N gloo ranks on CPU, builds a bf16 model with an fp32 master, takes one step,
then samples rank 0's resident memory (/proc/self/statm, every millisecond, in a thread)
while it gathers the full torch.optim.Adam-format state. Prints the peak growth next to
the size of one full copy of that state (master + exp_avg + exp_avg_sq, fp32).

    python bench/consolidate_memory.py [--params 50e6] [--ranks 2]
"""
import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import torch  # noqa: E402


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rank(rank, world_size, params):
    import zero_triton
    width = 4096
    layers = max(1, int(params) // (width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    model = model.to(torch.bfloat16)
    opt = zero_triton.ZeroAdam(model.parameters(), lr=1e-4, backend="torch")
    for p in model.parameters():
        p.grad = torch.randn_like(p)  # as a backward would leave it
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    base, peak, stop = _rss(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    state = opt.consolidated_state_dict(to_rank=0)
    seconds = time.perf_counter() - t0
    stop.set()
    watcher.join()
    peak[0] = max(peak[0], _rss())
    del state
    return {"params": n, "growth": peak[0] - base, "full": 12 * n, "seconds": seconds}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    from dist_utils import run_ranks
    r0 = run_ranks(_rank, args.ranks, args.params, timeout=600)[0]
    print(f"{r0['params']:,} params on {args.ranks} ranks: consolidated_state_dict took "
          f"{r0['seconds']:.2f} s; rank 0 resident memory grew by {r0['growth'] / 1e6:.1f} MB "
          f"at its peak, one full copy of the state is {r0['full'] / 1e6:.1f} MB "
          f"({r0['growth'] / r0['full']:.2f}x)")


if __name__ == "__main__":
    main()
