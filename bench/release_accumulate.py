#!/usr/bin/env python
"""ZeroAdamW(stage=2, grad_release=True) under HF accelerate's gradient accumulation,
checked against the plain stage 2, the way a user runs it (no DDP wrap, as release needs).

    python bench/release_accumulate.py --ranks 3      # launches itself under torchrun

Each rank runs the same 8 micro-batches (accumulation 2) four ways: plain and released,
with ``opt.no_sync()`` written out for the micro-batches that do not sync, and with
``model.no_sync = opt.no_sync`` set before ``accelerator.prepare_model(model,
evaluation_mode=True)`` (``accelerator.accumulate(model)`` then enters it), and once
released with neither (the second micro-batch is refused: the first had stepped the
shards). Prints one line per rank; exit status 1 unless every released run holds the
plain run's bits and the unguarded one is refused.
"""
import argparse
import contextlib
import datetime
import os
import subprocess
import sys


def run(release: bool, way: str):
    import torch
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    from zero_triton import ZeroAdamW

    acc = Accelerator(cpu=True, gradient_accumulation_steps=2, kwargs_handlers=[
        InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=60))])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    opt = ZeroAdamW(model.parameters(), lr=1e-2, stage=2, bucket_cap_mb=0.004, grad_release=release)
    if way == "model.no_sync":
        model.no_sync = opt.no_sync  # accelerate's accumulate() enters model.no_sync()
    model = acc.prepare_model(model, evaluation_mode=True)  # placed, not wrapped in DDP
    prepared = acc.prepare_optimizer(opt)
    g = torch.Generator().manual_seed(acc.process_index)
    try:
        for _ in range(8):
            x = torch.randn(4, 16, generator=g)
            with acc.accumulate(model):
                guard = opt.no_sync() if way == "opt.no_sync" and not acc.sync_gradients \
                    else contextlib.nullcontext()
                with guard:
                    acc.backward(model(x).square().mean())
                prepared.step()
                prepared.zero_grad()
    except RuntimeError as exc:
        return str(exc)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def rank_main() -> int:
    import torch
    rank = int(os.environ["RANK"])
    ok = True
    words = []
    for way in ("opt.no_sync", "model.no_sync"):
        plain, released = run(False, way), run(True, way)
        same = isinstance(plain, torch.Tensor) and isinstance(released, torch.Tensor) \
            and torch.equal(plain, released)
        ok &= same
        words.append(f"{way}: released == plain {same}")
    refused = run(True, "neither")
    said = isinstance(refused, str) and "model.no_sync = opt.no_sync" in refused
    ok &= said
    words.append(f"neither: refused naming the fix {said}")
    print(f"rank {rank}: " + "; ".join(words), flush=True)
    return 0 if ok else 1


def main() -> int:
    if "RANK" in os.environ:
        return rank_main()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=3)
    args = ap.parse_args()
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.ranks}",
           os.path.abspath(__file__)]
    return subprocess.run(cmd, env=env, timeout=600).returncode


if __name__ == "__main__":
    sys.exit(main())
