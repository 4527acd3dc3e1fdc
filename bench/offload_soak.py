"""offload="cpu" under random schedules: each rank sleeps a random while before every
stage of the offload pipeline (each gradient copy to the host, each host step, each copy
back) and before every all-gather, drawn from the run's seed and different on every
rank; the parameters and the state must be the same bits as an optimizer that keeps its
state on the device, trained on the same gradients in the same process, or the soak
counts a failure. Never a hang.

    python bench/offload_soak.py --runs 5                    # 2 to 8 ranks
    python bench/offload_soak.py --runs 20 --worlds 4 --steps 6

Each run starts ``world`` gloo ranks (CPU processes) and, for the run's configuration
(drawn by the seed from: fp32 or bf16 parameters, stage 1 or 2, one bucket or many,
fp32 / bf16 / int8 moments, an fp32 master, ``"remainder"`` or ``"stochastic"``,
clipping or not, all of the state offloaded or a part: ``offload_fraction`` 0.25, 0.5 or
0.75, the rest stepped on the device), trains both optimizers for ``--steps`` steps. Prints per world size:
runs, wrong results, hangs (a run past ``--timeout``), errors, and the slowest run.
Exit status 1 on any of them. ``tests/test_offload.py`` plays a few of these schedules
in the suite.
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

CONFIGS = [
    (torch.float32, {}),
    (torch.float32, {"moments": "int8"}),
    (torch.bfloat16, {}),
    (torch.bfloat16, {"moments": "bf16"}),
    (torch.bfloat16, {"master_weights": "remainder", "moments": "int8"}),
    (torch.bfloat16, {"master_weights": "stochastic", "moments": "int8"}),
]


def draw(seed: int) -> tuple:
    """The run's configuration: (dtype, ZeroAdamW keywords, the offloaded run's
    ``offload_fraction``: all of the state, or a part)."""
    rng = random.Random(seed)
    dtype, kw = rng.choice(CONFIGS)
    kw = {**kw, "stage": rng.choice([1, 2]), "bucket_cap_mb": rng.choice([None, 0.002, 0.0005])}
    if rng.random() < 0.5:
        kw["max_grad_norm"] = 0.05
    return dtype, kw, rng.choice([1.0, 1.0, 0.25, 0.5, 0.75])


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 32),
                               torch.nn.Tanh(), torch.nn.Linear(32, 8)).to(dtype)


def play(rank: int, world: int, seed: int, steps: int) -> tuple:
    from dist_utils import delay_offload
    from zero_triton import ZeroAdamW
    dtype, kw, fraction = draw(seed)
    runs = []
    for offload in (None, "cpu"):
        model = _model(dtype)
        placed = {"offload": offload, "offload_fraction": fraction} if offload else {}
        opt = ZeroAdamW(model.parameters(), lr=2e-2, **placed, **kw)
        if offload:
            delay_offload(opt, random.Random(seed * 1009 + rank), 0.005)
        for t in range(steps):
            x = torch.randn(6, 24, generator=torch.Generator().manual_seed(1000 * t + rank)).to(dtype)
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        sd = opt.state_dict()
        runs.append(([p.detach().clone() for p in model.parameters()], sd))
    (p0, s0), (p1, s1) = runs
    same = all(torch.equal(a, b) for a, b in zip(p0, p1)) and all(
        torch.equal(s0["state"][k][n], s1["state"][k][n]) for k in s0["state"] for n in s0["state"][k])
    return same


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="runs per world size")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4, 5, 6, 8])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from dist_utils import soak_run
    bad = 0
    print(f"{'world':>5} {'runs':>5} {'wrong':>5} {'hangs':>5} {'errors':>6} {'slowest run s':>13}")
    for world in args.worlds:
        wrong = hangs = errors = 0
        took = []
        for run in range(args.runs):
            seed = args.seed + 100 * world + run
            status, results, seconds = soak_run(play, world, seed, args.steps, timeout=args.timeout,
                                                what=f"world {world} seed {seed}")
            hangs += status == "hang"
            errors += status == "error"
            if results is None:
                continue
            took.append(seconds)
            if not all(results):
                wrong += 1
                print(f"  world {world} seed {seed} {draw(seed)}: not the same bits on ranks "
                      f"{[r for r, ok in enumerate(results) if not ok]}", file=sys.stderr)
        bad += wrong + hangs + errors
        print(f"{world:>5} {args.runs:>5} {wrong:>5} {hangs:>5} {errors:>6} {max(took, default=0):>13.1f}",
              flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
