"""``zero_triton.overlap(model, optimizer)``: the optimizer's parameter all-gathers
overlapped with the next forward. The hooks that wait are ``zero_triton.comm.prefetch``'s;
here the optimizer hands them its buckets and takes them back on ``remove()``."""
from __future__ import annotations

import weakref

import torch

from zero_triton.comm.prefetch import ParamPrefetch
from zero_triton.optim.fused import FusedAdam
from zero_triton.optim.seat import seat_of


def overlap(model: torch.nn.Module, optimizer) -> ParamPrefetch:
    """Overlap ``optimizer``'s parameter all-gathers with ``model``'s next forward.

    ``optimizer`` is a ZeroAdam (any zero_triton optimizer is accepted; at world size 1
    there is nothing to gather). ``model`` is the module whose parameters it trains (a
    DistributedDataParallel or accelerate wrapper is fine). Returns a handle whose
    ``remove()`` undoes it."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"zero_triton.overlap(model, optimizer): model must be a torch.nn.Module, "
                        f"got {type(model).__name__}")
    if not isinstance(optimizer, FusedAdam):
        raise TypeError(f"zero_triton.overlap(model, optimizer): optimizer must be a zero_triton "
                        f"optimizer (ZeroAdam, ZeroAdamW), got {type(optimizer).__name__}")
    owned = {id(p) for p in model.parameters()}
    trained = [p for g in optimizer.param_groups for p in g["params"]]
    if trained and not any(id(p) in owned for p in trained):
        raise ValueError("zero_triton.overlap(model, optimizer): none of the optimizer's parameters "
                         "belongs to model; pass the model the optimizer was built from")
    seat = seat_of(optimizer)  # its declared face
    if seat.overlap is not None:
        seat.overlap.remove()
    seat.reducer.set_overlapped(True)
    prefetch = ParamPrefetch(model, seat.reducer, weakref.WeakMethod(seat.overlap_removed))
    seat.overlap = prefetch
    return prefetch
