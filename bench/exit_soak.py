"""Exit soak: torchrun scripts that use ZeroAdam end with status 0 (or the exception's
status), never an abort, however they end.

    python bench/exit_soak.py --runs 200            # every variant, 200 runs each
    python bench/exit_soak.py --runs 200 --variants ddp   # the control, without zero_triton

Each run starts ``torchrun --nproc_per_node 2`` (gloo, CPU) on a small training script
that ends one of five ways: ``destroy_process_group()`` after the last step, no destroy
at all, right after an overlapped step (all-gathers in flight) with and without destroy,
and an exception on every rank. The ``ddp`` control ends the first way with DDP and
torch.optim.Adam instead of ZeroAdamW. Prints, per variant, how many runs ended with the
expected status and the statuses seen otherwise (a negative status is a signal: -6 is
SIGABRT); with ``EXIT_SOAK_VERBOSE=1`` the end of each such run's stderr. Exit status 1
when any run ended otherwise.

The ``lone-*`` variants start the ranks as plain processes (``env://``, no launcher that
would kill the others when one ends) and time how long a rank whose script is done
stays after its peers end, however they end (docs/checkpoints.md, "State dicts on one rank"):

- ``lone-end``: rank 1 is done; rank 0 ends 1 s later (nothing asked: the baseline, where
  the teardown figure is a 2-rank process's own shutdown);
- ``lone-save-last``: 4 ranks; ranks 1-3 end first, rank 0 calls ``opt.state_dict()``
  as its last line 1 s later (the others answer it, then leave with it);
- ``lone-peer-killed``: rank 1 is done; rank 0 is SIGKILLed 1 s later;
- ``lone-peer-exit``: rank 1 is done; rank 0 calls ``sys.exit(3)`` 1 s later;
- ``lone-peer-raises``: rank 1 is done; rank 0 raises 1 s later;
- ``lone-raise-mid-training``: rank 1 raises before its third step, while rank 0 goes
  on to it (its step's agreement fails at once);
- ``lone-spawn-raise``: ``torch.multiprocessing.spawn``, rank 1 raises before its third
  step (spawn turns it into ``sys.exit(1)``): the parent ends with status 1.

Each prints the statuses and the lag: how long after the last of its peers ended (its
script's last line, or its death) the slowest rank that was done exited (median and
max over the runs; about 1 s is the bar).
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import textwrap
import time

SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    variant = sys.argv[1]
    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    if variant == "ddp":  # the control: DDP + torch.optim.Adam, zero_triton never imported
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        import zero_triton
        opt = zero_triton.ZeroAdamW(model.parameters(), lr=1e-3, bucket_cap_mb=0.01)
    if variant.startswith("overlap"):
        zero_triton.overlap(model, opt)
    for _ in range(3):
        model(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    if variant == "raise":
        raise RuntimeError("the script fails on every rank")
    if variant in ("destroy", "overlap+destroy", "ddp"):
        dist.destroy_process_group()
""")

LONE_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time, torch, torch.distributed as dist
    variant, out = sys.argv[1], sys.argv[2]
    def mark(what):  # when this rank's script reached its end (wall clock)
        with open(f"{out}.{dist.get_rank() if dist.is_initialized() else 'p'}", "w") as f:
            f.write(f"{what} {time.time()}")
    def train(rank, world):
        import zero_triton
        torch.manual_seed(rank)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        opt = zero_triton.ZeroAdamW(model.parameters(), lr=1e-3, bucket_cap_mb=0.01)
        for step in range(3):
            if variant in ("lone-raise-mid-training", "lone-spawn-raise") and rank == 1 and step == 2:
                mark("raise")
                raise RuntimeError("rank 1 fails before its third step")
            model(torch.randn(8, 64)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return opt
    def entry(rank, port):  # a torch.multiprocessing.spawn rank
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2)
        train(rank, 2)
        mark("end")
    def main():
        if variant == "lone-spawn-raise":
            import torch.multiprocessing as mp
            mp.spawn(entry, args=(int(os.environ["MASTER_PORT"]),), nprocs=2)
            return
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        opt = train(rank, dist.get_world_size())
        if rank == 0 and variant != "lone-raise-mid-training":
            time.sleep(1.0)
        if variant == "lone-save-last" and rank == 0:
            opt.state_dict()
        mark("end")
        if rank == 0 and variant == "lone-peer-killed":
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == 0 and variant == "lone-peer-exit":
            sys.exit(3)
        if rank == 0 and variant == "lone-peer-raises":
            raise RuntimeError("rank 0 fails after rank 1 is done")
    if __name__ == "__main__":
        main()
