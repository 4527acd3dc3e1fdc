#!/usr/bin/env python
"""Low-bit optimizer state, by what it trains to: the project's GPT (``zero_triton.tools.gpt``)
trained from the same weights on the same batches of real text with each optimizer, and
the final loss against fp32 AdamW's.

The text: the Python standard library's own source (the ``.py`` files at the top of the
running interpreter's ``Lib/``, sorted by name), byte by byte (a vocabulary of 256): real,
structured text every Python ships, on which a small model's loss falls from ln 256 = 5.5
to about 1.5 within a few thousand steps. The last ``--val-frac`` of it is held out.

Rows (each when it can run here; the peers' with ``pip install -e ".[peers]"``):

  torch fp32      torch.optim.AdamW (the reference the ratios are to)
  zt fp32         zero_triton FusedAdamW, fp32 moments
  zt int8         FusedAdamW(moments="int8")
  zt bf16         FusedAdamW(moments="bf16"): bfloat16 moments, stochastic rounding
  bf16p + master  the model in bfloat16, FusedAdamW with its fp32 master (12 B of state)
  bf16p sr        the model in bfloat16, FusedAdamW(master_weights="stochastic"): no
                  master, fp32 moments (8 B of state)
  bf16p sr int8   the model in bfloat16, FusedAdamW(master_weights="stochastic",
                  moments="int8"): no master, 8-bit moments (2.03 B of state)
  bf16p rem       the model in bfloat16, FusedAdamW(master_weights="remainder"): the
                  master's low 16 bits beside the parameters, fp32 moments (10 B of state)
  bf16p rem int8  the same with moments="int8" (4.03 B of state)
  bf16p rem8      the model in bfloat16, FusedAdamW(master_weights="remainder8"): 8 bits
                  of the master beside the parameters, a 24-bit master (9 B of state)
  bf16p r8 int8   the same with moments="int8" (3.03 B of state)
  zt int4         FusedAdamW(moments="int4"): 4-bit moments, two codes to a byte (1.03 B)
  bf16p r8 int4   the model in bfloat16, FusedAdamW(master_weights="remainder8",
                  moments="int4") (2.03 B of state)
  r8 int8 release the same with grad_release=True: each parameter stepped in backward
                  and its gradient freed (the same bits as "bf16p r8 int8")
  bnb 8bit        bitsandbytes.optim.AdamW8bit (its defaults: tensors under 4,096
                  elements keep 32-bit state)
  torchao 8bit    torchao.optim.AdamW8bit
  torchao 4bit    torchao.optim.AdamW4bit
  torchao fp8     torchao.optim.AdamWFp8
  zt int8 FSDP2   FusedAdamW(moments="int8") over the same GPT under FSDP2 (``fully_shard``
                  per block and the root) at 2 gloo ranks, each rank given the whole batch
                  (their average is the batch's gradient): the int8 blocks are the
                  parameters' rows, 1-D parameters keep fp32 moments
                  (``docs/low-bit-state.md``); also ``zt_bf16p_rem_int8_fsdp2``,
                  ``zt_bf16p_sr_int8_fsdp2`` and ``zt_int4_fsdp2`` (blocks of 128)

Reported: the training loss averaged over the last ``--tail`` steps, the validation loss
at the end (``--val-batches`` fixed batches), each over torch fp32's, and the state bytes
per parameter. Curves go to a PNG (with matplotlib), the table to a CSV and JSON, in
``--out`` (bench/results/lowbit).

    python bench/lowbit_quality.py                  # 2,000 steps, about 10 minutes on 2 cores
    python bench/lowbit_quality.py --steps 300 --rows torch_fp32,zt_int8
    python bench/lowbit_quality.py --seed 1 --rows torch_fp32,zt_int8,bnb_8bit --out seed1
    python bench/lowbit_quality.py --seeds 0,1,2    # each seed's table, then their means

With ``--seeds``, each seed's results go to ``--out``/seed<N> and a last table gives, per
row, the mean over the seeds of its ratios to torch fp32's loss in the same seed (and
their smallest and largest): one run's ratio moves by about 1% from seed to seed.
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import math
import os
import sys
import sysconfig
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from zero_triton import FusedAdamW  # noqa: E402
from zero_triton.tools.gpt import GPTConfig, build_gpt  # noqa: E402

ROWS = ("torch_fp32", "zt_fp32", "zt_int8", "zt_bf16", "zt_bf16p_master", "zt_bf16p_sr",
        "zt_bf16p_sr_int8", "zt_bf16p_rem", "zt_bf16p_rem_int8", "zt_bf16p_rem8",
        "zt_bf16p_rem8_int8", "zt_bf16p_rem8_int8_release", "zt_int4", "zt_bf16p_rem8_int4",
        "bnb_8bit", "torchao_8bit", "torchao_4bit", "torchao_fp8",
        "zt_int8_fsdp2", "zt_bf16p_rem_int8_fsdp2", "zt_bf16p_sr_int8_fsdp2", "zt_int4_fsdp2")
FSDP2 = "_fsdp2"  # a row's suffix: the same optimizer under FSDP2 at 2 ranks
LABELS = {"torch_fp32": "torch fp32", "zt_fp32": "zt fp32", "zt_int8": "zt int8",
          "zt_bf16": "zt bf16", "zt_bf16p_master": "bf16p + master", "zt_bf16p_sr": "bf16p sr",
          "zt_bf16p_sr_int8": "bf16p sr int8", "zt_bf16p_rem": "bf16p rem",
          "zt_bf16p_rem_int8": "bf16p rem int8", "zt_bf16p_rem8": "bf16p rem8",
          "zt_bf16p_rem8_int8": "bf16p r8 int8", "zt_bf16p_rem8_int8_release": "r8 int8 release",
          "zt_int4": "zt int4", "zt_bf16p_rem8_int4": "bf16p r8 int4",
          "bnb_8bit": "bnb 8bit",
          "torchao_8bit": "torchao 8bit", "torchao_4bit": "torchao 4bit",
          "torchao_fp8": "torchao fp8", "zt_int8_fsdp2": "zt int8 FSDP2",
          "zt_bf16p_rem_int8_fsdp2": "rem int8 FSDP2", "zt_bf16p_sr_int8_fsdp2": "sr int8 FSDP2",
          "zt_int4_fsdp2": "zt int4 FSDP2"}
# rows whose model is in bfloat16
BF16_PARAMS = ("zt_bf16p_master", "zt_bf16p_sr", "zt_bf16p_sr_int8", "zt_bf16p_rem",
               "zt_bf16p_rem_int8", "zt_bf16p_rem8", "zt_bf16p_rem8_int8",
               "zt_bf16p_rem8_int8_release", "zt_bf16p_rem8_int4")


def corpus(max_bytes: int) -> torch.Tensor:
    """The standard library's top-level sources, concatenated, as bytes (uint8 tokens)."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    data, total = [], 0
    for path in files:
        with open(path, "rb") as f:
            chunk = f.read()
        data.append(chunk)
        total += len(chunk)
        if total >= max_bytes:
            break
    raw = b"".join(data)[:max_bytes]
    if len(raw) < 100_000:
        raise SystemExit(f"the standard library's sources here hold {len(raw):,} bytes; "
                         "need at least 100,000")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


