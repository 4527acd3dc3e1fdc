"""zero_triton under HF accelerate, written as a user script.

One process:   python tests/ecosystem/accelerate_train.py --opt fused ...
Two processes: ACCELERATE_USE_CPU=true python -m torch.distributed.run --nproc_per_node=2
               tests/ecosystem/accelerate_train.py --opt zero ...

--opt torch|fused|zero   torch.optim.AdamW | FusedAdamW | ZeroAdamW (built before prepare)
--recipe prepare         acc.prepare(model, opt, dl, sched): at 2 processes the model is
                         wrapped in DDP; clipping with acc.clip_grad_norm_
--recipe no_ddp          acc.prepare_model(model, evaluation_mode=True) (registered with
                         the Accelerator, placed, NOT wrapped in DDP) then
                         acc.prepare(opt, dl, sched); clipping with ZeroAdamW(max_grad_norm=)
--recipe ddp_hook        acc.prepare(model, opt, dl, sched), then
                         model.register_comm_hook(None, zero_triton.ddp_local_grads_hook)
                         (DDP communicates nothing); clipping with ZeroAdamW(max_grad_norm=)

Phases recorded in OUT/rank{r}.pt (see common.Phases):
  train          N steps, zero_triton's warnings recorded; at step K
                 acc.save_state(CKPT/safetensors) (accelerate's default, safetensors) and
                 acc.save_state(CKPT/pickle, safe_serialization=False); the model and
                 optimizer state at K; the parameters after N steps; the plain-torch
                 reference.
  resume_pickle, resume_safetensors
                 a new Accelerator, model (other init) and optimizer, prepared the same
                 way; acc.load_state(dir); the model and optimizer state right after
                 loading; N-K more steps (acc.skip_first_batches); the final parameters.
  local_clip     (--recipe no_ddp with --clip) the no_ddp recipe clipping with
                 acc.clip_grad_norm_ instead of max_grad_norm=: torch's clip_grad_norm_,
                 which ZeroAdam hands to its global norm (on its own it would clip each
                 rank's local gradients): it must match the reference.
  st_*           (with --safetensors-model) safetensors.torch: save_model(model) and
                 save_file(model.state_dict()) of the trained model; load_model and
                 load_file + load_state_dict of the save_file file, each into a fresh
                 plain model and into a fresh model whose parameters a FusedAdamW holds
                 in its flat buffer.
"""
import argparse
import datetime
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (sets TRITON_INTERPRET)

common.setup_process()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import InitProcessGroupKwargs  # noqa: E402

from zero_triton import FusedAdamW, ZeroAdamW, ddp_local_grads_hook  # noqa: E402


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--opt", choices=["torch", "fused", "zero"], required=True)
    ap.add_argument("--recipe", choices=["prepare", "no_ddp", "ddp_hook"], default="prepare")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save-at", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="per-process batch size")
    ap.add_argument("--clip", type=float, default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt", default=None, help="save_state/load_state phases when given")
    ap.add_argument("--safetensors-model", action="store_true")
    return ap.parse_args()


def make_accelerator():
    return Accelerator(cpu=True, kwargs_handlers=[
        InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=60))])


def build(acc, args, seed, local_clip=False):
    model = common.Net(seed)
    kw = dict(lr=common.LR, betas=common.BETAS, weight_decay=common.WEIGHT_DECAY)
    if args.opt == "torch":
        opt = torch.optim.AdamW(model.parameters(), **kw)
    elif args.opt == "fused":
        opt = FusedAdamW(model.parameters(), **kw)
    else:
        clip = args.clip if args.recipe != "prepare" and not local_clip else None
        opt = ZeroAdamW(model.parameters(), max_grad_norm=clip, **kw)
    sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=4 * args.steps)
    x, y = common.data()
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                     batch_size=args.batch, shuffle=False)
    if args.recipe in ("prepare", "ddp_hook"):
        model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
        if args.recipe == "ddp_hook" and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model.register_comm_hook(None, ddp_local_grads_hook)
    else:
        model = acc.prepare_model(model, evaluation_mode=True)
        opt, dl, sched = acc.prepare(opt, dl, sched)
    return model, opt, dl, sched


