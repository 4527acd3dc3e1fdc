"""``moments="int4"`` for DTensor parameters stepped through their rows: the same codes and
scales as the whole parameter's, at every layout (``zero_triton.state.int8_rows`` says
when a parameter is stepped so, and how the ranks that cut a row agree on its blocks'
scales).

What differs from int8's: blocks of 128 with bfloat16 scales, the codes two to a byte (a
piece's in local order from its state offset, a block boundary), and ``exp_avg_sq``
rounded stochastically as the kernels round it (``zero_triton.kernels.quant4``): each
block's scale from the agreed largest magnitude by the bits of the block's first
element's canonical index, each element's code by its own index's bits, the element
whose magnitude is the agreed largest the top code. Every rank that holds a part of a
block computes the same scale, and the codes the kernel would give its part.
"""
from __future__ import annotations

import torch

from zero_triton.kernels import quant4, rounding

from .int4 import Int4Moments
from .int8_rows import Int8RowMoments, RowBlocks


class RowBlocks4(RowBlocks):
    """The 4-bit moments of one piece stepped through its rows (``RowBlocks``' geometry)."""

    def keys(self, step: torch.Tensor, seed: int, tmp=None) -> tuple:
        return quant4.step_keys(step, seed, self._scratch(tmp))

    def _block_starts(self, shape) -> torch.Tensor:
        """The canonical index of the first element of each block of the table, int64."""
        rows = self.map.rows.to(self.table.device)
        blocks = torch.arange(shape[1], dtype=torch.int64, device=rows.device) * self.block
        return self.map.base + rows[:, None] * self.map.cols + blocks[None, :]

    def _scales(self, agreed: torch.Tensor, keys, tmp) -> torch.Tensor:
        most = agreed.view(torch.float32)
        out = tmp("scales4", tuple(most.shape), quant4.SCALE_DTYPE)
        out[..., 0].copy_(most[..., 0])  # exp_avg's: to nearest (even)
        if keys is None:
            out[..., 1].copy_(most[..., 1])
        else:
            bits = rounding.random_bits_at(keys[1], self._block_starts(most.shape))
            out[..., 1].copy_(rounding.to_bf16_stochastic(most[..., 1].contiguous(), bits))
        return out

    def _encode(self, x, col: int, fmt, scales, agreed, keys, out, tmp) -> None:
        if col == 0 or keys is None:
            super()._encode(x, col, fmt, scales, agreed, keys, out, tmp)
            return
        scale = self._per_element(scales, col, tmp).clone()
        most = self._per_element(agreed.view(torch.float32), col, tmp).view(torch.int32)
        bits = rounding.random_bits_at(keys[0], self.map.index(x.device)).view(self.shape)
        out.copy_(quant4.encode_stochastic_each(x, scale, bits, most, fmt))

    def _write(self, col: int, codes: torch.Tensor) -> None:
        n = self.map.numel
        store = (self.store.exp_avg, self.store.exp_avg_sq)[col]
        quant4.pack(codes.reshape(-1), store[self.s0 // 2:self.s0 // 2 + quant4.packed(n)])


class Int4RowMoments(Int8RowMoments):
    """exp_avg and exp_avg_sq of DTensor local shards stepped through their rows, as
    4-bit codes (``Int8RowMoments``' scales by row, bfloat16)."""

    format = "int4"
    align = quant4.BLOCK
    block = quant4.BLOCK
    keyed = True  # exp_avg_sq is rounded stochastically, keyed by element
    CODES = Int4Moments.CODES
    COMPACT = Int4Moments.COMPACT
    SCALE_DTYPE = quant4.SCALE_DTYPE
    blocks = RowBlocks4

    @staticmethod
    def _codes_storage(numel: int, device) -> tuple:
        return tuple(torch.zeros(quant4.packed(numel), dtype=torch.uint8, device=device)
                     for _ in range(2))

    def codes(self, a: int, b: int) -> tuple:
        return Int4Moments.codes(self, a, b)

    def _held(self, a: int, b: int) -> tuple:
        return self.exp_avg[a // 2:quant4.packed(b)], self.exp_avg_sq[a // 2:quant4.packed(b)]
