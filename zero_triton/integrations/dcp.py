"""torch.distributed.checkpoint's ``get_optimizer_state_dict`` (and ``get_state_dict``) on a
ZeroAdam at several ranks: each rank hands DCP its shard, ``ZeroAdam.sharded_state_dict()``,
instead of ``state_dict()`` (the whole state, gathered on every rank). With
``StateDictOptions(full_state_dict=True)`` torch asks for the whole state, and gets
``state_dict()``. ``set_optimizer_state_dict`` needs nothing: ``load_state_dict`` takes
the shards back."""
from __future__ import annotations

import functools

from zero_triton.integrations import patching
from zero_triton.optim.zero import ZeroAdam

_SHARDED = []  # non-empty while torch builds a sharded (not full) optimizer state dict


def install() -> None:
    """Wrap ``torch.distributed.checkpoint.state_dict._get_optim_state_dict`` (which
    builds the optimizers' part, knowing whether a full state dict is wanted) and
    ``_state_dict_fn`` (how it asks an optimizer for its state dict), once. Where torch
    has neither, nothing is patched and DCP gets ``state_dict()``: correct, not sharded."""
    try:
        from torch.distributed.checkpoint import state_dict as dcp_state_dict
    except ImportError:
        return
    build = getattr(dcp_state_dict, "_get_optim_state_dict", None)
    ask = getattr(dcp_state_dict, "_state_dict_fn", None)
    if ask is not None and getattr(ask, "zero_triton", False):
        return
    if build is None or ask is None:
        patching.skipped("dcp", "torch.distributed.checkpoint.state_dict's "
                         "_get_optim_state_dict/_state_dict_fn",
                         "get_optimizer_state_dict gets ZeroAdam.state_dict() (the whole state "
                         "on every rank; correct, not sharded); for sharded saves use "
                         "zero_triton.checkpoint.save, or hand DCP opt.sharded_state_dict()")
        return

    @functools.wraps(build)
    def _get_optim_state_dict(model, optimizers, info):
        if getattr(info, "full_state_dict", False):
            return build(model, optimizers, info)
        _SHARDED.append(True)
        try:
            return build(model, optimizers, info)
        finally:
            _SHARDED.pop()

    @functools.wraps(ask)
    def _state_dict_fn(obj, api):
        if (_SHARDED and api == "state_dict" and isinstance(obj, ZeroAdam)
                and obj.world_size > 1):
            return obj.sharded_state_dict
        return ask(obj, api)
    _state_dict_fn.zero_triton = True
    patching.set_attr("dcp", dcp_state_dict, "_get_optim_state_dict", _get_optim_state_dict)
    patching.set_attr("dcp", dcp_state_dict, "_state_dict_fn", _state_dict_fn)
