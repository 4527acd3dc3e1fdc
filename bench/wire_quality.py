#!/usr/bin/env python
"""Compressed collectives, by what they train to: the project's GPT in bfloat16 trained
by ZeroAdamW on 4 gloo ranks, from the same weights on the same batches of real text
(``bench/lowbit_quality.py``'s: Python's standard library source, as bytes), once per
row, and the final loss against the exact average's.

Rows (ZeroAdamW, bf16 parameters with an fp32 master, 4 ranks, each rank its own
batches):

  exact          reduce_dtype=torch.float32: the gradients sent in bf16, averaged in
                 fp32 (the reference the ratios are to)
  bf16 wire      the default: averaged in bf16
  int8           reduce_dtype="int8": int8 blocks, error feedback in bf16 buffers
  int8 ef32      the same with float32 error buffers
  int8 no ef     the same without error feedback
  int8 both      reduce_dtype="int8" and gather_dtype="int8" (parameters gathered as
                 int8 blocks), error feedback in bf16
  int8 both no ef
  2x2 int8 both  the last but one over a (2, 2) (replicate, shard) mesh: both hops of
                 the average and the row's gathers compressed

Reported: the training loss averaged over the last ``--tail`` steps (mean of the ranks),
the validation loss at the end, each over the exact row's, and the bytes a rank sent
per step (reduce-scatters and all-gathers, as ZeroAdamW's communicator counts them).
CSV, JSON and PNG to ``--out`` (bench/results/wire).

    python bench/wire_quality.py                         # 1,000 steps per row
    python bench/wire_quality.py --steps 200 --rows exact,int8
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lowbit_quality import (add_training_args, batches, corpus, evaluate, parsed,  # noqa: E402
                            train_steps, write_outputs)
from zero_triton.tools.gpt import GPTConfig, build_gpt  # noqa: E402
from zero_triton.tools.profiling import launch  # noqa: E402

WORLD = 4
ROWS = {
    "exact": ("exact (fp32 average)", {"reduce_dtype": torch.float32}),
    "bf16_wire": ("bf16 wire", {}),
    "int8": ("int8", {"reduce_dtype": "int8"}),
    "int8_ef32": ("int8 ef32", {"reduce_dtype": "int8", "error_feedback": torch.float32}),
    "int8_noef": ("int8 no ef", {"reduce_dtype": "int8", "error_feedback": False}),
    "int8_both": ("int8 both", {"reduce_dtype": "int8", "gather_dtype": "int8"}),
    "int8_both_noef": ("int8 both no ef", {"reduce_dtype": "int8", "gather_dtype": "int8",
                                           "error_feedback": False}),
    "hsdp_int8_both": ("2x2 int8 both", {"reduce_dtype": "int8", "gather_dtype": "int8",
                                         "mesh": (2, 2)}),
}


def train_rank(args, rank, world, device) -> dict:
    """One row on this rank: the losses, the validation loss, the bytes sent per step."""
    import torch.distributed as dist

    from zero_triton import ZeroAdamW
    from zero_triton.optim.interface import internals
    tokens = corpus(args.corpus_bytes)
    cut = int(tokens.numel() * (1 - args.val_frac))
    train_tokens, val = tokens[:cut], tokens[cut:]
    config = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers,
                       n_head=args.heads, n_embd=args.width)
    model = build_gpt(config, dtype=torch.bfloat16, seed=args.seed)
    kw = dict(ROWS[args.row][1])
    mesh = kw.pop("mesh", None)
    if mesh is not None:
        from torch.distributed.device_mesh import init_device_mesh
        kw["device_mesh"] = init_device_mesh("cpu", mesh, mesh_dim_names=("replicate", "shard"))
    opt = ZeroAdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, **kw)
    comm = internals(opt).comm
    it = batches(train_tokens, args.batch, args.seq, seed=1 + args.seed + 1000 * rank)
    # the bytes of every step but the first (which learns the buckets' order)
    losses, seconds = train_steps(model, opt, it, args,
                                  lambda step: comm.reset_wire() if step == 1 else None)
    sent = sum(v for k, v in comm.wire.items() if "reduce_scatter" in k or "all_gather" in k)
    val_loss = evaluate(model, val, args)
    dist.barrier()
    return {"losses": losses, "val_loss": val_loss, "seconds": seconds,
            "bytes_per_step": sent / max(1, len(losses) - 1),
            "error_bytes": comm.held_bytes()}


def run_row(row: str, args) -> dict:
    ranks = launch.spawn(train_rank, argparse.Namespace(**vars(args), row=row), WORLD, "cpu",
                         args.timeout, run_timeout_s=args.timeout * 20)
    n = min(len(r["losses"]) for r in ranks)
    losses = [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(n)]
    tail = losses[-args.tail:]
    return {"row": row, "label": ROWS[row][0], "losses": losses,
            "train_loss": sum(tail) / len(tail),
            "val_loss": sum(r["val_loss"] for r in ranks) / len(ranks),
            "bytes_per_step": max(r["bytes_per_step"] for r in ranks),
            "seconds": max(r["seconds"] for r in ranks),
            "error_bytes": max(r["error_bytes"] for r in ranks)}


def format_table(results) -> str:
    ref = next((r for r in results if r["row"] == "exact"), results[0])
    lines = [f"{'':<18}{'train loss':>11}{'x exact':>9}{'val loss':>10}{'x exact':>9}"
             f"{'MB sent/step':>14}{'x exact':>9}{'EF MB':>7}{'s':>6}"]
    for r in results:
        lines.append(f"{r['label']:<18}{r['train_loss']:>11.4f}"
                     f"{r['train_loss'] / ref['train_loss']:>9.4f}{r['val_loss']:>10.4f}"
                     f"{r['val_loss'] / ref['val_loss']:>9.4f}"
                     f"{r['bytes_per_step'] / 2**20:>14.3f}"
                     f"{r['bytes_per_step'] / ref['bytes_per_step']:>9.3f}"
                     f"{r['error_bytes'] / 2**20:>7.2f}{r['seconds']:>6.0f}")
    return "\n".join(lines)


def write_png(results, path, args) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'zero_triton[bench]')"
    fig, ax = plt.subplots(figsize=(8, 4))
    k = max(1, args.tail // 5)
    for r in results:
        raw = r["losses"]
        smooth = [sum(raw[max(0, i - k + 1):i + 1]) / len(raw[max(0, i - k + 1):i + 1])
                  for i in range(len(raw))]
        start = len(smooth) // 4
        ax.plot(range(start, len(smooth)), smooth[start:], label=r["label"], linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss ({k}-step mean, mean of {WORLD} ranks)")
    ax.legend(fontsize=8)
    ax.set_title(f"ZeroAdamW at {WORLD} gloo ranks, bf16 GPT on Python's stdlib source", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from {', '.join(ROWS)}")
    parser.add_argument("--seed", type=int, default=0)
    add_training_args(parser, batch=4, batch_help="sequences per rank (4: 16 in all)")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "results", "wire"))
    return parsed(parser, argv, ROWS)


def main(argv=None) -> int:
    args = parse_args(argv)
    results = []
    for row in args.rows:
        results.append(run_row(row, args))
        r = results[-1]
        print(f"{r['label']}: train {r['train_loss']:.4f}, val {r['val_loss']:.4f}, "
              f"{r['bytes_per_step'] / 2**20:.3f} MB sent per step ({r['seconds']:.0f} s)", flush=True)
    print(f"\n{args.steps} steps at {WORLD} ranks, batch {args.batch} x {args.seq} bytes per rank")
    print(format_table(results))
    write_outputs(args, results, ["row", "train_loss", "val_loss", "bytes_per_step",
                                  "error_bytes", "seconds"], write_png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
