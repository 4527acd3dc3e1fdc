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


def blocks(numel: int) -> int:
    """Blocks (scales) of a run of ``numel`` state elements."""
    return (numel + BLOCK - 1) // BLOCK


def _by_block(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [blocks, BLOCK] (the last block padded with zeros when it is short)."""
    n = x.numel()
    pad = blocks(n) * BLOCK - n
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, BLOCK)


def block_absmax(x: torch.Tensor) -> torch.Tensor:
    """The largest |x| of each block, float32 [blocks] (by the bits of |x|: NaN wins,
    as in every kernel)."""
    bits = _by_block(x.float()).view(torch.int32) & 0x7FFFFFFF
    return bits.amax(dim=1).view(torch.float32) if bits.numel() else x.new_zeros(0, dtype=torch.float32)


def encode(x: torch.Tensor, scale: torch.Tensor, fmt: Minifloat) -> torch.Tensor:
    """The codes of float32 ``x`` (a run starting on a block boundary) under the block
    scales ``scale`` (one per block)."""
    n = x.numel()
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return _codes(x, (_by_block(x).abs() * inv[:, None]).reshape(-1)[:n], fmt)


def encode_each(x: torch.Tensor, scale: torch.Tensor, fmt: Minifloat) -> torch.Tensor:
    """``encode`` with each element's block scale given beside it (``scale`` of ``x``'s
    shape): the same codes, for elements whose blocks are not runs of ``x``."""
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return _codes(x, x.float().abs() * inv, fmt)


def _codes(x: torch.Tensor, r: torch.Tensor, fmt: Minifloat) -> torch.Tensor:
    """The codes of ``x`` from ``r = |x| / scale`` (float32, ``x``'s shape)."""
    bits = r.view(torch.int32) + fmt.half
    exp = (bits >> 23) - 127 + fmt.bias  # the binade after rounding, biased
    code = (exp << fmt.man_bits) | ((bits >> fmt.shift) & ((1 << fmt.man_bits) - 1))
    code = torch.where(exp < 0, torch.zeros_like(code), code)
    code = torch.minimum(code, torch.full_like(code, fmt.top))  # r a rounding above 1, NaN
    if fmt.keeps_positive:
        code = torch.where((r > 0) & (code == 0), torch.ones_like(code), code)
    if fmt.signed:
        code = torch.where(x < 0, -code, code)
    return code.to(fmt.dtype)


def decode(codes: torch.Tensor, scale: torch.Tensor, fmt: Minifloat) -> torch.Tensor:
    """float32 values of ``codes`` (a run starting on a block boundary) under ``scale``."""
    n = codes.numel()
    c, r = _ratios(codes, fmt)
    x = (_by_block(r) * scale[:, None]).reshape(-1)[:n]
    return torch.where(c < 0, -x, x)


def decode_each(codes: torch.Tensor, scale: torch.Tensor, fmt: Minifloat) -> torch.Tensor:
    """``decode`` with each element's block scale given beside it (``scale`` of the
    codes' shape)."""
    c, r = _ratios(codes, fmt)
    x = r * scale
    return torch.where(c < 0, -x, x)


def _ratios(codes: torch.Tensor, fmt: Minifloat) -> tuple:
    """(the codes as int32, each code's magnitude r' in [0, 1] as float32)."""
    c = codes.to(torch.int32)
    mag = c.abs()
    bits = (((mag >> fmt.man_bits) - fmt.bias + 127) << 23) | ((mag & ((1 << fmt.man_bits) - 1)) << fmt.shift)
    return c, torch.where(mag == 0, torch.zeros_like(bits), bits).view(torch.float32)


def quantize(x: torch.Tensor, fmt: Minifloat, codes: torch.Tensor, scale: torch.Tensor) -> None:
    """Encode float ``x`` into ``codes`` and its block scales into ``scale`` (in place)."""
    x = x.float()
    s = block_absmax(x)
    codes.copy_(encode(x, s, fmt))
    scale.copy_(s)
