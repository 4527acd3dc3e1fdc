"""``moments="bf16"``: the Adam moments of a shard in bfloat16, 4 bytes per parameter for
both where ``fp32`` takes 8, written back by stochastic rounding
(``zero_triton.kernels.rounding``).

Round-to-nearest cannot move a bf16 value by less than half its last place, 0.2-0.4% of
it, and ``exp_avg_sq`` moves by ``1 - beta2`` = 0.1% a step: it would stop decaying.
Rounding up with the probability of the fraction dropped keeps each moment's expected
value exact. The random bits are a hash of (the flat buffer's number, the step, the
moment, the element's index in the canonical layout): the same at every world size and
bucket size, so ZeroAdam's result does not depend on them, and a resumed run continues
bit for bit. (DTensor parameters: the index is the element's place in this rank's local
shards, which the engine picks.)

Kernel operands: exp_avg and exp_avg_sq (bfloat16) and None; the step also takes
``seed`` and ``index`` (the canonical index of the run's first element), which the
optimizer passes to formats whose ``keyed`` is True. ``export`` is a float32 copy;
``commit`` rounds what was written to nearest (an edit or a load is not a step).
What it cannot store: amsgrad's running maximum, float64 moments.
"""
from __future__ import annotations

import torch

from .flat import ALIGN
from .keys import FIRST, SECOND
from .lowbit import NoMaximum


class Bf16Moments(NoMaximum):
    """exp_avg and exp_avg_sq of a shard in bfloat16."""

    format = "bf16"
    align = ALIGN
    block = 1  # each element rounded by itself
    live = False   # export() is a float32 copy
    keyed = True   # the step's rounding is keyed by element index

    def __init__(self, numel: int, dtype: torch.dtype, device, amsgrad: bool = False):
        self.check(dtype, amsgrad)
        self.numel, self.dtype, self.device = numel, dtype, device
        self.exp_avg = torch.zeros(numel, dtype=torch.bfloat16, device=device)
        self.exp_avg_sq = torch.zeros(numel, dtype=torch.bfloat16, device=device)

    def operands(self, a: int, b: int, amsgrad: bool) -> tuple:
        self.check(None, amsgrad)
        return self.exp_avg[a:b], self.exp_avg_sq[a:b], None

    def reset(self, amsgrad: bool | None = None) -> None:
        self.check(None, amsgrad)
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()

    def export(self) -> dict:
        return {FIRST: self.exp_avg.float(), SECOND: self.exp_avg_sq.float()}

    def commit(self, exported: dict) -> None:
        self.exp_avg.copy_(exported[FIRST])
        self.exp_avg_sq.copy_(exported[SECOND])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.storage())

    def storage(self) -> list:
        return [self.exp_avg, self.exp_avg_sq]

    # -- the compact state dict (zero_triton.optim.compact) -------------------------
    COMPACT = (FIRST, SECOND)

    @staticmethod
    def compact(first: torch.Tensor, second: torch.Tensor, shape, stride) -> dict:
        """One parameter's moments (float32, flat in its memory order ``stride``) as the
        compact state dict holds them: bfloat16, shaped and strided as the parameter
        (the store's values exactly: they are bfloat16 already)."""
        out = {}
        for key, values in ((FIRST, first), (SECOND, second)):
            t = torch.empty_strided(shape, stride, dtype=torch.bfloat16)
            t.as_strided((values.numel(),), (1,)).copy_(values)
            out[key] = t
        return out

    @staticmethod
    def expand(entry: dict, where: str) -> dict:
        """``compact``'s entry as torch's float32 moments."""
        out = {}
        for key in (FIRST, SECOND):
            t = entry.get(key)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16:
                raise ValueError(f"{where}: a compact bf16 entry holds {key} in bfloat16; this "
                                 "one does not. Save it again with state_dict(compact=True)")
            out[key] = t.float()
        return out

    def carry_over(self, old) -> None:
        self.commit({k: v.to(self.device, torch.float32) for k, v in old.export().items()
                     if k in (FIRST, SECOND)})

