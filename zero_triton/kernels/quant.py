"""The 8-bit moment codes: block-wise scaled minifloats, defined here in torch ops that
every backend's kernel (C++, CUDA, Triton, ``zero_triton.native.backends.torch_step_int8``)
reproduces operation for operation.

A shard's moments are cut into blocks of ``BLOCK`` state elements (blocks start where
the state does; the layout puts every parameter, shard and bucket boundary on a block
boundary, ``zero_triton.state.int8``). Each block keeps one float32 scale per moment, the
largest magnitude in it, and each element a code of ``r = |x| * (1 / scale)`` in (0, 1]:

- ``exp_avg`` (signed, ``FIRST``): a sign bit and an E4M3 minifloat: 16 binades
  [2^-15, 1] with 3 mantissa bits (relative error <= 1/16 of the value everywhere in its
  range), values below 2^-15 of the block's largest to zero.
- ``exp_avg_sq`` (unsigned, ``SECOND``): an E4M4 minifloat: 16 binades [2^-15, 1] with 4
  mantissa bits (relative error <= 1/32); a positive value never becomes zero: below the
  range it takes the smallest code.

Why these maps (Dettmers et al. 2021, "8-bit Optimizers via Block-wise Quantization";
Li et al. 2023, "Memory Efficient Optimizers with 4-bit States"): block-wise scaling
keeps an outlier from costing the precision of the whole tensor; a map with an exponent
keeps relative precision over many orders of magnitude, which the moments span (the
dynamic map's point). Here the exponent and mantissa are those of an IEEE float, so a
code is made from the bits of ``r`` with integer operations and one multiply, no table
search: the step stays bound by memory, not arithmetic. Li et al. found the second
moment's danger is zero: a small ``v`` quantized to 0 turns ``m / sqrt(v)`` into
``m / eps``, an update many orders too large. The second moment's map therefore rounds
nothing positive to zero: a value below its range (2^-15 of its block's largest, 2^-7.5
in ``sqrt(v)``, the quantity the update divides by) is over-estimated, which only
shortens its step. Within the range it spends the bits on precision rather than more
range: ``v`` moves by 1 - beta2 = 0.1% of itself a step, and a coarse code holds it
where it was. Measured on the project's GPT (``bench/lowbit_quality.py``, 1,000 steps),
E4M4 for ``v`` ended 0.8% above fp32 AdamW's validation loss where E5M3 (twice the range,
half the precision) ended 2.0% above and E3M5 1.6%; for ``m``, E3M4 (more precision, less
range) did worse than E4M3.

Every code decodes to ``scale * r'`` with ``r'`` exactly representable, the largest
element's to ``scale`` itself: decoding and encoding again gives the same codes and
scales, so a state exported in torch's format (dequantized) and loaded back is the same
state bit for bit. Rounding is to nearest, ties away from zero (an add to the bits, then
a truncation), identically on every backend.
"""
from __future__ import annotations

import torch

BLOCK = 256  # state elements per scale


class Minifloat:
    """A code format: ``exp_bits`` binades below 1.0 (bias ``2**exp_bits - 1``),
    ``man_bits`` mantissa bits, ``signed`` (a sign bit above them), ``keeps_positive``
    (a positive value never takes the zero code)."""

    def __init__(self, exp_bits: int, man_bits: int, signed: bool, keeps_positive: bool):
        self.exp_bits, self.man_bits = exp_bits, man_bits
        self.signed, self.keeps_positive = signed, keeps_positive
        self.bias = 2 ** exp_bits - 1
        self.top = self.bias << man_bits        # the code of 1.0, the largest one used
        self.shift = 23 - man_bits              # float32 mantissa bits dropped
        self.half = 1 << (self.shift - 1)       # added before the drop: round to nearest
        self.dtype = torch.int8 if signed else torch.uint8

    def __repr__(self) -> str:
        return (f"Minifloat(E{self.exp_bits}M{self.man_bits}, "
                f"{'signed' if self.signed else 'unsigned'})")


FIRST = Minifloat(4, 3, signed=True, keeps_positive=False)   # exp_avg
SECOND = Minifloat(4, 4, signed=False, keeps_positive=True)  # exp_avg_sq


def blocks(numel: int, block: int = BLOCK) -> int:
    """Blocks (scales) of a run of ``numel`` state elements (``block`` to a block)."""
    return (numel + block - 1) // block


def _by_block(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """``x`` as [blocks, block] (the last block padded with zeros when it is short)."""
    n = x.numel()
    pad = blocks(n, block) * block - n
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, block)


