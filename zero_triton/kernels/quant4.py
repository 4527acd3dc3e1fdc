"""The 4-bit moment codes (``moments="int4"``, ``zero_triton.state.int4``): the 8-bit
codes' block-scaled minifloats (``zero_triton.kernels.quant``) with fewer bits, two codes
to a byte, and the step over them.

- ``exp_avg`` (``FIRST``): a sign and an E2M1 minifloat: magnitudes
  {0.5, 0.75, 1, 1.5} x 2^e of the block's largest, e in -2..0 (and 0.125, 0.1875),
  values below 2^-3 of it to zero.
- ``exp_avg_sq`` (``SECOND``): an E3M1 minifloat with no sign: 8 binades [2^-7, 1], one
  mantissa bit; a positive value never becomes zero (below the range it takes the
  smallest code: its step is shortened, never blown up by ``m / eps``).

Blocks of ``BLOCK`` (128) state elements, each with one float32 scale per moment (its
largest magnitude): smaller blocks than the 8-bit format's 256, as Li et al. (2023,
"Memory Efficient Optimizers with 4-bit States") found 4-bit moments need. Element ``2k``
of a run takes the low nibble of byte ``k``, ``2k + 1`` the high one; a signed code is
its 4-bit two's complement.

The step (``stepper``) decodes a run's moments to float32, runs the backend's float32
step on them, and encodes them with their blocks' new scales, in torch ops on the
state's device: three passes, not one fused kernel (a fused 4-bit kernel is the next
part). Decoding and encoding again gives the same codes and scales (every code's value
is exact, the largest element's is its scale), so a state exported dequantized and
loaded back is the same bit for bit, and a skipped step (GradScaler's inf) keeps it.
"""
from __future__ import annotations

import torch

from zero_triton.kernels import quant

BLOCK = 128  # state elements per scale
FIRST = quant.Minifloat(2, 1, signed=True, keeps_positive=False)    # exp_avg
SECOND = quant.Minifloat(3, 1, signed=False, keeps_positive=True)   # exp_avg_sq


def packed(numel: int) -> int:
    """Bytes of ``numel`` 4-bit codes."""
    return (numel + 1) // 2


def blocks(numel: int) -> int:
    return quant.blocks(numel, BLOCK)


def unpack(packed_codes: torch.Tensor, n: int, fmt: quant.Minifloat) -> torch.Tensor:
    """The first ``n`` codes of ``packed_codes`` (uint8) as ``fmt.dtype`` (int8 signed,
    uint8 unsigned)."""
    b = packed_codes.to(torch.int16)
    both = torch.stack([b & 0xF, b >> 4], dim=1).reshape(-1)[:n]
    if fmt.signed:  # 4-bit two's complement
        both = both - ((both & 0x8) << 1)
    return both.to(fmt.dtype)


def pack(codes: torch.Tensor, out: torch.Tensor) -> None:
    """``codes`` (int8 or uint8, one per element) two to a byte into ``out`` (uint8)."""
    n = codes.numel()
    c = codes.to(torch.int16) & 0xF
    if n % 2:
        c = torch.cat([c, c.new_zeros(1)])  # the element after a run is padding: zero
    c = c.view(-1, 2)
    out.copy_((c[:, 0] | (c[:, 1] << 4)).to(torch.uint8))


def decode(packed_codes: torch.Tensor, n: int, scale: torch.Tensor, fmt: quant.Minifloat) -> torch.Tensor:
    """float32 values of the first ``n`` codes of a run starting on a block boundary."""
    return quant.decode(unpack(packed_codes, n, fmt), scale, fmt, BLOCK)


def quantize(x: torch.Tensor, fmt: quant.Minifloat, packed_codes: torch.Tensor,
             scale: torch.Tensor) -> None:
    """Encode float ``x`` (a run starting on a block boundary) into ``packed_codes`` and
    its blocks' scales into ``scale``, in place."""
    x = x.float()
    s = quant.block_absmax(x, BLOCK)
    pack(quant.encode(x, s, fmt, BLOCK), packed_codes)
    scale.copy_(s)


def stepper(fp32_step):
    """The step over 4-bit moments made from a backend's float32 step: ``step(ops,
    args)`` with ``ops.moments`` the run's packed codes and scales [blocks, 2]."""
    def step_int4(ops, args) -> None:
        first, second, scales = ops.moments
        n = ops.grad.numel()
        m = decode(first, n, scales[:, 0], FIRST)
        v = decode(second, n, scales[:, 1], SECOND)
        # The float32 step keeps m and v where found_inf is set (on the device); encoding
        # them again gives the codes they came from.
        fp32_step(ops._replace(moments=(m, v, None)), args.replace(amsgrad=False))
        quantize(m, FIRST, first, scales[:, 0])
        quantize(v, SECOND, second, scales[:, 1])
    return step_int4