""")

VARIANTS = {"destroy": 0, "no-destroy": 0, "overlap+destroy": 0, "overlap": 0, "raise": 1}
# Plain processes: the expected status of each rank (one entry: the spawning parent).
LONE = {"lone-end": (0, 0), "lone-save-last": (0, 0, 0, 0), "lone-peer-killed": (-9, 0), "lone-peer-exit": (3, 0),
        "lone-peer-raises": (1, 0), "lone-raise-mid-training": (1, 1), "lone-spawn-raise": (1,)}
CONTROL = {"ddp": 0}  # run only when named: the same ending without zero_triton
EXPECTED = {**VARIANTS, **CONTROL}


def run_lone(script: str, variant: str, timeout: float, tmp: str) -> tuple[tuple, float, float, str]:
    """One run of a ``lone-*`` variant: (statuses, lag, teardown, stderr of the ranks).
    The lag: from the last peer's end (its mark, or the parent seeing it die) to the exit
    of the slowest rank that was done, over the ranks that ended with status 0. The
    teardown, for comparison: how long the rank that ended last took from its last line
    to its exit (nobody left to wait for: the interpreter's and torch's own shutdown);
    None where that rank did not end with status 0."""
    import socket
    with socket.socket() as s_:
        s_.bind(("127.0.0.1", 0))
        port = s_.getsockname()[1]
    world = len(LONE[variant])
    out = os.path.join(tmp, f"mark-{variant}-{time.monotonic_ns()}")
    procs = []
    for rank in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world)}
        procs.append(subprocess.Popen([sys.executable, script, variant, out], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    exited = [None] * world
    deadline = time.monotonic() + timeout
    while any(e is None for e in exited) and time.monotonic() < deadline:
        for r, p in enumerate(procs):
            if exited[r] is None and p.poll() is not None:
                exited[r] = time.time()
        time.sleep(0.005)
    for p in procs:
        if p.poll() is None:
            p.kill()
    statuses = tuple(p.wait() if e is not None else 124 for p, e in zip(procs, exited))
    stderr = "".join(p.stderr.read() for p in procs)
    ends = {}
    for r in range(world):
        try:
            with open(f"{out}.{r}") as f:
                ends[r] = float(f.read().split()[1])
        except OSError:
            ends[r] = None
    lag = 0.0
    for r in range(world):
        if statuses[r] != 0 or exited[r] is None:
            continue
        peers = [min(t for t in (ends[q], exited[q]) if t is not None) if ends[q] or exited[q]
                 else None for q in range(world) if q != r]
        if peers and all(t is not None for t in peers):
            lag = max(lag, exited[r] - max(max(peers), ends[r] or 0))
    marked = [r for r in range(world) if ends[r] is not None]
    last = max(marked, key=lambda r: ends[r]) if marked else None
    teardown = exited[last] - ends[last] if last is not None and statuses[last] == 0 \
        and exited[last] is not None else None
    return statuses, lag, teardown, stderr


def run_once(script: str, variant: str, timeout: float) -> int:
    status, stderr = _run_once(script, variant, timeout)
    if status != EXPECTED[variant] and os.environ.get("EXIT_SOAK_VERBOSE"):
        sys.stderr.write(f"--- {variant}: status {status}\n{stderr[-6000:]}\n")
    return status


def _run_once(script: str, variant: str, timeout: float) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--standalone", script, variant]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHELASTIC_ERROR_FILE": os.devnull}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        return 124, str(exc.stderr or "")
    # torchrun reports a child's signal as its own failure: look for it in its summary.
    for line in proc.stderr.splitlines():
        if "exitcode" in line and ("-6" in line or "Signal" in line or "SIGABRT" in line):
            return -6, proc.stderr
    return proc.returncode, proc.stderr


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=200, help="runs per variant (default 200)")
    ap.add_argument("--variants", default=",".join([*VARIANTS, *LONE]),
                    help=f"comma list of {','.join([*VARIANTS, *LONE])} (default: all), or "
                         "ddp: the control, DDP + torch.optim.Adam ending with "
                         "destroy_process_group()")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in EXPECTED and v not in LONE]
    if bad or args.runs < 1:
        ap.error(f"unknown variants {bad}" if bad else "--runs must be >= 1")
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "train.py")
        with open(script, "w") as f:
            f.write(SCRIPT)
        lone = os.path.join(tmp, "lone.py")
        with open(lone, "w") as f:
            f.write(LONE_SCRIPT)
        for variant in variants:
            if variant in LONE:
                start, seen, lags, teardowns = time.monotonic(), collections.Counter(), [], []
                for _ in range(args.runs):
                    statuses, lag, teardown, stderr = run_lone(lone, variant, args.timeout, tmp)
                    seen[statuses] += 1
                    if statuses == LONE[variant]:
                        lags.append(lag)
                        if teardown is not None:
                            teardowns.append(teardown)
                    elif os.environ.get("EXIT_SOAK_VERBOSE"):
                        sys.stderr.write(f"--- {variant}: statuses {statuses}\n{stderr[-6000:]}\n")
                good = seen.pop(LONE[variant], 0)
                failed |= bool(seen)
                lags.sort()
                teardowns.sort()
                print(f"{variant:24s} {good}/{args.runs} exited {LONE[variant]}"
                      + (f"; otherwise {dict(seen)}" if seen else "")
                      + (f"; lag median {lags[len(lags) // 2]:.2f} s, max {lags[-1]:.2f} s"
                         if lags and variant != "lone-spawn-raise" else "")
                      + (f" (the last rank's own teardown: median "
                         f"{teardowns[len(teardowns) // 2]:.2f} s)" if teardowns else "")
                      + f"  ({time.monotonic() - start:.0f} s)", flush=True)
                continue
            start, seen = time.monotonic(), collections.Counter()
            for _ in range(args.runs):
                seen[run_once(script, variant, args.timeout)] += 1
            good = seen.pop(EXPECTED[variant], 0)
            failed |= bool(seen)
            print(f"{variant:16s} {good}/{args.runs} exited {EXPECTED[variant]}"
                  + (f"; otherwise {dict(seen)}" if seen else "")
                  + f"  ({time.monotonic() - start:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
