"""Gradient release: each parameter stepped in backward as its final gradient is made,
and the gradient freed at once (``FusedAdam(..., grad_release=True)``).

A bf16 model's gradients are 2 of the 7 bytes per parameter that a 24-bit master and int8
moments leave (``docs/low-bit-state.md``); released, the gradients are never all held at
once: backward holds one parameter's at a time (and what autograd holds itself).

How: the shards' gradient holder (``comm.grads.ReleasedGrads``) has no buffer; its hook
on each parameter, called by autograd once the parameter's gradient is final for this
backward (``register_post_accumulate_grad_hook``), hands it to ``ReleasePipeline.arrived``,
which steps that parameter's run of the state with it (``Shard.step_param``: the kernel
of the whole step on that run, its count taken alone) and sets ``.grad`` to None. The
first hook of a backward follows the user's edits as ``step()`` does (``Ranks.enter``);
the end of backward (a callback autograd runs once its graph is done) labels the step
counts (``ShardState.settle``) and shows them in ``opt.state``. Each parameter gets the
bits the plain step gives it: the same kernel, gradient, count and hyperparameters.

What it composes with, and what it refuses (each error says why and what to use):

- gradient accumulation: backward inside ``opt.no_sync()`` keeps its gradients in
  ``.grad`` (autograd adds them up as it does without the optimizer); the first backward
  outside it steps each parameter with the sum and frees it;
- ``step()`` steps what backward did not release (a ``.grad`` set by hand, or kept by
  ``no_sync()``) and ``zero_grad()`` clears those: training loops run unchanged;
- the gradient norm, measured (``clip_grad_norm_(params, inf)``, as HF Trainer logs it at
  every step, or ``get_total_norm``): each released gradient's 2-norm is kept as it is
  stepped (``ReleasedNorms``), so the norm after backward is the norm of the gradients the
  step took;
- refused: ``max_grad_norm`` and torch's clipping over the parameters by a finite norm
  (the global norm needs every gradient before any step), GradScaler (its inf check and unscale too),
  ``capturable``, ``offload``, ``differentiable``, DTensor parameters (FSDP2 and tensor
  parallel), and a process group of several ranks (DistributedDataParallel averages at
  the end of backward, after each parameter would have been stepped with its own rank's
  gradient: ``ZeroAdamW(..., stage=2, grad_release=True)`` steps each rank's shard as
  its average lands instead, ``zero_triton.optim.zero_release``).
"""
from __future__ import annotations

import contextlib
import math
import weakref

import torch
import torch.distributed as dist

from zero_triton.optim.clipping import Clipping
from zero_triton.optim.pipeline import StepPipeline
from zero_triton.state.param_view import Run


