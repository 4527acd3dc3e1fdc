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

bf16 training without a master (``master_dtype="stochastic"``, the optimizers'
``master_weights="stochastic"``): parameters 2P, gradients 2P, no master. With the
master's low half beside the parameters (``master_dtype="remainder"``, the optimizers'
``master_weights="remainder"``): the master 2P, exact (``zero_triton.state.master``);
its 8 bits (``master_dtype="remainder8"``): a 24-bit master, 1P.

The moments' format (``moments``, the optimizers' argument): ``"fp32"`` 8P; ``"bf16"``
4P; ``"int8"``
one byte per moment plus a float32 scale per moment per block of 256 elements,
(2 + 8/256)P = 2.03P (``zero_triton.state.int8``); ``"int4"`` half a byte per moment
and a bfloat16 scale per moment per block of 128, (1 + 4/128)P = 1.03P
(``zero_triton.state.int4``).

A shard holds ceil(P/N) elements: the flat layout pads buffers so that every rank's
shard has the same size, and the rank that pays most is the one that runs out of
memory. Activations, temporary buffers and fragmentation are not modelled. The
measured counterpart is the optimizer's ``memory_report()``.

Offload (``offloaded``): with ``offload_fraction`` f, each rank's host keeps f of its
optimizer state, the mirror of those parameters and the staging of their averaged
gradients; its device keeps the rest; per step f of its shard's gradients cross to the
host and f of its parameters back.

