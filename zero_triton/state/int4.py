"""``moments="int4"``: the Adam moments of a shard as 4-bit codes, two to a byte, with one
bfloat16 scale per moment per block of 128 state elements (the codes:
``zero_triton.kernels.quant4``).

Memory: half a byte per moment per element plus 4 bytes per block of 128 (two scales):
1.03 bytes per parameter where ``fp32`` takes 8 and ``int8`` 2.03.

As for ``int8`` (``zero_triton.state.int8``), the blocks are the layout's: every
parameter starts on a block boundary (``ALIGN``), so every bucket and every rank's shard
does too, and each block holds the same elements at any world size and bucket size; the
step of a block reads only that block, so the state is the same bit for bit at 1 rank or
64. A parameter's last block is completed by padding, whose moments stay zero (a run of
an odd length leaves the high nibble of its last byte, a padding element's, zero).

Kernel operands (``operands``): the run's packed codes of each moment (uint8) and its
scales, bfloat16 [blocks, 2]; the step rounds ``exp_avg_sq`` stochastically, keyed by each
element's canonical index (``keyed``). ``export`` dequantizes (a copy, float32 in torch's
keys); ``commit`` encodes it back (to nearest: an exported state comes back bit for bit).
No amsgrad maximum, no float64 moments (refused with the fix). DTensor parameters stepped
through their rows (a tensor-parallel cut): ``zero_triton.state.int4_rows``.
"""
from __future__ import annotations

import torch

from zero_triton.kernels import quant4

from .int8 import compact_codes, expand_codes
from .keys import FIRST, SECOND
from .lowbit import NoMaximum

BLOCK = quant4.BLOCK
ALIGN = BLOCK


class Int4Moments(NoMaximum):
    """exp_avg and exp_avg_sq of a shard as block-scaled 4-bit codes."""

    format = "int4"
    align = ALIGN
    block = BLOCK
    live = False   # export() is a dequantized copy
    keyed = True   # exp_avg_sq is rounded stochastically, keyed by element

    def __init__(self, numel: int, dtype: torch.dtype, device, amsgrad: bool = False):
        self.check(dtype, amsgrad)
        self.numel, self.dtype, self.device = numel, dtype, device
        self.exp_avg = torch.zeros(quant4.packed(numel), dtype=torch.uint8, device=device)
        self.exp_avg_sq = torch.zeros(quant4.packed(numel), dtype=torch.uint8, device=device)
        self.scales = torch.zeros(quant4.blocks(numel), 2, dtype=quant4.SCALE_DTYPE, device=device)

    def operands(self, a: int, b: int, amsgrad: bool) -> tuple:
        self.check(None, amsgrad)
        if a % BLOCK:
            raise ValueError(f"int4 moments are stepped from a block boundary (a multiple of "
                             f"{BLOCK}), got state element {a}")
        lo, hi = a // 2, quant4.packed(b)
        return (self.exp_avg[lo:hi], self.exp_avg_sq[lo:hi],
                self.scales[a // BLOCK:a // BLOCK + quant4.blocks(b - a)])

    def reset(self, amsgrad: bool | None = None) -> None:
        self.check(None, amsgrad)
        for t in self.storage():
            t.zero_()

    def export(self) -> dict:
        n = self.numel
        return {FIRST: quant4.decode(self.exp_avg, n, self.scales[:, 0], quant4.FIRST),
                SECOND: quant4.decode(self.exp_avg_sq, n, self.scales[:, 1], quant4.SECOND)}

    def commit(self, exported: dict) -> None:
        quant4.quantize(exported[FIRST], quant4.FIRST, self.exp_avg, self.scales[:, 0])
        quant4.quantize(exported[SECOND], quant4.SECOND, self.exp_avg_sq, self.scales[:, 1])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.storage())

    def storage(self) -> list:
        """The tensors this store holds (what a loaded state dict might alias)."""
        return [self.exp_avg, self.exp_avg_sq, self.scales]

    # -- the compact state dict (zero_triton.optim.compact) -------------------------
    # One code a byte, shaped as the parameter (packing them two to a byte, as the store
    # does, would lose the parameter's shape): int8's bytes, a quarter of torch's.
    COMPACT = ("exp_avg_codes4", "exp_avg_sq_codes4", "moment_scales4")
    CODES = (quant4.FIRST, quant4.SECOND)  # each moment's codes
    SCALE_DTYPE = quant4.SCALE_DTYPE

    def codes(self, a: int, b: int) -> tuple:
        """The codes of state elements [a, b) (``a`` on a block boundary), one per element
        (int8, uint8): unpacked copies."""
        return tuple(quant4.unpack(t[a // 2:quant4.packed(b)], b - a, fmt)
                     for t, fmt in zip((self.exp_avg, self.exp_avg_sq), self.CODES))

    @staticmethod
    def compact(first: torch.Tensor, second: torch.Tensor, shape, stride) -> dict:
        """One parameter's moments (float32, flat in its memory order ``stride``, whose
        blocks are the store's) as the compact state dict holds them: the codes, shaped
        and strided as the parameter, and its blocks' scales, bfloat16 [blocks, 2]."""
        return compact_codes(first, second, shape, stride, Int4Moments.COMPACT,
                             (quant4.FIRST, quant4.SECOND), BLOCK, quant4.scales_of)

    @staticmethod
    def expand(entry: dict, where: str) -> dict:
        """``compact``'s entry as torch's float32 moments (the codes' shape and strides);
        ``where`` names the entry in the error for a malformed one."""
        return expand_codes(entry, where, Int4Moments.COMPACT, (quant4.FIRST, quant4.SECOND),
                            BLOCK, quant4.SCALE_DTYPE, "int4")

    def carry_over(self, old) -> None:
        if isinstance(old, Int4Moments) and old.numel == self.numel:
            for mine, theirs in zip(self.storage(), old.storage()):
                mine.copy_(theirs)
            return
        self.commit({k: v.to(self.device, torch.float32) for k, v in old.export().items()
                     if k in (FIRST, SECOND)})
