"""The fused Adam/AdamW step over 4-bit moments (``moments="int4"``) as one Triton kernel:
each program steps ``ROWS`` blocks of ``quant4.BLOCK`` (128) elements as a [ROWS, BLOCK]
tile, unpacking the codes (two to a byte, element 2k the low nibble), decoding them
(``zero_triton.kernels.quant4`` defines them), updating as the fp32 kernel does
(``adam._adam_update``), taking each block's new largest magnitudes, rounded to bfloat16
(to nearest even, in integer operations: the same on every device), as its scales, then
encoding and packing again: half a byte read and written per moment per element.
"""
import torch
import triton
import triton.language as tl

from zero_triton.kernels import quant4, rounding
from zero_triton.kernels.adam import (INTERPRET, _adam_update, _bf16_stochastic_bits,
                                      _bits_at, _check, _check_step, _flags, _hyper, _key, _load_param, _param_flags, _scalars, _second_half,
                                      _store_param)
from zero_triton.kernels.adam8 import _decode, _encode
from zero_triton.kernels.args import Operands, StepArgs


@triton.jit
def _bf16_bits_of(x):
    """Bits of ``x`` rounded to bfloat16, to nearest even (NaN: 0x7FC0), as int32."""
    u = x.to(tl.int32, bitcast=True)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, rounded & 0xFFFF)


@triton.jit
def _rounded_scale(x):
    """Each row's largest |x| (by the bits: NaN the largest) rounded to bfloat16: its bits,
    its float32 value and its inverse (0 for 0)."""
    mag = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    bits = _bf16_bits_of(tl.max(mag, axis=1).to(tl.float32, bitcast=True))
    scale = (bits << 16).to(tl.float32, bitcast=True)
    safe = tl.where(scale > 0, scale, 1.0)
    inv = tl.where(scale > 0, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), safe), 0.0)
    return bits, scale, inv


@triton.jit
def _encode_second(v, index0, rows, offs, key_v, key_s, BIAS: tl.constexpr, MAN: tl.constexpr,
                   BLOCK: tl.constexpr):
    """exp_avg_sq's codes and its blocks' scales' bits, rounded stochastically
    (``quant4.quantize_stochastic``): each row's largest magnitude rounded to bfloat16 by
    the bits of the row's first element (``key_s``), then r = v / scale rounded by each
    element's (``key_v``); the row's largest takes the top code."""
    mag = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    most = tl.max(mag, axis=1)
    scale_bits = _bf16_stochastic_bits(most.to(tl.float32, bitcast=True),
                                       _bits_at(key_s, index0 + rows * BLOCK)).to(tl.int32)
    scale = (scale_bits << 16).to(tl.float32, bitcast=True)[:, None]
    safe = tl.where(scale > 0, scale, 1.0)
    r = tl.where(scale > 0, tl.math.div_rn(tl.abs(v), safe), 0.0)
    ebits = _bits_at(key_v, index0 + offs)
    bits = r.to(tl.int32, bitcast=True) + (ebits & ((1 << (23 - MAN)) - 1)).to(tl.int32)
    e = (bits >> 23) - 127 + BIAS
    code = (e << MAN) | ((bits >> (23 - MAN)) & ((1 << MAN) - 1))
    code = tl.where(e < 0, 0, code)
    code = tl.minimum(code, BIAS << MAN)
    code = tl.where((code == 0) & (r > 0), 1, code)  # a positive value never takes code 0
    code = tl.where((mag == most[:, None]) & (mag != 0), BIAS << MAN, code)
    return code, scale_bits


@triton.jit
def _unpack(packed, SIGNED: tl.constexpr):
    """int32 codes [ROWS, 2 * HALF] of uint8 bytes [ROWS, HALF] (low nibble first)."""
    b = packed.to(tl.int32)
    lo = b & 0xF
    hi = (b >> 4) & 0xF
    if SIGNED:  # 4-bit two's complement
        lo = lo - ((lo & 0x8) << 1)
        hi = hi - ((hi & 0x8) << 1)
    return tl.interleave(lo, hi)


