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

VARIANTS = {"destroy": 0, "no-destroy": 0, "overlap+destroy": 0, "overlap": 0, "raise": 1}
CONTROL = {"ddp": 0}  # run only when named: the same ending without zero_triton
EXPECTED = {**VARIANTS, **CONTROL}


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
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma list of {','.join(VARIANTS)} (default: all), or ddp: the "
                         "control, DDP + torch.optim.Adam ending with destroy_process_group()")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in EXPECTED]
    if bad or args.runs < 1:
        ap.error(f"unknown variants {bad}" if bad else "--runs must be >= 1")
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "train.py")
        with open(script, "w") as f:
            f.write(SCRIPT)
        for variant in variants:
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
