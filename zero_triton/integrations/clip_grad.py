"""torch's clipping functions on ZeroAdam's parameters clip by the global norm.

Scripts clip with torch's function (nanoGPT, accelerate's ``clip_grad_norm_``, HF Trainer,
Lightning). Under ZeroAdam it would see the wrong gradients: at stage 1 each rank's local
ones (each rank clipping by its own norm), at stage 2 none at all (backward handed them to
the optimizer), so nothing would be clipped, without a word. Once a ZeroAdam exists,
torch's function (``torch.nn.utils.clip_grad_norm_`` under each of its names, a name
imported before the optimizer was built included) hands a call over that passes every
trainable parameter of one ZeroAdam to ``optimizer.clip_grad_norm_``: the norm of the
averaged gradients over every rank's shard (one all-reduce, no host sync), applied inside
the next ``step`` as DDP + torch's clipping would, and returned. torch's two calls,
``get_total_norm`` over the optimizer's gradients and ``clip_grads_with_norm_`` over its
parameters, go to ``optimizer.total_grad_norm`` and ``optimizer.clip_grads_with_norm_``.
Other calls go to torch's functions unchanged (at world size 1 and stage 1 the local
gradients are the gradients). A call that cannot be right is refused with the fix: a
subset of a ZeroAdam's parameters (the other ranks' shards would need their own norm),
parameters of several optimizers at once, ``clip_grad_value_``, or
``clip_grads_with_norm_`` with a norm the optimizer did not take.

Which optimizer owns a parameter: ``zero_triton.optim.owners``. ``install`` runs when the
first ZeroAdam is built (``zero_triton.integrations.install``).
"""
from __future__ import annotations

import functools

import torch

from zero_triton.integrations import patching
from zero_triton.optim import owners
from zero_triton.optim.owners import owner as owner_of


def as_list(parameters) -> list:
    """The parameters a clipping call was given, as torch's functions read them."""
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def any_owned(params) -> bool:
    """Some of ``params`` belong to a live ZeroAdam that routes clipping."""
    return any(owner_of(p) is not None for p in params)


_NONFINITE = ("The total norm of order {} for gradients from `parameters` is non-finite, so it "
              "cannot be clipped. To disable this error and scale the gradients by the "
              "non-finite norm anyway, set `error_if_nonfinite=False`")


def install() -> None:
    """Route torch's clipping functions on a ZeroAdam's parameters; once. Every name that
    refers to them routes, a ``from torch.nn.utils import clip_grad_norm_`` made before the
    first ZeroAdam included (``_reroute``)."""
    import torch.nn.utils.clip_grad as clip_grad
    _reroute(clip_grad, "clip_grad_norm_", _routed_clip_grad_norm_)
    _reroute(clip_grad, "clip_grad_value_", _refused_value_clipping)
    # torch's two-call clipping (2.6+): public as get_total_norm, clip_grads_with_norm_
    if hasattr(clip_grad, "_get_total_norm") and hasattr(clip_grad, "_clip_grads_with_norm_"):
        _reroute(clip_grad, "_get_total_norm", _routed_get_total_norm)
        _reroute(clip_grad, "_clip_grads_with_norm_", _routed_clip_grads_with_norm_)


def routes(fn) -> bool:
    """``fn`` (one of torch's clipping functions) routes a ZeroAdam's parameters."""
    return getattr(fn, "_zero_triton_routes", False)


def _reroute(module, name: str, make) -> None:
    """Route torch's function ``module.name`` through ``make(original)``, which calls
    ``original`` for what is no ZeroAdam's. torch decorates its clipping functions with a
    wrapper that calls the function it holds in a closure cell: pointing that cell at the
    router makes every reference route, the names other modules and scripts imported from
    ``torch.nn.utils`` before the first ZeroAdam was built included (replacing the names
    would miss those: nanoGPT-style scripts import ``clip_grad_norm_`` at the top, and then
    each rank clipped by its local norm, or at stage 2 nothing, silently). Where torch's
    wrapper is not of that shape, the module's and ``torch.nn.utils``' names are replaced."""
    fn = getattr(module, name)
    if routes(fn):
        return
    inner = getattr(fn, "__wrapped__", None)
    for cell in (fn.__closure__ or ()) if inner is not None else ():
        try:
            held = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if held is inner:
            patching.set_cell("clip_grad", cell, functools.wraps(inner)(make(inner)))
            patching.set_attr("clip_grad", fn, "_zero_triton_routes", True)
            return
    routed = functools.wraps(fn)(make(fn))
    routed._zero_triton_routes = True
    for where in (module, torch.nn.utils):
        for attr, value in list(vars(where).items()):
            if value is fn:
                patching.set_attr("clip_grad", where, attr, routed)


