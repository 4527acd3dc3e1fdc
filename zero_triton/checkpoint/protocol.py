"""The collective save and load: every rank does its part of a phase, then every rank
learns how every rank did (``agree``); one failure anywhere raises on every rank, naming
the rank and the phase, before the next phase starts."""
from __future__ import annotations

import os
import secrets
import time

import torch

from zero_triton.checkpoint import directory as dirs
from zero_triton.checkpoint import manifest as mf
from zero_triton.checkpoint.errors import CheckpointError
from zero_triton.checkpoint.files import (EXTRA_FILE, MODEL_EXTRA_FILE, MODEL_FILE, Readers,
                                          Writer, as_bytes, encode, one_line, rank_file)
from zero_triton.checkpoint.target import Target
from zero_triton.state.int8 import BLOCK, Int8Moments

CODES = {mf.COMPACT_STATES[0]: torch.int8, mf.COMPACT_STATES[1]: torch.uint8}

LOCK_TIMEOUT_S = 300.0


class _Replaced(CheckpointError):
    """The directory being read was swapped by a save meanwhile (worth one retry)."""


def _say(exc: BaseException, limit: int = 600) -> str:
    return one_line(f"{type(exc).__name__}: {exc}", limit)


def agree(comm, phase: str, what: str, fn, share=lambda value: None, after: str = ""):
    """Run ``fn()`` on this rank, then exchange outcomes. Returns ``(value, [share(value)
    of every rank])``. When any rank failed (any Exception), raises on every rank: the
    failing rank its own CheckpointError (other exceptions wrapped in one naming the rank
    and phase), the others a CheckpointError naming the first failing rank and phase.
    ``after`` ends the message (what state things are in); ``exc.retryable``: every
    failure was a directory swapped during a load."""
    try:
        value, error = fn(), None
        outcome = ("ok", share(value), False)
    except Exception as exc:
        value, error = None, exc
        outcome = ("error", _say(exc), isinstance(exc, _Replaced))
    every = comm.all_gather_object(outcome, f"checkpoint {what} ({phase})")
    failed = [(r, msg, retry) for r, (status, msg, retry) in enumerate(every) if status != "ok"]
    if not failed:
        return value, [msg for _, msg, _ in every]
    if error is not None and isinstance(error, CheckpointError):
        exc = error
    else:
        r, msg, _ = (comm.rank, _say(error), False) if error is not None else failed[0]
        exc = CheckpointError(f"checkpoint {what} failed on rank {r} while {phase}: {msg}"
                              + (f"; {after}" if after else ""))
    exc.retryable = all(retry for _, _, retry in failed)
    if exc is error:
        raise exc
    raise exc from error


