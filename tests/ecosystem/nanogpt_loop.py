"""nanoGPT's training loop around ZeroAdamW, written as a user script.

Two processes: python -m torch.distributed.run --nproc_per_node=2
               tests/ecosystem/nanogpt_loop.py --stage 1|2 --out DIR

What nanoGPT's train.py does around the optimizer, plus what users add to it:
zero_triton.overlap(model, opt); two micro-batches per step, the first under
opt.no_sync(); GradScaler, then scaler.unscale_(opt) and
torch.nn.utils.clip_grad_norm_(model.parameters(), clip) before scaler.step(opt); a
layer frozen halfway (requires_grad_(False) at step FREEZE_AT, clipping stopped there
too); opt.zero_grad(set_to_none=True); a resharding checkpoint at the end. Phase
"train" records the parameters; rank 0 also records torch.optim.AdamW in one process
on the whole batch doing the same (the ground truth).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

common.setup_process()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import zero_triton  # noqa: E402
from zero_triton import ZeroAdamW, checkpoint  # noqa: E402

STEPS, FREEZE_AT, MICRO, CLIP, LR, WD = 8, 4, 4, 0.3, 1e-2, 0.1


def step_batch(step, rank, world):
    """Rank ``rank``'s 2 x MICRO samples of step ``step`` (all ranks': rank None)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world * 2 * MICRO, common.IN, generator=g)
    y = torch.randn(world * 2 * MICRO, common.OUT, generator=g)
    if rank is None:
        return x, y
    return x[rank * 2 * MICRO:(rank + 1) * 2 * MICRO], y[rank * 2 * MICRO:(rank + 1) * 2 * MICRO]


def freeze(model):
    model.fc1.requires_grad_(False)


def train_zero(args, rank, world):
    model = common.Net(0)
    opt = ZeroAdamW(model.parameters(), lr=LR, weight_decay=WD, stage=args.stage,
                    bucket_cap_mb=0.002)  # several buckets on this small model
    zero_triton.overlap(model, opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    for step in range(STEPS):
        if step == FREEZE_AT:
            freeze(model)
        x, y = step_batch(step, rank, world)
        for k in range(2):
            xs, ys = x[k * MICRO:(k + 1) * MICRO], y[k * MICRO:(k + 1) * MICRO]
            loss = F.mse_loss(model(xs), ys) / 2
            if k == 0:
                with opt.no_sync():
                    scaler.scale(loss).backward()
            else:
                scaler.scale(loss).backward()
        if step < FREEZE_AT:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    checkpoint.save(os.path.join(args.out, "ckpt"), opt, model)
    return common.params_of(model)


def train_reference(world):
    model = common.Net(0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in range(STEPS):
        if step == FREEZE_AT:
            freeze(model)
        opt.zero_grad(set_to_none=True)
        x, y = step_batch(step, None, world)
        F.mse_loss(model(x), y).backward()
        if step < FREEZE_AT:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return common.params_of(model)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    phases = common.Phases()
    with phases("train") as rec:
        rec["final"] = train_zero(args, rank, world)
        if rank == 0:
            rec["reference"] = train_reference(world)
    phases.save(args.out, rank)
    common.finish(rank)


if __name__ == "__main__":
    main()
