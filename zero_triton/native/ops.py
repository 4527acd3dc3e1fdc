"""The fused step as one PyTorch operator: ``torch.ops.zero_triton.adam_step_``.

``import zero_triton.native.ops`` registers it (``torch.library``). It is the kernel every
backend runs (``zero_triton.native.backends``: one Adam/AdamW step over flat tensors, in
place), as an operator that torch.compile traces whole, ``fullgraph=True`` included: a
fake implementation gives the compiler its effect (the tensors it writes, nothing
returned) without running it. It is for code that traces its own update over flat
buffers, as ``torch._fused_adamw_`` is torch's.

``FusedAdam.step`` does not go through it: in eager, an operator's dispatch costs ~20 us
a call (the kernel's own binding ~2 us), and under torch.compile the step runs as it is,
like torch.optim.Adam(fused=True)'s kernel (see ``FusedAdam._fused_step``).
"""
from __future__ import annotations

from typing import Optional

import torch

from zero_triton.kernels.args import Operands, StepArgs
from zero_triton.native import backends

_MUTATED = ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "param_lp")
_functions: dict = {}


@torch.library.custom_op("zero_triton::adam_step_", mutates_args=_MUTATED)
def adam_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, max_exp_avg_sq: Optional[torch.Tensor],
               param_lp: Optional[torch.Tensor], step: torch.Tensor, lr: torch.Tensor,
               beta1: float, beta2: float, eps: float, weight_decay: float, adamw: bool,
               amsgrad: bool, maximize: bool, grad_scale: Optional[torch.Tensor] = None,
               found_inf: Optional[torch.Tensor] = None, clip_coef: Optional[torch.Tensor] = None,
               backend: str = "auto") -> None:
    """One fused Adam (``adamw=False``) or AdamW step over flat tensors, in place.

    param: float32 [n], the fp32 master or parameter; grad: float32/float16/bfloat16 [n];
    exp_avg, exp_avg_sq (max_exp_avg_sq when amsgrad): float32 [n]; param_lp: a
    float16/bfloat16 [n] copy of param to write, or None; step (already incremented),
    lr: float32 [1]; grad_scale divides the gradient, clip_coef multiplies it, and a
    nonzero found_inf skips the step: float32 [1] or None. backend: as FusedAdam's.
    """
    _check(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, param_lp, amsgrad)
    name = backends.resolve(backend, param.device)
    fn = _functions.get(name)
    if fn is None:
        fn = _functions[name] = backends.step_function(name)
    # The operator's schema admits tensors and scalars only: its arguments become the
    # records every backend takes here, once.
    fn(Operands(param, grad, (exp_avg, exp_avg_sq, max_exp_avg_sq), param_lp, step, lr),
       StepArgs(beta1, beta2, eps, weight_decay, adamw, amsgrad, maximize, grad_scale,
                found_inf, clip_coef))


@adam_step_.register_fake
def _(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, param_lp, step, lr, beta1, beta2,
      eps, weight_decay, adamw, amsgrad, maximize, grad_scale=None, found_inf=None,
      clip_coef=None, backend="auto") -> None:
    _check(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, param_lp, amsgrad)


def _check(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, param_lp, amsgrad) -> None:
    """What the kernels assume of the shapes (each backend checks dtypes and layout)."""
    n = param.numel()
    tensors = {"grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq,
               "max_exp_avg_sq": max_exp_avg_sq if amsgrad else None, "param_lp": param_lp}
    if amsgrad and max_exp_avg_sq is None:
        raise ValueError("zero_triton::adam_step_: amsgrad=True needs `max_exp_avg_sq`")
    for name, t in tensors.items():
        if t is not None and t.numel() != n:
            raise ValueError(f"zero_triton::adam_step_: `{name}` has {t.numel()} elements, "
                             f"`param` {n}; every tensor of the step covers the same elements")
