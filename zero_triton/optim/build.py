"""A param group's parameters to the shards that step them (``zero_triton.optim.shard``):
plain tensors re-homed into a flat buffer per dtype (``Shard.flat``), DTensor parameters
left where their engine keeps them, a shard per dtype (``Shard.engine``)."""
from __future__ import annotations

import dataclasses

from zero_triton.native import backends
from zero_triton.optim.engine_home import is_dtensor, keeps_blocks
from zero_triton.optim.shard import FLAT_DTYPES, Shard
from zero_triton.state import moments as moment_formats
from zero_triton.state.flat import real_dtype


def build_flats(trainable: list, comm, spec, *, amsgrad: bool, key: int, reducer) -> list:
    """The shards of one param group, numbered from ``key``: a flat one per dtype of the
    plain tensors of ``trainable`` (complex parameters in their real dtype's), then an
    engine's per dtype of its DTensors, each built to ``spec``
    (``zero_triton.optim.spec``). The backend is resolved first (an error names the fix);
    if one shard fails, the hooks of those already built are removed and nothing is left
    behind."""
    spec.check_params(trainable, amsgrad)  # what the moments' format cannot step
    if trainable and trainable[0].device.type != "meta":  # meta: resolved once materialised
        backends.resolve(spec.backend, trainable[0].device)  # raises with the fix
    plain = [p for p in trainable if not is_dtensor(p)]
    engine = [p for p in trainable if is_dtensor(p)]
    flats = []
    try:
        for dtype in FLAT_DTYPES:
            members = [p for p in plain if real_dtype(p.dtype) == dtype]
            if members:
                flats.append(Shard.flat(members, comm, spec, amsgrad=amsgrad,
                                        key=key + len(flats), reducer=reducer))
        block = moment_formats.FORMATS[spec.moments].block
        for dtype in dict.fromkeys(p.dtype for p in engine):
            members = [p for p in engine if p.dtype == dtype]
            # A block-quantized format steps the parameters whose blocks stay whole on one
            # rank (``keeps_blocks``: the same codes at every world size); the others keep
            # fp32 moments, in a shard of their own.
            whole = [keeps_blocks(p, block) for p in members]
            kept = [p for p, w in zip(members, whole) if w]
            thin = [p for p, w in zip(members, whole) if not w]
            for part, part_spec in ((kept, spec), (thin, dataclasses.replace(spec, moments="fp32"))):
                if part:
                    flats.append(Shard.engine(part, comm, part_spec, amsgrad=amsgrad,
                                              key=key + len(flats)))
    except BaseException:
        for flat in flats:
            flat.remove_hooks()
        raise
    return flats