def batches(tokens: torch.Tensor, batch: int, seq: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=gen)
        idx = torch.stack([tokens[s:s + seq] for s in starts])
        tgt = torch.stack([tokens[s + 1:s + seq + 1] for s in starts])
        yield idx, tgt


def make_optimizer(row: str, params, lr: float, wd: float):
    if row == "torch_fp32":
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd)
    if row == "zt_fp32":
        return FusedAdamW(params, lr=lr, weight_decay=wd)
    if row == "zt_int8":
        return FusedAdamW(params, lr=lr, weight_decay=wd, moments="int8")
    if row == "zt_bf16":
        return FusedAdamW(params, lr=lr, weight_decay=wd, moments="bf16")
    if row == "zt_bf16p_master":
        return FusedAdamW(params, lr=lr, weight_decay=wd)
    if row == "zt_bf16p_sr":
        return FusedAdamW(params, lr=lr, weight_decay=wd, master_weights="stochastic")
    if row == "zt_bf16p_sr_int8":
        return FusedAdamW(params, lr=lr, weight_decay=wd, master_weights="stochastic",
                          moments="int8")
    if row == "zt_bf16p_rem":
        return FusedAdamW(params, lr=lr, weight_decay=wd, master_weights="remainder")
    if row == "zt_bf16p_rem_int8":
        return FusedAdamW(params, lr=lr, weight_decay=wd, master_weights="remainder",
                          moments="int8")
    if row == "zt_bf16p_rem8":
        return FusedAdamW(params, lr=lr, weight_decay=wd, master_weights="remainder8")
    if row == "zt_bf16p_rem8_int8":
        return FusedAdamW(params, lr=lr, weight_decay=wd, master_weights="remainder8",
                          moments="int8")
    if row == "zt_int4":
        return FusedAdamW(params, lr=lr, weight_decay=wd, moments="int4")
    if row == "zt_bf16p_rem8_int4":
        return FusedAdamW(params, lr=lr, weight_decay=wd, master_weights="remainder8",
                          moments="int4")
    if row == "zt_bf16p_rem8_int8_release":  # each parameter stepped in backward
        return FusedAdamW(params, lr=lr, weight_decay=wd, master_weights="remainder8",
                          moments="int8", grad_release=True)
    if row == "bnb_8bit":
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=wd)
    if row == "torchao_8bit":
        from torchao.optim import AdamW8bit
        return AdamW8bit(params, lr=lr, weight_decay=wd)
    if row == "torchao_4bit":
        from torchao.optim import AdamW4bit
        return AdamW4bit(params, lr=lr, weight_decay=wd)
    if row == "torchao_fp8":
        from torchao.optim import AdamWFp8
        return AdamWFp8(params, lr=lr, weight_decay=wd)
    raise ValueError(f"unknown row {row!r}; choose from {ROWS}")


