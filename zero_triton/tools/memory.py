"""``python -m zero_triton memory``: the formula's table (``zero_triton.memory.model``) and,
with ``--measure``, ZeroAdam's memory per rank measured beside it:
``python -m zero_triton memory --params 5e7 --world-size 2 --measure``.

For stage 1 and then stage 2, on fresh gloo CPU ranks each, the ranks build ``--params``
parameters (bf16 with an fp32 master, or fp32 with ``--master-dtype none``) in layers of
at most 2^20 elements, run two training iterations and report, on the second:

* held: what ``memory_report()`` counts right after backward, the gradients' high point
  (parameters, gradients, master, moments, the buckets' receive and staging buffers);
* peak: how far the process's resident set rose over its size before the parameters were
  built (``VmHWM`` after a reset, Linux), so what autograd and the step allocate on the
  way counts too. The ranks run with ``MALLOC_MMAP_THRESHOLD_`` fixed at 128 KiB: glibc
  otherwise raises its mmap threshold after the first large free and keeps later
  bucket-sized buffers in its heap after they are freed, and the resident set then stops
  following what is allocated.

Stage 2 must hold at most stage 1 minus (N-1)/N of the gradient bytes, within 10%: the
last line checks it on both measures.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from typing import Optional, Sequence

import torch

from zero_triton.memory.model import MOMENT_BYTES, PRECISIONS, format_table, memory_table
from zero_triton.tools.units import parse_count, positive_number

MAX_PARAMS = 400_000_000
_MMAP = "MALLOC_MMAP_THRESHOLD_"
LAYER = 1 << 20


def _params(n: int, dtype):
    sizes = [LAYER] * (n // LAYER) + ([n % LAYER] if n % LAYER else [])
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in sizes]


def _rank(args, rank, world, device):
    from zero_triton import ZeroAdam
    from zero_triton.memory.probe import MemoryProbe
    dtype = torch.float32 if args.master_dtype == "none" else torch.bfloat16
    gc.collect()
    before = MemoryProbe(device).snapshot()["current"]
    params = _params(args.params, dtype)
    opt = ZeroAdam(params, lr=1e-3, stage=args.stage, bucket_cap_mb=args.bucket_cap_mb,
                   reduce_dtype=torch.float32, moments=args.moments,
                   master_weights=args.master_dtype if args.master_dtype in ("stochastic", "remainder", "remainder8")
                   else None)
    probe = MemoryProbe(device)
    held = None
    for it in range(2):
        with probe.phase(f"iteration {it}"):
            # Gradients that differ by rank, as data parallelism's do (identical ones
            # are what a DDP wrapper leaves, which ZeroAdam warns about).
            loss = sum((p * p).sum() for p in params) * (rank + 1)
            loss.backward()
            del loss
            held = opt.memory_report()
            opt.step()
            opt.zero_grad()
    peak = probe.phases["iteration 1"]["peak"]
    return {"held": held, "rise": None if peak is None or before is None else peak - before,
            "how": probe.how}


def measure(params: int, world_size: int, master_dtype: str = "fp32", bucket_cap_mb=25,
            timeout_s: float = 600.0, moments: str = "fp32") -> dict:
    """{stage: {"held": bytes, "rise": bytes, "report": memory_report}} of the largest rank."""
    from zero_triton.tools.profiling import launch
    out = {}
    before = os.environ.get(_MMAP)
    os.environ[_MMAP] = "131072"  # read by glibc when each rank starts
    try:
        every = {}
        for stage in (1, 2):
            args = argparse.Namespace(params=params, master_dtype=master_dtype, stage=stage,
                                      bucket_cap_mb=bucket_cap_mb, moments=moments)
            every[stage] = launch.spawn(_rank, args, world_size, "cpu", timeout_s,
                                        fresh=True)  # the resident set is measured
    finally:
        if before is None:
            os.environ.pop(_MMAP, None)
        else:
            os.environ[_MMAP] = before
    for stage, ranks in every.items():
        worst = max(ranks, key=lambda r: _held(r["held"]))
        rises = [r["rise"] for r in ranks if r["rise"] is not None]
        out[stage] = {"held": _held(worst["held"]), "rise": max(rises) if rises else None,
                      "report": worst["held"], "how": worst["how"]}
    return out


def _held(report: dict) -> int:
    return sum(report[k] for k in ("params", "grads", "master", "moments", "buckets", "scratch"))


def check(measured: dict, table: dict) -> dict:
    """Stage 2 against stage 1 minus (N-1)/N of the gradient bytes (``table``'s DDP row
    has the full gradient bytes), on each measure: the ratio must be at most 1.10."""
    n = table["world_size"]
    grads = next(r for r in table["stages"] if r["stage"] == "ddp")["grads_bytes"]
    saving = grads * (n - 1) / n
    out = {}
    for what in ("held", "rise"):
        s1, s2 = measured[1][what], measured[2][what]
        if s1 is None or s2 is None:
            continue
        bound = s1 - saving
        out[what] = {"stage1": s1, "stage2": s2, "bound": bound,
                     "ratio": s2 / bound if bound > 0 else None}
    return out


def format_measured(measured: dict, table: dict, bucket_cap_mb) -> str:
    mb = 2 ** 20
    rows = {r["stage"]: r for r in table["stages"]}
    lines = [f"measured on {table['world_size']} gloo CPU ranks ({bucket_cap_mb} MiB buckets), "
             "largest rank, MB = 2^20 bytes:",
             f"{'stage':<7}{'formula':>10}{'held':>10}{'params':>9}{'grads':>9}{'master':>9}"
             f"{'moments':>9}{'buckets':>9}{'peak rise':>11}"]
    for stage in (1, 2):
        m, r = measured[stage], measured[stage]["report"]
        lines.append(f"zero{stage:<3}{rows[f'zero{stage}']['bytes_per_rank'] / mb:>10.1f}"
                     f"{m['held'] / mb:>10.1f}{r['params'] / mb:>9.1f}{r['grads'] / mb:>9.1f}"
                     f"{r['master'] / mb:>9.1f}{r['moments'] / mb:>9.1f}{r['buckets'] / mb:>9.1f}"
                     + ("         -" if m["rise"] is None else f"{m['rise'] / mb:>11.1f}"))
    for what, c in check(measured, table).items():
        ok = c["ratio"] is not None and c["ratio"] <= 1.10
        lines.append(f"stage 2 {what}: {c['stage2'] / mb:.1f} MB, stage 1 minus (N-1)/N of the "
                     f"gradients: {c['bound'] / mb:.1f} MB, ratio "
                     + ("-" if c["ratio"] is None else f"{c['ratio']:.3f}")
                     + (" (within 10%)" if ok else " (over the 10% allowed)"))
    lines.append("held: memory_report() after backward; formula: the table above (no buckets, "
                 "no averaged shard in stage 1); peak rise: " + measured[1]["how"])
    return "\n".join(lines)


def as_json(measured: dict, table: dict) -> dict:
    return {"stages": {f"zero{s}": {k: v for k, v in m.items() if k != "how"}
                       for s, m in measured.items()}, "check": check(measured, table)}


__all__ = ["measure", "check", "format_measured", "as_json", "MAX_PARAMS"]


def _param_count(text: str) -> int:
    """A parameter count > 0: 7500000000, 7.5e9, 7.5B (K/M/B/G/T = 1e3/1e6/1e9/1e9/1e12)."""
    return parse_count(text, "7.5e9 or 7.5B")


def _world_size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; pass e.g. 8")
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{value} ranks is not possible; pass the number of data-parallel ranks (>= 1)")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; pass e.g. 0.5")
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{value} is not in [0, 1]; pass the share of the "
                                         "optimizer state in host memory, e.g. 0.5")
    return value


def build_parser(prog: str = "python -m zero_triton memory") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Bytes per rank of parameters, gradients and Adam state under DDP "
                    "and ZeRO stages 1-3 (mixed precision: K = 12).")
    parser.add_argument("--params", type=_param_count, required=True,
                        help="number of parameters, e.g. 7.5e9 or 7B "
                             "(K/M/B/G/T = 1e3/1e6/1e9/1e9/1e12)")
    parser.add_argument("--world-size", type=_world_size, required=True,
                        help="number of data-parallel ranks N")
    parser.add_argument("--master-dtype", choices=sorted(PRECISIONS), default="fp32",
                        help="fp32: bf16/fp16 params + fp32 master (default); "
                             "none: plain fp32 training; stochastic: bf16 params, no master; "
                             "remainder: bf16 params + the master's low 16 bits (exact); "
                             "remainder8: bf16 params + 8 of them (a 24-bit master)")
    parser.add_argument("--moments", choices=sorted(MOMENT_BYTES), default="fp32",
                        help="the Adam moments' format: fp32 (8 bytes per parameter, default), "
                             "bf16 (4), int8 (2.03: block-scaled 8-bit codes) or int4 "
                             "(1.03: 4-bit codes)")
    parser.add_argument("--offload", action="store_true",
                        help="the optimizer state in host memory (offload='cpu'): device and "
                             "host bytes per rank, and what crosses the bus per step")
    parser.add_argument("--offload-fraction", type=_fraction, default=None,
                        help="with --offload: the share of the optimizer state in host memory "
                             "(default 1)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object with a 'stages' list")
    parser.add_argument("--measure", action="store_true",
                        help="also measure ZeroAdam stage 1 and 2 on --world-size gloo CPU "
                             "ranks with --params parameters (at most 4e8)")
    parser.add_argument("--bucket-cap-mb", type=positive_number("number of MiB", "25"), default=25.0,
                        help="ZeroAdam's bucket size for --measure (default 25)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m zero_triton memory ...``: print the table (or JSON); returns 0.
    Bad arguments exit through argparse with status 2 and a message naming the fix."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.measure:
        from zero_triton.tools.profiling import launch
        if launch.start_env_problem():
            parser.error(launch.start_env_problem())
        if args.params > MAX_PARAMS:
            parser.error(f"--measure builds the parameters on this machine: --params "
                         f"{args.params:,} is more than {MAX_PARAMS:,}; pass e.g. 5e7")
        if args.world_size > 16:
            parser.error(f"--measure starts --world-size CPU processes: {args.world_size} is "
                         "more than 16; pass e.g. 2 or 4")
        if not args.bucket_cap_mb > 0:
            parser.error(f"--bucket-cap-mb must be > 0, got {args.bucket_cap_mb}")
    if args.offload_fraction is not None and not args.offload:
        parser.error("--offload-fraction applies to --offload; pass --offload too")
    fraction = (1.0 if args.offload_fraction is None else args.offload_fraction) if args.offload else None
    table = memory_table(args.params, args.world_size, args.master_dtype, args.moments, fraction)
    measured = None
    if args.measure:
        measured = measure(args.params, args.world_size, args.master_dtype, args.bucket_cap_mb,
                           moments=args.moments)
    if args.json:
        print(json.dumps({**table, **({"measured": as_json(measured, table)} if measured else {})}))
    else:
        print(format_table(table))
        if measured:
            print("\n" + format_measured(measured, table, args.bucket_cap_mb))
    return 0
