"""The fused Adam/AdamW step over int8 moments (``moments="int8"``) as one Triton kernel:
each program steps ``ROWS`` blocks of ``quant.BLOCK`` elements as a [ROWS, BLOCK] tile,
decoding the codes (``zero_triton.kernels.quant`` defines them), updating as the fp32
kernel does (``adam._adam_update``), taking each block's new largest magnitudes as its
scales and encoding again: one read and one write of each code, 16 bytes per parameter
for fp32 parameters where the fp32 moments take 28.
"""
import torch
import triton
import triton.language as tl

from zero_triton.kernels import quant
from zero_triton.kernels.adam import (INTERPRET, _adam_update, _check, _check_step, _flags,
                                      _hyper, _key, _load_param, _param_flags, _scalars, _second_half,
                                      _store_param)
from zero_triton.kernels.args import Operands, StepArgs



@triton.jit
def _decode(code, scale, BIAS: tl.constexpr, MAN: tl.constexpr):
    """float32 values of int32 ``code`` (signed magnitudes) under per-row ``scale``."""
    mag = tl.abs(code)
    bits = (((mag >> MAN) - BIAS + 127) << 23) | ((mag & ((1 << MAN) - 1)) << (23 - MAN))
    r = tl.where(mag == 0, 0.0, bits.to(tl.float32, bitcast=True))
    x = r * scale[:, None]
    return tl.where(code < 0, -x, x)


@triton.jit
def _encode(x, inv, BIAS: tl.constexpr, MAN: tl.constexpr, SIGNED: tl.constexpr):
    """int32 codes of ``x`` under per-row inverse scales ``inv`` (quant.encode)."""
    r = tl.abs(x) * inv[:, None]
    bits = r.to(tl.int32, bitcast=True) + (1 << (22 - MAN))
    e = (bits >> 23) - 127 + BIAS
    code = (e << MAN) | ((bits >> (23 - MAN)) & ((1 << MAN) - 1))
    code = tl.where(e < 0, 0, code)
    code = tl.minimum(code, BIAS << MAN)
    if SIGNED:
        code = tl.where(x < 0, -code, code)
    else:  # a positive value never takes code 0
        code = tl.where((code == 0) & (r > 0), 1, code)
    return code


@triton.jit
def _scale_of(x):
    """Each row's largest |x| (by the bits: NaN the largest) and its inverse (0 for 0)."""
    mag = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    scale = tl.max(mag, axis=1).to(tl.float32, bitcast=True)
    safe = tl.where(scale > 0, scale, 1.0)
    inv = tl.where(scale > 0, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), safe), 0.0)
    return scale, inv


@triton.jit
def _adam8_kernel(
    param_ptr, grad_ptr, m_ptr, v_ptr, scales_ptr, param_lp_ptr,
    step_ptr, lr_ptr, grad_scale_ptr, found_inf_ptr, clip_coef_ptr,
    n_elements, n_blocks, seed, index0, beta1, beta2, log_beta1, log_beta2, eps, weight_decay,
    ADAMW: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr,
    HAS_PARAM_LP: tl.constexpr, PARAM_LP_BF16: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr, HAS_CLIP: tl.constexpr,
    FIRST_BIAS: tl.constexpr, FIRST_MAN: tl.constexpr, SECOND_BIAS: tl.constexpr,
    SECOND_MAN: tl.constexpr, PARAM_MODE: tl.constexpr, PARAM_MIX: tl.constexpr,
    ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    if HAS_FOUND_INF:
        if tl.load(found_inf_ptr) != 0.0:
            return
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offs < n_elements
    row_mask = rows < n_blocks
    lr = tl.load(lr_ptr)
    t = tl.load(step_ptr)
    m_scale = tl.load(scales_ptr + 2 * rows, mask=row_mask, other=0.0)
    v_scale = tl.load(scales_ptr + 2 * rows + 1, mask=row_mask, other=0.0)
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = _load_param(param_ptr + offs, param_lp_ptr + offs, mask, PARAM_MODE)
    m = _decode(tl.load(m_ptr + offs, mask=mask, other=0).to(tl.int32), m_scale, FIRST_BIAS, FIRST_MAN)
    v = _decode(tl.load(v_ptr + offs, mask=mask, other=0).to(tl.int32), v_scale, SECOND_BIAS, SECOND_MAN)
    p, m, v, _ = _adam_update(p, g, m, v, v, lr, t, grad_scale_ptr, clip_coef_ptr,
                              beta1, beta2, log_beta1, log_beta2, eps, weight_decay,
                              ADAMW, False, MAXIMIZE, HAS_WEIGHT_DECAY, HAS_GRAD_SCALE, HAS_CLIP)
    _store_param(param_ptr + offs, param_lp_ptr + offs, p, mask,
                 _key(seed.to(tl.uint32), t.to(tl.uint32), PARAM_MIX), index0 + offs,
                 PARAM_MODE, HAS_PARAM_LP, PARAM_LP_BF16)
    # Elements past the end were stepped from zeros: their moments are zero, no scale's.
    m_scale, m_inv = _scale_of(m)
    v_scale, v_inv = _scale_of(v)
    tl.store(m_ptr + offs, _encode(m, m_inv, FIRST_BIAS, FIRST_MAN, True).to(tl.int8), mask=mask)
    tl.store(v_ptr + offs, _encode(v, v_inv, SECOND_BIAS, SECOND_MAN, False).to(tl.uint8), mask=mask)
    tl.store(scales_ptr + 2 * rows, m_scale, mask=row_mask)
    tl.store(scales_ptr + 2 * rows + 1, v_scale, mask=row_mask)


def _rows(n_blocks: int) -> tuple:
    if INTERPRET:  # ~1 ms per program instance: few, large tiles
        return max(1, min(512, triton.next_power_of_2(n_blocks))), 4
    return 8, 8


def adam8_step(ops: Operands, args: StepArgs):
    """``adam.adam_step`` over int8 moments, in place: ``ops.moments`` are exp_avg int8
    [n], exp_avg_sq uint8 [n], scales float32 [ceil(n / 256), 2] (each block's first and
    second moment scale); the run starts on a block boundary. No amsgrad."""
    if args.amsgrad:
        raise ValueError("int8 moments hold no amsgrad maximum; use moments='fp32'")
    param, grad, (exp_avg, exp_avg_sq, scales), param_lp = ops[:4]
    n = param.numel()
    device = param.device
    _check_step(ops, args)
    _check("exp_avg", exp_avg, n, (torch.int8,), device)
    _check("exp_avg_sq", exp_avg_sq, n, (torch.uint8,), device)
    n_blocks = quant.blocks(n)
    _check("scales", scales, 2 * n_blocks, (torch.float32,), device)
    if n == 0:
        return
    rows, warps = _rows(n_blocks)
    dummy = param  # never dereferenced: its branch is compiled out
    _adam8_kernel[(triton.cdiv(n_blocks, rows),)](
        param, grad, exp_avg, exp_avg_sq, scales,
        _second_half(ops, dummy), ops.step, ops.lr, *_scalars(args, dummy),
        n, n_blocks, int(args.seed) & 0xFFFFFFFF, int(args.index), *_hyper(args),
        **_flags(args, param_lp),
        FIRST_BIAS=quant.FIRST.bias, FIRST_MAN=quant.FIRST.man_bits,
        SECOND_BIAS=quant.SECOND.bias, SECOND_MAN=quant.SECOND.man_bits,
        **_param_flags(ops, args),
        ROWS=rows, BLOCK=quant.BLOCK, num_warps=warps,
    )
