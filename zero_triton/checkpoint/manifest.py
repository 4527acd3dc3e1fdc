"""The manifest: what a checkpoint holds, sealed by a checksum, checked whole before a
byte of data is read.

``manifest.json`` is JSON with a ``checksum`` (SHA-256 of the rest, serialised with
sorted keys and no spaces): a manifest changed by hand or by a bad disk is refused. Its
``save_id`` is written into the header of every data file of the same save.

``validate`` checks the whole structure on its own (every field present with its type
and range; every data file a name the format defines; each state of each flat buffer
covered exactly once by the rank files' segments, which are laid out back to back; file
sizes equal to what the shapes and dtypes imply), so that no field can steer a reader
outside a file, into a huge allocation or into a partial load.
``check_same_model`` then compares it with the optimizer being loaded.
"""
from __future__ import annotations

import hashlib
import json
import math

import torch

from zero_triton.checkpoint.errors import CheckpointError, ModelMismatchError
from zero_triton.checkpoint.files import (EXTRA_FILE, HEADER_BYTES, MAX_MANIFEST_BYTES,
                                          MODEL_EXTRA_FILE, MODEL_FILE, file_crc, rank_file)
from zero_triton.state.flat import is_dense
from zero_triton.state.int8 import BLOCK, Int8Moments
from zero_triton.state.moments import KEYS as MOMENT_KEYS

FORMAT = "zero_triton.checkpoint"
VERSION = 2
# The states a shard file holds, in file order: the master, then the moments by torch's
# names (the store's export, zero_triton.state.moments; float32), the running maximum
# optional; or, saved compact (``save(..., compact=True)`` of int8 moments), the codes
# (one byte an element) and the scales (two float32 per block of ``BLOCK`` elements,
# a segment [start, end) holding its blocks from start / BLOCK on).
COMPACT_STATES = Int8Moments.COMPACT
STATES = ("master", *MOMENT_KEYS, *COMPACT_STATES)
REQUIRED_STATES = STATES[:3]
_BYTES = {COMPACT_STATES[0]: 1, COMPACT_STATES[1]: 1}  # an element's; float32 by default


