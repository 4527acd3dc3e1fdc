"""``python -m zero_triton checkpoint inspect | consolidate``: a sharded checkpoint
(``zero_triton.checkpoint``) printed, verified, or written as one torch.optim.Adam-format
state dict file."""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import secrets
import sys

import torch

from zero_triton.checkpoint import CheckpointError, consolidate
from zero_triton.checkpoint.offline import inspect


def _table(rows, header_row) -> str:
    rows = [header_row] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header_row))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _inspect(path) -> int:
    where, manifest, results = inspect(path)
    params = manifest["params"]
    n_elem = sum(math.prod(p["shape"]) for p in params)
    print(f"checkpoint   {where}")
    print(f"format       {manifest['format']} v{manifest['version']} ({manifest['optimizer']}), "
          f"save {manifest['save_id']}, manifest checksum ok")
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
    print(_table([[name, manifest["files"][name]["rank"], f"{size:,}",
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


def _check_outside(out, source) -> None:
    """Refuse an output that is, or lies inside, the checkpoint being read (links
    followed): writing there would replace the only copy of the training state."""
    src = os.path.realpath(source)
    dst = os.path.realpath(out)
    if dst == src or dst.startswith(src.rstrip(os.sep) + os.sep):
        raise CheckpointError(f"{out} lies inside the checkpoint {source} that is being read; "
                              "writing it there would overwrite the checkpoint: pass an output "
                              "path outside it")


def _save_file(obj, path) -> None:
    """``torch.save`` into a temporary file renamed over ``path`` (parent directories
    created): no half-written file."""
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        # A new file of our own: never a planted file or link under the temporary name.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        with os.fdopen(fd, "wb") as f:
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
    A missing, damaged or tampered checkpoint and an output that cannot be written are
    one line on stderr and exit status 1."""
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
        for out in (args.out, model_out):
            _check_outside(out, args.path)
            _check_output_file(out)
        optimizer_sd, model_sd = consolidate(args.path)
        _save_file(optimizer_sd, args.out)
        _save_file(model_sd, model_out)
        print(f"wrote {args.out} ({len(optimizer_sd['state'])} parameter states, torch.optim.Adam "
              f"format) and {model_out} ({len(model_sd)} entries)")
        return 0
    except BrokenPipeError:
        raise  # the reader went away: the command line's entry point ends quietly
    except (CheckpointError, OSError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    except Exception as exc:  # a manifest that validation let through: still one line
        print(f"error: {args.path}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}; the "
              "checkpoint is damaged: load an earlier one", file=sys.stderr)
        return 1