def _owners_of(params):
    """({id: ZeroAdam} owning some of ``params``, the parameters no ZeroAdam owns)."""
    owned, unowned = {}, []
    for p in params:
        opt = owner_of(p)
        if opt is not None:
            owned[id(opt)] = opt
        else:
            unowned.append(p)
    return owned, unowned


def _routed_clip_grad_norm_(original):
    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                        foreach=None):
        params = as_list(parameters)
        owned, unowned = _owners_of(params)
        if not owned:
            return original(params, max_norm, norm_type, error_if_nonfinite, foreach)
        opt = _check_call(params, owned, unowned)
        total = opt.clip_grad_norm_(float(max_norm), float(norm_type))
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(_NONFINITE.format(float(norm_type)))
        return total
    return clip_grad_norm_


def _refused_value_clipping(original):
    """``clip_grad_value_`` on a ZeroAdam's parameters is refused, before it changes
    anything: it would clamp each rank's local gradients, whose average is not DDP's
    clamped average (stage 1), or find no ``.grad`` (stage 2, where torch raises an error
    about an empty tensor list). Other calls go to torch's function unchanged."""
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
    return clip_grad_value_


# torch's two-call clipping, ``norm = torch.nn.utils.get_total_norm(grads)`` then
# ``torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)``: over a ZeroAdam's
# gradients and parameters, the norm is that of the averaged gradients over every rank
# (``optimizer.total_grad_norm``) and the clipping is applied inside the next step
# (``optimizer.clip_grads_with_norm_``), as ``clip_grad_norm_`` is. Left to torch, each rank
# clipped its local gradients by its own norm (stage 1), or nothing (stage 2: no ``.grad``),
# silently. A norm taken any other way is refused by the optimizer with the fix. torch's
# own clip_grad_norm_ calls these too, on what no ZeroAdam owns: unchanged.
def _routed_get_total_norm(original):
    def get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        grads = as_list(tensors)
        opt = _grads_owner(grads)
        if opt is None:
            return original(grads, norm_type, error_if_nonfinite, foreach)
        total = opt.total_grad_norm(float(norm_type))
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(_NONFINITE.format(float(norm_type)))
        return total
    return get_total_norm


def _routed_clip_grads_with_norm_(original):
    def clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
        params = as_list(parameters)
        owned, unowned = _owners_of(params)
        if not owned:
            return original(params, max_norm, total_norm, foreach)
        opt = _check_call(params, owned, unowned, "clip_grads_with_norm_")
        opt.clip_grads_with_norm_(float(max_norm), total_norm)
    return clip_grads_with_norm_


def _grads_owner(grads: list):
    """The ZeroAdam whose parameters' gradients ``grads`` are (every one of its trainable
    parameters' ``.grad``, and nothing else), None when they are no ZeroAdam's; raise
    when they are some of one's."""
    live = owners.live()
    if not live:
        return None
    given = {id(g) for g in grads if isinstance(g, torch.Tensor)}
    for opt in live:
        held = [p.grad for g in opt.param_groups for p in g["params"]
                if p.requires_grad and p.grad is not None]
        ours = sum(id(g) in given for g in held)
        if ours == 0:
            continue
        if ours != len(held) or len(given) != len(held):
            raise ValueError(
                f"zero_triton: torch.nn.utils.get_total_norm got {ours} of a ZeroAdam's "
                f"{len(held)} gradients and {len(given) - ours} other tensors: under ZeroAdam "
                f"the norm to clip by is that of the averaged gradients over all of the "
                f"optimizer's parameters at once. Pass [p.grad for p in model.parameters() if "
                f"p.grad is not None] (every parameter the optimizer holds, and no others), or "
                f"take it with optimizer.total_grad_norm()")
        return opt
    return None


def _check_call(params, owners, unowned, name: str = "clip_grad_norm_"):
    """The one ZeroAdam whose every trainable parameter ``params`` holds (``unowned``:
    those of ``params`` no routing ZeroAdam owns), or raise."""
    if len(owners) > 1:
        raise ValueError(
            f"zero_triton: torch.nn.utils.{name} got the parameters of several "
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
            f"zero_triton: torch.nn.utils.{name} under ZeroAdam clips by the global "
            f"norm of the averaged gradients, over all of the optimizer's parameters at once, "
            f"but {what}. Pass model.parameters() (every parameter the optimizer holds, and "
            f"no others with gradients), or clip with the optimizer: max_grad_norm= or "
            f"optimizer.clip_grad_norm_(max_norm)")
    return opt
