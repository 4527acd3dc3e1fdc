"""The one export of the optimizer state: torch.optim.Adam's format, ``{"state": {index:
entry}, "param_groups": [...]}``, built by ``exported`` (which numbers the parameters as
torch does, gives each its own ``step`` and keeps what the user put in ``opt.state``),
each parameter's values made by the source a way out hands in: ``live`` (views of this
process's buffers: ``state_dict()`` on one rank, DTensors for FSDP2 and tensor
parallel), ``assembled`` (whole values from every rank's chunks, gathered or served:
``optim/state_dict.py``) or ``boxed`` (DCP's ShardedTensors: ``optim/sharded_state.py``).
The compact form re-encodes the export's moments (``optim/compact.py``); checkpoint files
keep ``ParamView.canonical`` ranges instead (docs/architecture.md: the ways out).
"""
from __future__ import annotations

import torch

from zero_triton.state.moments import KEYS as MOMENT_KEYS
from zero_triton.state.shards import MASTER

# The per-parameter state keys this optimizer keeps in its flat buffers; anything else a
# user or a wrapper puts in ``opt.state`` (a parameter's extra entry, a key that is not a
# parameter) is kept beside them and round-trips through the state dict as in torch.
OWN_KEYS = frozenset(("step", *MOMENT_KEYS, MASTER))


def packed_groups(opt):
    """torch's param_groups with parameters replaced by their state-dict index, and
    the map id(param) -> index."""
    groups, ids, start = [], {}, 0
    for group in opt.param_groups:  # as torch.optim.Optimizer.state_dict numbers them
        packed = {k: v for k, v in group.items() if k != "params"}
        ids.update({id(p): i for i, p in enumerate(group["params"], start) if id(p) not in ids})
        packed["params"] = [ids[id(p)] for p in group["params"]]
        start += len(packed["params"])
        groups.append(packed)
    return groups, ids


def extras(table, params) -> tuple[dict, dict]:
    """(entries of ``table`` not keyed by one of ``params``, {id(p): p's extra keys})."""
    by_id = {id(p) for p in params}
    others, per_param = {}, {}
    for key, entry in dict.items(table):
        if not (isinstance(key, torch.Tensor) and id(key) in by_id):
            others[key] = entry
        elif isinstance(entry, dict):
            extra = {k: v for k, v in entry.items() if k not in OWN_KEYS}
            if extra:
                per_param[id(key)] = extra
    return others, per_param


def exported(opt, shards, values) -> dict | None:
    """torch.optim.Adam's format of ``shards`` (the optimizer's flat buffers, in param
    group order): ``values(shard)`` gives each parameter's ``{key: value}`` of its state
    (None where this rank assembles nothing: then None, once every shard's source has
    run, since a source may be collective). Each entry also holds ``step``, a tensor of
    its own (torch.optim.Adam increments each one: a shared one would count N times a
    step), and what ``opt.state`` holds beside our keys, as torch keeps it."""
    made = [values(shard) for shard in shards]
    if any(m is None for m in made):
        return None
    groups, ids = packed_groups(opt)
    others, per_param = extras(opt.state, [p for shard in shards for p in shard.params])
    state = {}
    for shard, per in zip(shards, made):
        steps = shard.state.param_steps()
        for i, p in enumerate(shard.params):
            state[ids[id(p)]] = {"step": torch.tensor(steps[i], dtype=torch.float32), **per[i],
                                 **per_param.get(id(p), {})}
    for key, entry in others.items():  # as torch: a parameter's index, any other key as is
        state[ids.get(id(key), key) if isinstance(key, torch.Tensor) else key] = entry
    return {"state": state, "param_groups": groups}


def each_param(views: dict, n: int) -> list[dict]:
    """``{key: [value of each of n parameters]}`` as ``[{key: value} of each]``."""
    return [{k: v[i] for k, v in views.items()} for i in range(n)]


def live(shard) -> list[dict]:
    """The source of views of this process's live state, as the shard's home presents its
    parameters (``Shard.state_views``): world size 1, or DTensor parameters' local shards."""
    return each_param(shard.state_views(), len(shard.params))


def assembled(pieces, world: int, chunk_elems: int, me: bool, on_host: bool):
    """The source of whole values from every rank's shards: ``pieces(part, rows)`` returns,
    for this rank's ``part`` (a chunk of one state), every rank's chunk at the same place
    (a list or a tensor of rows, in rank order; None where this rank does not assemble:
    ``me`` False), received into ``rows`` (world x chunk, on the host or the flat
    buffer's device; None where ``me`` is False). Chunks of ``chunk_elems`` elements of
    one state of one flat buffer, in ``state_chunks``' order."""
    def values(shard):
        view, bufs = shard.by_param, shard.state.buffers()
        numel = shard.layout.shard_numel
        rows = torch.empty(world, max(1, min(numel, chunk_elems)), dtype=shard.state.dtype,
                           device="cpu" if on_host else shard.device) if me else None
        out = {k: [view.empty(i, b.dtype) for i in range(len(shard.params))]
               for k, b in bufs.items()} if me else None
        for key, c, part in state_chunks(bufs, numel, chunk_elems):
            if not on_host and part.device != shard.device:  # offloaded state: sent from the device
                part = part.to(shard.device)
            got = pieces(part, rows)
            for r in range(world if me else 0):
                view.unpack(r, c, got[r], out[key])
        return each_param(shard.home.views(out), len(shard.params)) if me else None
    return values


def state_chunks(bufs: dict, numel: int, chunk_elems: int):
    """(key, first element, chunk) of each of this rank's state buffers ``bufs`` (a shard's
    ``state.buffers()``, ``numel`` elements each), ``chunk_elems`` elements at a time: what
    ``assembled`` sends and receives, in order."""
    chunk = max(1, min(numel, chunk_elems))
    for key, buf in bufs.items():
        for c in range(0, numel, chunk):
            yield key, c, buf[c:c + min(chunk, numel - c)]