def train(acc, args, model, opt, dl, sched, start=0, on_step=None, local_clip=False):
    batches = dl if start == 0 else acc.skip_first_batches(dl, start)
    done = start
    for x, y in batches:
        if done >= args.steps:
            break
        loss = F.mse_loss(model(x), y)
        acc.backward(loss)
        if args.clip is not None and (args.recipe == "prepare" or local_clip):
            acc.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        done += 1
        if on_step is not None:
            on_step(done)
    if done != args.steps:
        raise RuntimeError(f"the dataloader ran out after {done} steps")


def main():
    args = parse()
    os.makedirs(args.out, exist_ok=True)
    phases = common.Phases()
    acc = make_accelerator()
    rank, world = acc.process_index, acc.num_processes
    print(f"rank {rank}/{world}: distributed_type={acc.distributed_type}", flush=True)
    trained = None

    with phases("train") as rec:
        model, opt, dl, sched = build(acc, args, seed=0)
        rec["ddp_wrapped"] = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        rec["world_size"] = world

        def on_step(done):
            if args.ckpt is None or done != args.save_at:
                return
            rec["saved_model"] = common.params_of(model)
            rec["saved_opt"] = common.snapshot(opt.state_dict())
            for kind in ("safetensors", "pickle"):
                try:
                    acc.save_state(os.path.join(args.ckpt, kind),
                                   **({} if kind == "safetensors" else {"safe_serialization": False}))
                except Exception as exc:  # recorded: the resume phase reports it
                    rec[f"save_error_{kind}"] = repr(exc)
            acc.wait_for_everyone()
            rec["files"] = {k: sorted(os.listdir(os.path.join(args.ckpt, k)))
                            for k in ("safetensors", "pickle")}
            weights = os.path.join(args.ckpt, "safetensors", "model.safetensors")
            if os.path.exists(weights):
                from safetensors import safe_open
                with safe_open(weights, "pt") as f:
                    rec["safetensors_keys"] = sorted(f.keys())

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(acc, args, model, opt, dl, sched, on_step=on_step)
        rec["warnings"] = [str(w.message) for w in caught if "zero_triton" in str(w.message)]
        rec["final"] = common.params_of(model)
        rec["reference"] = common.reference_adamw(args.steps, args.batch * world,
                                                  sched_steps_per_step=world, max_grad_norm=args.clip)
        trained = model

    if args.ckpt is not None:
        for kind in ("pickle", "safetensors"):
            with phases(f"resume_{kind}") as rec:
                acc_r = make_accelerator()
                model_r, opt_r, dl_r, sched_r = build(acc_r, args, seed=7)
                acc_r.load_state(os.path.join(args.ckpt, kind))
                rec["loaded_model"] = common.params_of(model_r)
                rec["loaded_opt"] = common.snapshot(opt_r.state_dict())
                train(acc_r, args, model_r, opt_r, dl_r, sched_r, start=args.save_at)
                rec["final"] = common.params_of(model_r)

    if args.recipe == "no_ddp" and args.clip is not None:
        with phases("local_clip") as rec:
            acc_c = make_accelerator()
            model_c, opt_c, dl_c, sched_c = build(acc_c, args, seed=0, local_clip=True)
            train(acc_c, args, model_c, opt_c, dl_c, sched_c, local_clip=True)
            rec["final"] = common.params_of(model_c)

    if args.safetensors_model and trained is not None:
        from safetensors.torch import load_file, load_model, save_file, save_model
        phases.results["expected"] = {"ok": True, "model": common.params_of(trained)}
        unwrapped = acc.unwrap_model(trained)
        by_save_model = os.path.join(args.out, "save_model.safetensors")
        by_save_file = os.path.join(args.out, "save_file.safetensors")
        with phases("st_save_model"):
            save_model(unwrapped, by_save_model)
        with phases("st_save_file"):
            save_file(unwrapped.state_dict(), by_save_file)
        # Loads read the save_file file (so that they are tested whatever save_model does).
        for loader in ("load_model", "load_file"):
            for into in ("plain", "flat"):
                with phases(f"st_{loader}_{into}") as rec:
                    fresh = common.Net(seed=7)
                    # "flat": its parameters now live in a FusedAdamW's flat buffer
                    holder = FusedAdamW(fresh.parameters()) if into == "flat" else None
                    if loader == "load_model":
                        load_model(fresh, by_save_file)
                    else:
                        fresh.load_state_dict(load_file(by_save_file))
                    rec["loaded"] = common.params_of(fresh)
                    del holder

    phases.save(args.out, rank)
    acc.wait_for_everyone()
    acc.end_training()
    common.finish(rank)


if __name__ == "__main__":
    main()
