#!/usr/bin/env python
"""Low-bit optimizer state, side by side in one run: the step's time and the state's
bytes per parameter.

Every row steps the same parameters (``--size`` elements, fp32, as ``--tensors`` equal
tensors) with the same gradients, timed by the minimum over ``--repeats`` rounds; each
round runs every row once, in an order rotated round by round:

  zt fp32           FusedAdamW, fp32 moments (the baseline of the ratios)
  zt int8           FusedAdamW(moments="int8")
  zt bf16           FusedAdamW(moments="bf16")
  zt bf16+master    FusedAdamW on bf16 parameters and gradients with an fp32 master
  zt bf16 sr int8   bf16 parameters and gradients, master_weights="stochastic", int8
                    moments: no master (10 bytes of traffic, 2.03 of state)
  zt bf16 rem       bf16 parameters and gradients, master_weights="remainder": the
                    master's low 16 bits beside them (26 bytes of traffic, 10 of state)
  zt bf16 rem int8  the same with int8 moments (14 bytes of traffic, 4.03 of state)
  zt bf16 rem8      bf16 parameters and gradients, master_weights="remainder8": 8 bits
                    of the master beside them (24 bytes of traffic, 9 of state)
  zt bf16 r8 int8   the same with int8 moments (12 bytes of traffic, 3.03 of state)
  zt int4           FusedAdamW(moments="int4"): 4-bit moments, decoded and encoded around
                    the float32 step in torch ops (13 bytes of traffic, 1.03 of state)
  zt bf16 r8 int4   bf16 parameters, "remainder8", int4 moments (9 bytes, 2.03 of state)
  torch fused       torch.optim.AdamW(fused=True)
  bnb 8bit          bitsandbytes.optim.AdamW8bit (when installed)
  torchao 8bit      torchao.optim.AdamW8bit (when installed; compiled first)
  limit 28 B        a memory kernel with the fp32 step's traffic (read p g m v, write p m v)
  limit 16 B        a memory kernel with the int8 step's traffic (read p g, 1-byte m v;
                    write p, 1-byte m v)
  limit 20 B        the same with 2-byte m v (the bf16 step's traffic)

Columns: ms per step; x fp32 (the row's time over zt fp32's); % of the limit with the
row's bytes (the limit's time over the row's); state bytes per parameter (the optimizer's
own tensors, measured: ``memory_report()`` for ours, the tensors in ``opt.state`` for the
peers).

    python bench/lowbit_step.py                      # 16Mi and 64Mi on this CPU
    python bench/lowbit_step.py --size 16Mi --repeats 5 --no-peers
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from zero_triton import FusedAdamW  # noqa: E402
from zero_triton.tools.units import parse_count  # noqa: E402

LR, WD = 1e-3, 0.01


def _limits():
    """The memory kernels (one extension with bench/step.py's: one build for both)."""
    from zero_triton.tools.bench.providers import load_cpu_limit
    mod, how = load_cpu_limit()
    if mod is None:
        raise RuntimeError(f"the limit kernels could not be built: {how}")
    return mod


def _params(size, tensors, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    each = size // tensors
    params = [torch.nn.Parameter((torch.randn(each, generator=gen) * 0.02).to(dtype))
              for _ in range(tensors)]
    for p in params:
        p.grad = (torch.randn(each, generator=gen) * 1e-3).to(dtype)
    return params


def _state_bytes(opt, params):
    """Bytes of the tensors an optimizer keeps per parameter (not the parameters)."""
    seen, total = set(), 0
    for p in params:
        for v in opt.state[p].values():
            if isinstance(v, torch.Tensor) and v.data_ptr() not in seen and v.numel() > 1:
                seen.add(v.data_ptr())
                total += v.numel() * v.element_size()
    return total


def _subclass_bytes(opt, params):
    """Bytes of torchao's quantized state: the inner tensors of each tensor subclass
    (codes, scales, the map), plain tensors as they are."""
    total = 0
    for p in params:
        for v in opt.state[p].values():
            if not isinstance(v, torch.Tensor) or v.numel() <= 1:
                continue
            inner = [getattr(v, a) for a in v.__tensor_flatten__()[0]] \
                if hasattr(v, "__tensor_flatten__") else [v]
            total += sum(t.numel() * t.element_size() for t in inner)
    return total


def rows(args):
    """(name, step function, bytes moved per step, state bytes per parameter or None,
    note)."""
    n = args.size
    out = []
    for name, dtype, moments, master, moved in (
            ("zt fp32", torch.float32, "fp32", None, 28),
            ("zt int8", torch.float32, "int8", None, 16),
            ("zt bf16", torch.float32, "bf16", None, 20),
            ("zt bf16+master", torch.bfloat16, "fp32", None, 30),
            ("zt bf16 sr int8", torch.bfloat16, "int8", "stochastic", 10),
            ("zt bf16 rem", torch.bfloat16, "fp32", "remainder", 26),
            ("zt bf16 rem int8", torch.bfloat16, "int8", "remainder", 14),
            ("zt bf16 rem8", torch.bfloat16, "fp32", "remainder8", 24),
            ("zt bf16 r8 int8", torch.bfloat16, "int8", "remainder8", 12),
            ("zt int4", torch.float32, "int4", None, 13),
            ("zt bf16 r8 int4", torch.bfloat16, "int4", "remainder8", 9)):
        params = _params(n, args.tensors, dtype)
        opt = FusedAdamW(params, lr=LR, weight_decay=WD, moments=moments, master_weights=master)
        report = opt.memory_report()
        state = (report["master"] + report["moments"]) / n
        out.append((name, opt.step, moved, state, ""))
    params = _params(n, args.tensors, torch.float32)
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)
    opt.step()
    out.append(("torch fused", opt.step, 28, _state_bytes(opt, params) / n, ""))
    if not args.no_peers:
        try:
            import bitsandbytes as bnb
            params = _params(n, args.tensors, torch.float32)
            opt = bnb.optim.AdamW8bit(params, lr=LR, weight_decay=WD)
            opt.step()
            out.append(("bnb 8bit", opt.step, 16, _state_bytes(opt, params) / n,
                        f"bitsandbytes {bnb.__version__}"))
        except Exception as exc:  # noqa: BLE001 (a peer that cannot run here is said, not fatal)
            print(f"bnb 8bit: skipped ({type(exc).__name__}: {exc})", file=sys.stderr)
        try:
            import torchao
            from torchao.optim import AdamW8bit
            params = _params(n, args.tensors, torch.float32)
            opt = AdamW8bit(params, lr=LR, weight_decay=WD)
            opt.step()  # compiles
            out.append(("torchao 8bit", opt.step, 16, _subclass_bytes(opt, params) / n,
                        f"torchao {torchao.__version__}"))
        except Exception as exc:  # noqa: BLE001
            print(f"torchao 8bit: skipped ({type(exc).__name__}: {exc})", file=sys.stderr)
    lim = _limits()
    p, g = torch.randn(n) * 0.02, torch.randn(n) * 1e-3
    m, v = torch.zeros(n), torch.zeros(n)
    mq, vq = torch.zeros(n, dtype=torch.int8), torch.zeros(n, dtype=torch.uint8)
    mb, vb = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    out.append(("limit 28 B", lambda: lim.stream_fp32(p, g, m, v), 28, None, "memory kernel"))
    out.append(("limit 20 B", lambda: lim.stream20(p, g, mb, vb), 20, None, "memory kernel"))
    out.append(("limit 16 B", lambda: lim.stream16(p, g, mq, vq), 16, None, "memory kernel"))
    return out


def measure(args):
    table = rows(args)
    for _, fn, _, _, _ in table:  # warm up
        for _ in range(2):
            fn()
    best = [float("inf")] * len(table)
    for r in range(args.repeats):
        order = list(range(len(table)))
        order = order[r % len(order):] + order[:r % len(order)]
        for k in order:
            t0 = time.perf_counter()
            table[k][1]()
            best[k] = min(best[k], time.perf_counter() - t0)
    return [(name, best[k] * 1e3, moved, state, note)
            for k, (name, _, moved, state, note) in enumerate(table)]


def format_rows(results, size) -> str:
    base = next(ms for name, ms, *_ in results if name == "zt fp32")
    limits = {moved: ms for name, ms, moved, *_ in results if name.startswith("limit")}
    lines = [f"{size:,} parameters ({size / 2**20:g} Mi), {torch.get_num_threads()} threads",
             f"{'':<16}{'ms/step':>9}{'x fp32':>8}{'% limit':>9}{'state B/param':>15}  note"]
    for name, ms, moved, state, note in results:
        lim = limits.get(moved if moved in (16, 20) else 28 if moved in (28, 30) else None)
        pct = "" if name.startswith("limit") or lim is None else f"{100 * lim / ms:.0f}%"
        st = "" if state is None else f"{state:.3f}"
        lines.append(f"{name:<16}{ms:>9.2f}{ms / base:>8.2f}{pct:>9}{st:>15}  {note}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="16Mi,64Mi",
                        help="parameters per run, comma-separated (default 16Mi,64Mi)")
    parser.add_argument("--tensors", type=int, default=4, help="tensors the size is split into")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--no-peers", action="store_true", help="skip bitsandbytes and torchao")
    args = parser.parse_args(argv)
    for text in args.size.split(","):
        args.size = parse_count(text, "16Mi")
        args.size -= args.size % args.tensors
        print(format_rows(measure(args), args.size), flush=True)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
