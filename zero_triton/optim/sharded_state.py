"""ZeroAdam's state as torch.distributed.checkpoint shards it: each rank hands DCP only
what it owns.

A rank owns, of each parameter, one contiguous range of its elements (its shard of the
parameter's bucket, ``zero_triton.state.flat``), cut at any element. In the parameter's
shape such a range is a few boxes (a partial first row, whole rows, a partial last row,
and so on down the dimensions), each contiguous in memory: each state tensor of each
parameter is handed over as a ``ShardedTensor`` of the parameter's shape whose local
shards are those boxes, views of the live state (as torch's optimizers hand DCP views of
theirs), and whose global metadata lists every rank's boxes (computed here from the
layout, no communication). DCP then writes each rank's boxes only, and loads into any
other layout (another world size or bucket size) by the boxes' overlaps.

``sharded_state_dict(opt)`` builds it, the optimizer's export (``optim/export.py``) over
the ``boxed`` source; ``localized(state_dict)`` turns the ShardedTensors of a loaded one
into ``Pieces`` (this rank's boxes, copied) that ``ParamView.pack`` reads its runs from.
"""
from __future__ import annotations

import math
import warnings

import torch

from zero_triton.optim.export import exported
from zero_triton.state.param_view import Pieces

# torch marks ShardedTensor deprecated in favour of DTensor, but a DTensor cuts a tensor
# only where torch.chunk does, and a rank's part of a parameter ends at any element.
_DEPRECATED = "Please use DTensor instead and we are deprecating ShardedTensor"


def boxes(shape, a: int, b: int) -> list[tuple[tuple, tuple, int]]:
    """Elements [a, b) of a contiguous tensor of ``shape`` (in flat order) as boxes
    (offsets, sizes, first flat element), each contiguous in memory, in flat order."""
    if a >= b:
        return []
    shape = tuple(shape)
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    rest = (0,) * (len(shape) - 1)

    def within(row, lo, hi):  # [lo, hi) inside one row
        return [((row,) + off, (1,) + size, row * inner + start)
                for off, size, start in boxes(shape[1:], lo - row * inner, hi - row * inner)]
    first, last = a // inner, b // inner
    if first == last:
        return within(first, a, b)
    out = []
    if a % inner:
        out += within(first, a, (first + 1) * inner)
        first += 1
    if last > first:
        out.append(((first,) + rest, (last - first,) + shape[1:], first * inner))
    if b % inner:
        out += within(last, last * inner, b)
    return out


def _sharded(local, everyone, shape, dtype, device, group):
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (ShardedTensorMetadata,
                                                                  TensorProperties)
    place = str(device)
    metas = [ShardMetadata(shard_offsets=list(off), shard_sizes=list(size),
                           placement=f"rank:{r}/{place}") for r, off, size in everyone]
    shards = [Shard(t, ShardMetadata(shard_offsets=list(off), shard_sizes=list(size),
                                     placement=f"rank:{r}/{place}")) for t, r, off, size in local]
    meta = ShardedTensorMetadata(shards_metadata=metas, size=torch.Size(shape),
                                 tensor_properties=TensorProperties(dtype=dtype))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DEPRECATED)
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, meta, process_group=group, init_rrefs=False)


def sharded_state_dict(opt, shards) -> dict:
    """This rank's shard of ``opt``'s state in torch.optim.Adam's format: ``step`` a
    tensor per parameter (the same on every rank), each state tensor a ShardedTensor of
    the parameter's shape over every rank's boxes, its local shards views of the state.
    ``shards``: the optimizer's (group, Shard) pairs."""
    return exported(opt, [shard for _, shard in shards], boxed(opt.comm))


