"""torch.amp.GradScaler under ZeroAdam: every rank agrees on found_inf.

``install`` patches ``GradScaler._unscale_grads_`` and ``unscale_`` (once, when the first
ZeroAdam is built): a zero_triton optimizer is called from them through its declared
interface (``optim.interface.internals``: ``unscale_grads_``, ``agree_found_inf_``,
``grads_rescaled``); any other optimizer is untouched.
"""
from __future__ import annotations

import functools

import torch

from zero_triton.integrations import patching
from zero_triton.optim.interface import internals


class ZeroGradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler, kept as a name for scripts that use it.

    A plain ``torch.amp.GradScaler`` is now correct under ZeroAdam: every rank agrees on
    the inf/nan flag wherever the scaler records it (``unscale_`` and ``step``), so all
    ranks skip together and keep one scale (what FSDP's ShardedGradScaler does).
    ``process_group`` is accepted for compatibility; the optimizer's group is used.
    """

    def __init__(self, device="cpu", *, process_group=None, **kwargs):
        super().__init__(device, **kwargs)
        self.process_group = process_group


def install() -> None:
    """Make torch.amp.GradScaler (and torch.cuda.amp's subclass) agree on found_inf
    over a ZeroAdam's process group.

    Under ZeRO the gradients are averaged inside ``step()``, after GradScaler has looked
    at each rank's local ones: without agreement a rank whose local gradients are finite
    keeps its scale while another backs off, and every later average mixes scales.
    GradScaler records its per-device flags in ``_unscale_grads_`` and reads those same
    tensors in ``update()``; all-reducing them in place (MAX, on the device, no host
    sync) right there fixes both the skip and the scale. Optimizers without
    ``agree_found_inf_`` are untouched."""
    cls = torch.amp.GradScaler
    if getattr(cls._unscale_grads_, "_zero_triton_agrees", False):
        return
    original = vars(cls).get("_unscale_grads_")
    original_unscale = vars(cls).get("unscale_")
    if not callable(original) or not callable(original_unscale):
        patching.skipped("grad_scaler", "torch.amp.GradScaler._unscale_grads_/unscale_",
                         "under ZeroAdam at 2+ ranks the ranks may disagree on found_inf; "
                         "clip and check for inf yourself, or train without a scaler (bf16)")
        return

    @functools.wraps(original)
    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device = original(self, optimizer, inv_scale, found_inf, allow_fp16)
        view = internals(optimizer)
        if view is not None:  # ZeRO-2's gradients are the optimizer's shards; every rank agrees
            view.unscale_grads_(inv_scale, found_inf, per_device, allow_fp16)
            view.agree_found_inf_(per_device)
        return per_device

    _unscale_grads_._zero_triton_agrees = True
    patching.set_attr("grad_scaler", cls, "_unscale_grads_", _unscale_grads_)

    @functools.wraps(original_unscale)
    def unscale_(self, optimizer):
        # unscale_ rescales .grad in place with an op that leaves the version counter
        # alone: a ZeroAdam whose buckets averaged them during backward must know.
        out = original_unscale(self, optimizer)
        view = internals(optimizer)
        if view is not None and getattr(self, "_enabled", True):
            view.grads_rescaled()
        return out

    patching.set_attr("grad_scaler", cls, "unscale_", unscale_)
