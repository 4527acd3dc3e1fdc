"""Memory model: bytes per rank of model states under DDP and ZeRO stages 1, 2, 3.

Mixed-precision Adam on P parameters (Rajbhandari et al., "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", section 3 and Figure 1): fp16/bf16
parameters 2P, fp16/bf16 gradients 2P, optimizer state K*P with K = 12 (fp32 master
4P, Adam m 4P, v 4P). Per rank, over N data-parallel ranks:

    DDP    = 2P + 2P + 12P       = 16P
    ZeRO-1 = 2P + 2P + 12P/N     (optimizer state sharded)
    ZeRO-2 = 2P + (2P + 12P)/N   (gradients too)
    ZeRO-3 = 16P/N               (parameters too)

Plain fp32 training (``master_dtype="none"``): parameters 4P, gradients 4P, no
master, moments 8P, so K = 8 and DDP is 16P again.

A shard holds ceil(P/N) elements: the flat layout pads buffers so that every rank's
shard has the same size, and the rank that pays most is the one that runs out of
memory. Activations, temporary buffers and fragmentation are not modelled. The
measured counterpart is the optimizer's ``memory_report()``.

CLI: ``python -m zero_triton memory --params 7.5e9 --world-size 64 [--json]``; ``--params``
takes K/M/B/G/T suffixes too (7B = 7e9). ``--measure`` also builds that many parameters
on ``--world-size`` gloo CPU ranks and prints ZeroAdam stage 1 and 2 measured beside the
formula (``zero_triton.tools.memory``).
"""

from __future__ import annotations

import argparse
import json
import sys
from numbers import Integral
from typing import Dict, List, Optional, Sequence

from zero_triton.tools.units import parse_count, positive_number

__all__ = [
    "STAGES",
    "stage_bytes",
    "memory_table",
    "format_table",
    "formula_optimizer_bytes",
    "main",
]

# stage -> (what is sharded, shard params?, shard grads?, shard optimizer state?)
STAGES = {
    "ddp": ("nothing", False, False, False),
    "zero1": ("optimizer state", False, False, True),
    "zero2": ("optimizer state + grads", False, True, True),
    "zero3": ("optimizer state + grads + params", True, True, True),
}

# master_dtype -> bytes per parameter of (params, grads, master, m + v)
_PRECISIONS = {
    "fp32": (2, 2, 4, 8),  # fp16/bf16 params and grads, fp32 master and moments
    "none": (4, 4, 0, 8),  # plain fp32 training: the parameters are the master
}


def _check_count(value, name: str, minimum: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}; {fix}")
    return int(value)


