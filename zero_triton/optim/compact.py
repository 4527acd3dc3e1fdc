"""The compact state dict: torch.optim.Adam's format with each parameter's moments as the
optimizer's store keeps them, a quarter of the bytes (int8) or half (bf16), loading back
bit for bit::

    sd = opt.state_dict(compact=True)   # FusedAdam(W); ZeroAdam(W) also on one rank alone
    opt.load_state_dict(sd)             # any FusedAdam/ZeroAdam, any world size, any moments
    torch_sd = zero_triton.optim.compact.expand(sd)  # torch's format, for torch.optim.AdamW

Per parameter, beside ``step`` (and ``master_param``, float32, for fp16/bf16 parameters):

- ``moments="int8"``: ``exp_avg_codes`` (int8) and ``exp_avg_sq_codes`` (uint8), shaped
  and strided as the parameter, and ``moment_scales`` (float32 [ceil(numel / 256), 2]:
  the scale of exp_avg and of exp_avg_sq of each block of 256 elements, in the
  parameter's memory order). ``zero_triton.kernels.quant`` defines the codes: element
  ``j`` of block ``b`` is ``decode(code[j], moment_scales[b])``.
- ``moments="bf16"``: ``exp_avg`` and ``exp_avg_sq`` in bfloat16.
- ``moments="fp32"``: torch's format as it is.

The top level says which: ``"compact": {"moments": "int8", "version": 1}``.

Why bit for bit at any world size: a parameter's blocks are the flat layout's, which
start at the parameter's first element at every world size and bucket size
(``zero_triton.state.int8``), so the codes of its elements, 256 at a time from its
first, are the store's. The state dict is assembled in torch's float32 format first
(decoding then encoding gives the same codes and scales back), so every path that
assembles one (``FusedAdam.state_dict``, ``ZeroAdam.state_dict`` and
``consolidated_state_dict``) has a compact form; the assembly's transient memory is
torch's format's. DTensor parameters' state is the engine's shards: save it with
torch.distributed.checkpoint (refused here, with that fix).
"""
from __future__ import annotations

import torch

from zero_triton.optim.state_dict import packed_groups
from zero_triton.state import moments as moment_formats
from zero_triton.state.moments import FIRST, SECOND

KEY = "compact"
VERSION = 1


def compact(opt, state_dict: dict) -> dict:
    """``state_dict`` (torch's format, this optimizer's) in the compact form."""
    fmt = opt.spec.moments
    marker = {"moments": fmt, "version": VERSION}
    if fmt == "fp32":
        return {**state_dict, KEY: marker}
    store = moment_formats.FORMATS[fmt]
    _, ids = packed_groups(opt)
    state = dict(state_dict["state"])
    for _, flat in opt.all_flats():
        for i, p in enumerate(flat.params):
            entry = state.get(ids[id(p)])
            if not isinstance(entry, dict) or FIRST not in entry:
                continue
            if flat.engine_owned:
                raise ValueError(
                    "state_dict(compact=True) holds the codes of flat parameters; DTensor "
                    f"parameter {tuple(p.shape)}'s state is its engine's shards: save it with "
                    "torch.distributed.checkpoint (get_optimizer_state_dict, dcp.save), or "
                    "take state_dict() in torch's format")
            view = flat.by_param  # the parameter's elements in its blocks' (memory) order
            first, second = (view.elements(i, entry[k].detach().cpu()) for k in (FIRST, SECOND))
            kept = {k: v for k, v in entry.items() if k not in (FIRST, SECOND)}
            codes = store.compact(first, second, view.layout.shapes[i], view.stride(i))
            state[ids[id(p)]] = {**kept, **codes}
    return {**state_dict, "state": state, KEY: marker}


def expand(state_dict: dict) -> dict:
    """A compact state dict in torch's format (float32 moments); any other as it is."""
    marker = state_dict.get(KEY)
    if marker is None:
        return state_dict
    fmt = marker.get("moments") if isinstance(marker, dict) else None
    if fmt not in moment_formats.FORMATS or marker.get("version") != VERSION:
        raise ValueError(f"the state dict's 'compact' entry is {marker!r}; this version of "
                         f"zero_triton reads version {VERSION} with moments in "
                         f"{tuple(moment_formats.FORMATS)}")
    rest = {k: v for k, v in state_dict.items() if k != KEY}
    if fmt == "fp32":
        return rest
    store = moment_formats.FORMATS[fmt]
    state = {}
    for key, entry in state_dict["state"].items():
        if isinstance(entry, dict) and any(k in entry for k in store.COMPACT):
            kept = {k: v for k, v in entry.items() if k not in store.COMPACT}
            entry = {**kept, **store.expand(entry, f"state {key!r} of the compact state dict")}
        state[key] = entry
    return {**rest, "state": state}


def size_bytes(state_dict: dict) -> int:
    """Bytes of the tensors in a state dict's ``state`` (what it takes on disk, about)."""
    total = 0
    for entry in state_dict["state"].values():
        if isinstance(entry, dict):
            total += sum(v.numel() * v.element_size() for v in entry.values()
                         if isinstance(v, torch.Tensor))
    return total
