"""``differentiable=True``: autograd through the optimizer step.

Meta-learning and learned optimizers differentiate the updated parameters (and moments)
with respect to the gradients, the hyperparameters or earlier parameters. A fused kernel
that writes its buffers in place is opaque to autograd, so in this mode FusedAdam keeps
torch.optim.Adam's own layout — one state dict entry of tensors per parameter, the
parameters where the user made them (non-leaf tensors allowed, as in torch) — and steps
them with torch's functional single-tensor Adam with ``differentiable=True``: the same
results, and the same graph, as ``torch.optim.Adam(differentiable=True)``.
"""
from __future__ import annotations

import torch

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
