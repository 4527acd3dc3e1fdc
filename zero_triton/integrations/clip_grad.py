"""``torch.nn.utils.clip_grad_norm_`` on ZeroAdam's parameters clips by the global norm.

Scripts clip with torch's function (nanoGPT, accelerate's ``clip_grad_norm_``, HF Trainer,
Lightning). Under ZeroAdam it would see the wrong gradients: at stage 1 each rank's local
ones (each rank clipping by its own norm), at stage 2 none at all (backward handed them to
the optimizer), so nothing would be clipped, without a word. Once a ZeroAdam exists,
torch's function (``torch.nn.utils.clip_grad_norm_`` and ``torch.nn.utils.clip_grad.
clip_grad_norm_``, looked up at call time as those callers do) hands a call over that
passes every trainable parameter of one ZeroAdam to ``optimizer.clip_grad_norm_``: the
norm of the averaged gradients over every rank's shard (one all-reduce, no host sync),
applied inside the next ``step`` as DDP + torch's clipping would, and returned. Other
calls go to torch's function unchanged (at world size 1 and stage 1 the local gradients
are the gradients). A call that cannot be right is refused with the fix: a subset of a
ZeroAdam's parameters (the other ranks' shards would need their own norm), or
parameters of several optimizers at once.

Which optimizer owns a parameter: ``zero_triton.optim.owners``. ``install`` runs when the
first ZeroAdam is built (``zero_triton.integrations.install``).
"""
from __future__ import annotations

import functools

import torch

from zero_triton.optim.owners import owner as owner_of


def as_list(parameters) -> list:
    """The parameters a clipping call was given, as torch's functions read them."""
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def any_owned(params) -> bool:
    """Some of ``params`` belong to a live ZeroAdam that routes clipping."""
    return any(owner_of(p) is not None for p in params)


def install() -> None:
    """Route torch's ``clip_grad_norm_`` (both of its names) through ``_check_call``; once."""
    import torch.nn.utils.clip_grad as clip_grad
    original = clip_grad.clip_grad_norm_
    if getattr(original, "_zero_triton_routes", False):
        return

    @functools.wraps(original)
    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                        foreach=None):
        params = as_list(parameters)
        owners, unowned = {}, []
        for p in params:
            opt = owner_of(p)
            if opt is not None:
                owners[id(opt)] = opt
            else:
                unowned.append(p)
        if not owners:
            return original(params, max_norm, norm_type, error_if_nonfinite, foreach)
        opt = _check_call(params, owners, unowned)
        total = opt.clip_grad_norm_(float(max_norm), float(norm_type))
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
        return total

    clip_grad_norm_._zero_triton_routes = True
    clip_grad.clip_grad_norm_ = clip_grad_norm_
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    _refuse_value_clipping(clip_grad)


def _refuse_value_clipping(clip_grad) -> None:
    """``clip_grad_value_`` on a ZeroAdam's parameters is refused, before it changes
    anything: it would clamp each rank's local gradients, whose average is not DDP's
    clamped average (stage 1), or find no ``.grad`` (stage 2, where torch raises an error
    about an empty tensor list). Other calls go to torch's function unchanged."""
    original = clip_grad.clip_grad_value_
    if getattr(original, "_zero_triton_routes", False):
        return

    @functools.wraps(original)
    def clip_grad_value_(parameters, clip_value, foreach=None):
        params = as_list(parameters)
        if any_owned(params):
            raise ValueError(
                "zero_triton: torch.nn.utils.clip_grad_value_ on a ZeroAdam's parameters would "
                "clamp this rank's local gradients before they are averaged (stage 2: there "
                "are none), not the averaged gradients as under DDP. Clip by norm instead "
                "(torch.nn.utils.clip_grad_norm_, or max_grad_norm= on the optimizer), or "
                "train with zero_triton.FusedAdamW and DDP where value clipping is needed")
        return original(params, clip_value, foreach)

    clip_grad_value_._zero_triton_routes = True
    clip_grad.clip_grad_value_ = clip_grad_value_
    torch.nn.utils.clip_grad_value_ = clip_grad_value_


def _check_call(params, owners, unowned):
    """The one ZeroAdam whose every trainable parameter ``params`` holds (``unowned``:
    those of ``params`` no routing ZeroAdam owns), or raise."""
    if len(owners) > 1:
        raise ValueError(
            "zero_triton: torch.nn.utils.clip_grad_norm_ got the parameters of several "
            "ZeroAdam optimizers; clip each optimizer's parameters in its own call (or "
            "pass max_grad_norm= to each optimizer)")
    opt = next(iter(owners.values()))
    given = {id(p) for p in params}
    missing = [p for g in opt.param_groups for p in g["params"]
               if p.requires_grad and id(p) not in given]
    others = [p for p in unowned if p.grad is not None]
    if missing or others:
        what = (f"{len(missing)} of the optimizer's trainable parameters are missing from the call"
                if missing else f"{len(others)} parameters with gradients belong to no ZeroAdam")
        raise ValueError(
            f"zero_triton: torch.nn.utils.clip_grad_norm_ under ZeroAdam clips by the global "
            f"norm of the averaged gradients, over all of the optimizer's parameters at once, "
            f"but {what}. Pass model.parameters() (every parameter the optimizer holds, and "
            f"no others with gradients), or clip with the optimizer: max_grad_norm= or "
            f"optimizer.clip_grad_norm_(max_norm)")
    return opt
