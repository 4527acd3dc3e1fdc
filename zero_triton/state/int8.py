"""``moments="int8"``: the Adam moments of a shard as 8-bit codes with one float32 scale
per block of ``BLOCK`` state elements (the codes: ``zero_triton.kernels.quant``).

Memory: one byte per moment per element plus 8 bytes per block of 256 (two scales):
2.03 bytes per parameter where ``fp32`` takes 8.

The blocks are the layout's, not a shard's: a flat buffer of this format is laid out
with every parameter starting on a block boundary (``ALIGN``: the layout's alignment),
so every bucket and every rank's shard of it starts on one too, and each block holds the
same elements of the same parameter at any world size and any bucket size. The step of
a block reads only that block; so the codes, and the parameters they step, are the same
bit for bit at 1 rank or 64, and a checkpoint written at one world size loads at another
exactly. A parameter's last block is completed by padding, whose moments stay zero.

Kernel operands (``operands``): the first moment's codes (int8), the second's (uint8)
and the run's scales, float32 [blocks, 2] (first, second): the step decodes each block,
updates it in float32 as the ``fp32`` format's kernels do, and encodes it again with the
block's new largest magnitudes as scales: one read and one write of each.

``export`` dequantizes (a copy, float32 in torch's keys); ``commit`` encodes it back.
What the format cannot store: the running maximum of amsgrad, float64 moments (the
constructors refuse both with the fix, ``zero_triton.optim.spec``).
"""
from __future__ import annotations

import torch

from zero_triton.kernels import quant

from .keys import FIRST, SECOND
from .lowbit import NoMaximum