def refuse_process_group() -> None:
    """Refuse gradient release in a process group of several ranks."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(
            f"grad_release=True in a process group of {dist.get_world_size()} ranks: each "
            "parameter would be stepped in backward with this rank's own gradient, before "
            "DistributedDataParallel (or any wrapper) averages it at the end of backward. Use "
            "ZeroAdamW(..., stage=2, grad_release=True), which steps each rank's shard as "
            "its average lands, or leave grad_release out")


def _needs_every_gradient(what: str, fix: str) -> RuntimeError:
    return RuntimeError(
        f"{what} cannot be used with grad_release=True: it needs every gradient of the step "
        f"before any parameter is stepped, and gradient release stepped each parameter in "
        f"backward as its gradient was made, then freed it; {fix}")


_FIXES = {
    "GradScaler": ("GradScaler", "this backward's steps took the scaled gradients. Train with "
                   "bfloat16 autocast, which needs no scaler, or leave grad_release out"),
    "clip_grad_norm_": ("Clipping by the global gradient norm",
                        "leave grad_release out to clip, or clip nothing (HF Trainer: "
                        "TrainingArguments(max_grad_norm=0)); the norm itself, "
                        "clip_grad_norm_(params, float('inf')) or get_total_norm, is kept"),
}


def _norm(grad: torch.Tensor) -> torch.Tensor:
    """A gradient's 2-norm (a complex one's over its real view), summed in float32 and
    returned in the gradient's dtype as torch's ``clip_grad_norm_`` returns it (bfloat16
    has float32's range, and its norm is half the cost of one returned in float32);
    float16's in float32, which its range could not hold."""
    if grad.is_complex():
        grad = torch.view_as_real(grad)
    if grad.dtype == torch.float16:
        return torch.linalg.vector_norm(grad, 2.0, dtype=torch.float32)
    return torch.linalg.vector_norm(grad, 2.0)


class ReleasedNorms(Clipping):
    """Clipping under gradient release (one process): nothing can be clipped, since each
    parameter was stepped in backward before the global norm was known, but the norm can be
    measured: each released gradient's 2-norm is kept (``note``, a 0-d tensor a
    parameter, no host sync) until the step ends, ``zero_grad`` or the next releasing
    backward, and the norm asked for
    after backward is the 2-norm of those and of any ``.grad`` still to be stepped (torch's
    ``clip_grad_norm_`` stacks per-tensor norms the same way; here the total in float32).
    Clipping by a finite norm is refused."""

    def __init__(self, buffers):
        super().__init__(buffers)
        self.norms: list = []

    def note(self, grad: torch.Tensor) -> None:
        self.norms.append(_norm(grad))

    def reset(self) -> None:
        super().reset()
        self.norms.clear()

    def forget_norms(self) -> None:
        """A new backward releases: the norms kept are this backward's alone (a loop may
        never call ``step()``, since release steps in backward: they would pile up)."""
        self.norms.clear()

    def released_norm(self, grads: list):
        """The 2-norm of the gradients released since the step began and of ``grads``
        (the ``.grad``s ``step()`` will step); None if there are none."""
        norms = self.norms + [_norm(g) for g in grads]
        if not norms:
            return None
        device = norms[0].device
        return torch.linalg.vector_norm(torch.stack([n.to(device, torch.float32) for n in norms]), 2.0)

    def clip(self, total: torch.Tensor, max_norm: float, grad_scale) -> torch.Tensor:
        if grad_scale is not None:
            raise _needs_every_gradient(*_FIXES["GradScaler"])
        if not math.isinf(max_norm):
            raise _needs_every_gradient(*_FIXES["clip_grad_norm_"])
        return total

    def clip_with(self, max_norm: float, total_norm, local_is_averaged: bool) -> None:
        if not math.isinf(float(max_norm)):
            raise _needs_every_gradient(*_FIXES["clip_grad_norm_"])


def _refuse_written_back(shard, present, released) -> None:
    """A ``.grad`` at ``step()`` on a parameter that backward released since the last
    step was written afterwards: stepping it would step the parameter twice."""
    if released is None:
        return
    for i, p in enumerate(shard.params):
        if released[i] and (present is None or present[i]):
            raise RuntimeError(
                f"parameter {i} ({tuple(p.shape)}) has a .grad at step() after backward had "
                "stepped it and released its gradient (grad_release=True): something wrote it "
                "afterwards, almost always a DistributedDataParallel wrapper copying its "
                "average back at the end of backward; stepping it again would step the "
                "parameter twice. Do not wrap the model in DistributedDataParallel (one "
                "process needs none), or leave grad_release out. Nothing was stepped")


def _runs(shard) -> list:
    """Each parameter's run of ``shard``'s state (one process: the whole parameter; an
    empty one has none, and is only counted)."""
    owned = shard.by_param.owned()
    return [owned.get(i, Run(i, 0, 0, 0)) for i in range(len(shard.params))]


def _current_task():
    """The id of the backward running now (torch 2.1+), None where torch does not say."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return None if current is None else current()


class ReleasePipeline(StepPipeline):
    """The step of an optimizer built with ``grad_release=True``: parameters stepped one
    by one as backward makes their gradients (``arrived``); ``step()`` steps only what
    backward left in ``.grad``. The stages that need every gradient first (reduce, clip,
    GradScaler's unscale) refuse."""

    def __init__(self, seat, comm, shards, reducer, clipping, ranks, edits):
        super().__init__(seat, comm, shards, reducer, clipping, ranks, edits)
        self.held = 0         # depth of no_sync() blocks: backward keeps .grad
        self.task = None      # the backward whose first hook entered
        self.stepped = {}     # shard key -> parameters stepped since the last settle
        self.released = {}    # shard key -> parameters released since the last step()
        self.where = {}       # id(holder) -> (param group index, shard, its runs by parameter)
        shards.on_change(self.attach)

    def attach(self, param_groups: list) -> None:
        """The shards of ``param_groups`` (built or built again) hand their gradients
        here."""
        self.where = {}
        target = weakref.WeakMethod(self.arrived)
        for gi, shards in enumerate(self.shards.groups):
            for shard in shards:
                shard.grad_buffer.target = target
                self.where[id(shard.grad_buffer)] = (gi, shard, _runs(shard))

    @contextlib.contextmanager
    def accumulating(self):
        """Backward keeps its gradients in ``.grad`` (summed over the backwards, as torch
        does) inside this block; the first backward after it steps with the sum."""
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1

    # -- backward's hooks ------------------------------------------------------------------
    def arrived(self, holder, i: int, param) -> None:
        """Parameter ``i`` of ``holder``'s shard has its final gradient of this backward:
        step it and free the gradient (unless accumulating, or the parameter was moved or
        replaced since the shard was built: ``step()`` re-homes it and steps it then)."""
        g = param.grad
        if self.held or g is None:
            return
        found = self.where.get(id(holder))
        if found is None:  # a shard built again since (a move): its hooks go with it
            return
        gi, shard, runs = found
        view = shard.home.param_views[i]
        if g.is_sparse or g.dtype != param.dtype or g.device != view.device \
                or param.data_ptr() != view.data_ptr() or param.dtype != view.dtype:
            return  # step() says what is wrong, or follows the move
        task = _current_task()
        if task is None or task != self.task:
            self._enter(task)
        self.clipping.note(g)
        shard.step_param(self.seat.param_groups[gi], runs[i], shard.by_param.elements(i, g))
        self.stepped.setdefault(shard.key, bytearray(len(shard.params)))[i] = 1
        self.released.setdefault(shard.key, bytearray(len(shard.params)))[i] = 1
        param.grad = None

    def _enter(self, task) -> None:
        """The first gradient of a backward: what ``step()`` checks and follows first
        (the user's edits, written parameters), and the end of this backward queued."""
        refuse_process_group()
        self.settle()  # a backward that raised midway was never settled
        if task is not None:  # a loop that never calls step(): the norms of this backward
            self.clipping.forget_norms()
        self.task = task
        pairs = self.shards.listed(self.seat.param_groups)
        self.edits.check_frozen()
        self.ranks.enter(self.seat, "step", pairs)
        for group, s in pairs:
            if group["amsgrad"] and s.state.ensure_amsgrad():
                self.edits.expose(s)
        torch.autograd.Variable._execution_engine.queue_callback(self._ended)

    def _ended(self) -> None:
        self.task = None
        self.settle()

    def settle(self) -> None:
        """Label the step counts of the parameters stepped since the last settle
        (``ShardState.settle``), and show them in ``opt.state``."""
        if not self.stepped:
            return
        stepped, self.stepped = self.stepped, {}
        for _, s in self.shards.listed(self.seat.param_groups):
            mask = stepped.get(s.key)
            if mask is None:
                continue
            s.state.settle(list(map(bool, mask)))
            if self.edits.views_state and s.exposed_steps is not s.state.steps:
                self.edits.expose(s)
        self.ranks.stepped(self.seat)

    # -- the stages that need every gradient -----------------------------------------------
    def reduce(self, pairs=None, entry: str = "step") -> None:
        what, fix = _FIXES.get(entry, _FIXES["clip_grad_norm_"])
        raise _needs_every_gradient(what, fix)

    def global_norm(self, norm_type: float, averaged: bool = False):  # clip()'s too
        """The 2-norm of the gradients this step took and will take (``ReleasedNorms``):
        measured, not clipped by (``ReleasedNorms.clip`` refuses a finite norm)."""
        if float(norm_type) != 2.0:
            raise RuntimeError(
                f"a gradient norm of norm_type={norm_type} under grad_release=True: backward "
                "released each gradient as it stepped it, keeping only its 2-norm; ask for "
                "norm_type=2.0, or leave grad_release out")
        pairs = self.shards.listed(self.seat.param_groups)
        return self.clipping.released_norm(
            [p.grad for _, s in pairs for p in s.params if p.grad is not None])

    def rescaled(self) -> None:
        self.reduce(entry="GradScaler")

    # -- step() ------------------------------------------------------------------------------
    def step(self, pairs: list, grad_scale, found_inf, max_grad_norm, overlapped: bool):
        """Step each parameter that has a ``.grad`` still (kept by ``no_sync()``, or
        set by hand), one by one as backward would have; the gradients stay, as
        torch.optim.Adam leaves them, for ``zero_grad``."""
        if grad_scale is not None or found_inf is not None:
            self.reduce(entry="GradScaler")
        refuse_process_group()
        self.settle()
        self.edits.check_frozen()
        present = {s.key: s.grad_buffer.sync(None) for _, s in pairs}
        for _, s in pairs:
            _refuse_written_back(s, present[s.key], self.released.get(s.key))
        self.released = {}
        self.ranks.enter(self.seat, "step", pairs)
        for group, s in pairs:
            if present[s.key] is not None and not any(present[s.key]):
                continue
            if group["amsgrad"] and s.state.ensure_amsgrad():
                self.edits.expose(s)
            runs = self.where[id(s.grad_buffer)][2]
            for i, p in enumerate(s.params):
                if p.grad is not None:
                    s.step_param(group, runs[i], s.by_param.elements(i, p.grad))
                    self.stepped.setdefault(s.key, bytearray(len(s.params)))[i] = 1
        self.settle()
        self.clipping.reset()  # the next backward's norms are the next step's
        return None
