#!/usr/bin/env python
"""ZeroAdamW(stage=2) with and without ``grad_release=True``, side by side on the same
ranks: the gradient bytes a rank holds after backward (``memory_report()["grads"]``,
before the step), the iteration's time (forward, backward, step; ``overlap()`` on), and
whether the two trained the same bits.

    python bench/zero_release.py                       # 2 and 4 gloo ranks, bf16 GPT
    python bench/zero_release.py --ranks 2 --formats fp32 --steps 8

Each rank builds the project's GPT twice (the same seed), trains it ``--steps`` times
with each optimizer in turn, iteration by iteration (plain, released, plain, ...) so
that both see the same machine, and reports its medians. ``--formats``: ``fp32`` (fp32
parameters and state), ``remainder8+int8`` (bf16 parameters, a 24-bit master, int8
moments; the gradients averaged in float32). One thread per rank.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import zero_triton  # noqa: E402
from zero_triton.tools.gpt import GPTConfig, build_gpt, synthetic_batch  # noqa: E402
from zero_triton.tools.profiling import launch  # noqa: E402

FORMATS = {
    "fp32": (torch.float32, {}),
    "remainder8+int8": (torch.bfloat16, {"master_weights": "remainder8", "moments": "int8",
                                         "reduce_dtype": torch.float32}),
}


def _rank(args, rank: int, world: int, device) -> dict:
    fmt, steps, layers, width, bucket_mb = args
    dtype, kw = FORMATS[fmt]
    config = GPTConfig(vocab_size=2048, block_size=64, n_layer=layers, n_head=4, n_embd=width)
    runs = {}
    for release in (False, True):
        model = build_gpt(config, dtype=dtype)
        opt = zero_triton.ZeroAdamW(model.parameters(), lr=1e-3, stage=2, bucket_cap_mb=bucket_mb,
                                    grad_release=release, **kw)
        runs[release] = {"model": model, "opt": opt, "handle": zero_triton.overlap(model, opt),
                         "ms": [], "held": 0}
    for t in range(steps):
        x, y = synthetic_batch(config, 4, 64, seed=1000 * t + rank)
        for release in ((False, True) if t % 2 == 0 else (True, False)):
            run = runs[release]
            start = time.perf_counter()
            _, loss = run["model"](x, y)
            loss.backward()
            report = run["opt"].memory_report()  # after backward, before the step
            run["opt"].step()
            run["opt"].zero_grad()
            run["ms"].append((time.perf_counter() - start) * 1e3)
            run["held"] = report["grads"]
    for run in runs.values():
        run["opt"].wait_params()
        run["handle"].remove()
    same = all(torch.equal(p, q) for p, q in zip(runs[False]["model"].parameters(),
                                                 runs[True]["model"].parameters()))
    return {r: {"ms": statistics.median(run["ms"][1:]), "held": run["held"]}
            for r, run in runs.items()} | {"same": same}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4", help="world sizes, e.g. 2,4")
    ap.add_argument("--formats", default="fp32,remainder8+int8", help=f"from {', '.join(FORMATS)}")
    ap.add_argument("--steps", type=int, default=6, help="iterations per optimizer (the first is "
                    "warm-up: the medians leave it out)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="bucket_cap_mb")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first is warm-up)")
    formats = args.formats.split(",")
    for f in formats:
        if f not in FORMATS:
            ap.error(f"--formats {f}: not one of {', '.join(FORMATS)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print("ranks  format            grads held after backward (KiB/rank)    iteration (ms, median)      same bits")
    print("                         stage 2      released    ratio          stage 2   released  ratio")
    for world in (int(w) for w in args.ranks.split(",")):
        for fmt in formats:
            every = launch.spawn(_rank, (fmt, args.steps, args.layers, args.width, args.bucket_mb),
                                 world, "cpu", 300)
            plain_held = max(r[False]["held"] for r in every)
            held = max(r[True]["held"] for r in every)
            plain_ms = max(r[False]["ms"] for r in every)
            ms = max(r[True]["ms"] for r in every)
            same = all(r["same"] for r in every)
            print(f"{world:<6d} {fmt:<17s} {plain_held / 1024:10.1f} {held / 1024:11.1f}    "
                  f"{held / plain_held:5.3f}        {plain_ms:8.1f} {ms:10.1f}  {ms / plain_ms:5.3f}"
                  f"      {same}", flush=True)
            if not same:
                print("  the released run trained different bits from stage 2's", flush=True)
                return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
