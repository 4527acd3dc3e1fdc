"""Every patch of another library, in one place.

- ``clip_grad``: ``torch.nn.utils.clip_grad_norm_`` (and ``torch.nn.utils.clip_grad.
  clip_grad_norm_``) on a ZeroAdam's parameters clips by the global norm of the averaged
  gradients; every other call goes to torch's function unchanged.
- ``accelerate_clip``: accelerate's ``Accelerator.clip_grad_norm_`` (which from 1.16
  computes the norm itself) does the same on a ZeroAdam's parameters.
- ``grad_scaler``: ``torch.amp.GradScaler._unscale_grads_`` and ``unscale_``: under
  ZeroAdam every rank agrees on found_inf, and ZeRO-2's shards are unscaled.
- ``dcp``: torch.distributed.checkpoint's ``get_optimizer_state_dict`` takes a ZeroAdam's
  shard on each rank (``ZeroAdam.sharded_state_dict``), not the whole state.
- ``ddp``: a DistributedDataParallel communication hook that communicates nothing (for
  libraries that wrap the model in DDP anyway); nothing is patched.
- ``torch_zero``: torch's ``ZeroRedundancyOptimizer._build_param_buckets`` refuses
  ``parameters_as_bucket_view=True`` over a FusedAdam, naming the fix (its buckets would
  never see the updates).

``install()``, called once by ``zero_triton/__init__``, arms the patches; each is applied
when the first ZeroAdam that needs it is built (at 2+ ranks, or ZeRO-2 at one: at one rank
of ZeRO-1 nothing of torch needs routing) (``zero_triton.optim.owners.when_built``), and
``torch_zero`` when a FusedAdam is built while torch's ZeroRedundancyOptimizer module is
loaded: importing zero_triton, or using only FusedAdam outside torch's ZeRO, changes
nothing of torch. Each change is recorded (``zero_triton.integrations.patching``), where
its target is not of the shape it was written for one warning says what is not routed
and what to call instead, and ``disable()`` (or ``ZERO_TRITON_PATCHES=0`` in the
environment) turns them off for the process and undoes those applied: torch and
accelerate are then exactly as without zero_triton.
"""
from zero_triton.integrations import accelerate_clip, clip_grad, dcp, grad_scaler, patching, torch_zero
from zero_triton.integrations.ddp import ddp_local_grads_hook
from zero_triton.integrations.grad_scaler import ZeroGradScaler
from zero_triton.optim import owners


# The patches, by the name ``applied()`` reports them under, and what each does.
PATCHES = {
    "grad_scaler": "torch.amp.GradScaler._unscale_grads_ and unscale_: every rank agrees on "
                   "found_inf; ZeRO-2's shards are unscaled",
    "clip_grad": "torch.nn.utils.clip_grad_norm_ (and the two-call clipping of torch 2.6+) on "
                 "a ZeroAdam's parameters clips by the global norm; clip_grad_value_ refused",
    "accelerate_clip": "accelerate's Accelerator.clip_grad_norm_, the same",
    "dcp": "torch.distributed.checkpoint's get_optimizer_state_dict takes each rank's shard",
    "torch_zero": "torch's ZeroRedundancyOptimizer(parameters_as_bucket_view=True) over a "
                  "FusedAdam refused, naming the fix",
}


def _when_on(install):
    def run() -> None:
        if patching.enabled():
            install()
    return run


def install() -> None:
    for patch in (grad_scaler.install, clip_grad.install, accelerate_clip.install, dcp.install):
        owners.when_built(_when_on(patch))
    owners.when_any_built(_when_on(torch_zero.install))


def disable() -> None:
    """Turn zero_triton's patches off for this process and undo those applied: torch's
    and accelerate's functions are their own again. Under ZeroAdam at 2+ ranks, then:
    clip with ``max_grad_norm=`` (torch's ``clip_grad_norm_`` would clip each rank by its
    local gradients), save through ``zero_triton.checkpoint`` (DCP gets the whole state
    on every rank), and use GradScaler only if every rank's found_inf agrees by other
    means. ``ZERO_TRITON_PATCHES=0`` in the environment does the same from the start."""
    patching.turn_off()
    patching.undo()


def applied() -> list:
    """The names (``PATCHES``) of the patches applied in this process so far."""
    return patching.applied()


__all__ = ["install", "disable", "applied", "PATCHES", "ddp_local_grads_hook", "ZeroGradScaler"]