# -- save -------------------------------------------------------------------------------
def save(path, optimizer, model=None, *, extra=None, lock_timeout: float = LOCK_TIMEOUT_S,
         compact: bool = False) -> None:
    """Write a sharded checkpoint of ``optimizer`` (and ``model``) to the directory ``path``.

    Collective over the optimizer's process group (every rank calls it with the same
    ``path``); FusedAdam saves alone. Each rank writes its shard of the fp32 master and
    moments; rank 0 writes the low-precision parameters, ``model``'s other state-dict
    entries (buffers, frozen parameters) and ``extra`` (anything ``torch.load(...,
    weights_only=True)`` reads back: tensors, numbers, strings, lists, dicts; anything
    else is refused, with its key named, before a byte is written).

    ``path`` may be missing, an empty directory or a checkpoint: anything else (a
    directory with a file the checkpoint did not write) is refused. The previous
    checkpoint is replaced atomically; on any failure on any rank it stays, and every
    rank raises. Saves to one path are serialised: a second one waits up to
    ``lock_timeout`` seconds, then raises. ``compact=True``: int8 moments as their codes
    and scales (a quarter of the float32 bytes; ``load`` and ``consolidate`` decode them
    into any optimizer's format)."""
    target = Target(optimizer, compact=compact)
    # Agreed over every rank; written by the ranks of one copy of the shards (hybrid
    # sharding's replica 0), the lead (its shard 0) starting, writing the model's files
    # and committing.
    comm = target.comm.everyone
    lead = target.writes and target.rank == 0
    path = os.path.abspath(os.fspath(path))
    mine = {}
    untouched = f"the previous checkpoint at {path} is untouched"

    def start():
        blobs = _blobs(target, model, extra)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        mine["lock"] = dirs.SaveLock(path, lock_timeout).__enter__()
        dirs.check_replaceable(path)
        save_id = secrets.token_hex(8)
        mine["tmp"], mine["save_id"] = dirs.make_tmp(path, save_id), save_id
        mine["blobs"] = blobs
        return save_id, mine["tmp"]

    try:
        _, started = agree(comm, "starting", f"save to {path}",
                           start if lead else (lambda: None), share=lambda v: v, after=untouched)
        save_id, tmp = next(s for s in started if s is not None)
        _, records = agree(comm, "writing its files", f"save to {path}",
                           lambda: _write_files(tmp, save_id, target, mine.get("blobs", {})),
                           share=lambda v: v, after=untouched)

        def finish():
            manifest = _manifest(type(optimizer).__name__, target, model, save_id, records)
            dirs.commit(tmp, path, save_id, mf.seal(manifest))
            mine["committed"] = True

        agree(comm, "committing", f"save to {path}", finish if lead else (lambda: None),
              after=untouched)
    finally:
        if "tmp" in mine and not mine.get("committed"):
            dirs.remove_tmp(mine["tmp"], mine["save_id"])
        if "lock" in mine:
            mine["lock"].__exit__(None, None, None)


def _blobs(target: Target, model, extra) -> dict:
    """The lead's files beside the shards: ``model``'s other state-dict entries and
    ``extra``, encoded (refused, with the key named, before a byte is written)."""
    blobs = {}
    if model is not None:
        blobs[MODEL_EXTRA_FILE] = encode(target.model_extra(model), "the model's state-dict entry",
                                         plain_tensors_ok=True)
    if extra is not None:
        blobs[EXTRA_FILE] = encode(extra, "extra")
    return blobs


def _manifest(optimizer: str, target: Target, model, save_id: str, records: list) -> dict:
    """The manifest of save ``save_id`` of an ``optimizer`` (its class name), over every
    rank's files (``records``), checked before it is committed."""
    files = {}
    for part in records:
        files.update(part)
    manifest = {"format": mf.FORMAT, "version": mf.VERSION, "save_id": save_id,
                "time": time.time(), "optimizer": optimizer,
                "world_size": target.world_size, "params": target.param_entries(model),
                "flats": target.flat_entries(), "param_groups": target.hyperparameters(),
                "model_extra": MODEL_EXTRA_FILE in files, "extra": EXTRA_FILE in files,
                "files": files}
    manifest["step"] = max((f["step"] for f in manifest["flats"]), default=0.0)
    mf.validate(manifest, "the manifest being written")  # a bug here, not a bad disk
    return manifest


