"""The fused Adam/AdamW step as one Triton kernel per flat shard, then its launcher.

One launch reads the gradient (fp32/fp16/bf16), the fp32 master (or fp32 parameter),
exp_avg and exp_avg_sq, and writes master, moments and the low-precision parameter:
28 bytes per parameter for fp32, the same for bf16 params + bf16 grads + fp32 master.

Runtime values (lr, step, grad_scale, found_inf, clip_coef) are read from device
pointers: a scheduler changing lr or a GradScaler skipping a step neither recompiles
nor syncs the host.
"""
import math
import os

import torch
import triton
import triton.language as tl

# Triton decides interpreted vs compiled when a kernel is decorated, i.e. at import.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _one_minus_pow(log_beta, t):
    # 1 - beta**t as -expm1(t * log(beta)). Early in training t*log(beta) is tiny
    # (beta2 = 0.999, t = 1: 1e-3) and 1 - exp(x) in fp32 would lose ~4 digits of the
    # bias correction; the Taylor series keeps full fp32 precision there.
    x = t * log_beta
    series = x * (1.0 + x * (0.5 + x * (1.0 / 6.0 + x * (1.0 / 24.0 + x * (1.0 / 120.0 + x * (1.0 / 720.0 + x * (1.0 / 5040.0)))))))
    return tl.where(x > -0.25, -series, 1.0 - tl.exp(x))