def block_absmax(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The largest |x| of each block, float32 [blocks] (by the bits of |x|: NaN wins,
    as in every kernel)."""
    bits = _by_block(x.float(), block).view(torch.int32) & 0x7FFFFFFF
    return bits.amax(dim=1).view(torch.float32) if bits.numel() else x.new_zeros(0, dtype=torch.float32)


def encode(x: torch.Tensor, scale: torch.Tensor, fmt: Minifloat, block: int = BLOCK) -> torch.Tensor:
    """The codes of float32 ``x`` (a run starting on a block boundary) under the block
    scales ``scale`` (one per block of ``block``)."""
    n = x.numel()
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return _codes(x, (_by_block(x, block).abs() * inv[:, None]).reshape(-1)[:n], fmt)


def scratch(like: torch.Tensor):
    """``tmp(slot, dtype)``: a new tensor of ``like``'s shape and device at every call.
    The functions below (and ``zero_triton.kernels.rounding``'s) take such a ``tmp`` for
    their intermediates, and an ``out``: a capturable step hands in buffers it keeps
    (``zero_triton.state.buffers.Kept``), so that they allocate nothing. Their slots are
    numbered per dtype from 0 and live only during the call, so that one ``tmp`` serves
    them one after another."""
    return lambda name, dtype: torch.empty(like.shape, dtype=dtype, device=like.device)


def encode_each(x: torch.Tensor, scale: torch.Tensor, fmt: Minifloat, out=None,
                tmp=None) -> torch.Tensor:
    """``encode`` with each element's block scale given beside it (``scale`` of ``x``'s
    shape): the same codes, for elements whose blocks are not runs of ``x``."""
    tmp = tmp or scratch(x)
    inv = torch.reciprocal(scale, out=tmp(0, torch.float32))  # 1 / scale where scale > 0, else 0
    inv.masked_fill_(torch.gt(scale, 0, out=tmp(0, torch.bool)).logical_not_(), 0.0)
    r = torch.abs(x, out=tmp(1, torch.float32)).mul_(inv)
    return _codes(x, r, fmt, out, tmp)


def _codes(x: torch.Tensor, r: torch.Tensor, fmt: Minifloat, out=None, tmp=None,
           added=None) -> torch.Tensor:
    """The codes of ``x`` from ``r = |x| / scale`` (float32, ``x``'s shape), into ``out``
    (``tmp``'s int32 and bool slots). ``added``: what is added to r's bits before the
    bits below the code's are dropped: half of the last kept bit (round to nearest), or
    an int32 tensor of random bits below it (stochastic rounding)."""
    tmp = tmp or scratch(x)
    i32, flag = torch.int32, tmp(0, torch.bool)
    bits = torch.add(r.view(i32), fmt.half if added is None else added, out=tmp(0, i32))
    exp = torch.bitwise_right_shift(bits, 23, out=tmp(1, i32))
    exp.add_(fmt.bias - 127)  # the binade after rounding, biased
    # (exp << man_bits) | ((bits >> shift) & (2**man_bits - 1))
    code = torch.bitwise_left_shift(exp, fmt.man_bits, out=tmp(2, i32))
    code.bitwise_or_(bits.bitwise_right_shift_(fmt.shift).bitwise_and_((1 << fmt.man_bits) - 1))
    code.masked_fill_(torch.lt(exp, 0, out=flag), 0)  # below the range
    code.clamp_max_(fmt.top)  # r a rounding above 1, NaN
    if fmt.keeps_positive:  # (r > 0) & (code == 0) -> 1
        zero = torch.eq(code, 0, out=tmp(1, torch.bool))
        code.masked_fill_(torch.gt(r, 0, out=flag).logical_and_(zero), 1)
    if fmt.signed:  # x < 0 -> -code: code * (1 - 2 * (x < 0))
        sign = tmp(1, i32).copy_(torch.lt(x, 0, out=flag))  # exp's slot: exp is spent
        code.mul_(sign.mul_(-2).add_(1))
    if out is None:
        return code.to(fmt.dtype)
    return out.copy_(code)


def decode(codes: torch.Tensor, scale: torch.Tensor, fmt: Minifloat, block: int = BLOCK) -> torch.Tensor:
    """float32 values of ``codes`` (a run starting on a block boundary) under ``scale``."""
    n = codes.numel()
    c, r = _ratios(codes, fmt)
    x = (_by_block(r, block) * scale[:, None]).reshape(-1)[:n]
    return torch.where(c < 0, -x, x)


def decode_each(codes: torch.Tensor, scale: torch.Tensor, fmt: Minifloat, out=None,
                tmp=None) -> torch.Tensor:
    """``decode`` with each element's block scale given beside it (``scale`` of the
    codes' shape), into ``out`` (float32)."""
    tmp = tmp or scratch(codes)
    c, r = _ratios(codes, fmt, tmp)
    x = torch.mul(r, scale, out=torch.empty_like(r) if out is None else out)
    # where(c < 0, -x, x): a negative code's int32 has the sign bit set; negation flips it
    x.view(torch.int32).bitwise_xor_(c.bitwise_and_(-2 ** 31))
    return x


def _ratios(codes: torch.Tensor, fmt: Minifloat, tmp=None) -> tuple:
    """(the codes as int32, each code's magnitude r' in [0, 1] as float32)."""
    tmp = tmp or scratch(codes)
    i32 = torch.int32
    c = tmp(0, i32).copy_(codes)
    mag = torch.abs(c, out=tmp(1, i32))
    # (((mag >> man_bits) - bias + 127) << 23) | ((mag & (2**man_bits - 1)) << shift)
    bits = torch.bitwise_right_shift(mag, fmt.man_bits, out=tmp(2, i32))
    bits.add_(127 - fmt.bias).bitwise_left_shift_(23)
    bits.bitwise_or_(mag.bitwise_and_((1 << fmt.man_bits) - 1).bitwise_left_shift_(fmt.shift))
    bits.masked_fill_(torch.eq(c, 0, out=tmp(0, torch.bool)), 0)
    return c, bits.view(torch.float32)


def quantize(x: torch.Tensor, fmt: Minifloat, codes: torch.Tensor, scale: torch.Tensor,
             block: int = BLOCK) -> None:
    """Encode float ``x`` into ``codes`` and its block scales into ``scale`` (in place)."""
    x = x.float()
    s = block_absmax(x, block)
    codes.copy_(encode(x, s, fmt, block))
    scale.copy_(s)
