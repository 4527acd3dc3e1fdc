"""Clipping's math: the global norm of the averaged gradients over every rank's shards, and
the coefficient that the next step's kernel applies (``FusedAdam.clip_grad_norm_``)."""
from __future__ import annotations

import math

import torch

from zero_triton.state.buffers import PLAIN, Buffers


def global_norm(shards: list, comm, norm_type: float, buffers: Buffers) -> torch.Tensor:
    """The ``norm_type`` norm of the gradient whose pieces are every rank's ``shards``
    (no host sync), a 0-dim float32 tensor: their homes add up |g|^norm_type (the largest
    |g| for inf) over every rank (``Home.norm_total``: a flat buffer's shards reduced
    over ``comm``, DTensor parameters' over their meshes, as torch's clip_grad_norm_
    reduces DTensors). Computed in ``buffers``' ``kept`` tensors: nothing is allocated
    once they are kept (``state.buffers.Kept``, capturable=True)."""
    homes = [s.home for s in shards]
    kinds = {type(h) for h in homes}
    if len(kinds) > 1:
        raise RuntimeError(
            "clip_grad_norm_ over DTensor parameters (FSDP2, tensor parallel) and plain ones "
            "together: the plain ones' ranks are not the meshes' (torch's clip_grad_norm_ "
            "refuses the mix too). Make every parameter a DTensor (replicate the plain ones "
            "over the mesh: distribute_tensor(p, mesh, [Replicate()])), or clip them apart")
    total = kinds.pop().norm_total(homes, comm, norm_type, buffers)
    if norm_type == math.inf:
        return total.view(())
    norm = buffers.kept("norm", 1, torch.float32, total.device)
    norm.copy_(total.pow_(1.0 / norm_type))
    return norm.view(())


def coefficient(total: torch.Tensor, max_norm: float, grad_scale, previous, buffers: Buffers):
    """(the norm as torch's clip_grad_norm_ reports it, the coefficient for the kernel).
    ``grad_scale``: GradScaler's scale when the gradients are still scaled; ``previous``:
    this step's coefficient if it was clipped already, as a second call of torch's
    function would see the clipped gradients and clip them again (the two multiply)."""
    device = total.device
    if grad_scale is not None:
        unscaled = buffers.kept("unscaled", 1, torch.float32, device).view(())
        total = torch.div(total, grad_scale.to(device, torch.float32).reshape(()), out=unscaled)
    if previous is None:
        return total, factor(total, max_norm, buffers.kept("coef", 1, torch.float32, device))
    clipped = buffers.kept("clipped", 1, torch.float32, device).view(())
    total = torch.mul(total, previous.reshape(()), out=clipped)
    return total, previous.mul_(factor(total, max_norm, buffers.kept("factor", 1, torch.float32, device)))


def factor(total: torch.Tensor, max_norm: float, out=None) -> torch.Tensor:
    """torch's clipping factor for a gradient of norm ``total``: min(1, max_norm / (total
    + 1e-6)), shape (1,), where ``total`` is (into ``out``, shape (1,), if given)."""
    if out is None:
        return torch.clamp(max_norm / (total + 1e-6), max=1.0).reshape(1)
    o = out.view(())  # the ops max_norm / (total + 1e-6) dispatches, in place: the same bits
    torch.add(total, 1e-6, out=o)
    torch.reciprocal(o, out=o)
    return out.mul_(max_norm).clamp_(max=1.0)


class Clipping:
    """One optimizer's clipping of this step: the coefficient its kernel will apply
    (``coef``: None, or a 1-element float32 tensor, the product of every clip since the
    last step) and the norms ``total_grad_norm`` handed out since (``given``), which
    ``clip_grads_with_norm_`` checks a norm against where local gradients are not the
    averaged ones. ``reset`` at each step and ``zero_grad``."""

    def __init__(self, buffers: Buffers = PLAIN):
        self.coef = None
        self.given: list = []
        self.buffers = buffers  # ``Kept`` under capturable=True (chosen by the optimizer)

    def reset(self) -> None:
        self.coef = None
        self.given.clear()

    def forget(self) -> None:
        """The averages this step's coefficient was taken from were dropped: forget it."""
        self.coef = None

    def global_norm(self, flats: list, comm, norm_type: float) -> torch.Tensor:
        """``global_norm`` in this optimizer's buffers."""
        return global_norm(flats, comm, norm_type, self.buffers)

    def clip(self, total: torch.Tensor, max_norm: float, grad_scale) -> torch.Tensor:
        """Clip by ``total`` (the global norm of the possibly scaled gradients): the
        coefficient composed with any earlier this step; returns the unscaled norm."""
        total, self.coef = coefficient(total, max_norm, grad_scale, self.coef, self.buffers)
        return total

    def hand_out(self, total):
        """``total_grad_norm``'s answer: the norm ``total`` (None: no gradients) of the
        gradients as this step's clipping left them, remembered as handed out."""
        if total is None:
            total = torch.zeros(())
        elif self.coef is not None:
            total = total * self.coef.reshape(()).to(total.device)
        self.given.append(total)
        return total

    def clip_with(self, max_norm: float, total_norm, local_is_averaged: bool) -> None:
        """torch's ``clip_grads_with_norm_``: scale by min(1, max_norm / (total_norm +
        1e-6)); where the local gradients are not the averaged ones, ``total_norm`` must
        be a norm ``hand_out`` gave this step (refused with the fix, nothing changed)."""
        if not local_is_averaged and not (
                isinstance(total_norm, torch.Tensor) and any(t is total_norm for t in self.given)):
            raise ValueError(
                "zero_triton: clip_grads_with_norm_ over a ZeroAdam's parameters needs the norm "
                "of the averaged gradients over every rank, and was given another (this rank's "
                "local gradients' norm, or, at stage 2 where no .grad is left, the norm of "
                "nothing). Take it over the optimizer's gradients this step with "
                "torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]) "
                "(every parameter of the optimizer, stage 1) or optimizer.total_grad_norm() "
                "(any stage), or clip in one call: torch.nn.utils.clip_grad_norm_(params, "
                "max_norm) returns the norm it clipped by")
        if isinstance(total_norm, torch.Tensor):
            total = total_norm.detach().to(torch.float32).reshape(())
        else:
            total = torch.tensor(float(total_norm), dtype=torch.float32)
        coef = factor(total, float(max_norm))
        self.coef = coef if self.coef is None else self.coef * coef.to(self.coef.device)
