"""A param group's parameters to the shards that step them (``zero_triton.optim.shard``):
plain tensors re-homed into a flat buffer per dtype (``Shard.flat``), DTensor parameters
left where their engine keeps them, shards per dtype (``Shard.engine``) by their state's
format and how their local shards are stepped."""
from __future__ import annotations

import dataclasses

from zero_triton.native import backends
from zero_triton.optim.engine_home import blocks_fit, cuts_rows, is_dtensor, keeps_blocks
from zero_triton.optim.rows import row_map
from zero_triton.optim.shard import FLAT_DTYPES, Shard
from zero_triton.state import master as master_formats
from zero_triton.state import moments as moment_formats
from zero_triton.state.flat import FlatLayout, real_dtype

# Stochastic rounding's seeds of DTensor parameters: one per param group and dtype, apart
# from the flat buffers' (numbered from 0), the same at every layout (how many shards a
# dtype's parameters take is not).
ENGINE_SEEDS = 1 << 24


def build_shards(trainable: list, comm, spec, *, amsgrad: bool, key: int, reducer, group: int = 0) -> list:
    """The shards of param group number ``group``, numbered from ``key``: a flat one per
    dtype of the plain tensors of ``trainable`` (complex parameters in their real dtype's),
    then the DTensors' (``engine_shards``), each built to ``spec``
    (``zero_triton.optim.spec``). The backend is resolved first (an error names the fix);
    if one shard fails, the hooks of those already built are removed and nothing is left
    behind."""
    spec.check_params(trainable, amsgrad)  # what the moments' format cannot step
    if trainable and trainable[0].device.type != "meta":  # meta: resolved once materialised
        backends.resolve(spec.backend, trainable[0].device)  # raises with the fix
    plain = [p for p in trainable if not is_dtensor(p)]
    engine = [p for p in trainable if is_dtensor(p)]
    shards = []
    try:
        for dtype in FLAT_DTYPES:
            members = [p for p in plain if real_dtype(p.dtype) == dtype]
            if members:
                shards.append(Shard.flat(members, comm, spec, amsgrad=amsgrad,
                                        key=key + len(shards), reducer=reducer))
        for n, dtype in enumerate(dict.fromkeys(p.dtype for p in engine)):
            members = [p for p in engine if p.dtype == dtype]
            for part, part_spec, maps, rows in engine_shards(members, spec):
                shards.append(Shard.engine(part, comm, part_spec, amsgrad=amsgrad,
                                          key=key + len(shards), maps=maps, rows=rows,
                                          seed=ENGINE_SEEDS + 16 * group + n))
    except BaseException:
        for shard in shards:
            shard.remove_hooks()
        raise
    return shards


def engine_shards(members: list, spec) -> list:
    """DTensor parameters of one dtype as (parameters, spec, row maps, rows) per shard.

    A parameter's state is a function of the global parameter and the settings only, at
    every layout (mesh, tp and dp sizes, placements, world size):

    - its format: block-quantized moments where its rows are a whole number of blocks
      (``blocks_fit``), fp32 moments otherwise, in a shard of their own;
    - its rounding keys: its elements' indices in the canonical layout of ``members``'
      global shapes (``zero_triton.optim.rows``), and one seed per param group and dtype;
    - its blocks and their scales: runs of ``block`` (int8 256, int4 128) of its rows. Where a rank holds whole
      blocks in one run of keys the kernels step its local shard as it is; where a
      tensor-parallel cut leaves blocks that other ranks share a part of
      (``keeps_blocks`` false), or the rounding is keyed and a cut makes the keys no run
      (``cuts_rows``), it is stepped through its rows (``rows``: its ranks agree on the
      shared blocks' scales, keys are taken per element), in a shard of its own.

    Which shard a parameter is in depends on its placements and shape only, so every
    rank that holds it builds the same shards."""
    fmt = spec.moments
    block = moment_formats.FORMATS[fmt].block
    keyed = moment_formats.FORMATS[fmt].keyed or master_formats.FORMATS[
        spec.master_format(members[0].dtype)].keyed
    whole = FlatLayout.build([tuple(p.shape) for p in members], align=spec.align)
    maps = [row_map(p, f"DTensor parameter {tuple(p.shape)} ({p.dtype})", base)
            for p, base in zip(members, whole.offsets)]
    shards = {}
    for p, m in zip(members, maps):
        fits = blocks_fit(p, block)
        shared = fits and block > 1 and not keeps_blocks(p, block)
        rows = shared or (keyed and cuts_rows(p))
        if fits and block > 1:  # its blocks, their scales and its compact form read rows
            m.check(f"{fmt} moments (blocks of {block} of a row)")
        if rows:
            m.check(f"{fmt} blocks cut across ranks" if shared
                    else "stochastic rounding keyed by the element's global index")
        shards.setdefault((fits, rows), []).append((p, m))
    out = []
    for fits in (True, False):
        part_spec = spec if fits else dataclasses.replace(spec, moments="fp32")
        for rows in (False, True):
            held = shards.get((fits, rows))
            if held:
                out.append(([p for p, _ in held], part_spec, [m for _, m in held], rows))
    return out
