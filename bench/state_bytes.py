#!/usr/bin/env python
"""A bf16 model's whole optimizer side (parameters + gradients + state) in bytes per
parameter, per state format, measured two ways side by side: the optimizer's
``memory_report()`` (its device total) and the process's resident memory (peak, and
after two steps), each row in a fresh process over ``--size`` bf16 parameters (64 equal
tensors) whose gradients come from a real backward (the hooks take each one).

    python bench/state_bytes.py                    # 32Mi parameters, every row
    python bench/state_bytes.py --size 4Mi --rows remainder8+int8

Rows: ``fp32+fp32`` (an fp32 master and fp32 moments: torch's mixed precision, 16 B),
``remainder+int8`` (the exact master's low 16 bits, int8 moments), ``remainder8+int8``
(a 24-bit master, int8 moments), ``stochastic+int8`` (no master); ``+int4``: 4-bit
moments; ``+release``: the same with ``grad_release=True`` (each parameter stepped in
backward and its gradient freed).

Resident memory counts what the process holds from the OS; glibc keeps freed blocks
below its mmap threshold in its heap (the parameters' first storage, moved into the flat
buffer at construction, and backward's gradients, copied into it), which would add about
2 bytes per parameter that nothing uses. Each row runs with ``MALLOC_MMAP_THRESHOLD_``
at 64 KiB (``--keep-malloc`` leaves glibc's default), so that freed blocks go back.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

ROWS = ("fp32+fp32", "remainder+int8", "remainder8+int8", "stochastic+int8",
        "remainder+int8+release", "remainder8+int8+release", "stochastic+int8+release",
        "remainder8+int4", "remainder+int4+release", "remainder8+int4+release")
TENSORS = 64


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(row: str, n: int) -> dict:
    """One row, in this process: bytes per parameter by memory_report and resident memory."""
    import torch

    import zero_triton as zt
    torch.set_num_threads(1)
    master, moments, *release = row.split("+")
    master_weights = None if master == "fp32" else master
    kw = {"master_weights": master_weights, "moments": moments, "grad_release": bool(release)}
    warm = [torch.nn.Parameter(torch.randn(1024).bfloat16())]  # kernels and buffers loaded
    opt = zt.FusedAdamW(warm, **kw)
    (warm[0] * torch.randn(1024).bfloat16()).sum().backward()
    opt.step()
    del opt, warm
    peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    base = _rss()
    params = [torch.nn.Parameter(torch.empty(n // TENSORS, dtype=torch.bfloat16).normal_())
              for _ in range(TENSORS)]
    opt = zt.FusedAdamW(params, lr=1e-3, **kw)
    for _ in range(2):
        sum((p * 1e-3).sum() for p in params).backward()
        opt.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    count = TENSORS * (n // TENSORS)
    report = opt.memory_report()
    return {"row": row, "params": count, "report": report["device"] / count,
            "master": report["master"] / count, "moments": report["moments"] / count,
            # ru_maxrss is the process's peak since it started: over the warm-up's peak
            "peak_rss": (peak - max(peak0, base)) / count if peak > peak0 else None,
            "rss_after": (_rss() - base) / count}


def _size(text: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * scale)
    return int(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=_size, default=32 << 20, help="parameters (e.g. 32Mi)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"from {', '.join(ROWS)}")
    parser.add_argument("--keep-malloc", action="store_true",
                        help="leave glibc's mmap threshold as it is")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: measure this row, print it
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args.size)))
        return 0
    rows = [r for r in args.rows.split(",") if r]
    bad = [r for r in rows if r not in ROWS]
    if bad:
        parser.error(f"unknown rows {bad}; choose from {', '.join(ROWS)}")
    env = dict(os.environ)
    if not args.keep_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    print(f"{'row':24s} {'memory_report':>13s} {'master':>7s} {'moments':>8s} {'peak RSS':>9s} "
          f"{'RSS after':>10s}   (bytes per parameter, {args.size:,} bf16 parameters)")
    for row in rows:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", row,
                               "--size", str(args.size)], env=env, capture_output=True, text=True)
        if proc.returncode:
            print(f"{row}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
            return 1
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        peak = "n/a" if r["peak_rss"] is None else f"{r['peak_rss']:.3f}"
        print(f"{row:24s} {r['report']:13.3f} {r['master']:7.3f} {r['moments']:8.3f} "
              f"{peak:>9s} {r['rss_after']:10.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