@triton.jit
def _adam_kernel(
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr, param_lp_ptr,
    step_ptr, lr_ptr, grad_scale_ptr, found_inf_ptr, clip_coef_ptr,
    n_elements, beta1, beta2, log_beta1, log_beta2, eps, weight_decay,
    # Flags are constexpr so that the branches not taken vanish from the binary.
    ADAMW: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
    HAS_WEIGHT_DECAY: tl.constexpr, HAS_PARAM_LP: tl.constexpr, PARAM_LP_BF16: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr, HAS_CLIP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    if HAS_FOUND_INF:
        # GradScaler saw inf/nan: the whole step is skipped, on the device.
        if tl.load(found_inf_ptr) != 0.0:
            return
    # 64-bit offsets: a shard may hold more than 2**31 elements.
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements

    lr = tl.load(lr_ptr)
    t = tl.load(step_ptr)
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(param_ptr + offs, mask=mask, other=0.0)
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)

    if HAS_GRAD_SCALE:
        g = g / tl.load(grad_scale_ptr)
    if HAS_CLIP:
        g = g * tl.load(clip_coef_ptr)
    if MAXIMIZE:
        g = -g
    if HAS_WEIGHT_DECAY:
        if ADAMW:
            p = p * (1.0 - lr * weight_decay)
        else:
            g = g + weight_decay * p

    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    if AMSGRAD:
        vmax = tl.maximum(tl.load(max_exp_avg_sq_ptr + offs, mask=mask, other=0.0), v)
        tl.store(max_exp_avg_sq_ptr + offs, vmax, mask=mask)
    else:
        vmax = v

    bias_correction1 = _one_minus_pow(log_beta1, t)
    bias_correction2_sqrt = tl.sqrt(_one_minus_pow(log_beta2, t))
    step_size = lr / bias_correction1
    # eps is added after the bias correction, as torch.optim.Adam does.
    denom = tl.sqrt(vmax) / bias_correction2_sqrt + eps
    p = p - step_size * (m / denom)

    tl.store(param_ptr + offs, p, mask=mask)
    tl.store(exp_avg_ptr + offs, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
    if HAS_PARAM_LP:
        if PARAM_LP_BF16:
            # Round to nearest even with integer ops: the same bits on every device
            # (the Triton CPU interpreter truncates in .to(bfloat16)).
            bits = p.to(tl.uint32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            rounded = tl.where(p != p, 0x7FC0, rounded)
            tl.store(param_lp_ptr + offs, rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
        else:
            tl.store(param_lp_ptr + offs, p.to(tl.float16), mask=mask)


_GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(name, t, numel, dtypes, device):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"`{name}` must be a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes or not t.is_contiguous():
        want = "/".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(
            f"`{name}` must be {want} and contiguous, got {t.dtype} "
            f"{'contiguous' if t.is_contiguous() else 'non-contiguous'}; "
            "in-place targets are never copied, pass the flat buffer itself")
    if t.numel() != numel:
        raise ValueError(f"`{name}` has {t.numel()} elements, expected {numel}")
    if t.device != device:
        raise ValueError(f"`{name}` is on {t.device}, expected {device} like `param`")


def _block_and_warps(n):
    if INTERPRET:
        # The interpreter pays ~1 ms per program instance: few, large blocks.
        return max(16, min(1 << 17, triton.next_power_of_2(max(n, 1)))), 4
    return 2048, 8


def adam_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, param_lp, step, lr, *,
              beta1, beta2, eps, weight_decay, adamw, amsgrad, maximize,
              grad_scale=None, found_inf=None, clip_coef=None):
    """One fused Adam/AdamW step over a flat shard, in place.

    param: float32 [n] master or fp32 parameter; grad: fp32/fp16/bf16 [n];
    exp_avg, exp_avg_sq (and max_exp_avg_sq when amsgrad): float32 [n];
    param_lp: fp16/bf16 [n] receiving param rounded to nearest even, or None;
    step, lr: float32 [1] on the device (step already incremented);
    grad_scale (divides the grad), found_inf (skip when != 0), clip_coef (multiplies
    the grad): float32 [1] on the device, or None.
    """
    n = param.numel()
    device = param.device
    _check("param", param, n, (torch.float32,), device)
    _check("grad", grad, n, _GRAD_DTYPES, device)
    _check("exp_avg", exp_avg, n, (torch.float32,), device)
    _check("exp_avg_sq", exp_avg_sq, n, (torch.float32,), device)
    if amsgrad:
        if max_exp_avg_sq is None:
            raise ValueError("amsgrad=True needs `max_exp_avg_sq`")
        _check("max_exp_avg_sq", max_exp_avg_sq, n, (torch.float32,), device)
    if param_lp is not None:
        _check("param_lp", param_lp, n, (torch.float16, torch.bfloat16), device)
    for name, t in (("step", step), ("lr", lr), ("grad_scale", grad_scale),
                    ("found_inf", found_inf), ("clip_coef", clip_coef)):
        if t is not None:
            _check(name, t, 1, (torch.float32,), device)
    if device.type != "cuda" and not INTERPRET:
        raise RuntimeError(
            f"the Triton kernel got {device} tensors; Triton runs on CUDA tensors, or on CPU "
            "tensors with TRITON_INTERPRET=1 set before zero_triton is imported; "
            "otherwise use backend='cpu' or 'torch'")
    if n == 0:
        return
    block, warps = _block_and_warps(n)
    grid = (triton.cdiv(n, block),)
    dummy = param  # never dereferenced: its branch is compiled out
    _adam_kernel[grid](
        param, grad, exp_avg, exp_avg_sq,
        max_exp_avg_sq if amsgrad else dummy,
        param_lp if param_lp is not None else dummy,
        step, lr,
        grad_scale if grad_scale is not None else dummy,
        found_inf if found_inf is not None else dummy,
        clip_coef if clip_coef is not None else dummy,
        n, float(beta1), float(beta2),
        math.log(beta1) if beta1 > 0 else -math.inf,
        math.log(beta2) if beta2 > 0 else -math.inf,
        float(eps), float(weight_decay),
        ADAMW=bool(adamw), AMSGRAD=bool(amsgrad), MAXIMIZE=bool(maximize),
        HAS_WEIGHT_DECAY=weight_decay != 0, HAS_PARAM_LP=param_lp is not None,
        PARAM_LP_BF16=param_lp is not None and param_lp.dtype == torch.bfloat16,
        HAS_GRAD_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None,
        HAS_CLIP=clip_coef is not None,
        BLOCK=block, num_warps=warps,
    )