def segment_bytes(state: str, start: int, end: int) -> int:
    """Bytes a file's segment of ``state`` over elements [start, end) takes."""
    if state == COMPACT_STATES[2]:
        return (-(-end // BLOCK) - start // BLOCK) * 8
    return (end - start) * _BYTES.get(state, 4)
FLAT_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Keys of a param group that are bookkeeping, not hyperparameters of the step.
NOT_HYPER = {"params", "param_names", "foreach", "capturable", "differentiable", "fused"}
_MAX_NUMEL = 1 << 48
_MAX_WORLD = 1 << 20


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def as_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


# -- names ------------------------------------------------------------------------------
# Submodule names that wrappers insert: torch.compile (``_orig_mod``), activation
# checkpointing (``_checkpoint_wrapped_module``), FSDP (``_fsdp_wrapped_module``) anywhere;
# DDP and DataParallel (``module``) in front.
_WRAPPER_NAMES = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}


def plain_name(name: str) -> str:
    """``name`` without what wrappers add: ``module._orig_mod.a._checkpoint_wrapped_module.w``
    is ``a.w``, so a checkpoint saved through a wrapper loads into the bare model and back."""
    parts = [part for part in name.split(".") if part not in _WRAPPER_NAMES]
    while len(parts) > 1 and parts[0] == "module":
        parts.pop(0)
    return ".".join(parts)


def plain_names(names) -> dict[str, str]:
    """``{name: plain name}`` for one model's names; names unchanged where stripping would
    merge two of them (a bare model with both ``module.w`` and ``w``)."""
    names = list(names)
    plain = {n: plain_name(n) for n in names}
    return plain if len(set(plain.values())) == len(plain) else {n: n for n in names}


# -- sealing ----------------------------------------------------------------------------
def _body_digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def seal(manifest: dict) -> bytes:
    """The manifest file's bytes, with its checksum."""
    manifest = dict(manifest, checksum=_body_digest(manifest))
    return json.dumps(manifest, indent=1).encode()


def parse(data: bytes, source: str) -> dict:
    """The manifest in ``data`` (the bytes of ``source``), its format, version and
    checksum verified; nothing else is checked yet (see ``validate``)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{source} is {len(data):,} bytes, more than any manifest; it is "
                              "not a zero_triton manifest")
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"cannot read {source}: {type(exc).__name__}: {exc}; the manifest "
                              "is damaged: load an earlier checkpoint") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{source} is not a zero_triton checkpoint manifest")
    version = manifest.get("version")
    if version != VERSION:
        older = isinstance(version, int) and not isinstance(version, bool) and version < VERSION
        raise CheckpointError(
            f"{source} has format version {version!r}; this zero_triton reads version {VERSION}"
            + ("; load it with the zero_triton that wrote it and save again (or consolidate it "
               "there into a torch.optim.Adam state dict)" if older else ""))
    if manifest.get("checksum") != _body_digest(manifest):
        raise CheckpointError(f"checksum mismatch in {source}: the manifest was changed after it "
                              "was written (by hand or by a bad disk); load an earlier checkpoint")
    return manifest


# -- structure ----------------------------------------------------------------------------
class _Fields:
    """Typed access to manifest fields; any violation names the field."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, field: str, why: str):
        raise CheckpointError(f"{self.source}: field {field} {why}; the manifest is damaged or "
                              "was not written by zero_triton: load an earlier checkpoint")

    def get(self, obj, key, field, kind):
        if isinstance(obj, dict):
            present = key in obj
        else:
            present = isinstance(obj, list) and isinstance(key, int) and 0 <= key < len(obj)
        if not present:
            self.fail(field, "is missing")
        value = obj[key]
        if kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, kind)
        if not ok:
            name = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            self.fail(field, f"must be {name}, not {type(value).__name__}")
        return value

    def int(self, obj, key, field, lo=0, hi=None) -> int:
        value = self.get(obj, key, field, int)
        if value < lo or (hi is not None and value > hi):
            self.fail(field, f"is {value}, outside [{lo}, {hi if hi is not None else 'inf'}]")
        return value

    def number(self, obj, key, field, lo=0.0, hi=None, hi_open=False) -> float:
        value = self.get(obj, key, field, float)
        if not math.isfinite(value) or value < lo or (
                hi is not None and (value >= hi if hi_open else value > hi)):
            bound = f"[{lo}, {hi})" if hi_open else f"[{lo}, {hi if hi is not None else 'inf'}]"
            self.fail(field, f"is {value!r}, not a finite number in {bound}")
        return value

    def list(self, obj, key, field, max_len=None) -> list:
        value = self.get(obj, key, field, list)
        if max_len is not None and len(value) > max_len:
            self.fail(field, f"has {len(value)} entries, at most {max_len} are possible")
        return value


def validate_hyperparameters(groups, source: str) -> None:
    """Types and ranges of the values the step reads (as torch.optim.Adam checks them)."""
    v = _Fields(source)
    for gi, group in enumerate(groups):
        if not isinstance(group, dict):
            v.fail(f"param_groups[{gi}]", "must be an object")
        field = f"param_groups[{gi}]"
        if "lr" in group:
            v.number(group, "lr", f"{field}.lr")
        if "eps" in group:
            v.number(group, "eps", f"{field}.eps")
        if "weight_decay" in group:
            v.number(group, "weight_decay", f"{field}.weight_decay")
        if "betas" in group:
            betas = v.list(group, "betas", f"{field}.betas")
            if len(betas) != 2:
                v.fail(f"{field}.betas", f"has {len(betas)} values, not 2")
            for i in range(2):
                v.number(betas, i, f"{field}.betas[{i}]", 0.0, 1.0, hi_open=True)
        for key in ("amsgrad", "maximize", "decoupled_weight_decay"):
            if key in group:
                v.get(group, key, f"{field}.{key}", bool)


