"""The fused Adam/AdamW step as one Triton kernel per flat shard, then its launcher; and
the same step over a list of tensors in one launch (``adam_step_list``: the local shards
of DTensor parameters, which stay where their engine keeps them).

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

from zero_triton.kernels.args import Operands, StepArgs

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
def _adam_update(
    p, g, m, v, vmax, lr, t, grad_scale_ptr, clip_coef_ptr,
    beta1, beta2, log_beta1, log_beta2, eps, weight_decay,
    ADAMW: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
    HAS_WEIGHT_DECAY: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr,
):
    """The update of one block: (parameter, exp_avg, exp_avg_sq, max_exp_avg_sq) from
    the loaded fp32 values (``vmax``: the old max_exp_avg_sq, read only with AMSGRAD)."""
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
        vmax = tl.maximum(vmax, v)
    else:
        vmax = v

    bias_correction1 = _one_minus_pow(log_beta1, t)
    bias_correction2_sqrt = tl.sqrt(_one_minus_pow(log_beta2, t))
    step_size = lr / bias_correction1
    # eps is added after the bias correction, as torch.optim.Adam does.
    denom = tl.sqrt(vmax) / bias_correction2_sqrt + eps
    p = p - step_size * (m / denom)
    return p, m, v, vmax


@triton.jit
def _step_block(
    param_ptrs, param_lp_ptrs, g, exp_avg_ptrs, exp_avg_sq_ptrs, max_exp_avg_sq_ptrs, mask,
    lr, t, grad_scale_ptr, clip_coef_ptr, beta1, beta2, log_beta1, log_beta2, eps,
    weight_decay, ADAMW: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
    HAS_WEIGHT_DECAY: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr,
    PARAM_MODE: tl.constexpr,
):
    """One block of the step: load the parameter (the fp32 master, or the bf16 parameter
    itself: ``_load_param``) and the moments at the given pointers, update them from
    ``g`` (fp32), store the moments; returns the new parameter, for the caller to store
    (``_store_param``)."""
    p = _load_param(param_ptrs, param_lp_ptrs, mask, PARAM_MODE)
    m = tl.load(exp_avg_ptrs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptrs, mask=mask, other=0.0)
    vmax = v
    if AMSGRAD:
        vmax = tl.load(max_exp_avg_sq_ptrs, mask=mask, other=0.0)
    p, m, v, vmax = _adam_update(p, g, m, v, vmax, lr, t, grad_scale_ptr, clip_coef_ptr,
                                 beta1, beta2, log_beta1, log_beta2, eps, weight_decay,
                                 ADAMW, AMSGRAD, MAXIMIZE, HAS_WEIGHT_DECAY, HAS_GRAD_SCALE,
                                 HAS_CLIP)
    tl.store(exp_avg_ptrs, m, mask=mask)
    tl.store(exp_avg_sq_ptrs, v, mask=mask)
    if AMSGRAD:
        tl.store(max_exp_avg_sq_ptrs, vmax, mask=mask)
    return p


@triton.jit
def _store_low_precision(ptrs, p, mask, PARAM_LP_BF16: tl.constexpr):
    if PARAM_LP_BF16:
        # Round to nearest even with integer ops: the same bits on every device
        # (the Triton CPU interpreter truncates in .to(bfloat16)).
        bits = p.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(p != p, 0x7FC0, rounded)
        tl.store(ptrs, rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptrs, p.to(tl.float16), mask=mask)


@triton.jit
def _fmix32(x):
    """MurmurHash3's 32-bit finaliser (``zero_triton.kernels.rounding``)."""
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
def _bits_at(key, index):
    """rounding.random_bits_at: 32 random bits (uint32) of canonical indices ``index``."""
    lo = (index & 0xFFFFFFFF).to(tl.uint32)
    hi = (index >> 32).to(tl.uint32)
    return _fmix32(lo ^ key ^ (hi * 0xC2B2AE35))


