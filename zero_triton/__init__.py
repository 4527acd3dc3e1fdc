"""zero_triton: fused, ZeRO-sharded Adam/AdamW for PyTorch.

FusedAdam / FusedAdamW: drop-in torch.optim.Adam / AdamW, one fused kernel per flat
buffer. ZeroAdam / ZeroAdamW: the same step with optimizer state sharded over a
torch.distributed process group (ZeRO-1), averaged bucket by bucket during backward;
``overlap(model, optimizer)`` overlaps its parameter all-gathers with the next forward.
``zero_triton.checkpoint``: sharded save / load / reshard. ``zero_triton.reference``: the
float64 reference the tests hold every backend to, and the seed's ZeRO step
(``init_states``, ``zero_step``).
"""
from zero_triton import checkpoint, integrations, reference
from zero_triton.integrations import ZeroGradScaler, ddp_local_grads_hook
from zero_triton.optim.compact import state_dicts as compact_state_dicts
from zero_triton.optim.fused import FusedAdam, FusedAdamW
from zero_triton.optim.overlap import overlap
from zero_triton.optim.zero import ZeroAdam, ZeroAdamW
from zero_triton.state.flat import FlatLayout, flatten_params, unflatten_into

integrations.install()  # armed here, applied when the first ZeroAdam is built

__version__ = "0.1.0"

__all__ = ["checkpoint", "reference", "FusedAdam", "FusedAdamW", "ZeroAdam", "ZeroAdamW", "ZeroGradScaler", "ddp_local_grads_hook", "overlap", "compact_state_dicts", "FlatLayout", "flatten_params", "unflatten_into", "__version__"]
