"""``differentiable=True``: autograd through the optimizer step.

Meta-learning and learned optimizers differentiate the updated parameters (and moments)
with respect to the gradients, the hyperparameters or earlier parameters. A fused kernel
that writes its buffers in place is opaque to autograd, so in this mode FusedAdam keeps
torch.optim.Adam's own layout — one state dict entry of tensors per parameter, the
parameters where the user made them (non-leaf tensors allowed, as in torch) — and steps
them with torch's functional single-tensor Adam with ``differentiable=True``: the same
results, and the same graph, as ``torch.optim.Adam(differentiable=True)``.

It is a class of its own, ``DifferentiableAdam``: ``FusedAdam(..., differentiable=True)``
(and FusedAdamW's) checks its arguments as FusedAdam does and returns one (``build``).
It has torch's optimizer face and nothing of the fused one: no flat buffers, and no
``clip_grad_norm_`` or ``memory_report`` (torch's clipping works on its gradients);
GradScaler unscales its gradients as it does torch's optimizers'.
"""
from __future__ import annotations

import inspect

import torch

from zero_triton.optim import compact as compact_state
from zero_triton.optim.checks import (adam_hyperparameters, check_flag, check_hyperparameters,
                                      check_params_argument)
from zero_triton.optim.spec import Spec
from zero_triton.optim.state_dict import group_keys
from zero_triton.state.moments import FIRST, MAXIMUM, SECOND


def _scalar_dtype():
    """torch's step-count dtype: float64 only when that is the default dtype."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _adam_function(decoupled: bool):
    """torch's functional Adam or AdamW (the AdamW one exists in every torch we support)."""
    if decoupled:
        from torch.optim.adamw import adamw
        return adamw
    from torch.optim.adam import adam
    return adam


def init_group(opt, group):
    """The parameters of ``group`` that have a gradient, and their state (made on first
    use, as torch.optim.Adam makes it)."""
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
    has_complex = False
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError("Adam does not support sparse gradients, please consider "
                               "SparseAdam instead")
        has_complex |= torch.is_complex(p)
        params.append(p)
        grads.append(p.grad)
        state = opt.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
            state[FIRST] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state[SECOND] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state[MAXIMUM] = torch.zeros_like(p, memory_format=torch.preserve_format)
        exp_avgs.append(state[FIRST])
        exp_avg_sqs.append(state[SECOND])
        if group["amsgrad"]:
            max_exp_avg_sqs.append(state[MAXIMUM])
        if state["step"].requires_grad:
            raise RuntimeError("`requires_grad` is not supported for `step` in differentiable mode")
        steps.append(state["step"])
    return params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, has_complex


def step(opt, closure=None):
    """One differentiable step of every group (grad mode on, as torch's)."""
    loss = None
    with torch.set_grad_enabled(True):
        if closure is not None:
            loss = closure()
        for group in opt.param_groups:
            params, grads, m, v, vmax, steps, has_complex = init_group(opt, group)
            if not params:
                continue
            beta1, beta2 = group["betas"]
            fn = _adam_function(group.get("decoupled_weight_decay", False))
            fn(params, grads, m, v, vmax, steps, foreach=False, capturable=False,
               differentiable=True, fused=None, grad_scale=None, found_inf=None,
               has_complex=has_complex, amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2,
               lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
               maximize=group["maximize"])
    return loss


class DifferentiableAdam(torch.optim.Optimizer):
    """``FusedAdam(..., differentiable=True)``: torch.optim.Adam's layout and its
    differentiable single-tensor step (``step`` above). ``defaults``: the param groups'
    hyperparameters and torch's flags, checked (``build``)."""

    def add_param_group(self, param_group: dict) -> None:
        group = {**self.defaults, **param_group}
        check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        super().add_param_group(param_group)

    def step(self, closure=None):
        """One differentiable step of every group (grad mode on, as torch's)."""
        return step(self, closure)

    def state_dict(self, compact: bool | None = None) -> dict:
        """torch's. ``compact=True`` (or inside ``compact_state_dicts()``) is refused:
        it holds the codes of a low-bit store."""
        compact = compact_state.wanted(self, compact)
        check_flag("compact", compact)
        if compact:
            raise ValueError("state_dict(compact=True) holds the codes of a low-bit store; "
                             "a differentiable optimizer keeps torch's own state")
        return super().state_dict()


class BuildsDifferentiable:
    """A base of FusedAdam's: ``FusedAdam(..., differentiable=True)`` (FusedAdamW's too)
    is a ``DifferentiableAdam`` (``build``). After torch.optim.Optimizer in FusedAdam's
    bases, so that ``inspect.signature(FusedAdam)`` is its ``__init__``'s, not this
    ``__new__``'s. ``_builds_differentiable``: False where the constructor refuses the
    flag itself (ZeroAdam)."""

    _builds_differentiable = True

    def __new__(cls, *args, **kwargs):
        flag = kwargs.get("differentiable", False)  # a flag as check_flag takes it; else refused there
        if isinstance(flag, int) and flag == 1 and cls._builds_differentiable:
            return build(cls, args, kwargs)
        return super().__new__(cls)


def build(cls, args: tuple, kwargs: dict) -> DifferentiableAdam:
    """What ``cls(*args, **kwargs)`` (a FusedAdam class, ``differentiable=True``) is: its
    arguments taken as ``cls.__init__`` takes them (FusedAdamW's defaults and its
    decoupled weight decay included; the rest at its bases' constructors' defaults),
    checked in FusedAdam's order with its messages, then a DifferentiableAdam of them."""
    try:
        bound = inspect.signature(cls.__init__).bind(None, *args, **kwargs)
    except TypeError as exc:  # as the interpreter words it for a call of cls.__init__
        raise TypeError(f"{cls.__name__}.__init__() {exc}") from None
    bound.apply_defaults()
    given = dict(list(bound.arguments.items())[1:])  # self left out
    given.update(given.pop("kwargs", {}))
    names, full = set(), {}
    for klass in reversed(cls.__mro__):  # FusedAdam's constructor's defaults, then FusedAdamW's
        if issubclass(klass, BuildsDifferentiable) and "__init__" in vars(klass):
            for name, p in inspect.signature(klass.__init__).parameters.items():
                if p.kind is not inspect.Parameter.VAR_KEYWORD:
                    names.add(name)
                    if p.default is not inspect.Parameter.empty:
                        full[name] = p.default
    a = {**full, **given, "decoupled_weight_decay": cls._decoupled_weight_decay
         or given.get("decoupled_weight_decay", False)}
    unknown = sorted(set(a) - names)
    if unknown:
        raise TypeError(f"{cls.__name__}.__init__() got an unexpected keyword argument {unknown[0]!r}")
    hyper = adam_hyperparameters(a["lr"], a["betas"], a["eps"], a["weight_decay"], a["amsgrad"],
                                 a["maximize"], a["decoupled_weight_decay"], foreach=a["foreach"],
                                 fused=a["fused"], capturable=a["capturable"], differentiable=True)
    check_params_argument(a["params"], cls.__name__)
    spec = Spec.build(master_weights=a["master_weights"], backend=a["backend"],
                      max_grad_norm=a["max_grad_norm"], differentiable=True, moments=a["moments"],
                      capturable=a["capturable"]).with_offload(a["offload"], a["offload_fraction"])
    if isinstance(a["params"], (list, tuple)):
        for group in a["params"]:  # a group's own formats, refused as the constructor's are
            if isinstance(group, dict):
                spec.for_group(group)
    return DifferentiableAdam(a["params"], {**hyper, **group_keys(True, **spec.capture.keywords)})