def validate(m: dict, source: str) -> None:
    """Check the whole manifest on its own (see the module's docstring): its header, the
    flat buffers, the parameters, the files and that the files cover every state."""
    v = _Fields(source)
    save_id = v.get(m, "save_id", "save_id", str)
    if len(save_id) != 16 or any(c not in "0123456789abcdef" for c in save_id):
        v.fail("save_id", "must be 16 lowercase hex digits")
    v.get(m, "optimizer", "optimizer", str)
    v.number(m, "time", "time")
    world = v.int(m, "world_size", "world_size", 1, _MAX_WORLD)
    groups = v.list(m, "param_groups", "param_groups")
    validate_hyperparameters(groups, source)
    flats = v.list(m, "flats", "flats")
    for k, flat in enumerate(flats):
        _validate_flat(v, f"flats[{k}]", flat, len(groups))
    step = v.number(m, "step", "step")
    if flats and step != max(f["step"] for f in flats):
        v.fail("step", f"is {step}, the flat buffers' latest step is {max(f['step'] for f in flats)}")
    params = v.list(m, "params", "params")
    ends = [[] for _ in flats]  # per flat buffer, where each of its parameters ends
    for i, p in enumerate(params):
        _validate_param(v, i, p, flats, len(groups), ends)
    for k, flat in enumerate(flats):
        if "param_steps" in flat and len(flat["param_steps"]) != len(ends[k]):
            v.fail(f"flats[{k}].param_steps", f"has {len(flat['param_steps'])} entries for "
                   f"{len(ends[k])} parameters")
    files = _validate_file_names(v, m, world)
    covered = {}  # (flat, state) -> [(start, end, field)]
    for name in sorted(files):
        _validate_file(v, name, files[name], world, flats, len(params), covered)
    _validate_coverage(v, flats, covered)


def _validate_flat(v, field: str, flat: dict, ngroups: int) -> None:
    v.int(flat, "group", f"{field}.group", 0, ngroups - 1)
    if v.get(flat, "dtype", f"{field}.dtype", str) not in FLAT_DTYPES:
        v.fail(f"{field}.dtype", f"is {flat['dtype']!r}, not one of {sorted(FLAT_DTYPES)}")
    v.int(flat, "numel", f"{field}.numel", 0, _MAX_NUMEL)
    v.get(flat, "has_master", f"{field}.has_master", bool)
    step = v.number(flat, "step", f"{field}.step")
    states = v.list(flat, "states", f"{field}.states", max_len=len(STATES))
    compact = [s for s in states if s in COMPACT_STATES]
    required = ["master", *COMPACT_STATES] if compact else list(REQUIRED_STATES)
    if any(s not in STATES for s in states) or len(set(states)) != len(states) or \
            any(s not in states for s in required) or (compact and any(
                s in states for s in MOMENT_KEYS)):
        v.fail(f"{field}.states", f"is {states}: it must name each of {list(REQUIRED_STATES)} "
               f"once, and {STATES[3]} at most once (or, compact, each of "
               f"{['master', *COMPACT_STATES]} once)")
    if "param_steps" in flat:
        for i, _ in enumerate(v.list(flat, "param_steps", f"{field}.param_steps")):
            v.number(flat["param_steps"], i, f"{field}.param_steps[{i}]", 0.0, step)


def _validate_param(v, i: int, p: dict, flats: list, ngroups: int, ends: list) -> None:
    """Parameter ``i``: its fields, its shape and layout, and its place in its flat
    buffer after the one before it (``ends``)."""
    field = f"params[{i}]"
    v.get(p, "name", f"{field}.name", str)
    v.get(p, "named", f"{field}.named", bool)
    if v.int(p, "index", f"{field}.index") != i:
        v.fail(f"{field}.index", f"is {p['index']}, not {i}")
    group = v.int(p, "group", f"{field}.group", 0, ngroups - 1)
    shape = v.list(p, "shape", f"{field}.shape", max_len=64)
    for d in range(len(shape)):
        v.int(shape, d, f"{field}.shape[{d}]", 0, _MAX_NUMEL)
    numel = math.prod(shape)
    if numel > _MAX_NUMEL:
        v.fail(f"{field}.shape", f"is {shape}: {numel} elements")
    if "stride" in p:  # a dense layout other than the contiguous one (channels_last)
        stride = v.list(p, "stride", f"{field}.stride", max_len=64)
        for d in range(len(stride)):
            v.int(stride, d, f"{field}.stride[{d}]", 0, _MAX_NUMEL)
        if len(stride) != len(shape) or not is_dense(shape, stride):
            v.fail(f"{field}.stride", f"is {stride}: not a dense layout of shape {shape}")
    dtype = v.get(p, "dtype", f"{field}.dtype", str)
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        v.fail(f"{field}.dtype", f"is {dtype!r}, not a torch dtype")
    if p.get("flat", "missing") is None:
        if p.get("offset", "missing") is not None:
            v.fail(f"{field}.offset", "must be null for a frozen parameter (flat null)")
        return
    k = v.int(p, "flat", f"{field}.flat", 0, len(flats) - 1)
    offset = v.int(p, "offset", f"{field}.offset", 0, _MAX_NUMEL)
    if offset + numel > flats[k]["numel"]:
        v.fail(f"{field}.offset", f"is {offset}: {shape} ends past flat buffer {k}'s "
               f"{flats[k]['numel']} elements")
    if dtype != flats[k]["dtype"] or group != flats[k]["group"]:
        v.fail(field, f"has dtype {dtype} and group {group}, its flat buffer {k} "
               f"{flats[k]['dtype']} and {flats[k]['group']}")
    if ends[k] and offset < ends[k][-1]:
        v.fail(f"{field}.offset", f"is {offset}: it overlaps the previous parameter of flat "
               f"buffer {k} (which ends at {ends[k][-1]})")
    ends[k].append(offset + numel)