def _shard_elems(params: int, world_size: int) -> int:
    return -(-params // world_size)  # ceil: the largest (padded) shard


def stage_bytes(
    params: int,
    world_size: int,
    *,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    master_bytes: int = 4,
    moment_bytes: int = 8,
) -> List[Dict]:
    """Bytes per rank of model states for stages ddp, zero1, zero2, zero3.

    ``params``: number of parameters P (int >= 0). ``world_size``: data-parallel
    ranks N (int >= 1). ``*_bytes``: bytes per parameter of the low-precision
    parameters, the gradients, the master copy (0 when there is none) and the Adam
    moments m + v together. Returns one dict per stage with keys ``stage``,
    ``sharded``, ``bytes_per_rank``, ``params_bytes``, ``grads_bytes``,
    ``optimizer_bytes`` (master + moments), ``gb_per_rank`` (1 GB = 1e9 bytes) and
    ``drop_vs_ddp_pct``.
    """
    params = _check_count(params, "params", 0, "pass the parameter count, e.g. 7_500_000_000")
    world_size = _check_count(world_size, "world_size", 1,
                              "pass the number of data-parallel ranks, e.g. 8")
    for name, b in (("param_bytes", param_bytes), ("grad_bytes", grad_bytes),
                    ("master_bytes", master_bytes), ("moment_bytes", moment_bytes)):
        _check_count(b, name, 0, "pass bytes per parameter, e.g. 2 for bf16")

    full, shard = params, _shard_elems(params, world_size)
    k = master_bytes + moment_bytes
    rows = []
    for stage, (sharded, sh_p, sh_g, sh_o) in STAGES.items():
        p_b = param_bytes * (shard if sh_p else full)
        g_b = grad_bytes * (shard if sh_g else full)
        o_b = k * (shard if sh_o else full)
        rows.append({"stage": stage, "sharded": sharded, "bytes_per_rank": p_b + g_b + o_b,
                     "params_bytes": p_b, "grads_bytes": g_b, "optimizer_bytes": o_b})
    ddp = rows[0]["bytes_per_rank"]
    for row in rows:
        row["gb_per_rank"] = row["bytes_per_rank"] / 1e9
        row["drop_vs_ddp_pct"] = 100.0 * (1.0 - row["bytes_per_rank"] / ddp) if ddp else 0.0
    return rows


def memory_table(params: int, world_size: int, master_dtype: str = "fp32") -> Dict:
    """The memory model as one JSON-ready dict.

    ``master_dtype``: ``"fp32"`` (fp16/bf16 params and grads, fp32 master, K = 12) or
    ``"none"`` (plain fp32 training, no separate master, K = 8).
    Keys: ``params``, ``world_size``, ``master_dtype``, ``K`` (optimizer-state bytes
    per parameter), ``stages`` (the list from ``stage_bytes``).
    """
    if master_dtype not in _PRECISIONS:
        raise ValueError(f"master_dtype must be one of {sorted(_PRECISIONS)}, got "
                         f"{master_dtype!r}; use 'fp32' for bf16/fp16 training with an "
                         f"fp32 master copy, 'none' for plain fp32 training")
    pb, gb, mb, ob = _PRECISIONS[master_dtype]
    stages = stage_bytes(params, world_size, param_bytes=pb, grad_bytes=gb,
                         master_bytes=mb, moment_bytes=ob)
    return {"params": int(params), "world_size": int(world_size),
            "master_dtype": master_dtype, "K": mb + ob, "stages": stages}


def _human(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return str(n)


def format_table(table: Dict) -> str:
    """A fixed-width text table of ``memory_table(...)``: one line per stage."""
    head = (f"model states per rank: P = {table['params']:,} ({_human(table['params'])}) "
            f"parameters, N = {table['world_size']} ranks, master = "
            f"{table['master_dtype']}, K = {table['K']}")
    cols = f"{'stage':<6}  {'sharded':<32}  {'bytes/rank':>20}  {'GB/rank':>10}  {'drop vs DDP':>11}"
    lines = [head, cols, "-" * len(cols)]
    for r in table["stages"]:
        lines.append(f"{r['stage']:<6}  {r['sharded']:<32}  {r['bytes_per_rank']:>20,}  "
                     f"{r['gb_per_rank']:>10.3f}  {r['drop_vs_ddp_pct']:>10.1f}%")
    return "\n".join(lines)


def formula_optimizer_bytes(params: int, world_size: int, master: bool = True) -> int:
    """Per-rank bytes of the ZeRO-1 optimizer state: fp32 master (when ``master``),
    m and v for one shard of ceil(params / world_size) elements.

    For comparison with a measured ``memory_report()``, which also counts alignment
    padding, so it may be slightly larger.
    """
    table = memory_table(params, world_size, "fp32" if master else "none")
    return next(r["optimizer_bytes"] for r in table["stages"] if r["stage"] == "zero1")


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
    parser.add_argument("--master-dtype", choices=sorted(_PRECISIONS), default="fp32",
                        help="fp32: bf16/fp16 params + fp32 master (default); "
                             "none: plain fp32 training")
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
        from zero_triton.tools import memory as mm
        if args.params > mm.MAX_PARAMS:
            parser.error(f"--measure builds the parameters on this machine: --params "
                         f"{args.params:,} is more than {mm.MAX_PARAMS:,}; pass e.g. 5e7")
        if args.world_size > 16:
            parser.error(f"--measure starts --world-size CPU processes: {args.world_size} is "
                         "more than 16; pass e.g. 2 or 4")
        if not args.bucket_cap_mb > 0:
            parser.error(f"--bucket-cap-mb must be > 0, got {args.bucket_cap_mb}")
    table = memory_table(args.params, args.world_size, args.master_dtype)
    measured = None
    if args.measure:
        measured = mm.measure(args.params, args.world_size, args.master_dtype, args.bucket_cap_mb)
    if args.json:
        print(json.dumps({**table, **({"measured": mm.as_json(measured, table)} if measured else {})}))
    else:
        print(format_table(table))
        if measured:
            print("\n" + mm.format_measured(measured, table, args.bucket_cap_mb))
    return 0


if __name__ == "__main__":
    from zero_triton.tools.cli import run
    sys.exit(run(main))
