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

DTensor parameters (FSDP2, tensor parallel) hand DCP their compact form under
``state_dicts(opt)``, whose ``state_dict()`` ``get_optimizer_state_dict`` takes::

    with zero_triton.compact_state_dicts(opt):
        osd = get_optimizer_state_dict(model, opt)   # to save, and as dcp.load's template
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

Their codes are DTensors of the parameter's shape, mesh and placements, and their scales
DTensors of shape (rows, row length / 256, 2) with the same placements, so DCP reshards
both with the parameter: a parameter's blocks are runs of 256 of its rows, whole on one
rank at every world size (``zero_triton.optim.engine_home.keeps_blocks``); parameters
whose rows cannot keep them hold fp32 moments, in torch's format. DCP keeps no top-level
marker: a compact entry is known by its keys, and ``expand`` and ``load_state_dict``
take it wherever it is found (``dcp_to_torch_save``'s file included: expanded, it is
torch's format for ``set_optimizer_state_dict`` of torch's AdamW).

Why bit for bit at any world size: a parameter's blocks are the flat layout's, which
start at the parameter's first element at every world size and bucket size
(``zero_triton.state.int8``), so the codes of its elements, 256 at a time from its
first, are the store's. The state dict is assembled in torch's float32 format first
(decoding then encoding gives the same codes and scales back), so every path that
assembles one (``FusedAdam.state_dict``, ``ZeroAdam.state_dict`` and
``consolidated_state_dict``) has a compact form; the assembly's transient memory is
torch's format's. DTensor parameters' compact entries are their local codes and scales, taken from the
store as they are (no round trip).
"""
from __future__ import annotations

import contextlib
import math
import weakref

import torch

from zero_triton.optim.engine_home import is_dtensor
from zero_triton.optim.state_dict import packed_groups
from zero_triton.state import moments as moment_formats
from zero_triton.state.int8 import BLOCK, Int8Moments
from zero_triton.state.moments import FIRST, SECOND

KEY = "compact"
VERSION = 1
_WANTED = weakref.WeakSet()  # optimizers whose state_dict() is the compact form now


@contextlib.contextmanager
def state_dicts(opt):
    """Within it, ``opt.state_dict()`` (and so DCP's ``get_optimizer_state_dict``)
    returns the compact form (``state_dict(compact=False)`` still asks for torch's)."""
    import inspect
    if "compact" not in inspect.signature(getattr(opt, "state_dict", lambda: None)).parameters:
        raise TypeError(f"compact_state_dicts takes a zero_triton optimizer (FusedAdam(W), "
                        f"ZeroAdam(W)), not {type(opt).__name__}: only their state has a "
                        "compact form; save the others' state_dict() as it is")
    held = opt in _WANTED
    _WANTED.add(opt)
    try:
        yield opt
    finally:
        if not held:
            _WANTED.discard(opt)


def wanted(opt, compact):
    """Whether a ``state_dict(compact=compact)`` call is for the compact form (None: as
    ``state_dicts`` says)."""
    return (opt in _WANTED) if compact is None else compact


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
                local = _engine_entry(flat, i, p)
                if local is not None:
                    kept = {k: v for k, v in entry.items() if k not in (FIRST, SECOND)}
                    state[ids[id(p)]] = {**kept, **local}
                continue
            view = flat.by_param  # the parameter's elements in its blocks' (memory) order
            first, second = (view.elements(i, entry[k].detach().cpu()) for k in (FIRST, SECOND))
            kept = {k: v for k, v in entry.items() if k not in (FIRST, SECOND)}
            codes = store.compact(first, second, view.layout.shapes[i], view.stride(i))
            state[ids[id(p)]] = {**kept, **codes}
    return {**state_dict, "state": state, KEY: marker}


def _scales_shape(p) -> tuple | None:
    """The global shape of DTensor ``p``'s int8 scales, (rows, row length / 256, 2), or
    None where its placements would not shard them as its codes (only ``Shard(0)``,
    ``Replicate`` and a 2-D parameter's ``Shard(1)`` do)."""
    shape = tuple(p.shape)
    for placement in p.placements:
        if placement.is_replicate():
            continue
        if type(placement).__name__ != "Shard" or placement.dim % len(shape) > (1 if len(shape) == 2 else 0):
            return None
    return (shape[0], math.prod(shape[1:]) // BLOCK, 2)


def _engine_entry(flat, i: int, p) -> dict | None:
    """DTensor parameter ``i`` of engine shard ``flat``: its moments as the store keeps
    them, as DTensors with its mesh and placements (None: torch's format, for a store
    that is fp32 or placements the scales cannot follow)."""
    from torch.distributed.tensor import DTensor
    store, fmt = flat.state.moments, flat.state.moments.format
    if fmt == "fp32":
        return None
    lo, hi, s0 = flat.segments[i]
    local = flat.home.locals[i]
    mesh, placements = p.device_mesh, p.placements

    def shared(t, shape=None, stride=None):
        return DTensor.from_local(t, mesh, placements, run_check=False,
                                  shape=shape or p.shape, stride=stride or p.stride())
    if fmt == "bf16":
        return {FIRST: shared(store.exp_avg[s0:s0 + hi - lo].view(local.shape).clone()),
                SECOND: shared(store.exp_avg_sq[s0:s0 + hi - lo].view(local.shape).clone())}
    global_scales = _scales_shape(p)
    if global_scales is None:
        return None
    n, per_row = hi - lo, math.prod(local.shape[1:]) // BLOCK
    scales = store.scales[s0 // BLOCK:(s0 + n) // BLOCK].reshape(local.shape[0], per_row, 2)
    first, second, scales_key = Int8Moments.COMPACT
    return {first: shared(store.exp_avg[s0:s0 + n].view(local.shape).clone()),
            second: shared(store.exp_avg_sq[s0:s0 + n].view(local.shape).clone()),
            scales_key: shared(scales.clone(), global_scales, (global_scales[1] * 2, 2, 1))}


def _expand_int8(entry: dict, where: str) -> dict:
    """A compact int8 entry (plain tensors, or DTensors of a parameter's placements,
    scales [blocks, 2] or (rows, blocks per row, 2)) as torch's float32 moments."""
    first = entry.get(Int8Moments.COMPACT[0])
    scales_key = Int8Moments.COMPACT[2]
    if not is_dtensor(first):
        scales = entry.get(scales_key)
        if isinstance(scales, torch.Tensor) and scales.dim() == 3:
            entry = {**entry, scales_key: scales.reshape(-1, 2)}
        return Int8Moments.expand(entry, where)
    from torch.distributed.tensor import DTensor
    local = {k: (v.to_local() if is_dtensor(v) else v) for k, v in entry.items()
             if k in Int8Moments.COMPACT}
    local[scales_key] = local[scales_key].reshape(-1, 2)
    return {k: DTensor.from_local(v, first.device_mesh, first.placements, run_check=False,
                                  shape=first.shape, stride=first.stride())
            for k, v in Int8Moments.expand(local, where).items()}


def expand(state_dict: dict) -> dict:
    """A compact state dict in torch's format (float32 moments); any other as it is.
    Without the top-level marker (DCP drops it) an entry holding int8 codes is still
    expanded: it is known by its keys."""
    marker = state_dict.get(KEY)
    if marker is None:
        entries = state_dict.get("state") if isinstance(state_dict, dict) else None
        if not isinstance(entries, dict) or not any(
                isinstance(e, dict) and Int8Moments.COMPACT[0] in e for e in entries.values()):
            return state_dict
        return {**state_dict, "state": {
            key: ({**{k: v for k, v in e.items() if k not in Int8Moments.COMPACT},
                   **_expand_int8(e, f"state {key!r} of the state dict")}
                  if isinstance(e, dict) and Int8Moments.COMPACT[0] in e else e)
            for key, e in entries.items()}}
    fmt = marker.get("moments") if isinstance(marker, dict) else None
    if fmt not in moment_formats.FORMATS or marker.get("version") != VERSION:
        raise ValueError(f"the state dict's 'compact' entry is {marker!r}; this version of "
                         f"zero_triton reads version {VERSION} with moments in "
                         f"{tuple(moment_formats.FORMATS)}")
    rest = {k: v for k, v in state_dict.items() if k != KEY}
    if fmt == "fp32":
        return rest
    store = moment_formats.FORMATS[fmt]
    unpack = _expand_int8 if store is Int8Moments else store.expand
    state = {}
    for key, entry in state_dict["state"].items():
        if isinstance(entry, dict) and any(k in entry for k in store.COMPACT):
            kept = {k: v for k, v in entry.items() if k not in store.COMPACT}
            entry = {**kept, **unpack(entry, f"state {key!r} of the compact state dict")}
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
