"""The arguments of one fused step, as every backend takes them: ``Operands`` (the
tensors of one launch) and ``StepArgs`` (the step's scalars and flags, one frozen record),
the Python side of ``csrc/adam_args.h``'s ``AdamArgs``.

Every step function (``zero_triton.native.backends.STEPS``) is ``step(ops, args)``; a
list launch is ``step_list([ops, ...], args)``. A new state format brings a kernel that
reads its own ``moments`` operands and a registry row: no signature changes.

Imports neither Triton nor the rest of ``zero_triton``: the kernels' launchers read it.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import torch


class Operands(NamedTuple):
    """The tensors of one launch over ``n`` elements.

    param: float32 [n], the fp32 master or fp32 parameter; or the bf16 parameter itself
    (``StepArgs.stochastic``, or beside its int16 ``remainder``). grad: fp32/fp16/bf16 [n].
    moments: the moment store's operands (``MomentStore.operands``): fp32
    ``(exp_avg, exp_avg_sq, max_exp_avg_sq or None)``, bf16 ``(exp_avg, exp_avg_sq, None)``,
    int8 ``(codes, codes, scales [blocks, 2])``. param_lp: the fp16/bf16 copy written
    from an fp32 ``param``, or None. step (already incremented), lr: float32 [1].
    remainder: int16 [n], the low half of the master whose high half is ``param``
    (master_weights="remainder"), or None. scratch: float32 [n], the torch backend's
    work space (so that it allocates nothing), or None.
    """
    param: torch.Tensor
    grad: torch.Tensor
    moments: tuple
    param_lp: Optional[torch.Tensor]
    step: torch.Tensor
    lr: torch.Tensor
    remainder: Optional[torch.Tensor] = None
    scratch: Optional[torch.Tensor] = None


@dataclasses.dataclass(frozen=True)
class StepArgs:
    """The scalars and flags of one step: the param group's hyperparameters (floats as
    Python gives them: the kernels round them once), the optional device scalars
    (float32 [1]: ``grad_scale`` divides the gradient, ``clip_coef`` multiplies it, a
    nonzero ``found_inf`` skips the step; read on the device, no host sync) and how the
    parameter is rounded: ``stochastic`` (master_weights="stochastic"), keyed with the
    bf16 moments' rounding by ``seed`` and ``index`` (the canonical index of element 0)."""
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw: bool
    amsgrad: bool = False
    maximize: bool = False
    grad_scale: Optional[torch.Tensor] = None
    found_inf: Optional[torch.Tensor] = None
    clip_coef: Optional[torch.Tensor] = None
    stochastic: bool = False
    seed: int = 0
    index: int = 0

    def at(self, index: int) -> "StepArgs":
        """These arguments for a launch whose first element has canonical index ``index``."""
        return self if index == self.index else dataclasses.replace(self, index=int(index))

    def replace(self, **changes) -> "StepArgs":
        return dataclasses.replace(self, **changes)

    def hyper(self) -> dict:
        """The hyperparameters by name (beta1, beta2, eps, weight_decay)."""
        return dict(beta1=self.beta1, beta2=self.beta2, eps=self.eps, weight_decay=self.weight_decay)
