"""The fused Adam/AdamW step over bfloat16 moments (``moments="bf16"``) as one Triton
kernel: ``adam._adam_update`` on the widened moments, written back by stochastic rounding
from the counter-based generator of ``zero_triton.kernels.rounding`` (keyed by the seed,
the step, the moment and the element's canonical index). 20 bytes per parameter for fp32
parameters where the fp32 moments take 28.
"""
import torch
import triton
import triton.language as tl

from zero_triton.kernels import rounding
from zero_triton.kernels.adam import (INTERPRET, _adam_update, _check, _check_step, _flags,
                                      _hyper, _key, _load_param, _param_flags, _scalars, _second_half,
                                      _store_bf16_stochastic, _store_param)
from zero_triton.kernels.args import Operands, StepArgs


@triton.jit
def _adam_bf16_kernel(
    param_ptr, grad_ptr, m_ptr, v_ptr, param_lp_ptr,
    step_ptr, lr_ptr, grad_scale_ptr, found_inf_ptr, clip_coef_ptr,
    n_elements, seed, index0, beta1, beta2, log_beta1, log_beta2, eps, weight_decay,
    ADAMW: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr,
    HAS_PARAM_LP: tl.constexpr, PARAM_LP_BF16: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr, HAS_CLIP: tl.constexpr, FIRST_MIX: tl.constexpr,
    SECOND_MIX: tl.constexpr, PARAM_MODE: tl.constexpr, PARAM_MIX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    if HAS_FOUND_INF:
        if tl.load(found_inf_ptr) != 0.0:
            return
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    lr = tl.load(lr_ptr)
    t = tl.load(step_ptr)
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = _load_param(param_ptr + offs, param_lp_ptr + offs, mask, PARAM_MODE)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p, m, v, _ = _adam_update(p, g, m, v, v, lr, t, grad_scale_ptr, clip_coef_ptr,
                              beta1, beta2, log_beta1, log_beta2, eps, weight_decay,
                              ADAMW, False, MAXIMIZE, HAS_WEIGHT_DECAY, HAS_GRAD_SCALE, HAS_CLIP)
    step = t.to(tl.uint32)
    seed32 = seed.to(tl.uint32)
    index = index0 + offs
    _store_param(param_ptr + offs, param_lp_ptr + offs, p, mask, _key(seed32, step, PARAM_MIX),
                 index, PARAM_MODE, HAS_PARAM_LP, PARAM_LP_BF16)
    _store_bf16_stochastic(m_ptr + offs, m, _key(seed32, step, FIRST_MIX), index, mask)
    _store_bf16_stochastic(v_ptr + offs, v, _key(seed32, step, SECOND_MIX), index, mask)


def adam_bf16_step(ops: Operands, args: StepArgs):
    """``adam.adam_step`` over bfloat16 moments, in place: ``ops.moments`` are exp_avg,
    exp_avg_sq bfloat16 [n] and None (no amsgrad); ``args.seed`` and ``args.index`` (the
    canonical index of element 0) key their stochastic rounding."""
    param, grad, (exp_avg, exp_avg_sq, max_exp_avg_sq), param_lp = ops[:4]
    if args.amsgrad or max_exp_avg_sq is not None:
        raise ValueError("bf16 moments hold no amsgrad maximum; use moments='fp32'")
    n = param.numel()
    device = param.device
    _check_step(ops, args)
    _check("exp_avg", exp_avg, n, (torch.bfloat16,), device)
    _check("exp_avg_sq", exp_avg_sq, n, (torch.bfloat16,), device)
    if n == 0:
        return
    block = max(16, min(1 << 17, triton.next_power_of_2(n))) if INTERPRET else 2048
    dummy = param  # never dereferenced: its branch is compiled out
    _adam_bf16_kernel[(triton.cdiv(n, block),)](
        param, grad, exp_avg, exp_avg_sq,
        _second_half(ops, dummy), ops.step, ops.lr, *_scalars(args, dummy),
        n, int(args.seed) & 0xFFFFFFFF, int(args.index), *_hyper(args),
        **_flags(args, param_lp),
        FIRST_MIX=(rounding.FIRST_STREAM * rounding.M1) & rounding.MASK32,
        SECOND_MIX=(rounding.SECOND_STREAM * rounding.M1) & rounding.MASK32,
        **_param_flags(ops, args), BLOCK=block, num_warps=1 if INTERPRET else 8,
    )
