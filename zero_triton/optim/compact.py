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
- ``moments="int4"``: ``exp_avg_codes4`` and ``exp_avg_sq_codes4`` (one 4-bit code a
  byte), and ``moment_scales4`` (bfloat16, blocks of 128): ``zero_triton.state.int4``.
- ``moments="bf16"``: ``exp_avg`` and ``exp_avg_sq`` in bfloat16.
- ``moments="fp32"``: torch's format as it is.

The top level says which: ``"compact": {"moments": "int8", "version": 1}``.

DTensor parameters (FSDP2, tensor parallel) hand DCP their compact form under
``state_dicts(opt)``, whose ``state_dict()`` ``get_optimizer_state_dict`` takes::

    with zero_triton.compact_state_dicts(opt):
        osd = get_optimizer_state_dict(model, opt)   # to save, and as dcp.load's template
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

Their codes are DTensors of the parameter's shape, mesh and placements, and their scales
DTensors of shape (rows, row length / block, 2) whose rows are split as the parameter's, so
DCP reshards both with the parameter: a parameter's blocks are runs of 256 of its rows
(``zero_triton.optim.engine_home.blocks_fit``: the same parameters at every layout);
where a tensor-parallel cut splits blocks between ranks, the ranks agree on their scales
and each holds those of every block of its rows (replicated over the cut:
``engine_home.scales_placements``). Parameters whose rows are not whole blocks hold fp32 moments, in
torch's format, at every layout. DCP keeps no top-level
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

from zero_triton.kernels import quant
from zero_triton.optim.engine_home import is_dtensor
from zero_triton.optim.rows import local_indices, row_map
from zero_triton.optim.export import packed_groups
from zero_triton.state import moments as moment_formats
from zero_triton.state.int4 import Int4Moments
from zero_triton.state.int8 import Int8Moments
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
    """``state_dict`` (torch's format, this optimizer's) in the compact form: each
    shard's parameters in its moments' format (a param group may name its own:
    ``Spec.for_group``); the marker names the format, or the formats in param group
    order where they differ."""
    shards = opt.shards()
    formats = list(dict.fromkeys(shard.state.moments.format for _, shard in shards)) or [opt.spec.moments]
    marker = {"moments": formats[0] if len(formats) == 1 else formats, "version": VERSION}
    if formats == ["fp32"]:
        return {**state_dict, KEY: marker}
    _, ids = packed_groups(opt)
    state = dict(state_dict["state"])
    for _, shard in shards:
        for i, p in enumerate(shard.params):
            entry = state.get(ids[id(p)])
            if not isinstance(entry, dict) or FIRST not in entry:
                continue
            codes = shard.home.compact_entry(shard.state.moments, i, entry)
            if codes is not None:
                kept = {k: v for k, v in entry.items() if k not in (FIRST, SECOND)}
                state[ids[id(p)]] = {**kept, **codes}
    return {**state_dict, "state": state, KEY: marker}


def _expand_blocks(entry: dict, where: str, store) -> dict:
    """A compact entry of ``store``'s block-scaled codes (int8 or int4: plain tensors, or
    DTensors of a parameter's placements, scales [blocks, 2] or (rows, blocks per row,
    2)) as torch's float32 moments."""
    first = entry.get(store.COMPACT[0])
    scales_key = store.COMPACT[2]
    if not is_dtensor(first):
        scales = entry.get(scales_key)
        if isinstance(scales, torch.Tensor) and scales.dim() == 3:
            entry = {**entry, scales_key: scales.reshape(-1, 2)}
        return store.expand(entry, where)
    from torch.distributed.tensor import DTensor
    return {k: DTensor.from_local(v, first.device_mesh, first.placements, run_check=False,
                                  shape=first.shape, stride=first.stride())
            for k, v in _local_moments(entry, where, store).items()}


