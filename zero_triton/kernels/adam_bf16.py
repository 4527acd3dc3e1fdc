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
from zero_triton.kernels.adam import (_GRAD_DTYPES, INTERPRET, _adam_update, _check,
                                      _check_scalars_and_device, _flags, _hyper,
                                      _store_low_precision)


@triton.jit
def _fmix32(x):
    x ^= x >> 16
    x *= 0x85EBCA6B
    x ^= x >> 13
    x *= 0xC2B2AE35
    x ^= x >> 16
    return x


@triton.jit
def _key(seed, step, STREAM_MIX: tl.constexpr):
    """rounding.key on uint32 scalars (``STREAM_MIX``: the stream times 0x85EBCA6B, mod 2^32)."""
    return _fmix32(_fmix32(seed) ^ (step * 0x9E3779B1) ^ STREAM_MIX)


@triton.jit
def _store_bf16_stochastic(ptrs, x, key, index, mask):
    """rounding.to_bf16_stochastic of ``x`` with the bits of elements ``index`` (int64)."""
    lo = (index & 0xFFFFFFFF).to(tl.uint32)
    hi = (index >> 32).to(tl.uint32)
    bits = _fmix32(lo ^ key ^ (hi * 0xC2B2AE35))
    u = x.to(tl.uint32, bitcast=True)
    out = (u + (bits & 0xFFFF)) >> 16
    out = tl.where((u & 0x7FFFFFFF) == 0x7F800000, u >> 16, out)
    out = tl.where(x != x, 0x7FC0, out)
    tl.store(ptrs, out.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)


@triton.jit
def _adam_bf16_kernel(
    param_ptr, grad_ptr, m_ptr, v_ptr, param_lp_ptr,
    step_ptr, lr_ptr, grad_scale_ptr, found_inf_ptr, clip_coef_ptr,
    n_elements, seed, index0, beta1, beta2, log_beta1, log_beta2, eps, weight_decay,
    ADAMW: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr,
    HAS_PARAM_LP: tl.constexpr, PARAM_LP_BF16: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr, HAS_CLIP: tl.constexpr, FIRST_MIX: tl.constexpr,
    SECOND_MIX: tl.constexpr, BLOCK: tl.constexpr,
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
    p = tl.load(param_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p, m, v, _ = _adam_update(p, g, m, v, v, lr, t, grad_scale_ptr, clip_coef_ptr,
                              beta1, beta2, log_beta1, log_beta2, eps, weight_decay,
                              ADAMW, False, MAXIMIZE, HAS_WEIGHT_DECAY, HAS_GRAD_SCALE, HAS_CLIP)
    tl.store(param_ptr + offs, p, mask=mask)
    if HAS_PARAM_LP:
        _store_low_precision(param_lp_ptr + offs, p, mask, PARAM_LP_BF16)
    step = t.to(tl.uint32)
    seed32 = seed.to(tl.uint32)
    index = index0 + offs
    _store_bf16_stochastic(m_ptr + offs, m, _key(seed32, step, FIRST_MIX), index, mask)
    _store_bf16_stochastic(v_ptr + offs, v, _key(seed32, step, SECOND_MIX), index, mask)


def adam_bf16_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, param_lp, step, lr, *,
                   beta1, beta2, eps, weight_decay, adamw, amsgrad, maximize,
                   grad_scale=None, found_inf=None, clip_coef=None, seed=0, index=0):
    """``adam.adam_step`` over bfloat16 moments, in place: exp_avg, exp_avg_sq bfloat16
    [n] (``max_exp_avg_sq`` must be None: no amsgrad); ``seed`` and ``index`` (the
    canonical index of element 0) key their stochastic rounding."""
    if amsgrad or max_exp_avg_sq is not None:
        raise ValueError("bf16 moments hold no amsgrad maximum; use moments='fp32'")
    n = param.numel()
    device = param.device
    _check("param", param, n, (torch.float32,), device)
    _check("grad", grad, n, _GRAD_DTYPES, device)
    _check("exp_avg", exp_avg, n, (torch.bfloat16,), device)
    _check("exp_avg_sq", exp_avg_sq, n, (torch.bfloat16,), device)
    if param_lp is not None:
        _check("param_lp", param_lp, n, (torch.float16, torch.bfloat16), device)
    _check_scalars_and_device(device, step=step, lr=lr, grad_scale=grad_scale,
                              found_inf=found_inf, clip_coef=clip_coef)
    if n == 0:
        return
    block = max(16, min(1 << 17, triton.next_power_of_2(n))) if INTERPRET else 2048
    dummy = param  # never dereferenced: its branch is compiled out
    _adam_bf16_kernel[(triton.cdiv(n, block),)](
        param, grad, exp_avg, exp_avg_sq, param_lp if param_lp is not None else dummy, step, lr,
        grad_scale if grad_scale is not None else dummy,
        found_inf if found_inf is not None else dummy,
        clip_coef if clip_coef is not None else dummy,
        n, int(seed) & 0xFFFFFFFF, int(index), *_hyper(beta1, beta2, eps, weight_decay),
        **_flags(adamw, maximize, weight_decay, param_lp, grad_scale, found_inf, clip_coef),
        FIRST_MIX=(rounding.FIRST_STREAM * rounding.M1) & rounding.MASK32,
        SECOND_MIX=(rounding.SECOND_STREAM * rounding.M1) & rounding.MASK32,
        BLOCK=block, num_warps=1 if INTERPRET else 8,
    )