def boxed(comm):
    """The source (``export.exported``'s) of each parameter's state as ShardedTensors over
    every rank of ``comm``: this rank's boxes views of its state, the others' named."""
    # A placement names a global rank (of the group's shard r; hybrid sharding: this
    # copy's, whose boxes DCP keeps once over the copies).
    ranks = _global_ranks(comm)

    def values(shard):
        layout = shard.layout
        for i, p in enumerate(shard.params):
            if layout.strides[i] is not None or p.is_complex():
                raise TypeError(
                    f"get_optimizer_state_dict of a ZeroAdam at {comm.world_size} ranks hands "
                    "DCP each rank's shard, and a parameter with strides other than the "
                    f"contiguous ones, or complex, ({tuple(p.shape)}, {p.dtype}) has no boxes "
                    "in its shape: save with zero_triton.checkpoint.save (sharded, any world "
                    "size), or take optimizer.state_dict() (the whole state on every rank)")
        everyone = [shard.by_param.owned(r) for r in range(comm.world_size)]
        mine = everyone[comm.rank]
        buffers = shard.state.buffers()
        out = []
        for i, p in enumerate(shard.params):
            shape = tuple(p.shape)
            entry = {}
            if p.numel() == 0:
                entry.update({k: torch.empty(shape, dtype=b.dtype, device=b.device)
                              for k, b in buffers.items()})
            elif not shape:  # a 0-dim parameter: one rank has it; every rank gets it
                for key, buf in buffers.items():
                    value = buf[mine[i].at].clone() if i in mine else torch.zeros((), dtype=buf.dtype,
                                                                                    device=buf.device)
                    comm.all_reduce(value, "sum")  # the owner's value plus zeros: exact
                    entry[key] = value
            else:
                # A rank that owns none of it holds one empty box: DCP takes a rank without
                # a local shard for a checkpoint of an older format. The box sits at the
                # tensor's far corner, where no other box starts: DCP keeps one chunk per
                # (name, offsets), and would drop a real box that starts where it does.
                empty, corner = (0,) * len(shape), shape
                spread = [(ranks[r], off, size) for r in range(comm.world_size)
                          for off, size, _ in (boxes(shape, *everyone[r][i][1:3]) if i in everyone[r]
                                               else [(corner, empty, 0)])]
                for key, buf in buffers.items():
                    if i in mine:
                        _, a, b, at = mine[i]
                        local = [(buf[at + start - a:at + start - a + math.prod(size)].view(size),
                                  ranks[comm.rank], off, size) for off, size, start in boxes(shape, a, b)]
                    else:
                        local = [(buf[:0].view(empty), ranks[comm.rank], corner, empty)]
                    entry[key] = _sharded(local, spread, shape, buf.dtype, buf.device, comm.group)
            out.append(entry)
        return out
    return values


def _global_ranks(comm) -> list:
    """The global rank of each shard of ``comm``'s group."""
    if comm.group is None:
        return list(range(comm.world_size))
    import torch.distributed as dist
    return dist.get_process_group_ranks(comm.group)


def _is_sharded(value) -> bool:
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:
        return False
    return isinstance(value, ShardedTensor)


def localized(state_dict: dict) -> dict:
    """``state_dict`` with each ShardedTensor of its state replaced by ``Pieces``: this
    rank's local shards, copied (they may be views of the state the load overwrites),
    at their flat positions in the parameter's shape."""
    state = state_dict.get("state")
    if not isinstance(state, dict) or not any(
            _is_sharded(v) for e in state.values() if isinstance(e, dict) for v in e.values()):
        return state_dict
    out = {}
    for key, entry in state.items():
        if not isinstance(entry, dict):
            out[key] = entry
            continue
        out[key] = {name: _pieces(v) if _is_sharded(v) else v for name, v in entry.items()}
    return {**state_dict, "state": out}


def _pieces(value) -> Pieces:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DEPRECATED)
        shape = tuple(value.size())
        shards = value.local_shards()
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    pieces = []
    for shard in shards:
        offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        start = sum(o * s for o, s in zip(offsets, strides))
        data = shard.tensor.detach()
        numel = data.numel()
        if numel == 0:  # a rank that owns none of the parameter holds an empty box
            continue
        # A box is contiguous in the flat order when every dimension after its first
        # that is not 1 spans the whole of it.
        lead = next((d for d, n in enumerate(sizes) if n != 1), len(sizes))
        if any(sizes[d] != shape[d] for d in range(lead + 1, len(shape))):
            raise ValueError(
                f"a ShardedTensor of shape {list(shape)} has a local shard at offsets "
                f"{list(offsets)} of sizes {list(sizes)} that is not one run of elements: "
                "load it into the state dict that this optimizer's get_optimizer_state_dict "
                "returns (dcp.load(...)), then call set_optimizer_state_dict")
        pieces.append((start, data.reshape(-1).clone()))
    return Pieces(shape, sorted(pieces, key=lambda piece: piece[0]))
