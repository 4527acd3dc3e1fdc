"""Clipping's math: the global norm of the averaged gradients over every rank's shards, and
the coefficient that the next step's kernel applies (``FusedAdam.clip_grad_norm_``)."""
from __future__ import annotations

import math

import torch


def global_norm(flats: list, comm, norm_type: float) -> torch.Tensor:
    """The ``norm_type`` norm of the gradient whose pieces are every rank's shards of
    ``flats`` (no host sync), a 0-dim float32 tensor: the shards' terms are reduced over
    ``comm`` (one all-reduce), or, for DTensor parameters' shards, over their meshes
    (``zero_triton.optim.local_shard``), as torch's clip_grad_norm_ reduces DTensors."""
    engine = [f.engine_owned for f in flats]
    if any(engine) and not all(engine):
        raise RuntimeError(
            "clip_grad_norm_ over DTensor parameters (FSDP2, tensor parallel) and plain ones "
            "together: the plain ones' ranks are not the meshes' (torch's clip_grad_norm_ "
            "refuses the mix too). Make every parameter a DTensor (replicate the plain ones "
            "over the mesh: distribute_tensor(p, mesh, [Replicate()])), or clip them apart")
    device = flats[0].device
    if norm_type == math.inf:
        terms = [f.grad_norm_term(norm_type, torch.float32) for f in flats]
        total = torch.stack([t.to(device) for t in terms]).max()
        if not all(engine):
            comm.all_reduce(total, "max")
        return total
    # Over ranks, in float64: the sum of per-shard parts then rounds to the same float32
    # for any bucket size (whose shards split the sum differently).
    acc = torch.float64 if comm.world_size > 1 or all(engine) else torch.float32
    terms = [f.grad_norm_term(norm_type, acc) for f in flats]
    total = torch.stack([t.to(device) for t in terms]).sum()
    if not all(engine):
        comm.all_reduce(total, "sum")
    return (total ** (1.0 / norm_type)).float()


def coefficient(total: torch.Tensor, max_norm: float, grad_scale, previous):
    """(the norm as torch's clip_grad_norm_ reports it, the coefficient for the kernel).
    ``grad_scale``: GradScaler's scale when the gradients are still scaled; ``previous``:
    this step's coefficient if it was clipped already, as a second call of torch's
    function would see the clipped gradients and clip them again (the two multiply)."""
    if grad_scale is not None:
        total = total / grad_scale.to(total.device, torch.float32).reshape(())
    if previous is None:
        return total, factor(total, max_norm)
    total = total * previous.reshape(())
    return total, previous * factor(total, max_norm)


def factor(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch's clipping factor for a gradient of norm ``total``: min(1, max_norm / (total
    + 1e-6)), shape (1,), where ``total`` is."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0).reshape(1)
