"""The 4-bit moment codes (``moments="int4"``, ``zero_triton.state.int4``): the 8-bit
codes' block-scaled minifloats (``zero_triton.kernels.quant``) with fewer bits, two codes
to a byte, and the step over them.

- ``exp_avg`` (``FIRST``): a sign and an E3M0 minifloat: the powers of two 2^-6 .. 1 of
  the block's largest (the nearest in value), values below 2^-6.5 of it to zero.
- ``exp_avg_sq`` (``SECOND``): an E3M1 minifloat with no sign: 8 binades [2^-7, 1], one
  mantissa bit; a positive value never becomes zero (below the range it takes the
  smallest code: its step is shortened, never blown up by ``m / eps``).

Chosen on the project's GPT (2,000 steps; final train loss over torch AdamW fp32's, the
mean of seeds 0-2, fp32 parameters and bf16 ones with ``"remainder8"``): E3M0 / E3M1
1.0146 and 1.0126, E3M0 / E4M0 1.0181 and 1.0144 (one seed, the moments held in 4 bits
between float32 steps: E2M1 / E4M0 1.0469 against E3M0 / E4M0's 1.0246). A single seed
moves these by +-1%: the first moment needs range more than precision; between the
second moment's two maps, the three seeds' means favour precision by 0.2-0.35%.

Blocks of ``BLOCK`` (128) state elements, each with one bfloat16 scale per moment (its
largest magnitude, rounded): smaller blocks than the 8-bit format's 256, as Li et al.
(2023, "Memory Efficient Optimizers with 4-bit States") found 4-bit moments need (256
trained worse in both seeds tried), with scales of 2 bytes, so that the format costs
(0.5 + 2/128) bytes per moment per element: 1.03 bytes per parameter for both. Element ``2k``
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
SCALE_DTYPE = torch.bfloat16  # a scale's dtype: the moments' range, 2 bytes
FIRST = quant.Minifloat(3, 0, signed=True, keeps_positive=False)    # exp_avg
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


def scales_of(x: torch.Tensor) -> torch.Tensor:
    """The block scales of float32 ``x`` as the store keeps them: each block's largest
    magnitude rounded to bfloat16 (to nearest even; the elements above a scale rounded
    down take the largest code, which decodes to the scale)."""
    return quant.block_absmax(x, BLOCK).to(SCALE_DTYPE)


def encode(x: torch.Tensor, scale: torch.Tensor, fmt: quant.Minifloat) -> torch.Tensor:
    """The codes (one per element) of float32 ``x`` under its blocks' ``scale``."""
    return quant.encode(x, scale.float(), fmt, BLOCK)


def decode(packed_codes: torch.Tensor, n: int, scale: torch.Tensor, fmt: quant.Minifloat) -> torch.Tensor:
    """float32 values of the first ``n`` codes of a run starting on a block boundary."""
    return quant.decode(unpack(packed_codes, n, fmt), scale.float(), fmt, BLOCK)


def quantize(x: torch.Tensor, fmt: quant.Minifloat, packed_codes: torch.Tensor,
             scale: torch.Tensor) -> None:
    """Encode float ``x`` (a run starting on a block boundary) into ``packed_codes`` and
    its blocks' scales into ``scale``, in place."""
    x = x.float()
    s = scales_of(x)
    pack(encode(x, s, fmt), packed_codes)
    scale.copy_(s)


CHUNK = 1 << 16  # elements decoded at a time (a multiple of BLOCK): ~2 MiB of temporaries


def _chunk(ops, lo: int, hi: int):
    """``ops`` over elements [lo, hi) of its run (``lo`` on a block boundary)."""
    first, second, scales = ops.moments
    cut = (lambda t: None if t is None else t[lo:hi])
    return ops._replace(param=ops.param[lo:hi], grad=ops.grad[lo:hi], param_lp=cut(ops.param_lp),
                        remainder=cut(ops.remainder), scratch=cut(ops.scratch),
                        moments=(first[lo // 2:packed(hi)], second[lo // 2:packed(hi)],
                                 scales[lo // BLOCK:lo // BLOCK + blocks(hi - lo)]))


def stepper(fp32_step):
    """The step over 4-bit moments made from a backend's float32 step: ``step(ops,
    args)`` with ``ops.moments`` the run's packed codes and scales [blocks, 2], a
    ``CHUNK`` of elements at a time (blocks are stepped alone: the same bits)."""
    def step_int4(ops, args) -> None:
        n = ops.grad.numel()
        for lo in range(0, n, CHUNK):
            part = ops if n <= CHUNK else _chunk(ops, lo, min(n, lo + CHUNK))
            _step(fp32_step, part, args.at(args.index + lo))
    return step_int4


def _step(fp32_step, ops, args) -> None:
    first, second, scales = ops.moments
    n = ops.grad.numel()
    m = decode(first, n, scales[:, 0], FIRST)
    v = decode(second, n, scales[:, 1], SECOND)
    # The float32 step keeps m and v where found_inf is set (on the device); encoding
    # them again gives the codes they came from.
    fp32_step(ops._replace(moments=(m, v, None)), args.replace(amsgrad=False))
    quantize(m, FIRST, first, scales[:, 0])
    quantize(v, SECOND, second, scales[:, 1])