def _local_moments(entry: dict, where: str, store) -> dict:
    """A DTensor compact entry's local codes (``store``'s) as float32 moments: each element
    decoded by the scale of its block of its row, whichever of the scales' columns this
    rank holds (``engine_home.scales_placements``: a block split as the codes, or every
    block of the rows)."""
    first, second, scales = (entry.get(k) for k in store.COMPACT)
    fmts, size = store.CODES, store.block
    ok = (is_dtensor(second) and is_dtensor(scales) and first.dtype == fmts[0].dtype
          and second.dtype == fmts[1].dtype and second.shape == first.shape
          and scales.dtype == store.SCALE_DTYPE
          and first.dim() >= 1 and tuple(scales.shape) == (
              first.shape[0], math.prod(first.shape[1:]) // size, 2))
    if not ok:
        dtype = str(store.SCALE_DTYPE).replace("torch.", "")
        raise ValueError(
            f"{where}: a compact {store.format} entry of a DTensor parameter holds "
            f"{store.COMPACT[0]} (int8) and {store.COMPACT[1]} (uint8) of the parameter's "
            f"shape and {store.COMPACT[2]} ({dtype}, (rows, row length / {size}, 2)) as "
            "DTensors; this one does not. Save it again inside zero_triton.compact_state_dicts")
    rows = row_map(first, where, 0)
    rows.check(f"a compact {store.format} entry")
    r, w = rows.rows.numel(), rows.width
    table = scales.to_local()
    columns = local_indices(scales, 1) if table.shape[1] != scales.shape[1] else None
    k_lo = int(columns[0]) if columns is not None and columns.numel() else 0
    block = (rows.c0 + torch.arange(w, device=table.device)) // size - k_lo
    each = table[:, block, :].reshape(r * w, 2).float()
    out = {}
    for key, codes, fmt, col in ((FIRST, first, fmts[0], 0), (SECOND, second, fmts[1], 1)):
        local = codes.to_local()
        values = quant.decode_each(local.reshape(-1), each[:, col].to(local.device), fmt)
        out[key] = values.view(local.shape)
    return out


def expand(state_dict: dict) -> dict:
    """A compact state dict in torch's format (float32 moments); any other as it is.
    Without the top-level marker (DCP drops it) an entry holding int8 or int4 codes is still
    expanded: it is known by its keys."""
    marker = state_dict.get(KEY)
    if marker is None:
        entries = state_dict.get("state") if isinstance(state_dict, dict) else None
        if not isinstance(entries, dict) or not any(
                _coded(e) is not None for e in entries.values()):
            return state_dict
        return {**state_dict, "state": {
            key: ({**{k: v for k, v in e.items() if k not in _coded(e).COMPACT},
                   **_expand_blocks(e, f"state {key!r} of the state dict", _coded(e))}
                  if _coded(e) is not None else e)
            for key, e in entries.items()}}
    named = marker.get("moments") if isinstance(marker, dict) else None
    formats = named if isinstance(named, list) else [named]
    if not formats or any(f not in moment_formats.FORMATS for f in formats) or \
            marker.get("version") != VERSION:
        raise ValueError(f"the state dict's 'compact' entry is {marker!r}; this version of "
                         f"zero_triton reads version {VERSION} with moments in "
                         f"{tuple(moment_formats.FORMATS)} (one, or a list: one per param "
                         "group's format)")
    rest = {k: v for k, v in state_dict.items() if k != KEY}
    stores = [moment_formats.FORMATS[f] for f in formats if f != "fp32"]
    if not stores:
        return rest
    state = {}
    for key, entry in state_dict["state"].items():
        store = next((s for s in stores if isinstance(entry, dict) and
                      _holds(s, entry, mixed=len(formats) > 1)), None)
        if store is not None:
            where = f"state {key!r} of the compact state dict"
            kept = {k: v for k, v in entry.items() if k not in store.COMPACT}
            entry = {**kept, **(_expand_blocks(entry, where, store) if store in BLOCK_STORES
                                else store.expand(entry, where))}
        state[key] = entry
    return {**rest, "state": state}


BLOCK_STORES = (Int8Moments, Int4Moments)  # block-scaled codes: DTensor entries too


def _coded(entry):
    """The block store whose codes ``entry`` holds (known by its keys: DCP keeps no
    marker), or None."""
    return next((s for s in BLOCK_STORES if isinstance(entry, dict) and s.COMPACT[0] in entry), None)


def _holds(store, entry: dict, mixed: bool) -> bool:
    """Whether ``entry`` is in ``store``'s compact form: it has its keys (any of them: a
    partial entry is refused by the store's ``expand``); where param groups have
    different formats (``mixed``) and the store's keys are torch's (bf16), also its
    dtype, so that the entries of fp32 groups pass as they are."""
    if not any(k in entry for k in store.COMPACT):
        return False
    return not (mixed and store.COMPACT == (FIRST, SECOND)) or \
        getattr(entry.get(FIRST), "dtype", None) == torch.bfloat16


def size_bytes(state_dict: dict) -> int:
    """Bytes of the tensors in a state dict's ``state`` (what it takes on disk, about)."""
    total = 0
    for entry in state_dict["state"].values():
        if isinstance(entry, dict):
            total += sum(v.numel() * v.element_size() for v in entry.values()
                         if isinstance(v, torch.Tensor))
    return total
