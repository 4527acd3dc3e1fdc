"""Uneven inputs: ZeroAdam under ``torch.distributed.algorithms.join.Join``.

When the ranks have different numbers of batches, the rank that runs out first stops
calling backward and ``step`` while the others still do, and their collectives wait for
it. torch's answer is the ``Join`` context manager: a rank whose loop has ended shadows
the others' collectives until every rank is done, as DDP and ZeroRedundancyOptimizer do
(``with Join([ddp_model, optimizer]):`` around the loop). Under ZeRO a joined rank must
do more than shadow: it owns a shard of the optimizer state and of the parameters, which
the others need stepped at every step.

So a joined rank runs the others' iteration with nothing to contribute (``ZeroJoinHook``):
a backward that hands every trainable parameter a zero gradient (backward's buckets
launch in the agreed order, as the others'), then ``step``: its shard is stepped with the
average of every rank's gradients, a joined rank's counting as zeros over the initial
world size, as DDP's ``divide_by_initial_world_size=True`` (its default) averages; the
all-gathers bring every rank the parameters. At that step every rank exchanges its
hyperparameters once, and a joined rank takes the others' (a scheduler stepped in their
loop and not in its ended one). While a rank is joined, a parameter that no other rank
has a gradient for steps with a zero gradient, as after ``zero_grad(set_to_none=False)``.

A joined rank shadows backward, ``clip_grad_norm_`` and ``step``: when the others make
a call before their step (clipping, another micro-batch's backward), the joined rank,
entering its step, finds them at that call in the agreement's rows (which carry the
clipping's ``max_norm`` and ``norm_type``), makes the same call and enters its step
again (``zero_triton.comm.agreement.CatchUp``). What it cannot make is refused on every
rank at that call, with the fix, never a hang: GradScaler (its scale is a device value
the joined rank does not have), torch's two-call clipping (no agreement carries the
second call's max_norm), state dicts and checkpoints, and a DDP wrapper that averages
the gradients too (``optim.ddp_check.AlreadyAveraged.refuse_under_join``).
"""
from __future__ import annotations

import torch
from torch.distributed.algorithms.join import JoinHook

from zero_triton.comm.agreement import CatchUp

HYPERPARAMETERS = ("lr", "beta1", "beta2", "eps", "weight_decay")


