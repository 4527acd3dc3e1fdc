"""Clipping's math: the global norm of the averaged gradients over every rank's shards, and
the coefficient that the next step's kernel applies (``FusedAdam.clip_grad_norm_``)."""
from __future__ import annotations

import math

import torch


def global_norm(shards: list, comm, norm_type: float) -> torch.Tensor:
    """The ``norm_type`` norm of the gradient whose pieces are every rank's ``shards``
    (one all-reduce over ``comm``, no host sync), a 0-dim float32 tensor."""
    device = shards[0].device
    if norm_type == math.inf:
        parts = [g.abs().max().float() if g.numel() else torch.zeros((), device=device)
                 for g in shards]
        total = torch.stack([p.to(device) for p in parts]).max()
        comm.all_reduce(total, "max")
        return total
    # Over ranks, in float64: the sum of per-shard parts then rounds to the same float32
    # for any bucket size (whose shards split the sum differently).
    acc = torch.float64 if comm.world_size > 1 else torch.float32
    parts = [torch.linalg.vector_norm(g, norm_type, dtype=acc) ** norm_type for g in shards]
    total = torch.stack([p.to(device) for p in parts]).sum()
    comm.all_reduce(total, "sum")
    return (total ** (1.0 / norm_type)).float()


def coefficient(total: torch.Tensor, max_norm: float, grad_scale, previous):
    """(the norm as torch's clip_grad_norm_ reports it, the coefficient for the kernel).
    ``grad_scale``: GradScaler's scale when the gradients are still scaled; ``previous``:
    this step's coefficient if it was clipped already, as a second call of torch's
    function would see the clipped gradients and clip them again (the two multiply)."""
    if grad_scale is not None:
        total = total / grad_scale.to(total.device, torch.float32).reshape(())
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0).reshape(1)
    if previous is not None:
        total = total * previous.reshape(())
        coef = previous * torch.clamp(max_norm / (total + 1e-6), max=1.0).reshape(1)
    return total, coef