def state_bytes(opt) -> int:
    """The optimizer's own tensors (tensor subclasses by their inner tensors)."""
    if hasattr(opt, "memory_report"):
        report = opt.memory_report()
        return report["master"] + report["moments"]
    seen, total = set(), 0
    for entry in opt.state.values():
        for v in entry.values():
            if not isinstance(v, torch.Tensor) or v.numel() <= 1:
                continue
            inner = [getattr(v, a) for a in v.__tensor_flatten__()[0]] \
                if hasattr(v, "__tensor_flatten__") else [v]
            for t in inner:
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
    return total


@torch.no_grad()
def evaluate(model, val, args) -> float:
    model.eval()
    it = batches(val, args.batch, args.seq, seed=12345)
    total = 0.0
    for _ in range(args.val_batches):
        idx, tgt = next(it)
        total += model(idx, tgt)[1].float().item()
    model.train()
    return total / args.val_batches


def train_steps(model, opt, it, args, before_step=None):
    """``args.steps`` steps of ``model`` on the batches of ``it`` (linear warm-up of the
    lr, then constant; stopped at a non-finite loss): (losses, seconds).
    ``before_step(step)`` runs first in each (shared with ``bench/wire_quality.py``)."""
    losses = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        if before_step is not None:
            before_step(step)
        idx, tgt = next(it)
        lr = args.lr * min(1.0, (step + 1) / args.warmup)  # linear warm-up, then constant
        for g in opt.param_groups:
            if isinstance(g["lr"], torch.Tensor):  # torchao keeps lr as a tensor
                g["lr"].fill_(lr)
            else:
                g["lr"] = lr
        _, loss = model(idx, tgt)
        loss.float().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.float().item())
        if not math.isfinite(losses[-1]):
            break
    return losses, time.perf_counter() - t0