class ZeroJoinHook(JoinHook):
    """The join hook of one ZeroAdam (``ZeroAdam.join_hook``)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def main_hook(self) -> None:
        """One iteration of the ranks that still have inputs: a backward of zero gradients
        and a step."""
        opt = self.optimizer
        opt.ranks.shadowing = True
        try:
            opt.zero_grad(set_to_none=True)  # what this rank's own last iteration left
            self._backward()
            while True:
                try:
                    opt.step()
                    break
                except CatchUp as up:  # the others made a call first: make it, step again
                    opt.ranks.catch_up(up.entry, up.rows)
                    if up.entry == "backward":  # another micro-batch
                        self._backward()
                    else:
                        opt.clip_grad_norm_(*up.args)
            opt.zero_grad(set_to_none=True)
        finally:
            opt.ranks.shadowing = False

    def _backward(self) -> None:
        """A backward pass that reaches every trainable parameter with a zero gradient
        (a zero expanded to each shape: one parameter's gradient exists at a time)."""
        opt = self.optimizer
        params = [p for group in opt.param_groups for p in group["params"] if p.requires_grad]
        zeros, grads = {}, []
        for p in params:
            key = (p.dtype, p.device)
            if key not in zeros:
                zeros[key] = torch.zeros((), dtype=p.dtype, device=p.device)
            grads.append(zeros[key].expand_as(p))
        with torch.enable_grad():
            torch.autograd.backward(params, grads)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank has joined: the last step's all-gathers are waited here
        (``overlap()`` leaves them to a forward that a joined rank no longer runs)."""
        self.optimizer.wait_params()


def averaging_ddp(params, hooked_too: bool = False) -> bool:
    """A live DistributedDataParallel wraps one of ``params`` and averages its gradients
    (it has no ``zero_triton.ddp_local_grads_hook``; ``hooked_too``: or has one, and
    still writes its buckets back into ``.grad``). Looked up once, when the first step
    finds the gradients identical on every rank (ranks that drew the same batches look
    the same, and are no reason to refuse Join), or at the first backward that releases
    gradients (``optim.ranks``): a walk over the live objects, ~0.1 s."""
    import gc

    ddp_class = torch.nn.parallel.DistributedDataParallel
    ids = {id(p) for p in params}
    for obj in gc.get_objects():
        if not isinstance(obj, ddp_class):
            continue
        hooks = [hook for hook, _ in getattr(obj, "_comm_hooks", ())]
        if not hooked_too and any(getattr(h, "__qualname__", "") == "ddp_local_grads_hook"
                                  and getattr(h, "__module__", "").startswith("zero_triton.")
                                  for h in hooks):
            continue
        module = getattr(obj, "module", None)
        if module is not None and any(id(p) in ids for p in module.parameters()):
            return True
    return False


def release_under_ddp(param_groups):
    """The error for ``ZeroAdam(stage=2, grad_release=True)`` when a live
    DistributedDataParallel wraps its parameters (None when none does), asked before the
    first releasing backward steps anything (``optim.ranks``; ``optim.zero_release`` at one
    rank)."""
    if not averaging_ddp([p for g in param_groups for p in g["params"]], hooked_too=True):
        return None
    return RuntimeError(
        "ZeroAdam(stage=2, grad_release=True) under a DistributedDataParallel wrapper: "
        "ZeroAdam takes each gradient in backward and steps with its average, and DDP "
        "writes its own average back into .grad afterwards (with ddp_local_grads_hook "
        "too), which would count twice. Do not wrap the model in DDP (ZeroAdam averages "
        "the gradients itself; under accelerate, accelerator.prepare_model(model, "
        "evaluation_mode=True) places it without the wrap), or, where a library always "
        "wraps it (HF Trainer at 2+ processes), use ZeroAdamW(stage=1) without "
        "grad_release. Nothing was stepped")


def _values(param_groups):
    """Every group's hyperparameters, in ``HYPERPARAMETERS``' order."""
    for group in param_groups:
        beta1, beta2 = group["betas"]
        yield from (group["lr"], beta1, beta2, group["eps"], group["weight_decay"])


def hyperparameters(param_groups) -> list:
    """This rank's hyperparameters as floats, group after group (a tensor on an
    accelerator is read: called only where they are exchanged)."""
    return [float(v) for v in _values(param_groups)]


def digest(param_groups) -> int:
    """A 63-bit digest of the hyperparameters, the same on ranks that hold the same
    (Python's hash of floats does not vary between processes). A tensor on an
    accelerator counts as a placeholder: reading it would wait for the device."""
    values = []
    for v in _values(param_groups):
        if isinstance(v, torch.Tensor):
            v = float(v) if v.device.type == "cpu" else -1.0
        values.append(-2.0 if v != v else v)  # hash(nan) differs from one nan to another
    return hash(tuple(values)) & ((1 << 63) - 1)


def first_difference(rows: list):
    """Where ``rows`` ((rank, ``hyperparameters``) of several ranks) first differ, in
    words; None if they are equal."""
    if not rows:
        return None
    n = len(HYPERPARAMETERS)
    first_rank, first = rows[0]
    for rank, values in rows[1:]:
        for i, (a, b) in enumerate(zip(first, values)):
            if a != b and not (a != a and b != b):  # nan on both: the same
                return (f"param group {i // n}'s {HYPERPARAMETERS[i % n]} is {a!r} on rank "
                        f"{first_rank} and {b!r} on rank {rank}")
    return None


def adopt(param_groups, values: list) -> None:
    """Set the groups' hyperparameters to ``values`` (``hyperparameters``' layout); a
    tensor is filled in place, as a scheduler that holds it expects."""
    n = len(HYPERPARAMETERS)
    for i, group in enumerate(param_groups):
        lr, beta1, beta2, eps, weight_decay = values[i * n:(i + 1) * n]
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
        betas = []
        for b, v in zip(group["betas"], (beta1, beta2)):
            if isinstance(b, torch.Tensor):
                b.fill_(v)
            betas.append(b if isinstance(b, torch.Tensor) else v)
        group["betas"] = tuple(betas)
        group["eps"] = eps
        group["weight_decay"] = weight_decay
