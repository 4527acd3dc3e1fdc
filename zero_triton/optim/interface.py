"""What the layers above ``optim`` (checkpoint, integrations, tools) may read of an optimizer.

The optimizers' public face is torch.optim.Optimizer's plus a short documented list
(``docs/reference.md``). Everything else those layers need, they reach through
``internals(optimizer)``: one declared interface, so the optimizers' attributes stay
theirs and an integration names exactly what it depends on.

    view = internals(opt)          # None for any optimizer that is not ours
    if view is not None and view.comm.world_size > 1: ...
"""
from __future__ import annotations

from typing import Optional

from zero_triton.optim.fused import FusedAdam


class Internals:
    """A view of one FusedAdam or ZeroAdam for the layers above ``optim``. It holds the
    optimizer only while it is used: make one per use (``internals(opt)``)."""

    __slots__ = ("_opt",)

    def __init__(self, optimizer: FusedAdam):
        self._opt = optimizer

    @property
    def comm(self):
        """The communicator: ``rank``, ``world_size``, ``group`` (one rank: no group) and
        the collectives the step uses."""
        return self._opt._comm

    def shards(self, reader: Optional[str] = None) -> list:
        """(param group index, shard) of every shard, in order (``optim.shards``). With ``reader`` (the
        name of a call that reads the state, e.g. "checkpoint.save"), first follow what the
        user changed since the last such call (parameters moved or written, ``opt.state``
        edited), agreed by every rank under ZeRO: a collective there."""
        if reader is not None:
            self._opt._enter(reader)
        return [(gi, s) for gi, shards in enumerate(self._opt._shards.groups) for s in shards]

    def shards_loaded(self, shards) -> None:
        """A loader (``zero_triton.checkpoint``) wrote the master and moments of ``shards``
        and the parameters from them."""
        self._opt._shards_loaded(shards)

    # -- GradScaler's calls (zero_triton.integrations.grad_scaler) ----------------------
    def grads_rescaled(self) -> None:
        """GradScaler.unscale_ rescaled the local gradients in place (their version
        counters unchanged): averages taken from them are stale."""
        self._opt._pipeline.rescaled()

    def unscale_grads_(self, inv_scale, found_inf, per_device: dict, allow_fp16: bool) -> None:
        """Check (and unscale) the gradients GradScaler cannot see: ZeRO-2's shards."""
        self._opt._unscale_grads_(inv_scale, found_inf, per_device, allow_fp16)

    def agree_found_inf_(self, per_device: dict) -> None:
        """GradScaler's per-device inf flags, max-reduced over the ranks in place."""
        self._opt._agree_found_inf_(per_device)


def internals(optimizer) -> Optional[Internals]:
    """The declared interface of a zero_triton optimizer; None for any other object."""
    return Internals(optimizer) if isinstance(optimizer, FusedAdam) else None
