"""A checkpoint read offline: consolidated into torch.optim.Adam's format, verified,
inspected (its command line: ``zero_triton.tools.checkpoint``)."""
from __future__ import annotations

import math
import zlib

import torch

from zero_triton.checkpoint import directory as dirs
from zero_triton.checkpoint.errors import CheckpointError
from zero_triton.checkpoint.files import HEADER_BYTES, MODEL_EXTRA_FILE, Readers, file_crc, header
from zero_triton.checkpoint.protocol import read_model_flat, read_states
from zero_triton.checkpoint.target import own_bytes
from zero_triton.optim import state_dict as adam_state
from zero_triton.state.flat import shaped
from zero_triton.state.shards import MASTER


def consolidate(path) -> tuple[dict, dict]:
    """The checkpoint at ``path`` as ``(optimizer_state_dict, model_state_dict)``:
    torch.optim.Adam's format (per-parameter step, exp_avg, exp_avg_sq, [max_exp_avg_sq],
    master_param for fp16/bf16) and a plain state dict keyed by parameter name. Needs no
    process group, no GPU and not the world size it was saved at."""
    directory, manifest = dirs.resolve(path)
    with directory:
        readers = Readers(directory, manifest)
        try:
            state, model_sd = {}, {}
            flat_params = {k: read_model_flat(readers, manifest, k)
                           for k in range(len(manifest["flats"]))}
            seen_in_flat = {}
            for entry in manifest["params"]:
                k = entry["flat"]
                if k is None:
                    continue
                saved = manifest["flats"][k]
                numel = math.prod(entry["shape"])
                lo, end = entry["offset"], entry["offset"] + numel
                index = seen_in_flat.get(k, 0)  # entries of one flat come in its parameters' order
                seen_in_flat[k] = index + 1
                step = saved["param_steps"][index] if "param_steps" in saved else saved["step"]
                s = {"step": torch.tensor(step, dtype=torch.float32)}
                got = read_states(readers, manifest, k, [(lo, end, 0)] if numel else [], numel)
                for name, t in got.items():
                    if name == "master" and not saved["has_master"]:
                        continue
                    s[MASTER if name == "master" else name] = shaped(
                        t, entry["shape"], entry.get("stride"))
                state[entry["index"]] = s
                model_sd[entry["name"]] = shaped(flat_params[k][lo:end].clone(), entry["shape"],
                                                 entry.get("stride"))
            if manifest["model_extra"]:
                blob = readers.get_reader(MODEL_EXTRA_FILE).read_blob()
                if not isinstance(blob, dict):
                    raise CheckpointError(f"checkpoint {directory.path}: {MODEL_EXTRA_FILE} holds a "
                                          f"{type(blob).__name__}, not a state dict")
                for n, t in blob.items():
                    model_sd.setdefault(n, own_bytes(t) if isinstance(t, torch.Tensor) else t)
        finally:
            readers.close()
    groups = [adam_state.torch_group(saved, [e["index"] for e in manifest["params"] if e["group"] == gi])
              for gi, saved in enumerate(manifest["param_groups"])]
    return {"state": state, "param_groups": groups}, model_sd


def _verify_open(directory, manifest) -> list[tuple[str, int, bool, str]]:
    out = []
    for name, record in manifest["files"].items():
        try:
            f, size = directory.open(name)
        except FileNotFoundError:
            out.append((name, record["bytes"], False, "missing"))
            continue
        except CheckpointError as exc:
            out.append((name, record["bytes"], False, str(exc).split(";")[0]))
            continue
        with f:
            if size != record["bytes"]:
                out.append((name, record["bytes"], False, f"{size} bytes on disk"))
                continue
            crcs, first = [], b""
            while block := f.read(min(record["chunk_bytes"], record["bytes"] - f.tell())):
                first = first or block[:HEADER_BYTES]
                crcs.append(zlib.crc32(block))
        bad = [c for c, (a, b) in enumerate(zip(crcs, record["chunk_crc32"])) if a != b]
        if bad or file_crc(crcs) != record["crc32"]:
            out.append((name, record["bytes"], False,
                        f"checksum mismatch in chunk {bad[0] if bad else '?'}"))
        elif first != header(manifest["save_id"], name):
            out.append((name, record["bytes"], False, "written by another save"))
        else:
            out.append((name, record["bytes"], True, ""))
    return out


def verify(path) -> list[tuple[str, int, bool, str]]:
    """Check every file of the checkpoint against its CRC32 and its header's save id:
    ``(file, bytes, ok, why)``. The manifest's own checksum and structure are checked
    first (a failure raises CheckpointError)."""
    directory, manifest = dirs.resolve(path)
    with directory:
        return _verify_open(directory, manifest)


def inspect(path) -> tuple[str, dict, list[tuple[str, int, bool, str]]]:
    """The directory that ``load`` would read at ``path``, its validated manifest, and
    every file's (name, bytes, crc ok, why not) verified while the directory is held."""
    directory, manifest = dirs.resolve(path)
    with directory:
        return directory.path, manifest, _verify_open(directory, manifest)