def _train_fsdp2(rank, world, row, train_tokens, val, config, args) -> dict:
    """``row`` (its optimizer) under FSDP2 on this rank of ``world``: rank 0's result."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    result = train(row, train_tokens, val, config, args, shard=lambda m: [
        fully_shard(b, mesh=mesh) for b in m.blocks] + [fully_shard(m, mesh=mesh)])
    return result


def train(row: str, train_tokens, val, config, args, shard=None) -> dict:
    if row.endswith(FSDP2):
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from dist_utils import run_ranks
        out = run_ranks(_train_fsdp2, 2, row[:-len(FSDP2)], train_tokens, val, config, args,
                        timeout=24 * 3600)[0]
        return {**out, "row": row, "label": LABELS[row]}
    model = build_gpt(config, dtype=torch.bfloat16 if row in BF16_PARAMS else torch.float32,
                      seed=args.seed)
    if shard is not None:
        shard(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(row, params, args.lr, args.weight_decay)
    it = batches(train_tokens, args.batch, args.seq, seed=1 + args.seed)
    losses, seconds = train_steps(model, opt, it, args)
    # this rank's parameters (its local shards under FSDP2), whose state it holds
    n = sum(getattr(p, "_local_tensor", p).numel() for p in params)
    tail = losses[-args.tail:]
    return {"row": row, "label": LABELS[row], "losses": losses, "seconds": seconds,
            "train_loss": sum(tail) / len(tail), "val_loss": evaluate(model, val, args),
            "state_bytes_per_param": state_bytes(opt) / n, "params": n}


def write_png(results, path, args) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'zero_triton[bench]')"
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(11, 4))
    k = max(1, args.tail // 5)
    for r in results:
        raw = r["losses"]
        smooth = [sum(raw[max(0, i - k + 1):i + 1]) / len(raw[max(0, i - k + 1):i + 1])
                  for i in range(len(raw))]
        ax.plot(smooth, label=r["label"], linewidth=1)
        start = len(smooth) // 2
        zoom.plot(range(start, len(smooth)), smooth[start:], label=r["label"], linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss ({k}-step mean)")
    zoom.set_xlabel("step (second half)")
    ax.legend(fontsize=8)
    ax.set_title(f"GPT {results[0]['params']:,} params on Python's stdlib source (bytes)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def format_table(results) -> str:
    ref = next((r for r in results if r["row"] == "torch_fp32"), results[0])
    lines = [f"{'':<14}{'train loss':>11}{'x ref':>8}{'val loss':>10}{'x ref':>8}"
             f"{'state B/param':>15}{'s':>7}"]
    for r in results:
        lines.append(f"{r['label']:<14}{r['train_loss']:>11.4f}"
                     f"{r['train_loss'] / ref['train_loss']:>8.4f}{r['val_loss']:>10.4f}"
                     f"{r['val_loss'] / ref['val_loss']:>8.4f}"
                     f"{r['state_bytes_per_param']:>15.3f}{r['seconds']:>7.0f}")
    return "\n".join(lines)


def add_training_args(parser, batch: int, batch_help: str) -> None:
    """The model, the text and the schedule (shared with ``bench/wire_quality.py``)."""
    parser.add_argument("--batch", type=int, default=batch, help=batch_help)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--tail", type=int, default=100, help="steps the final loss averages")
    parser.add_argument("--val-batches", type=int, default=50)
    parser.add_argument("--val-frac", type=float, default=0.1)
    parser.add_argument("--corpus-bytes", type=int, default=4_000_000)


def parsed(parser, argv, known) -> argparse.Namespace:
    """``argv`` parsed, ``--rows`` split and checked against ``known``, the steps against
    the tail (shared with ``bench/wire_quality.py``)."""
    args = parser.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    bad = [r for r in rows if r not in known]
    if bad:
        parser.error(f"unknown rows {bad}; choose from {', '.join(known)}")
    if args.steps < args.tail:
        parser.error(f"--steps ({args.steps}) must be at least --tail ({args.tail})")
    args.rows = rows
    return args


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0,
                        help="the model's initial weights and the order of its batches (0: the "
                             "published run); other seeds show how much one run's loss varies")
    parser.add_argument("--seeds", default=None,
                        help="comma-separated seeds, each a run of every row, then their mean "
                             "ratios (instead of --seed)")
    parser.add_argument("--rows", default=",".join(ROWS),
                        help=f"comma-separated, from {', '.join(ROWS)}")
    add_training_args(parser, batch=16, batch_help="sequences per step")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "results", "lowbit"))
    return parsed(parser, argv, ROWS)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    tokens = corpus(args.corpus_bytes)
    cut = int(tokens.numel() * (1 - args.val_frac))
    train_tokens, val = tokens[:cut], tokens[cut:]
    config = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers,
                       n_head=args.heads, n_embd=args.width)
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    every, out = [], args.out
    for seed in seeds:
        args.seed = seed
        args.out = out if len(seeds) == 1 else os.path.join(out, f"seed{seed}")
        results = []
        for row in args.rows:
            try:
                results.append(train(row, train_tokens, val, config, args))
            except ImportError as exc:
                print(f"{LABELS[row]}: skipped ({exc})", file=sys.stderr)
                continue
            r = results[-1]
            print(f"{r['label']}: train {r['train_loss']:.4f}, val {r['val_loss']:.4f} "
                  f"({r['seconds']:.0f} s)", flush=True)
        print(f"\nseed {seed}: {args.steps} steps, batch {args.batch} x {args.seq} bytes, "
              f"{tokens.numel():,} bytes of text ({cut:,} train)")
        print(format_table(results))
        write_outputs(args, results, ["row", "train_loss", "val_loss", "state_bytes_per_param",
                                      "seconds"], write_png)
        every.append(results)
    if len(seeds) > 1:
        print(f"\nover seeds {seeds}: each row's loss over torch fp32's in the same seed")
        print(format_means(every))
    return 0


def format_means(every: list) -> str:
    """Per row, the mean (and the smallest and largest) over the seeds of its train and
    validation loss ratios to torch fp32's of the same seed; the seeds without a torch
    fp32 row (or without the row) are left out."""
    lines = [f"{'':<16}{'train x ref':>12}{'(min-max)':>16}{'val x ref':>11}{'(min-max)':>16}"
             f"{'state B/param':>15}{'seeds':>6}"]
    rows = list(dict.fromkeys(r["row"] for results in every for r in results))
    for row in rows:
        ratios = []
        for results in every:
            ref = next((r for r in results if r["row"] == "torch_fp32"), None)
            mine = next((r for r in results if r["row"] == row), None)
            if ref is not None and mine is not None:
                ratios.append((mine["train_loss"] / ref["train_loss"],
                               mine["val_loss"] / ref["val_loss"], mine["state_bytes_per_param"]))
        if not ratios:
            continue
        tr, va = [r[0] for r in ratios], [r[1] for r in ratios]
        lines.append(f"{LABELS[row]:<16}{sum(tr) / len(tr):>12.4f}"
                     f"{f'({min(tr):.4f}-{max(tr):.4f})':>16}{sum(va) / len(va):>11.4f}"
                     f"{f'({min(va):.4f}-{max(va):.4f})':>16}{ratios[0][2]:>15.3f}{len(ratios):>6}")
    return "\n".join(lines)


def write_outputs(args, results, columns, png) -> None:
    """quality.csv (``columns`` of each result), quality.json and quality.png (``png``)
    in ``args.out`` (shared with ``bench/wire_quality.py``)."""
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "quality.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for r in results:
            w.writerow([r[c] for c in columns])
    with open(os.path.join(args.out, "quality.json"), "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items()}, "results": results}, f)
    why = png(results, os.path.join(args.out, "quality.png"), args)
    print(f"wrote {args.out}/quality.csv, .json" + (f"; no PNG: {why}" if why else ", .png"))


if __name__ == "__main__":
    raise SystemExit(main())
