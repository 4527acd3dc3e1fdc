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
when the first ZeroAdam is built (``zero_triton.optim.owners.when_built``), and
``torch_zero`` when a FusedAdam is built while torch's ZeroRedundancyOptimizer module is
loaded: importing zero_triton, or using only FusedAdam outside torch's ZeRO, changes
nothing of torch.
"""
from zero_triton.integrations import accelerate_clip, clip_grad, dcp, grad_scaler, torch_zero
from zero_triton.integrations.ddp import ddp_local_grads_hook
from zero_triton.integrations.grad_scaler import ZeroGradScaler
from zero_triton.optim import owners


def install() -> None:
    owners.when_built(grad_scaler.install)
    owners.when_built(clip_grad.install)
    owners.when_built(accelerate_clip.install)
    owners.when_built(dcp.install)
    owners.when_any_built(torch_zero.install)


__all__ = ["install", "ddp_local_grads_hook", "ZeroGradScaler"]