@triton.jit
def _bf16_stochastic_bits(x, bits):
    """rounding.to_bf16_stochastic: the bfloat16 bits (uint32) of ``x`` rounded up with
    probability the fraction dropped (the low 16 of ``bits``); NaN 0x7FC0, infinities stay."""
    u = x.to(tl.uint32, bitcast=True)
    out = (u + (bits & 0xFFFF)) >> 16
    out = tl.where((u & 0x7FFFFFFF) == 0x7F800000, u >> 16, out)
    return tl.where(x != x, 0x7FC0, out)


@triton.jit
def _store_bf16_stochastic(ptrs, x, key, index, mask):
    """rounding.to_bf16_stochastic of ``x`` with the bits of elements ``index`` (int64)."""
    out = _bf16_stochastic_bits(x, _bits_at(key, index))
    tl.store(ptrs, out.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)


# How the parameter is stepped (``PARAM_MODE``, csrc/adam_args.h's ParamMode): the fp32
# master (and its optional fp16/bf16 copy at the ``param_lp`` pointers), or the bf16
# parameter itself, rounded back stochastically (master_weights="stochastic") or with its
# int16 remainder at the ``param_lp`` pointers (master_weights="remainder",
# zero_triton.kernels.remainder), or its int8 one (master_weights="remainder8": the
# master rounded to 24 bits, then split).
MODE_MASTER, MODE_STOCHASTIC, MODE_REMAINDER, MODE_REMAINDER8 = 0, 1, 2, 3
REMAINDER_MODES = {torch.int16: MODE_REMAINDER, torch.int8: MODE_REMAINDER8}