def _write_files(tmp, save_id, target: Target, blobs: dict) -> dict:
    """This rank's shard file (and rank 0's model files); returns their records (none on
    a replica's ranks: replica 0's hold the same shards)."""
    if not target.writes:
        return {}
    rank = target.rank
    segments = []
    with Writer(tmp, rank_file(rank), save_id) as w:
        for k, flat in enumerate(target.flats):
            # Canonical coordinates (no buckets, no padding): any layout can read them.
            pieces = flat.by_param.canonical(rank)
            for name, buf in target.saved_states(flat).items():
                for lo, end, s0 in pieces:
                    if name == mf.COMPACT_STATES[2]:  # the scales of the range's blocks
                        part = buf[s0 // BLOCK:s0 // BLOCK + mf.segment_bytes(name, lo, end) // 8]
                    else:
                        part = buf[s0:s0 + end - lo]
                    offset = w.write(as_bytes(part))
                    segments.append({"flat": k, "state": name, "start": lo, "end": end,
                                     "offset": offset})
        records = {rank_file(rank): {"rank": rank, "segments": segments, **w.close()}}
    if rank != 0:
        return records
    segments = []
    with Writer(tmp, MODEL_FILE, save_id) as w:
        for k, flat in enumerate(target.flats):
            parts = flat.layout.to_canonical(flat.flat_param)
            offset = w.write(as_bytes(parts[0]))
            for part in parts[1:]:  # consecutive: one canonical run
                w.write(as_bytes(part))
            segments.append({"flat": k, "offset": offset, "numel": flat.layout.numel,
                             "dtype": mf.dtype_name(flat.dtype)})
        records[MODEL_FILE] = {"rank": 0, "segments": segments, **w.close()}
    for name, data in blobs.items():
        with Writer(tmp, name, save_id) as w:
            w.write(data)
            records[name] = {"rank": 0, **w.close()}
    return records


# -- load -------------------------------------------------------------------------------
def read_state_range(readers: Readers, manifest, k, name, lo, end, out: torch.Tensor) -> None:
    """Fill ``out`` with state ``name`` of flat ``k`` over the buffer range [lo, end)
    (``end - lo`` elements in the state's dtype; for the scales of a compact save, the
    range's blocks, [blocks, 2] float32, ``lo`` on a block), from whichever rank files
    hold it (the manifest's segments cover every state exactly once: checked by
    ``validate``)."""
    dest = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    for fname, record in manifest["files"].items():
        for seg in record.get("segments", ()):
            if seg["flat"] != k or seg.get("state") != name:
                continue
            a, b = max(lo, seg["start"]), min(end, seg["end"])
            if a < b:
                skip = mf.segment_bytes(name, seg["start"], a) if a > seg["start"] else 0
                at = mf.segment_bytes(name, lo, a) if a > lo else 0
                readers.get_reader(fname).read_into(
                    seg["offset"] + skip, dest[at:at + mf.segment_bytes(name, a, b)])


def read_states(readers: Readers, manifest, k, ranges, numel: int) -> dict:
    """Every state of flat ``k`` over ``ranges`` ((lo, end, at): buffer range [lo, end)
    put at element ``at``) as float32 tensors of ``numel`` elements (zero elsewhere),
    torch's names: a compact save's codes and scales decoded."""
    saved = manifest["flats"][k]["states"]
    compact = mf.COMPACT_STATES[0] in saved
    out = {}
    for name in saved:
        if name == mf.COMPACT_STATES[2]:
            t = torch.zeros(-(-numel // BLOCK), 2, dtype=torch.float32)
        else:
            t = torch.zeros(numel, dtype=CODES.get(name, torch.float32))
        for lo, end, at in ranges:
            if name == mf.COMPACT_STATES[2]:
                read_state_range(readers, manifest, k, name, lo, end,
                                 t[at // BLOCK:at // BLOCK + mf.segment_bytes(name, lo, end) // 8])
            else:
                read_state_range(readers, manifest, k, name, lo, end, t[at:at + end - lo])
        out[name] = t
    if compact:
        codes = [out.pop(name) for name in mf.COMPACT_STATES[:2]]
        scales = out.pop(mf.COMPACT_STATES[2])
        out.update(Int8Moments.decoded(codes[0], codes[1], scales))
    return out


def read_model_flat(readers: Readers, manifest, k) -> torch.Tensor:
    seg = manifest["files"][MODEL_FILE]["segments"][k]
    out = torch.empty(seg["numel"], dtype=mf.as_dtype(seg["dtype"]))
    readers.get_reader(MODEL_FILE).read_into(seg["offset"], memoryview(out.view(torch.uint8).numpy()))
    return out


def _prepare(path, target: Target, model) -> tuple[dict, dict]:
    """Read and check everything this rank needs; change nothing."""
    directory, manifest = dirs.resolve(path)
    with directory:
        try:
            return _read(directory, manifest, target, model), manifest
        except (CheckpointError, OSError) as exc:
            if directory.removed():
                raise _Replaced(f"the checkpoint at {os.fspath(path)} was replaced by another save "
                                f"while it was being read ({_say(exc, 200)})") from exc
            if isinstance(exc, OSError):
                raise CheckpointError(f"cannot read checkpoint {directory.path}: {_say(exc)}") from exc
            raise


def _read(directory, manifest, target: Target, model) -> dict:
    mf.check_same_model(manifest, target.param_entries(model), target.flat_entries(),
                        len(target.optimizer.param_groups), directory.path)
    readers = Readers(directory, manifest)
    try:
        states, params = [], []
        for k, flat in enumerate(target.flats):  # padding stays zero
            states.append(read_states(readers, manifest, k, flat.by_param.canonical(target.rank),
                                      flat.layout.shard_numel))
            params.append(read_model_flat(readers, manifest, k))
        model_extra = extra = None
        if model is not None and manifest["model_extra"]:
            model_extra = _match_model_extra(readers.get_reader(MODEL_EXTRA_FILE).read_blob(),
                                             model, directory.path)
        if manifest["extra"]:
            extra = readers.get_reader(EXTRA_FILE).read_blob()
    finally:
        readers.close()
    return {"states": states, "params": params, "model_extra": model_extra, "extra": extra}


def _match_model_extra(saved, model, where) -> dict:
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint {where}: {MODEL_EXTRA_FILE} holds a "
                              f"{type(saved).__name__}, not a state dict")
    current = model.state_dict()
    here = {p: n for n, p in mf.plain_names(current).items()}  # plain name -> this model's
    there = mf.plain_names(saved)
    out = {}  # keyed by this model's state-dict names
    for n, t in saved.items():
        if there[n] not in here:
            raise mf.ModelMismatchError(f"checkpoint {where} holds model entry '{n}', which this "
                                        "model lacks; build the same model before loading")
        mine = here[there[n]]
        if isinstance(current[mine], torch.Tensor):
            if not isinstance(t, torch.Tensor) or tuple(current[mine].shape) != tuple(t.shape):
                raise mf.ModelMismatchError(
                    f"checkpoint {where}: model entry '{n}' has shape "
                    f"{tuple(getattr(t, 'shape', ()))}, this model's {tuple(current[mine].shape)}")
            out[mine] = t
    return out


def load(path, optimizer, model=None):
    """Load the checkpoint at ``path`` into ``optimizer`` (and ``model``); return the
    ``extra`` it was saved with (None if none).

    Collective over the optimizer's process group, at any world size: each rank reads
    the byte ranges of its own shard, verified by checksum. The manifest's checksum, its
    whole structure and its match with this optimizer are checked, and everything this
    rank needs is read and verified, on every rank, before anything changes: a bad file,
    a tampered manifest, a different model or a rank that cannot load raises on every
    rank and leaves the optimizer untouched. A load that races a save to the same path
    retries once. The checkpoint's hyperparameters replace the optimizer's (with a
    warning if they differ)."""
    target = Target(optimizer, "checkpoint.load")
    comm = target.comm.everyone
    where = f"load from {os.fspath(path)}"
    for attempt in (0, 1):
        try:
            (plan, manifest), ids = agree(comm, "reading", where,
                                          lambda: _prepare(path, target, model),
                                          share=lambda v: v[1]["save_id"], after="nothing was changed")
        except CheckpointError as exc:
            if attempt == 0 and getattr(exc, "retryable", False):
                continue
            raise
        if len(set(ids)) == 1:
            break
        if attempt == 1:
            raise CheckpointError(f"checkpoint {where}: the ranks read different saves ({sorted(set(ids))}): "
                                  "another job is saving to this path; load again when it is done")
    target.apply(plan, manifest, model)
    return plan["extra"]