BLOCK = quant.BLOCK
ALIGN = BLOCK


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers its memory without gaps or overlaps (``empty_like`` keeps
    exactly those strides)."""
    return t.is_contiguous() or torch.empty_like(t).stride() == t.stride()


def compact_codes(first: torch.Tensor, second: torch.Tensor, shape, stride, keys: tuple,
                  formats: tuple, block: int, scales_of) -> dict:
    """One parameter's moments (float32, flat in its memory order ``stride``, starting on a
    block boundary) as a compact entry of block-scaled codes under ``keys``: the codes
    (``formats``) shaped and strided as the parameter, and the scales of its blocks of
    ``block`` [blocks, 2], as ``scales_of(x)`` gives them (their dtype is the store's)."""
    n = first.numel()
    out = {}
    for key, x, fmt, col in ((keys[0], first, formats[0], 0), (keys[1], second, formats[1], 1)):
        x = x.float()
        s = scales_of(x)
        if col == 0:
            out[keys[2]] = torch.zeros(quant.blocks(n, block), 2, dtype=s.dtype)
        codes = torch.empty_strided(shape, stride, dtype=fmt.dtype)
        codes.as_strided((n,), (1,)).copy_(quant.encode(x, s.float(), fmt, block))
        out[keys[2]][:, col] = s
        out[key] = codes
    return out


def expand_codes(entry: dict, where: str, keys: tuple, formats: tuple, block: int,
                 scale_dtype: torch.dtype, name: str) -> dict:
    """A compact entry of block-scaled codes (``keys``: the first and second moments'
    codes, shaped as the parameter, and their scales [blocks of ``block``, 2] of
    ``scale_dtype``; ``formats``: the moments' ``quant.Minifloat``) as torch's float32
    moments (the codes' shape and strides); ``where`` names it in the error for a
    malformed one, ``name`` the format."""
    first, second, scales = (entry.get(k) for k in keys)
    n = first.numel() if isinstance(first, torch.Tensor) else -1
    ok = (isinstance(first, torch.Tensor) and first.dtype == formats[0].dtype
          and isinstance(second, torch.Tensor) and second.dtype == formats[1].dtype
          and second.shape == first.shape and second.stride() == first.stride()
          and _dense(first)
          and isinstance(scales, torch.Tensor) and scales.dtype == scale_dtype
          and tuple(scales.shape) == (quant.blocks(n, block), 2))
    if not ok:
        raise ValueError(
            f"{where}: a compact {name} entry holds {keys[0]} (int8) and {keys[1]} (uint8) "
            f"of the parameter's shape and {keys[2]} ({str(scale_dtype).replace('torch.', '')} "
            f"[ceil(numel / {block}), 2]); this one does not. Save it again with "
            "state_dict(compact=True)")
    out = {}
    for key, codes, fmt, col in ((FIRST, first, formats[0], 0), (SECOND, second, formats[1], 1)):
        values = torch.empty_strided(codes.shape, codes.stride(), dtype=torch.float32,
                                     device=codes.device)
        values.as_strided((n,), (1,)).copy_(quant.decode(
            codes.as_strided((n,), (1,)), scales[:, col].to(codes.device).float(), fmt, block))
        out[key] = values
    return out


class Int8Moments(NoMaximum):
    """exp_avg and exp_avg_sq of a shard as block-scaled 8-bit codes."""

    format = "int8"
    align = ALIGN
    block = BLOCK  # elements quantized together (one scale per moment)
    live = False  # export() is a dequantized copy
    keyed = False  # its rounding is to nearest: the step takes no element index

    def __init__(self, numel: int, dtype: torch.dtype, device, amsgrad: bool = False):
        self.check(dtype, amsgrad)
        self.numel, self.dtype, self.device = numel, dtype, device
        self.exp_avg = torch.zeros(numel, dtype=quant.FIRST.dtype, device=device)
        self.exp_avg_sq = torch.zeros(numel, dtype=quant.SECOND.dtype, device=device)
        self.scales = torch.zeros(quant.blocks(numel), 2, dtype=torch.float32, device=device)

    def operands(self, a: int, b: int, amsgrad: bool) -> tuple:
        self.check(None, amsgrad)
        if a % BLOCK:
            raise ValueError(f"int8 moments are stepped from a block boundary (a multiple of "
                             f"{BLOCK}), got state element {a}")
        return (self.exp_avg[a:b], self.exp_avg_sq[a:b],
                self.scales[a // BLOCK:a // BLOCK + quant.blocks(b - a)])

    def reset(self, amsgrad: bool | None = None) -> None:
        self.check(None, amsgrad)
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        self.scales.zero_()

    def export(self) -> dict:
        return {FIRST: quant.decode(self.exp_avg, self.scales[:, 0], quant.FIRST),
                SECOND: quant.decode(self.exp_avg_sq, self.scales[:, 1], quant.SECOND)}

    def commit(self, exported: dict) -> None:
        quant.quantize(exported[FIRST], quant.FIRST, self.exp_avg, self.scales[:, 0])
        quant.quantize(exported[SECOND], quant.SECOND, self.exp_avg_sq, self.scales[:, 1])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.exp_avg, self.exp_avg_sq, self.scales))

    def storage(self) -> list:
        """The tensors this store holds (what a loaded state dict might alias)."""
        return [self.exp_avg, self.exp_avg_sq, self.scales]

    # -- the compact state dict (zero_triton.optim.compact) -------------------------
    COMPACT = ("exp_avg_codes", "exp_avg_sq_codes", "moment_scales")
    CODES = (quant.FIRST, quant.SECOND)  # each moment's codes
    SCALE_DTYPE = torch.float32

    def codes(self, a: int, b: int) -> tuple:
        """The codes of state elements [a, b), one per element (int8, uint8)."""
        return self.exp_avg[a:b], self.exp_avg_sq[a:b]

    @staticmethod
    def decoded(first: torch.Tensor, second: torch.Tensor, scales: torch.Tensor) -> dict:
        """Codes over a run of whole blocks and their scales [blocks, 2] as torch's
        float32 moments."""
        return {FIRST: quant.decode(first, scales[:, 0], quant.FIRST),
                SECOND: quant.decode(second, scales[:, 1], quant.SECOND)}

    def stored(self) -> dict:
        """The storage itself under the compact names (codes over the shard in state
        order, scales [blocks, 2]): what a compact checkpoint file writes."""
        return dict(zip(self.COMPACT, (self.exp_avg, self.exp_avg_sq, self.scales)))

    @staticmethod
    def compact(first: torch.Tensor, second: torch.Tensor, shape, stride) -> dict:
        """One parameter's moments (float32, flat in its memory order ``stride``, whose
        blocks are the store's: a parameter starts on a block boundary) as the compact
        state dict holds them: the codes, shaped and strided as the parameter, and the
        scales of its blocks, float32 [blocks, 2] (exp_avg's, exp_avg_sq's)."""
        return compact_codes(first, second, shape, stride, Int8Moments.COMPACT,
                             (quant.FIRST, quant.SECOND), BLOCK,
                             lambda x: quant.block_absmax(x, BLOCK))

    @staticmethod
    def expand(entry: dict, where: str) -> dict:
        """``compact``'s entry as torch's float32 moments (the codes' shape and strides);
        ``where`` names the entry in the error for a malformed one."""
        return expand_codes(entry, where, Int8Moments.COMPACT, (quant.FIRST, quant.SECOND),
                            BLOCK, torch.float32, "int8")

    def carry_over(self, old) -> None:
        if isinstance(old, Int8Moments) and old.numel == self.numel:
            for mine, theirs in zip(self.storage(), old.storage()):
                mine.copy_(theirs)
            return
        self.commit({k: v.to(self.device, torch.float32) for k, v in old.export().items()
                     if k in (FIRST, SECOND)})