Its command line (``zero_triton.tools.memory``): ``python -m zero_triton memory --params 7.5e9 --world-size 64 [--offload [--offload-fraction f]] [--json]``; ``--params``
takes K/M/B/G/T suffixes too (7B = 7e9). ``--measure`` also builds that many parameters
on ``--world-size`` gloo CPU ranks and prints ZeroAdam stage 1 and 2 measured beside the
formula (``zero_triton.tools.memory``).
"""

from __future__ import annotations

from numbers import Integral
from typing import Dict, List

__all__ = [
    "STAGES",
    "stage_bytes",
    "memory_table",
    "format_table",
    "formula_optimizer_bytes",
]

# stage -> (what is sharded, shard params?, shard grads?, shard optimizer state?)
STAGES = {
    "ddp": ("nothing", False, False, False),
    "zero1": ("optimizer state", False, False, True),
    "zero2": ("optimizer state + grads", False, True, True),
    "zero3": ("optimizer state + grads + params", True, True, True),
}

# master_dtype -> bytes per parameter of (params, grads, master, m + v in fp32)
PRECISIONS = {
    "fp32": (2, 2, 4, 8),  # fp16/bf16 params and grads, fp32 master and moments
    "none": (4, 4, 0, 8),  # plain fp32 training: the parameters are the master
    "stochastic": (2, 2, 0, 8),  # bf16 params and grads, no master (master_weights="stochastic")
    "remainder": (2, 2, 2, 8),   # bf16 params and grads, the master's low 16 bits beside them
    "remainder8": (2, 2, 1, 8),  # the same with 8 bits of it: a 24-bit master
}
# moments format -> bytes per parameter of m + v
MOMENT_BYTES = {"fp32": 8, "bf16": 4, "int8": 2 + 8 / 256, "int4": 1 + 4 / 128}


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
                    ("master_bytes", master_bytes)):
        _check_count(b, name, 0, "pass bytes per parameter, e.g. 2 for bf16")
    if isinstance(moment_bytes, bool) or not isinstance(moment_bytes, (int, float)) or \
            not 0 <= moment_bytes < float("inf"):
        raise ValueError(f"moment_bytes must be a number >= 0, got {moment_bytes!r}; pass "
                         "bytes per parameter of m and v together, e.g. 8 for fp32")

    full, shard = params, _shard_elems(params, world_size)
    k = master_bytes + moment_bytes
    rows = []
    for stage, (sharded, sh_p, sh_g, sh_o) in STAGES.items():
        p_b = param_bytes * (shard if sh_p else full)
        g_b = grad_bytes * (shard if sh_g else full)
        o_b = -int(-k * (shard if sh_o else full) // 1)  # whole bytes, rounded up
        rows.append({"stage": stage, "sharded": sharded, "bytes_per_rank": p_b + g_b + o_b,
                     "params_bytes": p_b, "grads_bytes": g_b, "optimizer_bytes": o_b})
    ddp = rows[0]["bytes_per_rank"]
    for row in rows:
        row["gb_per_rank"] = row["bytes_per_rank"] / 1e9
        row["drop_vs_ddp_pct"] = 100.0 * (1.0 - row["bytes_per_rank"] / ddp) if ddp else 0.0
    return rows


def offloaded(rows: List[Dict], params: int, world_size: int, param_bytes, grad_bytes,
              fraction: float) -> List[Dict]:
    """``rows`` (``stage_bytes``) with the optimizer state's share ``fraction`` in host
    memory (``offload="cpu"``, ``zero_triton.optim.offload``): per rank ``host_bytes``
    (that share of the state, plus the mirror of its parameters and the staging of its
    averaged gradients, which the host step reads and writes), ``device_bytes`` (the
    rest) and ``bus_bytes_per_step`` (its gradients to the host, its parameters back)."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        raise ValueError(f"offload_fraction must be a number in [0, 1], got {fraction!r}")
    out = []
    for row in rows:
        sharded = STAGES[row["stage"]][3]
        elems = _shard_elems(params, world_size) if sharded else params
        state = -int(-row["optimizer_bytes"] * fraction // 1)
        moved = int(elems * fraction)
        host = state + moved * (param_bytes + grad_bytes)
        out.append({**row, "host_bytes": host, "device_bytes": row["bytes_per_rank"] - state,
                    "device_gb_per_rank": (row["bytes_per_rank"] - state) / 1e9,
                    "host_gb_per_rank": host / 1e9,
                    "bus_bytes_per_step": moved * (param_bytes + grad_bytes)})
    return out


def memory_table(params: int, world_size: int, master_dtype: str = "fp32",
                 moments: str = "fp32", offload_fraction: float | None = None) -> Dict:
    """The memory model as one JSON-ready dict.

    ``master_dtype``: ``"fp32"`` (fp16/bf16 params and grads, fp32 master, K = 12),
    ``"none"`` (plain fp32 training, no separate master, K = 8), ``"stochastic"`` (bf16
    params and grads, no master: ``master_weights="stochastic"``), ``"remainder"`` (the
    master's low 16 bits beside bf16 params, K = 10) or ``"remainder8"`` (8 of them, a
    24-bit master, K = 9). ``moments``: the
    moments' format, ``"fp32"`` (8 bytes per parameter), ``"bf16"`` (4) or ``"int8"`` (2.03).
    ``offload_fraction``: the share of the optimizer state in host memory (None: no
    offload; each stage then also has ``host_bytes``, ``device_bytes`` and
    ``bus_bytes_per_step``, ``offloaded``).
    Keys: ``params``, ``world_size``, ``master_dtype``, ``moments``, ``K``
    (optimizer-state bytes per parameter), ``offload_fraction``, ``stages`` (the list
    from ``stage_bytes``).
    """
    if master_dtype not in PRECISIONS:
        raise ValueError(f"master_dtype must be one of {sorted(PRECISIONS)}, got "
                         f"{master_dtype!r}; use 'fp32' for bf16/fp16 training with an "
                         f"fp32 master copy, 'none' for plain fp32 training, 'stochastic' "
                         f"for bf16 training without a master, 'remainder' for an exact "
                         f"master in 2 bytes beside bf16 parameters, 'remainder8' for a "
                         f"24-bit master in 1 byte")
    if moments not in MOMENT_BYTES:
        raise ValueError(f"moments must be one of {sorted(MOMENT_BYTES)}, got {moments!r}")
    pb, gb, mb, _ = PRECISIONS[master_dtype]
    ob = MOMENT_BYTES[moments]
    stages = stage_bytes(params, world_size, param_bytes=pb, grad_bytes=gb,
                         master_bytes=mb, moment_bytes=ob)
    if offload_fraction is not None:
        stages = offloaded(stages, params, world_size, pb, gb, offload_fraction)
    return {"params": int(params), "world_size": int(world_size),
            "master_dtype": master_dtype, "moments": moments, "K": mb + ob,
            "offload_fraction": offload_fraction, "stages": stages}


def _human(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return str(n)


def format_table(table: Dict) -> str:
    """A fixed-width text table of ``memory_table(...)``: one line per stage."""
    head = (f"model states per rank: P = {table['params']:,} ({_human(table['params'])}) "
            f"parameters, N = {table['world_size']} ranks, master = "
            f"{table['master_dtype']}, moments = {table.get('moments', 'fp32')}, "
            f"K = {table['K']:g}")
    off = table.get("offload_fraction")
    if off is not None:
        head += (f"; offload='cpu', {off:g} of the optimizer state in host memory (host: that "
                 "state, the mirror of its parameters and the staging of its gradients)")
    cols = f"{'stage':<6}  {'sharded':<32}  {'bytes/rank':>20}  {'GB/rank':>10}  {'drop vs DDP':>11}"
    if off is not None:
        cols += f"  {'device GB':>10}  {'host GB':>10}  {'bus GB/step':>11}"
    lines = [head, cols, "-" * len(cols)]
    for r in table["stages"]:
        line = (f"{r['stage']:<6}  {r['sharded']:<32}  {r['bytes_per_rank']:>20,}  "
                f"{r['gb_per_rank']:>10.3f}  {r['drop_vs_ddp_pct']:>10.1f}%")
        if off is not None:
            line += (f"  {r['device_gb_per_rank']:>10.3f}  {r['host_gb_per_rank']:>10.3f}  "
                     f"{r['bus_bytes_per_step'] / 1e9:>11.3f}")
        lines.append(line)
    return "\n".join(lines)


def formula_optimizer_bytes(params: int, world_size: int, master: bool = True) -> int:
    """Per-rank bytes of the ZeRO-1 optimizer state: fp32 master (when ``master``),
    m and v for one shard of ceil(params / world_size) elements.

    For comparison with a measured ``memory_report()``, which also counts alignment
    padding, so it may be slightly larger.
    """
    table = memory_table(params, world_size, "fp32" if master else "none")
    return next(r["optimizer_bytes"] for r in table["stages"] if r["stage"] == "zero1")
