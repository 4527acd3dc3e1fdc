"""zero_triton under HF transformers' Trainer, written as a user script (CPU, no
downloads: the model is common.Net, an nn.Module returning {"loss", "logits"}).

One process:   python tests/ecosystem/trainer_train.py --opt torch ...
Two processes: python -m torch.distributed.run --nproc_per_node=2
               tests/ecosystem/trainer_train.py --opt zero ...

--opt torch|fused|zero  torch.optim.AdamW | FusedAdamW | ZeroAdamW
--how instance          built on model.parameters() before the Trainer and passed as
                        Trainer(optimizers=(opt, None)); the Trainer makes the scheduler
--how cls               Trainer(optimizer_cls_and_kwargs=(cls, kwargs)): the Trainer builds
                        it (its usual decay / no-decay param groups)
--how optclip           as instance, with TrainingArguments(max_grad_norm=0) and the
                        optimizer clipping instead (FusedAdamW/ZeroAdamW(max_grad_norm=C))
--how hook              as optclip, and a callback that registers
                        zero_triton.ddp_local_grads_hook on the Trainer's DDP wrapper at
                        on_train_begin (DDP then communicates nothing; the Trainer's own
                        clipping would see local gradients, hence max_grad_norm=0)
--release               the optimizer releases gradients: FusedAdamW(grad_release=True),
                        ZeroAdamW(stage=2, grad_release=True)
--clip C                TrainingArguments(max_grad_norm=C) (0 switches clipping off): the
                        Trainer clips with accelerate's clip_grad_norm_ on the DDP-wrapped
                        model, whose gradients DDP has already averaged over the ranks.
--ckpt                  the "instance" run also saves a Trainer checkpoint at step
                        --save-at (save_strategy "steps"); phase "resume" resumes from it
                        in a fresh Trainer (trainer.train(resume_from_checkpoint=...)):
                        transformers' own Trainer, which calls optimizer.state_dict() on
                        the saving rank only.

Phases recorded in OUT/rank{r}.pt (see common.Phases): train, [noclip], [resume].
"""
import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (sets TRITON_INTERPRET)

common.setup_process()

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from zero_triton import FusedAdamW, ZeroAdamW, ddp_local_grads_hook  # noqa: E402

CLASSES = {"torch": torch.optim.AdamW, "fused": FusedAdamW, "zero": ZeroAdamW}


class LocalGradsHook(TrainerCallback):
    """Registers ddp_local_grads_hook on the Trainer's DDP wrapper before the first step."""

    def __init__(self):
        self.trainer = None

    def on_train_begin(self, args, state, control, **kwargs):
        wrapped = self.trainer.model_wrapped
        if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
            wrapped.register_comm_hook(None, ddp_local_grads_hook)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--opt", choices=sorted(CLASSES), required=True)
    ap.add_argument("--how", choices=["instance", "cls", "optclip", "hook"], action="append")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8, help="per-device batch size")
    ap.add_argument("--clip", type=float, default=7.0)
    ap.add_argument("--noclip", action="store_true", help="also a run with max_grad_norm=0")
    ap.add_argument("--save-at", type=int, default=3)
    ap.add_argument("--ckpt", action="store_true")
    ap.add_argument("--release", action="store_true")
    ap.add_argument("--out", required=True)
    return ap.parse_args()


def run(args, how, clip, output_dir, *, seed=0, save=False, resume=None):
    model = common.Net(seed)
    kwargs = dict(lr=common.LR, betas=common.BETAS, weight_decay=common.WEIGHT_DECAY)
    if args.release:
        kwargs.update(grad_release=True, **({"stage": 2} if args.opt == "zero" else {}))
    if how in ("optclip", "hook"):  # the optimizer clips (global norm inside step), the Trainer not
        kwargs["max_grad_norm"], clip = clip, 0.0
    targs = TrainingArguments(
        output_dir=output_dir, use_cpu=True, per_device_train_batch_size=args.batch,
        max_steps=args.steps, learning_rate=common.LR, weight_decay=common.WEIGHT_DECAY,
        adam_beta1=common.BETAS[0], adam_beta2=common.BETAS[1], max_grad_norm=clip,
        logging_steps=1, report_to=[], disable_tqdm=True, seed=0, ddp_timeout=60,
        dataloader_num_workers=0, ddp_find_unused_parameters=False,
        save_strategy="steps" if save else "no", save_steps=args.save_at)
    extra = {}
    if how in ("instance", "optclip", "hook"):
        extra["optimizers"] = (CLASSES[args.opt](model.parameters(), **kwargs), None)
    else:
        extra["optimizer_cls_and_kwargs"] = (CLASSES[args.opt], kwargs)
    callbacks = []
    if how == "hook":
        callbacks.append(LocalGradsHook())
    trainer = Trainer(model=model, args=targs, train_dataset=common.DictDataset(), callbacks=callbacks,
                  **extra)
    for cb in callbacks:
        if isinstance(cb, LocalGradsHook):
            cb.trainer = trainer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=resume)
    trainer.zero_triton_warnings = [str(w.message) for w in caught if "zero_triton" in str(w.message)]
    return trainer, model


def main():
    args = parse()
    rank = int(os.environ.get("RANK", "0"))
    phases = common.Phases()
    for how in args.how or ["instance"]:
        with phases(f"train_{how}") as rec:
            trainer, model = run(args, how, args.clip, os.path.join(args.out, f"run_{how}"),
                                 save=args.ckpt and how == "instance")
            rec["ddp_wrapped"] = isinstance(trainer.model_wrapped,
                                            torch.nn.parallel.DistributedDataParallel)
            rec["optimizer"] = type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__
            rec["world_size"] = trainer.args.world_size
            rec["final"] = common.params_of(model)
            rec["grad_norms"] = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
            rec["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
            rec["warnings"] = trainer.zero_triton_warnings
    if args.noclip:
        with phases("noclip") as rec:
            trainer, model = run(args, "instance", 0.0, os.path.join(args.out, "run_noclip"))
            rec["final"] = common.params_of(model)
    if args.ckpt:
        with phases("resume") as rec:
            ckpt = os.path.join(args.out, "run_instance", f"checkpoint-{args.save_at}")
            rec["files"] = sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else None
            trainer, model = run(args, "instance", args.clip, os.path.join(args.out, "run_resume"),
                                 seed=7, resume=ckpt)
            rec["final"] = common.params_of(model)
    phases.save(args.out, rank)
    common.finish(rank)


if __name__ == "__main__":
    main()
