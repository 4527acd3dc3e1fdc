"""Served state dicts under random schedules: any ranks call ``ZeroAdam.state_dict()``, in
any order, at any moment between steps; every call returns the whole state, the same
bits as the collective gather, or the soak counts a failure. Never a hang.

    python bench/serve_soak.py --runs 20 --rounds 12            # 2 to 8 ranks
    python bench/serve_soak.py --runs 5 --worlds 4 --rounds 30
    python bench/serve_soak.py --accelerate 4 --runs 3          # accelerate's save_state

Each run starts ``world`` gloo ranks (CPU processes) on a tiny model and plays ``rounds``
rounds drawn from the run's seed (the same draw on every rank): a training step, then
a random set of ranks (none, one, some, all) calls ``state_dict()`` after a random delay
of 0 to 60 ms, some twice (the shards sent in chunks of 5, 16 or 4 Mi elements, by
the seed); the round ends with ``dist.barrier()`` on every rank, or with
nothing (the callers catch up in the next step's collectives), or with every rank's call
in lockstep. After each round every rank takes ``consolidated_state_dict(None)`` (the
collective gather) as the reference. Prints per world size: runs, rounds, calls, wrong
results, hangs (a run past ``--timeout``), and the slowest call. Exit status 1 on any
wrong result or hang. ``tests/test_serve.py`` plays a few of these schedules in the suite.

``--accelerate N`` runs accelerate's own checkpointing instead: ``torchrun
--nproc_per_node N`` of a script that prepares a 6 x Linear(512, 512) model and a
ZeroAdamW with ``Accelerator(cpu=True)`` and calls ``save_state`` after every one of 5
steps, each process arriving 0 to 150 ms after its step (accelerate calls
``state_dict()`` on every process, each at its own moment). Prints each run's status
and seconds.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import random
import sys
import time
from pathlib import Path

import torch

ENDINGS = ("barrier", "none", "lockstep")


def schedule(seed: int, world: int, rounds: int) -> list:
    """Per round: (callers -> (delay s, calls)), the ending."""
    rng = random.Random(seed * 1000 + world)
    plan = []
    for _ in range(rounds):
        ending = rng.choice(ENDINGS)
        k = world if ending == "lockstep" else rng.choice([0, 1, 1, 2, world - 1, world])
        callers = rng.sample(range(world), min(k, world))
        plan.append(({r: (0.0 if ending == "lockstep" else rng.uniform(0, 0.06),
                          rng.choice([1, 1, 1, 2])) for r in callers}, ending))
    return plan


def digest(sd: dict) -> str:
    h = hashlib.blake2b(digest_size=8)
    for i in sorted(sd["state"]):
        for k in sorted(sd["state"][i]):
            t = sd["state"][i][k]
            h.update(k.encode())
            h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def play(rank: int, world: int, seed: int, rounds: int, stage: int) -> list:
    """One run on this rank: per round, (digests of this rank's calls, the reference
    digest, the slowest call in seconds)."""
    import torch.distributed as dist

    from zero_triton import ZeroAdamW

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5))
    opt = ZeroAdamW(model.parameters(), lr=1e-2, stage=stage, bucket_cap_mb=0.0002)
    # Chunks of 5, 16 or 4 Mi elements (the default): a shard sent in many pieces, as a
    # large model's is, or in one.
    opt._GATHER_CHUNK = random.Random(seed).choice([5, 16, 4 << 20])
    g = torch.Generator().manual_seed(seed * 7 + rank)
    out = []
    for callers, ending in schedule(seed, world, rounds):
        model(torch.randn(3, 12, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        got, slowest = [], 0.0
        if rank in callers:
            delay, calls = callers[rank]
            time.sleep(delay)
            for _ in range(calls):
                start = time.monotonic()
                got.append(digest(opt.state_dict()))
                slowest = max(slowest, time.monotonic() - start)
        if ending == "barrier":
            dist.barrier()
        out.append((got, digest(opt.consolidated_state_dict(None)), slowest))
    return out


ACCELERATE = """
import os, random, sys, time, torch
from accelerate import Accelerator
from zero_triton import ZeroAdamW
acc = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)])
model, opt = acc.prepare(model, ZeroAdamW(model.parameters(), lr=1e-3))
rng = random.Random(acc.process_index)
for step in range(int(sys.argv[2])):
    acc.backward(model(torch.randn(8, 512)).pow(2).mean())
    opt.step()
    opt.zero_grad()
    time.sleep(rng.uniform(0, 0.15))
    acc.save_state(os.path.join(sys.argv[1], f"step{step}"), safe_serialization=False)
acc.print("saved", step + 1)
"""


def accelerate_runs(nproc: int, runs: int, timeout: float) -> int:
    import subprocess
    import tempfile
    bad = 0
    for run in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "save.py"
            script.write_text(ACCELERATE)
            start = time.monotonic()
            try:
                proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                       "--nproc_per_node", str(nproc), str(script),
                                       str(Path(tmp) / "ckpt"), "5"],
                                      capture_output=True, text=True, timeout=timeout,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"})
                status = proc.returncode if "saved 5" in proc.stdout else f"{proc.returncode}, no save"
            except subprocess.TimeoutExpired:
                status = "hung"
            bad += status != 0
            print(f"accelerate save_state, {nproc} processes, run {run + 1}: status {status}, "
                  f"{time.monotonic() - start:.1f} s", flush=True)
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10, help="runs per world size")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4, 5, 6, 8])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    ap.add_argument("--accelerate", type=int, default=0, metavar="N",
                    help="run accelerate's save_state at N processes instead")
    args = ap.parse_args(argv)
    if args.accelerate:
        return accelerate_runs(args.accelerate, args.runs, args.timeout)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from dist_utils import soak_run
    bad = 0
    print(f"{'world':>5} {'runs':>5} {'rounds':>6} {'calls':>6} {'wrong':>5} {'hangs':>5} "
          f"{'errors':>6} {'slowest call s':>14} {'run s':>6}")
    for world in args.worlds:
        calls = wrong = hangs = errors = 0
        slowest, took = 0.0, []
        for run in range(args.runs):
            seed = args.seed + run
            status, results, seconds = soak_run(play, world, seed, args.rounds, 1 + run % 2,
                                                timeout=args.timeout, what=f"world {world} seed {seed}")
            hangs += status == "hang"
            errors += status == "error"
            if results is None:
                continue
            took.append(seconds)
            for per_rank in results:
                for got, ref, s in per_rank:
                    calls += len(got)
                    wrong += sum(d != ref for d in got)
                    slowest = max(slowest, s)
        bad += wrong + hangs + errors
        print(f"{world:>5} {args.runs:>5} {args.runs * args.rounds:>6} {calls:>6} {wrong:>5} "
              f"{hangs:>5} {errors:>6} {slowest:>14.3f} {max(took, default=0):>6.1f}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
