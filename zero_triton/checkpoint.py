"""Sharded checkpoints: every rank writes what it owns, any world size loads them.

A checkpoint is a directory::

    manifest.json    format, world size, every parameter (name, shape, dtype, group,
                     flat buffer, offset), hyperparameters, steps, which rank wrote which
                     byte range of which file, a CRC32 per 4 MiB chunk of every file and
                     a per-file checksum (the CRC32 of its chunk CRCs)
    rank00000.bin    rank r's [lo, hi) of each flat buffer's fp32 master, exp_avg,
    rank00001.bin    exp_avg_sq (max_exp_avg_sq): raw little-endian float32, clipped to
    ...              the parameters' end (tail padding is never written)
    model.bin        the flat low-precision parameter buffers, once (rank 0)
    model_extra.pt   with ``model=``: the model's state-dict entries the optimizer does
                     not own (buffers, frozen parameters), once (rank 0)
    extra.pt         ``extra=`` (rank 0's), if given

Because flat offsets do not depend on the world size (``zero_triton.flat``), a loader at
any world size reads exactly the byte ranges of its new shard, verified chunk by chunk.

Atomicity: ranks write into ``PATH.tmp-<token>``; after every rank reported success rank
0 writes ``manifest.json`` last, fsyncs, renames an existing ``PATH`` to
``PATH.old-<token>``, renames the temporary directory to ``PATH`` and removes the old
one. A crash at any point leaves ``PATH`` (or, in the window between the two renames,
``PATH.old-<token>``, which ``load`` falls back to) holding the previous complete
checkpoint; a directory without a manifest is never loaded. All ranks must see one
filesystem (one machine, or a shared mount).
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import io
import math
import json
import os
import secrets
import shutil
import sys
import warnings
import zlib

import numpy as np
import torch

from zero_triton.flat import unflatten_into

FORMAT = "zero_triton.checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
MODEL_FILE = "model.bin"
MODEL_EXTRA_FILE = "model_extra.pt"
EXTRA_FILE = "extra.pt"
CHUNK_BYTES = 4 << 20  # checksum granularity: a loader verifies only the chunks it reads
STATES = ("master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
# Keys of a param group that are bookkeeping, not hyperparameters of the step.
_NOT_HYPER = {"params", "param_names", "foreach", "capturable", "differentiable", "fused"}

if sys.byteorder != "little":  # the shard files are little-endian by definition
    raise ImportError("zero_triton.checkpoint supports little-endian machines only")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupted or could not be written."""


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.bin"


# -- low-level I/O ------------------------------------------------------------------------
def _write_bytes(f, data) -> None:
    """The one place bytes reach the disk (tests replace it to simulate a full disk)."""
    f.write(data)


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor (moved to CPU), without a copy when already there."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.contiguous().view(torch.uint8).numpy())


def _file_crc(chunk_crcs) -> int:
    """The per-file checksum: CRC32 of the chunk CRCs (one pass over the data, not two)."""
    return zlib.crc32(np.asarray(chunk_crcs, dtype="<u4").tobytes())


class _Writer:
    """A file written front to back with a CRC32 per chunk."""

    def __init__(self, path):
        self.path = path
        self.f = open(path, "wb")
        self.bytes = 0
        self.chunk_crcs = []
        self._chunk_crc = 0
        self._chunk_fill = 0

    def write(self, data) -> int:
        """Append ``data``; return the byte offset it starts at."""
        data = memoryview(data).cast("B")
        start = self.bytes
        _write_bytes(self.f, data)
        pos = 0
        while pos < len(data):
            take = min(CHUNK_BYTES - self._chunk_fill, len(data) - pos)
            self._chunk_crc = zlib.crc32(data[pos:pos + take], self._chunk_crc)
            self._chunk_fill += take
            pos += take
            if self._chunk_fill == CHUNK_BYTES:
                self.chunk_crcs.append(self._chunk_crc)
                self._chunk_crc, self._chunk_fill = 0, 0
        self.bytes += len(data)
        return start

    def close(self) -> dict:
        if self._chunk_fill:
            self.chunk_crcs.append(self._chunk_crc)
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return {"bytes": self.bytes, "crc32": _file_crc(self.chunk_crcs), "chunk_bytes": CHUNK_BYTES,
                "chunk_crc32": self.chunk_crcs}

    def abort(self):
        with contextlib.suppress(OSError):
            self.f.close()


