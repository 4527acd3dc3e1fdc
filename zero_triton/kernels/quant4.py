"""The 4-bit moment codes (``moments="int4"``, ``zero_triton.state.int4``): the 8-bit
codes' block-scaled minifloats (``zero_triton.kernels.quant``) with fewer bits, two codes
to a byte, and the step over them.

- ``exp_avg`` (``FIRST``): a sign and an E3M0 minifloat: the powers of two 2^-6 .. 1 of
  the block's largest (the nearest in value), values below 2^-6.5 of it to zero.
- ``exp_avg_sq`` (``SECOND``): an E3M1 minifloat with no sign: 8 binades [2^-7, 1], one
  mantissa bit; a positive value never becomes zero (below the range it takes the
  smallest code: its step is shortened, never blown up by ``m / eps``). In a step it is
  **rounded stochastically** (``quantize_stochastic``), and so is its block's scale.

Why stochastic for the second moment: it moves by ``1 - beta2`` (0.1%) a step, and a code's
step is 33-50% of its value (a bfloat16 scale's, 0.4-0.8%): rounded to nearest, a decaying
``exp_avg_sq`` stays where it is, only growing ones move, and every later step is
shortened. Rounded up with the probability of the fraction past the code below, its mean
is its value. The bits come from ``zero_triton.kernels.rounding``'s counter-based hash of
(seed, step, stream, canonical index): each element's code from its own index
(``SECOND_STREAM``), each block's scale, its largest magnitude rounded to bfloat16, from
its first element's (``SCALE_STREAM``); the element whose magnitude is the largest takes
the top code (it decodes to the scale). The same bits at every world size and layout, on
every backend. The project's GPT (2,000 steps, the train loss over torch AdamW fp32's,
the mean of seeds 0-2): fp32 parameters 1.0146 -> 1.0006, bf16 ones with
``"remainder8"`` 1.0126 -> 0.9913 (``docs/low-bit-state.md``). ``exp_avg`` stays rounded
to nearest: it moves by 10% a step, and rounding it stochastically as well moved the loss
less than a seed does (0.9947 against 0.9972, one seed, a simulation of the format).

The maps (the same GPT, the moments held in 4 bits between float32 steps, before the
stochastic rounding): E3M0 / E3M1 1.0146 and 1.0126, E3M0 / E4M0 1.0181 and 1.0144, E2M1 /
E4M0 1.0469 against E3M0 / E4M0's 1.0246 (one seed): the first moment needs range more
than precision.

Blocks of ``BLOCK`` (128) state elements, each with one bfloat16 scale per moment (its
largest magnitude, rounded): smaller blocks than the 8-bit format's 256, as Li et al.
(2023, "Memory Efficient Optimizers with 4-bit States") found 4-bit moments need (256
trained worse in both seeds tried), with scales of 2 bytes, so that the format costs
(0.5 + 2/128) bytes per moment per element: 1.03 bytes per parameter for both. Element ``2k``
of a run takes the low nibble of byte ``k``, ``2k + 1`` the high one; a signed code is
its 4-bit two's complement.

The step (``stepper``, for backends without a 4-bit kernel) decodes a run's moments to
float32, runs the backend's float32 step on them, and encodes them with their blocks' new
scales, in torch ops on the state's device. Decoding and encoding again (to nearest, or
stochastically by any bits) gives the same codes and scales (every code's value is
exact, the largest element's is its scale), so a state exported dequantized and loaded
back is the same bit for bit, and a skipped step (GradScaler's inf) keeps it.
"""
from __future__ import annotations

import torch

from zero_triton.kernels import quant, rounding

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


def stochastic_scales(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``SECOND``'s block scales of float32 ``x`` in a step: each block's largest magnitude
    rounded to bfloat16 stochastically by ``bits`` (int64, one per block; NaN stays NaN)."""
    return rounding.to_bf16_stochastic(quant.block_absmax(x, BLOCK), bits)


def encode_stochastic(x: torch.Tensor, scale: torch.Tensor, bits: torch.Tensor,
                      fmt: quant.Minifloat = SECOND) -> torch.Tensor:
    """The codes (one per element) of float32 ``x`` (>= 0) under its blocks' ``scale``,
    rounded stochastically (``encode_stochastic_each``) by ``bits`` (int64, one per
    element); the block's largest (by its bits) takes the top code."""
    n = x.numel()
    by_block = quant._by_block(x, BLOCK)
    each = scale.float()[:, None].expand(-1, BLOCK).reshape(-1)[:n]
    most = (by_block.view(torch.int32) & 0x7FFFFFFF).amax(dim=1, keepdim=True)
    return encode_stochastic_each(x, each, bits, most.expand(-1, BLOCK).reshape(-1)[:n], fmt)


def encode_stochastic_each(x: torch.Tensor, scale: torch.Tensor, bits: torch.Tensor,
                           most: torch.Tensor, fmt: quant.Minifloat = SECOND) -> torch.Tensor:
    """``encode_stochastic`` with each element's block scale, bits and block's largest
    magnitude (int32 bits) given beside it (all of ``x``'s shape): ``r = |x| / scale`` (0
    where the scale is not positive) rounded up to the next code with the probability of
    the fraction past the one below (the low ``fmt.shift`` of ``bits`` added to r's bits
    before they are dropped); a positive value never code 0; the element whose magnitude
    is ``most`` (not 0) takes the top code, which decodes to the scale."""
    r = torch.where(scale > 0, x.abs() / torch.where(scale > 0, scale, 1.0), 0.0)
    codes = quant._codes(x, r, fmt, added=(bits & ((1 << fmt.shift) - 1)).to(torch.int32))
    mag = x.view(torch.int32) & 0x7FFFFFFF
    return codes.masked_fill_((mag == most) & (mag != 0), fmt.top)


def quantize_stochastic(x: torch.Tensor, packed_codes: torch.Tensor, scale: torch.Tensor,
                        keys: tuple, index0: int) -> None:
    """Encode float ``x`` (``SECOND``: exp_avg_sq of a run starting on a block boundary,
    its element 0 at canonical index ``index0``) into ``packed_codes`` and ``scale`` as
    the step does: rounded stochastically (``encode_stochastic``, ``stochastic_scales``),
    by the bits of ``keys`` (the step's keys of ``rounding.SECOND_STREAM`` and
    ``rounding.SCALE_STREAM``: ints, or ``rounding.key_at``'s tensors) at each element's
    index and at each block's first."""
    x = x.float()
    n = x.numel()
    index = torch.arange(index0, index0 + n, dtype=torch.int64, device=x.device)
    s = stochastic_scales(x, rounding.random_bits_at(keys[1], index[::BLOCK].contiguous()))
    pack(encode_stochastic(x, s, rounding.random_bits_at(keys[0], index)), packed_codes)
    scale.copy_(s)


def step_keys(step: torch.Tensor, seed: int, tmp=None) -> tuple:
    """The keys ``quantize_stochastic`` takes at the step count ``step`` holds (float32
    [1] on the device: nothing read on the host); ``tmp``: a ``state.buffers.Scratch``
    to take them from (new tensors without)."""
    out = []
    for stream in (rounding.SECOND_STREAM, rounding.SCALE_STREAM):
        if tmp is None:
            k, t = (torch.empty(1, dtype=torch.int64, device=step.device) for _ in range(2))
        else:
            k, t = (tmp((name, stream), (1,), torch.int64) for name in ("key", "key scratch"))
        out.append(rounding.key_at(step, seed, stream, k, t))
    return tuple(out)


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
    quantize_stochastic(v, second, scales[:, 1], step_keys(ops.step, args.seed), args.index)
