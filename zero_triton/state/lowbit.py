"""What the low-bit moment stores share (``zero_triton.state.int8``, ``zero_triton.state.bf16``):
they store no running maximum (amsgrad) and hold float32 state only, and refuse the rest
with the fix."""
from __future__ import annotations

import torch


class NoMaximum:
    """A store of exp_avg and exp_avg_sq of float32 state, without amsgrad's maximum."""

    format: str

    @classmethod
    def refusal(cls, what: str) -> str:
        """Why this format cannot hold ``what``, with the fix."""
        return (f"moments={cls.format!r} cannot be used with {what}: it holds exp_avg and "
                "exp_avg_sq of float32 state only (no amsgrad maximum, no float64); use "
                "moments='fp32' for these parameters (another optimizer or param group)")

    @classmethod
    def check(cls, dtype: torch.dtype | None, amsgrad: bool | None) -> None:
        """Refuse amsgrad, and parameters whose state is not float32 (``dtype`` None: not asked)."""
        if amsgrad:
            raise ValueError(cls.refusal("amsgrad=True"))
        if dtype is not None and dtype != torch.float32:
            raise ValueError(cls.refusal(f"{dtype} parameters"))

    @property
    def amsgrad(self) -> bool:
        return False

    def ensure_amsgrad(self) -> bool:
        raise ValueError(self.refusal("amsgrad=True"))