def _validate_file_names(v, m: dict, world: int) -> dict:
    """The files a ``world``-rank save writes, and no other."""
    has_model_extra = v.get(m, "model_extra", "model_extra", bool)
    has_extra = v.get(m, "extra", "extra", bool)
    files = v.get(m, "files", "files", dict)
    expected = {rank_file(r) for r in range(world)} | {MODEL_FILE}
    expected |= {MODEL_EXTRA_FILE} if has_model_extra else set()
    expected |= {EXTRA_FILE} if has_extra else set()
    if set(files) != expected:
        odd = sorted(set(files) ^ expected)[:5]
        v.fail("files", f"names {sorted(files)[:8]}{' ...' if len(files) > 8 else ''}, not the "
               f"files a {world}-rank save writes (differs in {odd})")
    return files


def _validate_file(v, name: str, record: dict, world: int, flats: list, nparams: int,
                   covered: dict) -> None:
    """One file's record: its owner, size and checksums, then its segments (the state
    ranges they hold go into ``covered``)."""
    field = f"files[{name!r}]"
    owner = v.int(record, "rank", f"{field}.rank", 0, world - 1)
    if name.startswith("rank") and owner != int(name[4:9]):
        v.fail(f"{field}.rank", f"is {owner}, the file is rank {int(name[4:9])}'s")
    size = v.int(record, "bytes", f"{field}.bytes", HEADER_BYTES, 1 << 62)
    chunk = v.int(record, "chunk_bytes", f"{field}.chunk_bytes", 4096, 1 << 30)
    crcs = v.list(record, "chunk_crc32", f"{field}.chunk_crc32")
    if len(crcs) != -(-size // chunk):
        v.fail(f"{field}.chunk_crc32", f"has {len(crcs)} entries; {size} bytes in chunks of "
               f"{chunk} need {-(-size // chunk)}")
    for c in range(len(crcs)):
        v.int(crcs, c, f"{field}.chunk_crc32[{c}]", 0, 0xFFFFFFFF)
    if v.int(record, "crc32", f"{field}.crc32", 0, 0xFFFFFFFF) != file_crc(crcs):
        v.fail(f"{field}.crc32", "does not match its chunk checksums")
    if name in (MODEL_EXTRA_FILE, EXTRA_FILE):
        return
    # A rank holds one piece of every bucket of every state; a bucket holds at least
    # one parameter.
    segments = v.list(record, "segments", f"{field}.segments",
                      max_len=max(len(flats), nparams) * len(STATES))
    at = HEADER_BYTES
    for s, seg in enumerate(segments):
        at = _validate_segment(v, f"{field}.segments[{s}]", seg, s, name == MODEL_FILE, at,
                               flats, covered)
    if name == MODEL_FILE and len(segments) != len(flats):
        v.fail(f"{field}.segments", f"has {len(segments)} entries for {len(flats)} flat buffers")
    if at != size:
        v.fail(f"{field}.bytes", f"is {size}; its header and segments take {at}")


def _validate_segment(v, sf: str, seg: dict, s: int, model: bool, at: int, flats: list,
                      covered: dict) -> int:
    """Segment ``s`` of a file, starting at byte ``at``; returns where the next starts."""
    k = v.int(seg, "flat", f"{sf}.flat", 0, len(flats) - 1)
    if v.int(seg, "offset", f"{sf}.offset", 0, 1 << 62) != at:
        v.fail(f"{sf}.offset", f"is {seg['offset']}; segments follow each other from byte "
               f"{HEADER_BYTES}, so it must be {at}")
    if model:
        if k != s:
            v.fail(f"{sf}.flat", f"is {k}; model.bin holds the flat buffers in order")
        numel = v.int(seg, "numel", f"{sf}.numel", 0, _MAX_NUMEL)
        if numel != flats[k]["numel"] or seg.get("dtype") != flats[k]["dtype"]:
            v.fail(sf, f"is {numel} {seg.get('dtype')}, flat buffer {k} is "
                   f"{flats[k]['numel']} {flats[k]['dtype']}")
        return at + numel * FLAT_DTYPES[flats[k]["dtype"]]
    state = v.get(seg, "state", f"{sf}.state", str)
    if state not in flats[k]["states"]:
        v.fail(f"{sf}.state", f"is {state!r}, not one of flat buffer {k}'s states")
    start = v.int(seg, "start", f"{sf}.start", 0, flats[k]["numel"])
    end = v.int(seg, "end", f"{sf}.end", start + 1, flats[k]["numel"])
    if state == COMPACT_STATES[2] and start % BLOCK:
        v.fail(f"{sf}.start", f"is {start}: a segment of {state} starts on a block ({BLOCK})")
    covered.setdefault((k, state), []).append((start, end, f"{sf}"))
    return at + segment_bytes(state, start, end)


def _validate_coverage(v, flats: list, covered: dict) -> None:
    """The files' segments cover every state of every flat buffer exactly once."""
    for k, flat in enumerate(flats):
        for state in flat["states"]:
            pos = 0
            for start, end, where in sorted(covered.get((k, state), [])):
                if start != pos:
                    v.fail(where, f"starts at {start}: {state} of flat buffer {k} is "
                           f"{'covered twice' if start < pos else 'not covered'} from {min(start, pos)}")
                pos = end
            if pos != flat["numel"]:
                v.fail("files", f"cover {state} of flat buffer {k} only up to element {pos} "
                       f"of {flat['numel']}")


def describe(entry: dict) -> str:
    where = "frozen" if entry["flat"] is None else f"flat buffer {entry['flat']}"
    return (f"'{entry['name']}' {entry['shape']} {entry['dtype']} in param group "
            f"{entry['group']} ({where})")


def check_same_model(manifest: dict, mine: list[dict], flats: list[dict], n_groups: int,
                     directory: str) -> None:
    """The checkpoint's parameters, flat buffers and groups are this optimizer's."""
    theirs = manifest["params"]
    plain = plain_names(a["name"] for a in theirs if a["named"])
    keys = ("group", "shape", "dtype", "flat", "offset")
    for i, (a, b) in enumerate(zip(theirs, mine)):
        if a.get("stride") != b.get("stride"):
            raise ModelMismatchError(
                f"checkpoint {directory}: parameter {i} {describe(a)} was saved with strides "
                f"{a.get('stride') or 'contiguous'}, this model's are {b.get('stride') or 'contiguous'} "
                "(channels_last on one side only); convert the model to the saved memory format "
                "(model.to(memory_format=...)) before building the optimizer and loading")
        if any(a[k] != b[k] for k in keys) or (
                a["named"] and b["named"] and plain[a["name"]] != b["name"]):
            raise ModelMismatchError(
                f"checkpoint {directory} is from a different model: parameter {i} is "
                f"{describe(a)} there, {describe(b)} here; build the same model and param "
                "groups (same order, shapes and dtypes) before loading")
    if len(theirs) != len(mine):
        i = min(len(theirs), len(mine))
        extra = theirs[i] if len(theirs) > len(mine) else mine[i]
        side = "only the checkpoint" if len(theirs) > len(mine) else "only this optimizer"
        raise ModelMismatchError(
            f"checkpoint {directory} is from a different model: it has {len(theirs)} parameters, "
            f"this optimizer {len(mine)}; the first unmatched, parameter {i} "
            f"{describe(extra)}, is in {side}")
    saved = manifest["flats"]
    if len(manifest["param_groups"]) != n_groups or len(saved) != len(flats):
        raise ModelMismatchError(
            f"checkpoint {directory} has {len(manifest['param_groups'])} param groups and "
            f"{len(saved)} flat buffers, this optimizer {n_groups} and {len(flats)}; build the "
            "same param groups before loading")
    for k, (a, b) in enumerate(zip(saved, flats)):
        if (a["numel"], a["dtype"], a["group"]) != (b["numel"], b["dtype"], b["group"]):
            raise ModelMismatchError(
                f"checkpoint {directory}: flat buffer {k} holds {a['numel']} {a['dtype']} elements "
                f"of group {a['group']}, this optimizer's {b['numel']} {b['dtype']} of group "
                f"{b['group']}; build the same model before loading")
