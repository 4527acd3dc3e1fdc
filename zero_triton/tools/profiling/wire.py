"""Bytes on the wire per rank: a naive all-reduce against reduce-scatter + all-gather.

The seed's exercise. For a buffer of B bytes over N ranks, a ring all-reduce sends
(and receives) 2(N-1)/N * B per rank: a reduce-scatter pass and an all-gather pass,
(N-1)/N * B each. ZeRO-1 runs the same two passes as two collectives, the
reduce-scatter on the gradients and the all-gather on the updated parameters, so it
moves exactly what DDP's all-reduce moves; ZeRO-2 keeps only the gradient shard and
runs the same two collectives. ZeroAdam's buckets are padded to a multiple of
N * 16 elements, so B / N is a whole number of bytes and the figures here are exact
for the real buffers (``buffers_of``). ZeroAdam's reduce-scatter is an all-to-all and a
sum in rank order (``zero_triton.comm.group``): the all-to-all moves (N-1)/N * B per rank,
the reduce-scatter's bytes, on every backend.

``measure`` times each collective on buffers of those sizes, the way ZeroAdam calls it
(``GroupComm``), and gives the achieved bus bandwidth: formula bytes per rank / time.
"""
from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.distributed as dist

from zero_triton.comm.group import GroupComm
from zero_triton.optim.interface import internals
from zero_triton.state.flat import FlatLayout


def ring_bytes(buffer_bytes: int, world_size: int) -> dict:
    """Bytes each rank sends for one collective on a buffer of ``buffer_bytes`` (a
    multiple of ``world_size``), by the ring formulas."""
    if buffer_bytes % world_size:
        raise ValueError(f"a buffer of {buffer_bytes} bytes does not split into {world_size} "
                         "equal shards; ZeroAdam pads its flat buffers so that it does")
    shard = buffer_bytes // world_size
    return {"all_reduce": 2 * (world_size - 1) * shard,
            "reduce_scatter": (world_size - 1) * shard,
            "all_gather": (world_size - 1) * shard}


def buffers_of(optimizer) -> list:
    """[{"numel", "grad_dtype", "grad_bytes", "param_dtype", "param_bytes"}] for every
    flat buffer of a ZeroAdam: the gradients its reduce-scatters send (in their own
    dtype, also with a wider ``reduce_dtype``) and the parameters its all-gathers fill."""
    out = []
    for _, flat in internals(optimizer).shards():
        param = flat.flat_param
        grad = param  # the gradients: the parameters' dtype and layout (ZeRO-2: in buckets)
        out.append({"numel": flat.layout.padded_numel,
                    "grad_dtype": str(grad.dtype).replace("torch.", ""),
                    "grad_bytes": grad.numel() * grad.element_size(),
                    "param_dtype": str(param.dtype).replace("torch.", ""),
                    "param_bytes": param.numel() * param.element_size()})
    return out


def synthetic_buffers(numel: int, dtype: torch.dtype, world_size: int) -> list:
    """One flat buffer of ``numel`` elements, padded as ZeroAdam pads its own."""
    padded = FlatLayout.build([(numel,)], world_size).padded_numel
    size = torch.empty((), dtype=dtype).element_size()
    name = str(dtype).replace("torch.", "")
    return [{"numel": padded, "grad_dtype": name, "grad_bytes": padded * size,
             "param_dtype": name, "param_bytes": padded * size}]


def formula(buffers: list, world_size: int, backend: str) -> dict:
    """Bytes per rank of each scheme over ``buffers``: by the ring formulas, and as
    ``backend`` runs them (the same: ZeroAdam's reduce-scatter is an all-to-all)."""
    grad = sum(b["grad_bytes"] for b in buffers)
    param = sum(b["param_bytes"] for b in buffers)
    g, p = ring_bytes(grad, world_size), ring_bytes(param, world_size)
    rs_backend = g["reduce_scatter"]
    zero = g["reduce_scatter"] + p["all_gather"]
    return {
        "world_size": world_size, "grad_buffer_bytes": grad, "param_buffer_bytes": param,
        "collectives": {"all_reduce": g["all_reduce"], "reduce_scatter": g["reduce_scatter"],
                        "all_gather": p["all_gather"]},
        "schemes": {
            "ddp_all_reduce": {"collectives": ["all_reduce"], "bytes_per_rank": g["all_reduce"],
                               "backend_bytes_per_rank": g["all_reduce"]},
            "zero1": {"collectives": ["reduce_scatter", "all_gather"], "bytes_per_rank": zero,
                      "backend_bytes_per_rank": rs_backend + p["all_gather"]},
            "zero2": {"collectives": ["reduce_scatter", "all_gather"], "bytes_per_rank": zero,
                      "backend_bytes_per_rank": rs_backend + p["all_gather"]},
        },
        "note": None,
    }


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(buffers: list, device, repeats: int = 5, group=None) -> dict:
    """Median seconds of all_reduce and reduce_scatter on each gradient-sized buffer
    and all_gather on each parameter-sized buffer (summed over buffers), on fresh
    buffers of those sizes, called as ZeroAdam calls them. Collective: every rank."""
    comm = GroupComm(group)
    n, r = comm.world_size, comm.rank
    plans = []
    for b in buffers:
        grad = torch.ones(b["numel"], dtype=getattr(torch, b["grad_dtype"]), device=device)
        param = torch.ones(b["numel"], dtype=getattr(torch, b["param_dtype"]), device=device)
        s = b["numel"] // n
        plans.append((grad, (torch.empty(s, dtype=grad.dtype, device=device), torch.empty_like(grad)),
                      param, param[r * s:(r + 1) * s]))
    ops = {
        "all_reduce": lambda g, gs, p, ps: comm.all_reduce(g),
        "reduce_scatter": lambda g, gs, p, ps: comm.reduce_scatter_avg(gs[0], g, gs[1]),
        "all_gather": lambda g, gs, p, ps: comm.all_gather(p, ps),
    }
    seconds = {}
    for name, op in ops.items():
        samples = []
        for i in range(repeats + 1):  # the first call warms the connection up
            dist.barrier(group=group)
            _sync(device)
            t0 = time.perf_counter()
            for plan in plans:
                op(*plan)
            _sync(device)
            if i:
                samples.append(time.perf_counter() - t0)
        seconds[name] = statistics.median(samples)
    return seconds


def achieved(table: dict, seconds: dict) -> dict:
    """``table`` (``formula``) with each collective's median time and bus bandwidth
    (formula bytes per rank / time, as nccl-tests' busbw) filled in."""
    out = copy.deepcopy(table)
    out["measured"] = {}
    for name, t in seconds.items():
        wire = table["collectives"][name]
        out["measured"][name] = {"ms": t * 1e3, "bus_gbps": wire / t / 1e9 if t > 0 else None}
    for scheme in out["schemes"].values():
        scheme["ms"] = sum(seconds[c] for c in scheme["collectives"]) * 1e3
    return out