@triton.jit
def _pack(code, ROWS: tl.constexpr, HALF: tl.constexpr):
    """uint8 bytes [ROWS, HALF] of int32 codes [ROWS, 2 * HALF]."""
    lo, hi = tl.split(tl.reshape(code & 0xF, (ROWS, HALF, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def _adam4_kernel(
    param_ptr, grad_ptr, m_ptr, v_ptr, scales_ptr, param_lp_ptr,
    step_ptr, lr_ptr, grad_scale_ptr, found_inf_ptr, clip_coef_ptr,
    n_elements, n_bytes, n_blocks, seed, index0, beta1, beta2, log_beta1, log_beta2, eps,
    weight_decay,
    ADAMW: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr,
    HAS_PARAM_LP: tl.constexpr, PARAM_LP_BF16: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr, HAS_CLIP: tl.constexpr,
    FIRST_BIAS: tl.constexpr, FIRST_MAN: tl.constexpr, SECOND_BIAS: tl.constexpr,
    SECOND_MAN: tl.constexpr, PARAM_MODE: tl.constexpr, PARAM_MIX: tl.constexpr,
    SECOND_MIX: tl.constexpr, SCALE_MIX: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    if HAS_FOUND_INF:
        if tl.load(found_inf_ptr) != 0.0:
            return
    HALF: tl.constexpr = BLOCK // 2
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offs < n_elements
    byte_offs = rows[:, None] * HALF + tl.arange(0, HALF)[None, :]
    byte_mask = byte_offs < n_bytes
    row_mask = rows < n_blocks
    lr = tl.load(lr_ptr)
    t = tl.load(step_ptr)
    m_scale = ((tl.load(scales_ptr + 2 * rows, mask=row_mask, other=0).to(tl.int32) & 0xFFFF)
               << 16).to(tl.float32, bitcast=True)
    v_scale = ((tl.load(scales_ptr + 2 * rows + 1, mask=row_mask, other=0).to(tl.int32) & 0xFFFF)
               << 16).to(tl.float32, bitcast=True)
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = _load_param(param_ptr + offs, param_lp_ptr + offs, mask, PARAM_MODE)
    m = _decode(_unpack(tl.load(m_ptr + byte_offs, mask=byte_mask, other=0), True), m_scale,
                FIRST_BIAS, FIRST_MAN)
    v = _decode(_unpack(tl.load(v_ptr + byte_offs, mask=byte_mask, other=0), False), v_scale,
                SECOND_BIAS, SECOND_MAN)
    p, m, v, _ = _adam_update(p, g, m, v, v, lr, t, grad_scale_ptr, clip_coef_ptr,
                              beta1, beta2, log_beta1, log_beta2, eps, weight_decay,
                              ADAMW, False, MAXIMIZE, HAS_WEIGHT_DECAY, HAS_GRAD_SCALE, HAS_CLIP)
    _store_param(param_ptr + offs, param_lp_ptr + offs, p, mask,
                 _key(seed.to(tl.uint32), t.to(tl.uint32), PARAM_MIX), index0 + offs,
                 PARAM_MODE, HAS_PARAM_LP, PARAM_LP_BF16)
    # Elements past the end were stepped from zeros: zero moments, code 0 (a padding nibble).
    m = tl.where(mask, m, 0.0)
    v = tl.where(mask, v, 0.0)
    m_bits, _, m_inv = _rounded_scale(m)
    m_codes = _encode(m, m_inv, FIRST_BIAS, FIRST_MAN, True)
    seed32 = seed.to(tl.uint32)
    step32 = t.to(tl.uint32)
    v_codes, v_bits = _encode_second(v, index0, rows, offs, _key(seed32, step32, SECOND_MIX),
                                     _key(seed32, step32, SCALE_MIX), SECOND_BIAS, SECOND_MAN,
                                     BLOCK)
    tl.store(m_ptr + byte_offs, _pack(m_codes, ROWS, HALF), mask=byte_mask)
    tl.store(v_ptr + byte_offs, _pack(v_codes, ROWS, HALF), mask=byte_mask)
    tl.store(scales_ptr + 2 * rows, m_bits.to(tl.int16), mask=row_mask)
    tl.store(scales_ptr + 2 * rows + 1, v_bits.to(tl.int16), mask=row_mask)


def _mix(stream: int) -> int:
    return (stream * rounding.M1) & rounding.MASK32


def _rows(n_blocks: int) -> tuple:
    if INTERPRET:  # ~1 ms per program instance: few, large tiles
        return max(1, min(512, triton.next_power_of_2(n_blocks))), 4
    return 16, 4


def adam4_step(ops: Operands, args: StepArgs):
    """``adam.adam_step`` over 4-bit moments, in place: ``ops.moments`` are exp_avg and
    exp_avg_sq uint8 [ceil(n / 2)] (two codes a byte), scales bfloat16 [ceil(n / 128), 2]
    (each block's first and second moment scale); the run starts on a block boundary.
    No amsgrad."""
    if args.amsgrad:
        raise ValueError("int4 moments hold no amsgrad maximum; use moments='fp32'")
    param, grad, (exp_avg, exp_avg_sq, scales), param_lp = ops[:4]
    n = param.numel()
    device = param.device
    _check_step(ops, args)
    n_bytes, n_blocks = quant4.packed(n), quant4.blocks(n)
    _check("exp_avg", exp_avg, n_bytes, (torch.uint8,), device)
    _check("exp_avg_sq", exp_avg_sq, n_bytes, (torch.uint8,), device)
    _check("scales", scales, 2 * n_blocks, (torch.bfloat16,), device)
    if n == 0:
        return
    rows, warps = _rows(n_blocks)
    dummy = param  # never dereferenced: its branch is compiled out
    _adam4_kernel[(triton.cdiv(n_blocks, rows),)](
        param, grad, exp_avg, exp_avg_sq, scales.view(torch.int16),
        _second_half(ops, dummy), ops.step, ops.lr, *_scalars(args, dummy),
        n, n_bytes, n_blocks, int(args.seed) & 0xFFFFFFFF, int(args.index), *_hyper(args),
        **_flags(args, param_lp),
        FIRST_BIAS=quant4.FIRST.bias, FIRST_MAN=quant4.FIRST.man_bits,
        SECOND_BIAS=quant4.SECOND.bias, SECOND_MAN=quant4.SECOND.man_bits,
        **_param_flags(ops, args), SECOND_MIX=_mix(rounding.SECOND_STREAM),
        SCALE_MIX=_mix(rounding.SCALE_STREAM), ROWS=rows, BLOCK=quant4.BLOCK, num_warps=warps,
    )
