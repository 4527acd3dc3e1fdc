"""The Adam step's achieved bandwidth against a plain copy of the same bytes.

Bytes are counted as ``zero_triton.tools.bench`` counts them: 28 per parameter of the shard
(fp32: read p, g, m, v, write p, m, v; bf16 + fp32 master: read g2, master4, m4, v4,
write master4, m4, v4, p2). The step's time is, on a GPU, the device time of the
kernels launched inside ``zero_triton.adam_step`` (from the profiler's device
events); on CPU, the wall time of that range. The limit is ``copy_`` of a buffer
whose read + write bytes equal the step's, timed the same way on this rank right
after a barrier, so that every rank streams at once as in the step, and its working
set sits in the same level of the memory hierarchy as the step's.
"""
from __future__ import annotations

import statistics
import time

import torch

from zero_triton.tools.bench import BYTES_PER_PARAM


def copy_seconds(device: torch.device, nbytes: int, repeats: int = 20) -> float:
    """Median seconds of one ``dst.copy_(src)`` of ``nbytes`` bytes (reads and writes
    ``nbytes`` each)."""
    src = torch.ones(max(1, nbytes), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    samples = []
    for i in range(repeats + 2):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            t = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            t = time.perf_counter() - t0
        if i >= 2:
            samples.append(t)
    return statistics.median(samples)


def adam_figures(splits: list, shard_elements: int, device: torch.device, backend: str,
                 copy_s: float) -> dict:
    """Per-step time, bytes and GB/s of this rank's Adam step over the profiled
    iterations (``splits`` from ``timeline.split_iterations``) against ``copy_s``,
    the median time of a copy moving the same bytes."""
    step_bytes = BYTES_PER_PARAM * shard_elements
    on_device = device.type == "cuda"
    if on_device:
        per_step = [sum(ms for _, ms in s.adam_kernels) for s in splits]
        kernels = {}
        for s in splits:
            for name, ms in s.adam_kernels:
                kernels.setdefault(name, []).append(ms)
        kernel_rows = [{"name": name, "calls_per_step": len(v) / len(splits),
                        "median_us": statistics.median(v) * 1e3} for name, v in kernels.items()]
        source = "device time of the kernels launched inside zero_triton.adam_step"
        if not any(per_step):
            per_step = [s.adam_step_ms for s in splits]
            source = ("wall time of zero_triton.adam_step (no device kernel was matched to its "
                      "launch in the trace)")
    else:
        per_step = [s.adam_step_ms for s in splits]
        kernel_rows = []
        source = "wall time of zero_triton.adam_step"
    ms = statistics.median(per_step)
    gbps = step_bytes / (ms / 1e3) / 1e9 if ms > 0 else None
    copy_gbps = step_bytes / copy_s / 1e9 if copy_s > 0 else None
    return {"backend": backend, "shard_elements": shard_elements,
            "bytes_per_param": BYTES_PER_PARAM, "bytes_per_step": step_bytes,
            "step_ms": ms, "gbps": gbps, "source": source, "kernels": kernel_rows,
            "copy_ms": copy_s * 1e3, "copy_gbps": copy_gbps,
            "pct_of_copy": 100 * gbps / copy_gbps if gbps and copy_gbps else None,
            "copy": f"{'device-to-device' if on_device else 'CPU memory'} copy_ of "
                    f"{step_bytes // 2:,} bytes (read + write = the step's bytes)"}