@triton.jit
def _load_param(ptrs, lp_ptrs, mask, PARAM_MODE: tl.constexpr):
    """The parameter (or master) in float32."""
    if PARAM_MODE == 1:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if PARAM_MODE >= 2:  # remainder.join (int8: its high byte)
        hi = tl.load(ptrs, mask=mask, other=0.0).to(tl.uint16, bitcast=True).to(tl.uint32)
        r = tl.load(lp_ptrs, mask=mask, other=0).to(tl.int32)
        if PARAM_MODE == 3:
            r = r * 256
        hi = (hi - (r < 0).to(tl.uint32)) & 0xFFFF
        bits = (hi << 16) | (r.to(tl.uint32, bitcast=True) & 0xFFFF)
        return bits.to(tl.float32, bitcast=True)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _store_param(ptrs, lp_ptrs, p, mask, key, index, PARAM_MODE: tl.constexpr,
                 HAS_PARAM_LP: tl.constexpr, PARAM_LP_BF16: tl.constexpr):
    """The stepped parameter back: the master (and its low-precision copy), or the bf16
    parameter, rounded stochastically or split with its remainder."""
    if PARAM_MODE == 1:
        _store_bf16_stochastic(ptrs, p, key, index, mask)
    elif PARAM_MODE == 2:  # remainder.split
        u = p.to(tl.uint32, bitcast=True)
        hi = tl.where(p != p, (u >> 16) | 0x40, (u + 0x8000) >> 16)
        tl.store(ptrs, hi.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
        tl.store(lp_ptrs, (u & 0xFFFF).to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    elif PARAM_MODE == 3:  # remainder.split(remainder.round24(p), torch.int8)
        u = p.to(tl.uint32, bitcast=True)
        u = tl.where(p != p, u, (u + 0x7F + ((u >> 8) & 1)) & 0xFFFFFF00)
        hi = tl.where(p != p, (u >> 16) | 0x40, (u + 0x8000) >> 16)
        tl.store(ptrs, hi.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
        tl.store(lp_ptrs, ((u >> 8) & 0xFF).to(tl.uint8).to(tl.int8, bitcast=True), mask=mask)
    else:
        tl.store(ptrs, p, mask=mask)
        if HAS_PARAM_LP:
            _store_low_precision(lp_ptrs, p, mask, PARAM_LP_BF16)


@triton.jit
def _adam_kernel(
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr, param_lp_ptr,
    step_ptr, lr_ptr, grad_scale_ptr, found_inf_ptr, clip_coef_ptr,
    n_elements, seed, index0, beta1, beta2, log_beta1, log_beta2, eps, weight_decay,
    # Flags are constexpr so that the branches not taken vanish from the binary.
    ADAMW: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
    HAS_WEIGHT_DECAY: tl.constexpr, HAS_PARAM_LP: tl.constexpr, PARAM_LP_BF16: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr, HAS_CLIP: tl.constexpr,
    PARAM_MODE: tl.constexpr, PARAM_MIX: tl.constexpr, BLOCK: tl.constexpr,
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
    p = _step_block(param_ptr + offs, param_lp_ptr + offs, g, exp_avg_ptr + offs,
                    exp_avg_sq_ptr + offs, max_exp_avg_sq_ptr + offs, mask, lr, t,
                    grad_scale_ptr, clip_coef_ptr, beta1, beta2, log_beta1, log_beta2, eps,
                    weight_decay, ADAMW, AMSGRAD, MAXIMIZE, HAS_WEIGHT_DECAY, HAS_GRAD_SCALE,
                    HAS_CLIP, PARAM_MODE)
    _store_param(param_ptr + offs, param_lp_ptr + offs, p, mask,
                 _key(seed.to(tl.uint32), t.to(tl.uint32), PARAM_MIX), index0 + offs,
                 PARAM_MODE, HAS_PARAM_LP, PARAM_LP_BF16)


@triton.jit
def _adam_list_kernel(
    table_ptr, tiles_ptr, lr_ptr, grad_scale_ptr, found_inf_ptr, clip_coef_ptr,
    beta1, beta2, log_beta1, log_beta2, eps, weight_decay,
    ADAMW: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
    HAS_WEIGHT_DECAY: tl.constexpr, HAS_PARAM_LP: tl.constexpr, PARAM_LP_BF16: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr, HAS_CLIP: tl.constexpr,
    GRAD_KIND: tl.constexpr, BLOCK: tl.constexpr,
):
    """The same step over a list of tensors in one launch: program ``i`` updates BLOCK
    elements of one tensor, from element ``tiles[i, 1]`` of tensor ``tiles[i, 0]``, whose
    row of ``table`` holds the addresses of its parameter (fp32), gradient
    (GRAD_KIND: 0 fp32, 1 fp16, 2 bf16), moments, low-precision copy, step count, and
    its element count (columns as ``_row`` writes them)."""
    if HAS_FOUND_INF:
        if tl.load(found_inf_ptr) != 0.0:
            return
    pid = tl.program_id(0).to(tl.int64)
    row = table_ptr + tl.load(tiles_ptr + 2 * pid) * 8
    offs = tl.load(tiles_ptr + 2 * pid + 1) + tl.arange(0, BLOCK)
    mask = offs < tl.load(row + 7)
    param_ptr = tl.load(row + 0).to(tl.pointer_type(tl.float32))
    exp_avg_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    exp_avg_sq_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    if GRAD_KIND == 1:
        g = tl.load(tl.load(row + 1).to(tl.pointer_type(tl.float16)) + offs, mask=mask, other=0.0)
    elif GRAD_KIND == 2:
        g = tl.load(tl.load(row + 1).to(tl.pointer_type(tl.bfloat16)) + offs, mask=mask, other=0.0)
    else:
        g = tl.load(tl.load(row + 1).to(tl.pointer_type(tl.float32)) + offs, mask=mask, other=0.0)
    g = g.to(tl.float32)

    lr = tl.load(lr_ptr)
    t = tl.load(tl.load(row + 6).to(tl.pointer_type(tl.float32)))
    max_exp_avg_sq_ptr = exp_avg_sq_ptr  # never read without AMSGRAD
    if AMSGRAD:
        max_exp_avg_sq_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    p = _step_block(param_ptr + offs, param_ptr + offs, g, exp_avg_ptr + offs,
                    exp_avg_sq_ptr + offs, max_exp_avg_sq_ptr + offs, mask, lr, t,
                    grad_scale_ptr, clip_coef_ptr, beta1, beta2, log_beta1, log_beta2, eps,
                    weight_decay, ADAMW, AMSGRAD, MAXIMIZE, HAS_WEIGHT_DECAY, HAS_GRAD_SCALE,
                    HAS_CLIP, 0)
    tl.store(param_ptr + offs, p, mask=mask)
    if HAS_PARAM_LP:
        if PARAM_LP_BF16:
            lp_ptr = tl.load(row + 5).to(tl.pointer_type(tl.bfloat16))
        else:
            lp_ptr = tl.load(row + 5).to(tl.pointer_type(tl.float16))
        _store_low_precision(lp_ptr + offs, p, mask, PARAM_LP_BF16)


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


def _check_scalars_and_device(device, **scalars) -> None:
    """The 1-element float32 scalars given (None: absent) on ``device``, and a device
    Triton can run on here."""
    for name, t in scalars.items():
        if t is not None:
            _check(name, t, 1, (torch.float32,), device)
    if device.type != "cuda" and not INTERPRET:
        raise RuntimeError(
            f"the Triton kernel got {device} tensors; Triton runs on CUDA tensors, or on CPU "
            "tensors with TRITON_INTERPRET=1 set before zero_triton is imported; "
            "otherwise use backend='cpu' or 'torch'")


def _hyper(args: StepArgs) -> tuple:
    """The kernels' runtime hyperparameters: beta1, beta2, their logs, eps, weight decay."""
    beta1, beta2 = float(args.beta1), float(args.beta2)
    return (beta1, beta2, math.log(beta1) if beta1 > 0 else -math.inf,
            math.log(beta2) if beta2 > 0 else -math.inf, float(args.eps), float(args.weight_decay))


def _scalars(args: StepArgs, dummy) -> tuple:
    """The optional device scalars' pointers (``dummy`` for the absent ones: their
    branches are compiled out): grad_scale, found_inf, clip_coef."""
    return tuple(t if t is not None else dummy for t in (args.grad_scale, args.found_inf, args.clip_coef))


def _flags(args: StepArgs, param_lp) -> dict:
    """The kernels' compile-time flags every format's kernel shares."""
    return dict(ADAMW=bool(args.adamw), MAXIMIZE=bool(args.maximize),
                HAS_WEIGHT_DECAY=args.weight_decay != 0,
                HAS_PARAM_LP=param_lp is not None,
                PARAM_LP_BF16=param_lp is not None and param_lp.dtype == torch.bfloat16,
                HAS_GRAD_SCALE=args.grad_scale is not None, HAS_FOUND_INF=args.found_inf is not None,
                HAS_CLIP=args.clip_coef is not None)


def _check_step(ops: Operands, args: StepArgs) -> None:
    """What every launcher checks beside its moments: the parameter (``_check_param``),
    the gradient, the low-precision copy, the 1-element scalars and the device."""
    param, grad, param_lp = ops.param, ops.grad, ops.param_lp
    n, device = param.numel(), param.device
    _check_param(param, param_lp, args.stochastic, ops.remainder)
    _check("grad", grad, n, _GRAD_DTYPES, device)
    if param_lp is not None:
        _check("param_lp", param_lp, n, (torch.float16, torch.bfloat16), device)
    _check_scalars_and_device(device, step=ops.step, lr=ops.lr, grad_scale=args.grad_scale,
                              found_inf=args.found_inf, clip_coef=args.clip_coef)


def _check_param(param, param_lp, stochastic, remainder=None) -> None:
    """``param``: the fp32 master (or parameter), or with ``stochastic`` or a
    ``remainder`` (int16, or int8: ``zero_triton.kernels.remainder``) the bf16 parameter."""
    if stochastic and remainder is not None:
        raise ValueError("stochastic=True and `remainder` are two ways of stepping a bfloat16 "
                         "parameter without an fp32 master; pass one")
    if stochastic or remainder is not None:
        _check("param", param, param.numel(), (torch.bfloat16,), param.device)
        if param_lp is not None:
            raise ValueError("`param_lp` must be None with stochastic=True or a `remainder`: "
                             "`param` is the bfloat16 parameter itself")
        if remainder is not None:
            _check("remainder", remainder, param.numel(), tuple(REMAINDER_MODES), param.device)
    else:
        _check("param", param, param.numel(), (torch.float32,), param.device)


def _param_flags(ops: Operands, args: StepArgs) -> dict:
    """The constexprs of the parameter's mode (and its stream of bits, stochastic)."""
    from zero_triton.kernels import rounding
    mode = MODE_STOCHASTIC if args.stochastic else \
        REMAINDER_MODES[ops.remainder.dtype] if ops.remainder is not None else MODE_MASTER
    return dict(PARAM_MODE=mode, PARAM_MIX=(rounding.PARAM_STREAM * rounding.M1) & rounding.MASK32)


def _second_half(ops: Operands, dummy):
    """What the kernels read at their ``param_lp`` pointer: the low-precision copy, or
    the remainder (``dummy``, never dereferenced, for neither)."""
    if ops.remainder is not None:
        return ops.remainder
    return ops.param_lp if ops.param_lp is not None else dummy


def _block_and_warps(n):
    if INTERPRET:
        # The interpreter pays ~1 ms per program instance: few, large blocks.
        return max(16, min(1 << 17, triton.next_power_of_2(max(n, 1)))), 4
    return 2048, 8


def adam_step(ops: Operands, args: StepArgs):
    """One fused Adam/AdamW step over a flat shard, in place (``zero_triton.kernels.args``).

    ops.param: float32 [n] master or fp32 parameter; grad: fp32/fp16/bf16 [n];
    ops.moments: (exp_avg, exp_avg_sq, max_exp_avg_sq or None), float32 [n] (the
    maximum read with ``args.amsgrad``); param_lp: fp16/bf16 [n] receiving param rounded
    to nearest even, or None; step, lr: float32 [1] on the device (step already
    incremented); args' grad_scale, found_inf, clip_coef: float32 [1] on the device, or
    None. ``args.stochastic`` (master_weights="stochastic"): param is the bf16 parameter
    itself, param_lp None, rounded back stochastically keyed by ``args.seed`` and
    ``args.index`` (``zero_triton.kernels.rounding``). ``ops.remainder``
    (master_weights="remainder"): int16 [n], the low half of the master whose high half
    is ``param`` (bf16; ``zero_triton.kernels.remainder``).
    """
    param, grad, (exp_avg, exp_avg_sq, max_exp_avg_sq), param_lp = ops[:4]
    n = param.numel()
    device = param.device
    _check_step(ops, args)
    _check("exp_avg", exp_avg, n, (torch.float32,), device)
    _check("exp_avg_sq", exp_avg_sq, n, (torch.float32,), device)
    if args.amsgrad:
        if max_exp_avg_sq is None:
            raise ValueError("amsgrad=True needs `max_exp_avg_sq`")
        _check("max_exp_avg_sq", max_exp_avg_sq, n, (torch.float32,), device)
    if n == 0:
        return
    block, warps = _block_and_warps(n)
    grid = (triton.cdiv(n, block),)
    dummy = param  # never dereferenced: its branch is compiled out
    _adam_kernel[grid](
        param, grad, exp_avg, exp_avg_sq,
        max_exp_avg_sq if args.amsgrad else dummy,
        _second_half(ops, dummy), ops.step, ops.lr, *_scalars(args, dummy),
        n, int(args.seed) & 0xFFFFFFFF, int(args.index), *_hyper(args),
        AMSGRAD=bool(args.amsgrad), **_flags(args, param_lp), **_param_flags(ops, args),
        BLOCK=block, num_warps=warps,
    )


def _row(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, param_lp, step) -> list:
    """One tensor's row of the list kernel's table: its tensors' addresses (0 for the
    absent ones), then its element count."""
    return [param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
            0 if max_exp_avg_sq is None else max_exp_avg_sq.data_ptr(),
            0 if param_lp is None else param_lp.data_ptr(), step.data_ptr(), param.numel()]


def _list_block(numels) -> int:
    if INTERPRET:  # few program instances: one block covers the largest tensor
        return max(16, min(1 << 17, triton.next_power_of_2(max(numels, default=1))))
    return 2048


def _list_table(launches: list, amsgrad: bool, has_lp: bool, device, block: int) -> tuple:
    """Each launch's operands checked, and the table ``_adam_list_kernel`` reads: a row of
    addresses per launch, then a (launch, first element) pair per tile of ``block``."""
    rows, tiles = [], []
    for i, o in enumerate(launches):
        numel = o.param.numel()
        exp_avg, exp_avg_sq, vmax = o.moments
        _check(f"params[{i}]", o.param, numel, (torch.float32,), device)
        _check(f"grads[{i}]", o.grad, numel, _GRAD_DTYPES, device)
        _check(f"exp_avgs[{i}]", exp_avg, numel, (torch.float32,), device)
        _check(f"exp_avg_sqs[{i}]", exp_avg_sq, numel, (torch.float32,), device)
        _check(f"steps[{i}]", o.step, 1, (torch.float32,), device)
        if not amsgrad:
            vmax = None
        elif vmax is None:
            raise ValueError(f"amsgrad=True needs `max_exp_avg_sq` (launch {i})")
        else:
            _check(f"max_exp_avg_sqs[{i}]", vmax, numel, (torch.float32,), device)
        if has_lp:
            _check(f"params_lp[{i}]", o.param_lp, numel, (torch.float16, torch.bfloat16), device)
        rows.extend(_row(o.param, o.grad, exp_avg, exp_avg_sq, vmax, o.param_lp, o.step))
        for start in range(0, numel, block):
            tiles.extend((i, start))
    return rows, tiles


def adam_step_list(launches: list, args: StepArgs):
    """``adam_step`` over a list of ``Operands`` (the local shards of DTensor parameters,
    wherever they live), in one launch: each a float32 ``param`` (a master or an fp32
    parameter) with its gradient, fp32 moments, ``param_lp`` (fp16/bf16 written from the
    update; None for all or for none) and ``step`` (float32 [1], already incremented).
    Every gradient has one dtype and every launch one ``lr``. The addresses travel in a
    table the kernel reads on the device; ``args`` are as in ``adam_step``, with neither
    ``stochastic`` nor remainders (their parameters are stepped one launch each)."""
    amsgrad = args.amsgrad
    if args.stochastic or any(o.remainder is not None for o in launches):
        raise ValueError("adam_step_list steps fp32 masters or parameters; a bfloat16 parameter "
                         "rounded stochastically or beside a remainder is stepped by adam_step")
    n = len(launches)
    if n == 0:
        return
    lr = launches[0].lr
    if any(o.lr is not lr for o in launches):
        raise ValueError("every launch of adam_step_list reads one `lr` tensor")
    has_lp = {o.param_lp is not None for o in launches}
    if len(has_lp) > 1:
        raise ValueError("`param_lp` must be given for every tensor or for none")
    has_lp = has_lp.pop()
    device = launches[0].param.device
    grad_dtypes = {o.grad.dtype for o in launches}
    if len(grad_dtypes) != 1:
        raise ValueError(f"the gradients have several dtypes {sorted(map(str, grad_dtypes))}; "
                         "one launch reads one: call once per dtype")
    lp_dtypes = {o.param_lp.dtype for o in launches} if has_lp else set()
    if len(lp_dtypes) > 1:
        raise ValueError(f"`params_lp` mixes {sorted(map(str, lp_dtypes))}; call once per dtype")
    block = _list_block([o.param.numel() for o in launches])
    rows, tiles = _list_table(launches, amsgrad, has_lp, device, block)
    _check_scalars_and_device(device, lr=lr, grad_scale=args.grad_scale, found_inf=args.found_inf,
                              clip_coef=args.clip_coef)
    if not tiles:
        return
    table = torch.tensor(rows + tiles, dtype=torch.int64)
    if device.type == "cuda":  # pinned, so the copy queues behind the work before it
        table = table.pin_memory().to(device, non_blocking=True)
    tile_table = table[len(rows):]
    dummy = launches[0].param  # never dereferenced: its branch is compiled out
    grad_dtype = grad_dtypes.pop()
    _adam_list_kernel[(len(tiles) // 2,)](
        table, tile_table, lr, *_scalars(args, dummy), *_hyper(args),
        AMSGRAD=bool(amsgrad), **_flags(args, launches[0].param_lp),
        GRAD_KIND={torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[grad_dtype],
        BLOCK=block, num_warps=8 if not INTERPRET else 4,
    )