class _Reader:
    """Reads byte ranges of one checkpoint file, verifying every chunk it touches."""

    def __init__(self, directory, name, record):
        self.name, self.record = name, record
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            who = f" (written by rank {record['rank']})" if "rank" in record else ""
            raise CheckpointError(f"checkpoint file {name}{who} is missing from {directory}; "
                                  "the checkpoint is incomplete: load an earlier one")
        size = os.path.getsize(path)
        if size != record["bytes"]:
            raise CheckpointError(f"checkpoint file {name} in {directory} is truncated or was "
                                  f"replaced: {size} bytes, the manifest says {record['bytes']}")
        self.f = open(path, "rb")

    def close(self):
        self.f.close()

    def _bad(self, chunk):
        return CheckpointError(f"checksum mismatch in checkpoint file {self.name} (chunk {chunk}, "
                               f"bytes {chunk * self.record['chunk_bytes']}..): the file is "
                               "corrupted; load an earlier checkpoint")

    def read_into(self, offset: int, dest: memoryview) -> None:
        """Fill ``dest`` with the file's bytes [offset, offset + len(dest))."""
        cb, crcs = self.record["chunk_bytes"], self.record["chunk_crc32"]
        end = offset + len(dest)
        c = offset // cb
        while c * cb < end:
            cs, ce = c * cb, min((c + 1) * cb, self.record["bytes"])
            self.f.seek(cs)
            if offset <= cs and ce <= end:  # whole chunk lands in dest: read it in place
                view = dest[cs - offset:ce - offset]
                got = self.f.readinto(view)
            else:  # a chunk straddling the range: read it whole to check it, keep a part
                view = memoryview(bytearray(ce - cs))
                got = self.f.readinto(view)
                lo, hi = max(cs, offset), min(ce, end)
                dest[lo - offset:hi - offset] = view[lo - cs:hi - cs]
            if got != ce - cs or zlib.crc32(view) != crcs[c]:
                raise self._bad(c)
            c += 1


def _fsync_dir(path):
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


# -- what the optimizer holds ---------------------------------------------------------------
def _flats(optimizer):
    """The optimizer's flat buffers, after following parameters moved since the last
    step (``model.to(...)``)."""
    return [flat for _, flat in optimizer._current_flats()]


def _flat_states(flat) -> dict:
    out = {"master": flat.master, "exp_avg": flat.exp_avg, "exp_avg_sq": flat.exp_avg_sq}
    if flat.max_exp_avg_sq is not None:
        out["max_exp_avg_sq"] = flat.max_exp_avg_sq
    return out


# Submodule names that wrappers insert: torch.compile (``_orig_mod``), activation
# checkpointing (``_checkpoint_wrapped_module``), FSDP (``_fsdp_wrapped_module``) anywhere;
# DDP and DataParallel (``module``) in front.
_WRAPPER_NAMES = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}


def _plain_name(name: str) -> str:
    """``name`` without what wrappers add: ``module._orig_mod.a._checkpoint_wrapped_module.w``
    is ``a.w``, so a checkpoint saved through a wrapper loads into the bare model and back."""
    parts = [part for part in name.split(".") if part not in _WRAPPER_NAMES]
    while len(parts) > 1 and parts[0] == "module":
        parts.pop(0)
    return ".".join(parts)


def _plain_names(names) -> dict[str, str]:
    """``{name: plain name}`` for one model's names; names unchanged where stripping would
    merge two of them (a bare model with both ``module.w`` and ``w``)."""
    names = list(names)
    plain = {n: _plain_name(n) for n in names}
    return plain if len(set(plain.values())) == len(plain) else {n: n for n in names}


