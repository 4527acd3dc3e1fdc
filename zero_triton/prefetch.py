"""Parameter all-gathers overlapped with the next forward: ``zero_triton.overlap``.

Without it, ``step()`` starts each bucket's all-gather as soon as that bucket's kernel
is done and waits for all of them before returning. With it, ``step()`` returns with
the all-gathers in flight, and a forward pre-hook on every module that owns parameters
waits for the buckets holding that module's own parameters only: the gathers of later
layers run while the earlier layers compute. The optimizer's state dicts, checkpoints
and next ``step`` wait for whatever is left; code that reads parameters outside the
model's forward (logging a weight norm, an EMA copy) calls ``optimizer.wait_params()``
first. A module that uses another module's parameter functionally (not through that
module's forward) must own it too (tied weights: the same Parameter in both modules).
A forward that read a parameter without waiting (that, or a graph compiled by
torch.compile before ``overlap`` was called, which skips the hooks) is refused by the
backward hooks that follow (``buckets.grad_ready``), before the step.
"""
from __future__ import annotations

import functools
import weakref

import torch

from zero_triton.comm import phase


def _wait_for_own(reducer_ref, module, _args):
    reducer = reducer_ref()
    if reducer is None or not reducer.gathering:
        return
    where = reducer.bucket_of_param
    for p in module._parameters.values():
        b = where.get(id(p)) if p is not None else None
        if b is not None and b.gather is not None:
            with phase("zero_triton.all_gather", p.is_cuda):
                b.wait_gather()


def _wait_for_all(reducer_ref, *_args, **_kwargs):
    reducer = reducer_ref()
    if reducer is not None:
        reducer.wait_gathers()


def _remove(handles: list) -> None:
    for h in handles:
        h.remove()
    handles.clear()


class ParamPrefetch:
    """The hooks that ``overlap`` puts on a model; ``remove()`` takes them off (then
    ``step()`` waits for its all-gathers again)."""

    def __init__(self, model: torch.nn.Module, optimizer):
        reducer = optimizer._reducer
        ref = weakref.ref(reducer)
        self.handles = []
        for m in model.modules():
            if any(p is not None for p in m._parameters.values()):
                self.handles.append(m.register_forward_pre_hook(functools.partial(_wait_for_own, ref)))
                # state_dict() of this module or any module above it (every saver) reads
                # the parameters: wait for them all.
                self.handles.append(m.register_state_dict_pre_hook(functools.partial(_wait_for_all, ref)))
        self._optimizer = weakref.ref(optimizer)
        # A dropped optimizer must not leave hooks (holding nothing of it) on the model.
        weakref.finalize(reducer, _remove, self.handles)

    def remove(self) -> None:
        opt = self._optimizer()
        if opt is not None:
            opt.wait_params()
            if opt._overlap is self:
                opt._overlap = None
        _remove(self.handles)


def overlap(model: torch.nn.Module, optimizer) -> ParamPrefetch:
    """Overlap ``optimizer``'s parameter all-gathers with ``model``'s next forward.

    ``optimizer`` is a ZeroAdam (any zero_triton optimizer is accepted; at world size 1
    there is nothing to gather). ``model`` is the module whose parameters it trains (a
    DistributedDataParallel or accelerate wrapper is fine). Returns a handle whose
    ``remove()`` undoes it."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"zero_triton.overlap(model, optimizer): model must be a torch.nn.Module, "
                        f"got {type(model).__name__}")
    if not hasattr(optimizer, "_reducer"):
        raise TypeError(f"zero_triton.overlap(model, optimizer): optimizer must be a zero_triton "
                        f"optimizer (ZeroAdam, ZeroAdamW), got {type(optimizer).__name__}")
    owned = {id(p) for p in model.parameters()}
    trained = [p for g in optimizer.param_groups for p in g["params"]]
    if trained and not any(id(p) in owned for p in trained):
        raise ValueError("zero_triton.overlap(model, optimizer): none of the optimizer's parameters "
                         "belongs to model; pass the model the optimizer was built from")
    if optimizer._overlap is not None:
        optimizer._overlap.remove()
    prefetch = ParamPrefetch(model, optimizer)
    optimizer._overlap = prefetch
    return prefetch