def _own_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU holding only its own bytes: ``torch.save`` writes a view's whole
    storage (a tied weight would carry its flat buffer along). A copy only for views."""
    t = t.detach().cpu()
    if t.untyped_storage().nbytes() > t.numel() * t.element_size():
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _param_entries(optimizer, model=None) -> list[dict]:
    """Every parameter of the optimizer, in state-dict order: name (wrapper prefixes
    stripped), shape, dtype, group, and the flat buffer and offset it lives at (None
    when frozen: not optimized)."""
    names = {}
    if model is not None:
        named = list(model.named_parameters())
        plain = _plain_names(n for n, _ in named)
        names = {id(p): plain[n] for n, p in named}
    where = {}
    for k, flat in enumerate(_flats(optimizer)):
        for p, offset in zip(flat.params, flat.layout.offsets):
            where[id(p)] = (k, offset)
    entries, index = [], 0
    for gi, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            k, offset = where.get(id(p), (None, None))
            named = id(p) in names
            entries.append({"name": names[id(p)] if named else f"param_groups[{gi}].params[{j}]",
                            "named": named, "index": index, "group": gi, "shape": list(p.shape),
                            "dtype": _dtype_name(p.dtype), "flat": k, "offset": offset})
            index += 1
    return entries


def _jsonable(value):
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (tuple, list)):
        items = [_jsonable(v) for v in value]
        return _SKIP if any(i is _SKIP for i in items) else items
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return _SKIP


_SKIP = object()


def _hyperparameters(optimizer) -> list[dict]:
    groups = []
    for group in optimizer.param_groups:
        kept = {}
        for k, v in group.items():
            if k in _NOT_HYPER:
                continue
            j = _jsonable(v)
            if j is not _SKIP:
                kept[k] = j
        groups.append(kept)
    return groups


def _describe(entry: dict) -> str:
    where = "frozen" if entry["flat"] is None else f"flat buffer {entry['flat']}"
    return (f"'{entry['name']}' {entry['shape']} {entry['dtype']} in param group "
            f"{entry['group']} ({where})")


def _check_same_model(manifest: dict, mine: list[dict], directory: str) -> None:
    theirs = manifest["params"]
    # save strips wrapper prefixes from names; older checkpoints may still hold them
    plain = _plain_names(a["name"] for a in theirs if a["named"])
    keys = ("group", "shape", "dtype", "flat", "offset")
    for i, (a, b) in enumerate(zip(theirs, mine)):
        differ = (any(a[k] != b[k] for k in keys)
                  or (a["named"] and b["named"] and plain[a["name"]] != b["name"]))
        if differ:
            raise ValueError(
                f"checkpoint {directory} is from a different model: parameter {i} is "
                f"{_describe(a)} there, {_describe(b)} here; build the same model and param "
                "groups (same order, shapes and dtypes) before loading")
    if len(theirs) != len(mine):
        i = min(len(theirs), len(mine))
        extra = theirs[i] if len(theirs) > len(mine) else mine[i]
        side = "only the checkpoint" if len(theirs) > len(mine) else "only this optimizer"
        raise ValueError(
            f"checkpoint {directory} is from a different model: it has {len(theirs)} parameters, "
            f"this optimizer {len(mine)}; the first unmatched, parameter {i} "
            f"{_describe(extra)}, is in {side}")


# -- save -----------------------------------------------------------------------------------
def _is_checkpoint_dir(path) -> bool:
    return os.path.isdir(path) and (os.path.exists(os.path.join(path, MANIFEST))
                                    or not os.listdir(path))


def save(path, optimizer, model=None, *, extra=None) -> None:
    """Write a sharded checkpoint of ``optimizer`` (and ``model``) to the directory ``path``.

    Collective over the optimizer's process group (every rank calls it with the same
    ``path``); FusedAdam saves alone. Each rank writes its shard of the fp32 master and
    moments; rank 0 writes the low-precision parameters, ``model``'s other state-dict
    entries (buffers, frozen parameters) and ``extra`` (anything ``torch.load(...,
    weights_only=True)`` reads back: tensors, numbers, strings, lists, dicts). An
    existing checkpoint at ``path`` is replaced atomically; on any failure it stays.
    """
    comm = optimizer._comm
    path = os.path.abspath(os.fspath(path))
    token = secrets.token_hex(4)
    start = None
    if comm.rank == 0:
        try:
            if os.path.lexists(path) and not _is_checkpoint_dir(path):
                raise CheckpointError(f"{path} exists and is not a checkpoint directory (no "
                                      f"{MANIFEST}); refusing to replace it: choose another path")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp-{token}"
            os.mkdir(tmp)
            start = ("ok", tmp)
        except (OSError, CheckpointError) as exc:
            start = ("error", f"{type(exc).__name__}: {exc}")
    status, tmp = comm.all_gather_object(start, "checkpoint save (start)")[0]
    if status != "ok":
        raise CheckpointError(f"checkpoint save to {path} failed on rank 0: {tmp}")

    committed = False
    try:
        try:
            records, error = _write_rank_files(tmp, optimizer, model, extra, comm.rank), None
        except OSError as exc:
            records, error = None, exc
        every = comm.all_gather_object(
            ("error", f"{type(error).__name__}: {error}") if error else ("ok", records),
            "checkpoint save (write shards)")
        failed = [(r, msg) for r, (s, msg) in enumerate(every) if s != "ok"]
        if failed:
            r, msg = failed[0]
            raise CheckpointError(f"checkpoint save to {path} failed on rank {r}: {msg}; the "
                                  "previous checkpoint there is untouched") from error
        done = ("ok", None)
        if comm.rank == 0:
            try:
                files = {}
                for recs in (msg for _, msg in every):
                    files.update(recs)
                manifest = _manifest(optimizer, model, comm.world_size, files)
                _commit_dir(tmp, path, token, manifest)
                committed = True
            except OSError as exc:
                done = ("error", f"{type(exc).__name__}: {exc}")
        status, msg = comm.all_gather_object(done, "checkpoint save (commit)")[0]
        if status != "ok":
            raise CheckpointError(f"checkpoint save to {path} failed on rank 0 while "
                                  f"committing: {msg}; the previous checkpoint is untouched")
    finally:
        if comm.rank == 0 and not committed:
            shutil.rmtree(tmp, ignore_errors=True)


def _write_rank_files(tmp, optimizer, model, extra, rank) -> dict:
    """This rank's shard file (and rank 0's model files); returns their records."""
    records = {}
    writer = _Writer(os.path.join(tmp, rank_file(rank)))
    segments = []
    try:
        for k, flat in enumerate(_flats(optimizer)):
            lo, hi = flat.shard
            end = min(hi, flat.layout.numel)  # tail padding is not state
            if end <= lo:
                continue
            for name, buf in _flat_states(flat).items():
                offset = writer.write(_as_bytes(buf[:end - lo]))
                segments.append({"flat": k, "state": name, "start": lo, "end": end,
                                 "offset": offset})
    except BaseException:
        writer.abort()
        raise
    records[rank_file(rank)] = {"rank": rank, "segments": segments, **writer.close()}
    if rank != 0:
        return records

    writer = _Writer(os.path.join(tmp, MODEL_FILE))
    segments = []
    try:
        for k, flat in enumerate(_flats(optimizer)):
            offset = writer.write(_as_bytes(flat.flat_param[:flat.layout.numel]))
            segments.append({"flat": k, "offset": offset, "numel": flat.layout.numel,
                             "dtype": _dtype_name(flat.dtype)})
    except BaseException:
        writer.abort()
        raise
    records[MODEL_FILE] = {"rank": 0, "segments": segments, **writer.close()}

    blobs = {}
    if model is not None:
        mine = {id(q) for flat in _flats(optimizer) for q in flat.params}
        named = list(model.named_parameters())
        param_names = _plain_names(n for n, _ in named)
        owned = {param_names[n] for n, p in named if id(p) in mine}
        state = model.state_dict()
        state_names = _plain_names(state)
        blobs[MODEL_EXTRA_FILE] = {state_names[n]: _own_bytes(t) for n, t in state.items()
                                   if state_names[n] not in owned}
    if extra is not None:
        blobs[EXTRA_FILE] = extra
    for name, obj in blobs.items():
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        writer = _Writer(os.path.join(tmp, name))
        try:
            writer.write(buffer.getbuffer())
        except BaseException:
            writer.abort()
            raise
        records[name] = {"rank": 0, **writer.close()}
    return records


def _manifest(optimizer, model, world_size, files) -> dict:
    flats = []
    for k, (gi, flat) in enumerate((gi, flat) for gi, flats in enumerate(optimizer._flats)
                                   for flat in flats):
        steps = flat.param_steps()
        entry = {"group": gi, "dtype": _dtype_name(flat.dtype), "numel": flat.layout.numel,
                 "has_master": flat.has_master, "step": max(steps, default=0.0),
                 "states": list(_flat_states(flat))}
        if flat.steps is not None:  # parameters that missed steps (no gradient) count their own
            entry["param_steps"] = steps
        flats.append(entry)
    steps = {f["step"] for f in flats}
    return {"format": FORMAT, "version": VERSION, "optimizer": type(optimizer).__name__,
            "world_size": world_size, "step": max(steps) if steps else 0.0,
            "params": _param_entries(optimizer, model), "flats": flats,
            "param_groups": _hyperparameters(optimizer), "files": files}


def _commit_dir(tmp, path, token, manifest) -> None:
    """manifest.json last, fsynced; then swap the directory into place."""
    manifest_path = os.path.join(tmp, MANIFEST)
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    parent = os.path.dirname(path)
    old = None
    if os.path.lexists(path):
        old = f"{path}.old-{token}"
        os.rename(path, old)
    # Between these two renames PATH does not exist; load() falls back to PATH.old-*.
    os.rename(tmp, path)
    _fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    # Leftovers of saves that crashed (their manifest was never written) and of old swaps.
    for stale in glob.glob(glob.escape(path) + ".tmp-*") + glob.glob(glob.escape(path) + ".old-*"):
        shutil.rmtree(stale, ignore_errors=True)


# -- load -----------------------------------------------------------------------------------
def resolve(path) -> tuple[str, dict]:
    """The checkpoint directory to read at ``path`` and its manifest. Falls back to
    ``PATH.old-*`` when a save was interrupted between its two renames."""
    path = os.path.abspath(os.fspath(path))
    candidates = [path]
    if not os.path.exists(os.path.join(path, MANIFEST)):
        olds = glob.glob(glob.escape(path) + ".old-*")
        candidates += sorted(olds, key=os.path.getmtime, reverse=True)
    for directory in candidates:
        manifest_path = os.path.join(directory, MANIFEST)
        if os.path.exists(manifest_path):
            try:
                with open(manifest_path) as f:
                    manifest = json.load(f)
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"cannot read {manifest_path}: {exc}") from exc
            if manifest.get("format") != FORMAT:
                raise CheckpointError(f"{manifest_path} is not a zero_triton checkpoint manifest")
            if manifest.get("version") != VERSION:
                raise CheckpointError(f"{manifest_path} has format version {manifest.get('version')};"
                                      f" this zero_triton reads version {VERSION}")
            return directory, manifest
    if os.path.isfile(path):
        raise CheckpointError(f"{path} is a file; pass the checkpoint directory (the one "
                              f"holding {MANIFEST})")
    raise CheckpointError(f"no checkpoint at {path}: {MANIFEST} not found (a save that never "
                          "finished leaves no manifest)")


class _Readers(dict):
    def __init__(self, directory, manifest):
        super().__init__()
        self.directory, self.files = directory, manifest["files"]

    def get_reader(self, name) -> _Reader:
        if name not in self:
            if name not in self.files:
                raise CheckpointError(f"the manifest of {self.directory} lists no file {name}")
            self[name] = _Reader(self.directory, name, self.files[name])
        return self[name]

    def close(self):
        for reader in self.values():
            reader.close()


def _read_state_range(readers, manifest, k, name, lo, end, out: torch.Tensor) -> None:
    """Fill ``out`` (float32, ``end - lo`` elements) with state ``name`` of flat ``k``
    over the buffer range [lo, end), from whichever rank files hold it."""
    covered = 0
    dest = memoryview(out.view(torch.uint8).numpy())
    for fname, record in manifest["files"].items():
        for seg in record.get("segments", ()):
            if seg.get("flat") != k or seg.get("state") != name:
                continue
            a, b = max(lo, seg["start"]), min(end, seg["end"])
            if a >= b:
                continue
            reader = readers.get_reader(fname)
            reader.read_into(seg["offset"] + (a - seg["start"]) * 4, dest[(a - lo) * 4:(b - lo) * 4])
            covered += b - a
    if covered != end - lo:
        raise CheckpointError(f"checkpoint {readers.directory} does not cover {name} of flat "
                              f"buffer {k} over [{lo}, {end}) ({covered} of {end - lo} elements "
                              "found): a rank file is missing from the manifest")


def _read_model_flat(readers, manifest, k) -> torch.Tensor:
    record = manifest["files"][MODEL_FILE]
    seg = next(s for s in record["segments"] if s["flat"] == k)
    out = torch.empty(seg["numel"], dtype=_dtype(seg["dtype"]))
    readers.get_reader(MODEL_FILE).read_into(seg["offset"], memoryview(out.view(torch.uint8).numpy()))
    return out


def _read_blob(readers, name):
    reader = readers.get_reader(name)
    data = bytearray(reader.record["bytes"])
    reader.read_into(0, memoryview(data))
    return torch.load(io.BytesIO(data), weights_only=True)


def _prepare(directory, manifest, optimizer, model) -> dict:
    """Read and check everything this rank needs; change nothing."""
    _check_same_model(manifest, _param_entries(optimizer, model), directory)
    saved_flats = manifest["flats"]
    readers = _Readers(directory, manifest)
    try:
        states, params = [], []
        for k, flat in enumerate(_flats(optimizer)):
            saved = saved_flats[k]
            if saved["numel"] != flat.layout.numel:
                raise ValueError(f"checkpoint {directory}: flat buffer {k} holds {saved['numel']} "
                                 f"elements, this optimizer's {flat.layout.numel}")
            steps = saved.get("param_steps")
            if steps is not None and (not isinstance(steps, list) or len(steps) != len(flat.params) or
                                      not all(isinstance(t, (int, float)) and not isinstance(t, bool)
                                              and math.isfinite(t) and 0 <= t <= saved["step"]
                                              for t in steps)):
                raise ValueError(f"checkpoint {directory}: flat buffer {k}'s param_steps must be "
                                 f"{len(flat.params)} finite counts in [0, step]; the manifest is corrupt")
            lo, hi = flat.shard
            end = min(hi, flat.layout.numel)
            got = {}
            for name in saved["states"]:
                t = torch.zeros(hi - lo, dtype=torch.float32)  # tail padding stays zero
                if end > lo:
                    _read_state_range(readers, manifest, k, name, lo, end, t[:end - lo])
                got[name] = t
            states.append(got)
            params.append(_read_model_flat(readers, manifest, k))
        model_extra = extra = None
        files = manifest["files"]
        if model is not None and MODEL_EXTRA_FILE in files:
            saved = _read_blob(readers, MODEL_EXTRA_FILE)
            current = model.state_dict()
            here = {p: n for n, p in _plain_names(current).items()}  # plain name -> this model's
            there = _plain_names(saved)
            model_extra = {}  # keyed by this model's state-dict names
            for n, t in saved.items():
                if there[n] not in here:
                    raise ValueError(f"checkpoint {directory} holds model entry '{n}', which this "
                                     "model lacks; build the same model before loading")
                mine = here[there[n]]
                if tuple(current[mine].shape) != tuple(t.shape):
                    raise ValueError(f"checkpoint {directory}: model entry '{n}' has shape "
                                     f"{tuple(t.shape)}, this model's {tuple(current[mine].shape)}")
                model_extra[mine] = t
        if EXTRA_FILE in files:
            extra = _read_blob(readers, EXTRA_FILE)
    finally:
        readers.close()
    return {"states": states, "params": params, "model_extra": model_extra, "extra": extra}


def _apply_hyperparameters(optimizer, saved_groups, directory) -> None:
    diffs = []
    for gi, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups)):
        for k, v in saved.items():
            mine = _jsonable(group.get(k))
            if mine != v:
                diffs.append(f"group {gi} {k}: {v} (was {group.get(k)})")
            if isinstance(group.get(k), torch.Tensor):
                group[k].fill_(v)  # a tensor lr stays a tensor
            else:
                group[k] = tuple(v) if k == "betas" else v
    if diffs:
        warnings.warn(f"zero_triton.checkpoint.load: the checkpoint's hyperparameters replace "
                      f"the optimizer's: {'; '.join(diffs)}", stacklevel=3)


@torch.no_grad()
def _apply(plan, manifest, optimizer, model, directory) -> None:
    _apply_hyperparameters(optimizer, manifest["param_groups"], directory)
    for k, flat in enumerate(_flats(optimizer)):
        saved, got = manifest["flats"][k], plan["states"][k]
        flat.set_param_steps(saved.get("param_steps") or [saved["step"]] * len(flat.params))
        # The saved flat weights go back into the parameters (views of flat_param).
        unflatten_into(flat.params, plan["params"][k], flat.layout)
        if "max_exp_avg_sq" in got:
            flat.ensure_amsgrad()
        elif flat.max_exp_avg_sq is not None:
            flat.max_exp_avg_sq.zero_()
        for name, buf in _flat_states(flat).items():
            if name in got:
                buf.copy_(got[name])
        if flat.has_master:
            flat.param_shard.copy_(flat.master)
    if optimizer._comm.world_size == 1:
        for flat in _flats(optimizer):
            optimizer._expose_state(flat)
    if plan["model_extra"]:
        current = model.state_dict()
        for n, t in plan["model_extra"].items():
            current[n].copy_(t)


def load(path, optimizer, model=None):
    """Load the checkpoint at ``path`` into ``optimizer`` (and ``model``); return the
    ``extra`` it was saved with (None if none).

    Collective over the optimizer's process group, at any world size: each rank reads
    the byte ranges of its own shard, verified by checksum. Everything is read and
    checked on every rank before anything changes; a bad file, a different model or a
    rank that cannot load raises on every rank and leaves the optimizer untouched. The
    checkpoint's hyperparameters replace the optimizer's (with a warning if they
    differ)."""
    comm = optimizer._comm
    plan, error, directory, manifest = None, None, None, None
    try:
        directory, manifest = resolve(path)
        plan = _prepare(directory, manifest, optimizer, model)
    except (OSError, ValueError, KeyError, CheckpointError) as exc:
        error = exc
    every = comm.all_gather_object(None if error is None else f"{type(error).__name__}: {error}",
                                   "checkpoint load")
    if error is not None:
        raise error
    failed = [(r, msg) for r, msg in enumerate(every) if msg is not None]
    if failed:
        r, msg = failed[0]
        raise CheckpointError(f"checkpoint load from {path} failed on rank {r}: {msg}; "
                              "nothing was changed")
    _apply(plan, manifest, optimizer, model, directory)
    return plan["extra"]


# -- offline: consolidate and inspect ----------------------------------------------------------
def consolidate(path) -> tuple[dict, dict]:
    """The checkpoint at ``path`` as ``(optimizer_state_dict, model_state_dict)``:
    torch.optim.Adam's format (per-parameter step, exp_avg, exp_avg_sq, [max_exp_avg_sq],
    master_param for fp16/bf16) and a plain state dict keyed by parameter name. Needs no
    process group, no GPU and not the world size it was saved at."""
    directory, manifest = resolve(path)
    readers = _Readers(directory, manifest)
    try:
        state, model_sd = {}, {}
        flat_params = {}
        for k, saved in enumerate(manifest["flats"]):
            flat_params[k] = _read_model_flat(readers, manifest, k)
        seen_in_flat = {}
        for entry in manifest["params"]:
            k = entry["flat"]
            if k is None:
                continue
            saved = manifest["flats"][k]
            numel = int(np.prod(entry["shape"], dtype=np.int64))
            lo, end = entry["offset"], entry["offset"] + numel
            index = seen_in_flat.get(k, 0)  # entries of one flat come in its parameters' order
            seen_in_flat[k] = index + 1
            step = saved["param_steps"][index] if "param_steps" in saved else saved["step"]
            s = {"step": torch.tensor(step, dtype=torch.float32)}
            for name in saved["states"]:
                if name == "master" and not saved["has_master"]:
                    continue
                t = torch.empty(numel, dtype=torch.float32)
                if numel:
                    _read_state_range(readers, manifest, k, name, lo, end, t)
                s["master_param" if name == "master" else name] = t.view(entry["shape"])
            state[entry["index"]] = s
            model_sd[entry["name"]] = flat_params[k][lo:end].clone().view(entry["shape"])
        if MODEL_EXTRA_FILE in manifest["files"]:
            for n, t in _read_blob(readers, MODEL_EXTRA_FILE).items():
                model_sd.setdefault(n, _own_bytes(t))
    finally:
        readers.close()
    groups = []
    for gi, saved in enumerate(manifest["param_groups"]):
        g = dict(saved)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        g.update({"foreach": None, "capturable": False, "differentiable": False, "fused": None})
        g["params"] = [e["index"] for e in manifest["params"] if e["group"] == gi]
        groups.append(g)
    return {"state": state, "param_groups": groups}, model_sd


def verify(path) -> list[tuple[str, int, bool, str]]:
    """Check every file of the checkpoint against its CRC32: (file, bytes, ok, why)."""
    directory, manifest = resolve(path)
    out = []
    for name, record in manifest["files"].items():
        full = os.path.join(directory, name)
        if not os.path.exists(full):
            out.append((name, record["bytes"], False, "missing"))
            continue
        size = os.path.getsize(full)
        if size != record["bytes"]:
            out.append((name, record["bytes"], False, f"{size} bytes on disk"))
            continue
        crcs = []
        with open(full, "rb") as f:
            while block := f.read(record["chunk_bytes"]):
                crcs.append(zlib.crc32(block))
        bad = [c for c, (a, b) in enumerate(zip(crcs, record["chunk_crc32"])) if a != b]
        ok = not bad and _file_crc(crcs) == record["crc32"]
        out.append((name, record["bytes"], ok, "" if ok else
                    f"checksum mismatch in chunk {bad[0] if bad else '?'}"))
    return out


def _table(rows, header) -> str:
    rows = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _inspect(path) -> int:
    directory, manifest = resolve(path)
    params = manifest["params"]
    n_elem = sum(int(np.prod(p["shape"], dtype=np.int64)) for p in params)
    print(f"checkpoint   {directory}")
    print(f"format       {manifest['format']} v{manifest['version']} ({manifest['optimizer']})")
    print(f"world size   {manifest['world_size']}")
    print(f"step         {manifest['step']:g}")
    print(f"parameters   {len(params)} tensors, {n_elem:,} elements")
    for gi, g in enumerate(manifest["param_groups"]):
        print(f"group {gi}      " + ", ".join(f"{k}={v}" for k, v in sorted(g.items())))
    print()
    print(_table([[p["index"], p["name"], "x".join(map(str, p["shape"])) or "scalar", p["dtype"],
                   p["group"], "-" if p["flat"] is None else p["flat"],
                   "-" if p["offset"] is None else p["offset"]] for p in params],
                 ["#", "name", "shape", "dtype", "group", "flat", "offset"]))
    print()
    results = verify(path)
    print(_table([[name, manifest["files"][name].get("rank", "-"), f"{size:,}",
                   "ok" if ok else f"FAILED ({why})"] for name, size, ok, why in results],
                 ["file", "rank", "bytes", "crc32"]))
    total = sum(size for _, size, _, _ in results)
    bad = [name for name, _, ok, _ in results if not ok]
    print(f"\ntotal {total:,} bytes; " + (f"{len(bad)} file(s) FAILED: {', '.join(bad)}" if bad
                                          else "all checksums ok"))
    return 1 if bad else 0


def _check_output_file(path) -> None:
    """Refuse, before any work, a ``path`` that cannot become a file: a directory, or one
    whose nearest existing ancestor is a file or not writable. Missing directories in
    between are fine: ``_save_file`` creates them."""
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a directory; pass a file path such as "
                              f"{os.path.join(path, 'adam.pt')}")
    ancestor = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise CheckpointError(f"cannot write {path}: {ancestor} is not a directory; "
                              "pass a path in a writable directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot write {path}: directory {ancestor} is not writable; "
                              "pass a path in a writable directory")


def _save_file(obj, path) -> None:
    """``torch.save`` into a temporary file renamed over ``path`` (parent directories
    created): no half-written file."""
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(obj, f)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise CheckpointError(f"cannot write {path}: {exc.strerror or exc}; pass a path in a "
                              "writable directory with room for it") from exc


def main(argv=None) -> int:
    """``python -m zero_triton checkpoint inspect PATH`` |
    ``python -m zero_triton checkpoint consolidate PATH OUT.pt [--model MODEL.pt]``.
    A missing or damaged checkpoint and an output that cannot be written are one line
    on stderr and exit status 1."""
    parser = argparse.ArgumentParser(prog="python -m zero_triton checkpoint",
                                     description="Inspect or consolidate a sharded checkpoint.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="print the manifest as tables and verify every checksum")
    p.add_argument("path")
    p = sub.add_parser("consolidate", help="write one torch.optim.Adam-format state dict file "
                       "(and a plain model state dict), at no particular world size")
    p.add_argument("path")
    p.add_argument("out", help="optimizer state dict file (torch.save); missing parent "
                   "directories are created")
    p.add_argument("--model", default=None,
                   help="model state dict file (default: OUT with .model.pt for .pt)")
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            return _inspect(args.path)
        model_out = args.model or (args.out[:-3] if args.out.endswith(".pt") else args.out) + ".model.pt"
        if os.path.abspath(model_out) == os.path.abspath(args.out):
            parser.error("--model names the same file as OUT; pass another file for the model")
        _check_output_file(args.out)
        _check_output_file(model_out)
        optimizer_sd, model_sd = consolidate(args.path)
        _save_file(optimizer_sd, args.out)
        _save_file(model_sd, model_out)
        print(f"wrote {args.out} ({len(optimizer_sd['state'])} parameter states, torch.optim.Adam "
              f"format) and {model_out} ({len(model_sd)} entries)")
        return 0
    except BrokenPipeError:
        raise  # the reader went away: the command line's entry point ends quietly
    except (CheckpointError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyError as exc:
        print(f"error: the manifest of {args.path} lacks {exc}: the checkpoint is damaged or "
              "was not written by zero_triton; load an earlier one", file=sys.stderr)
        return 1


if __name__ == "__main__":
    from zero_triton.cli import run
    sys.exit(run(main))
