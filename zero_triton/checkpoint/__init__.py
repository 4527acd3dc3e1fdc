"""Sharded checkpoints: every rank writes what it owns, any world size loads them.

A checkpoint is a directory::

    manifest.json    format, version, save id, world size, every parameter (name, shape,
                     dtype, group, flat buffer, offset), hyperparameters, steps, which
                     rank wrote which byte range of which file, a CRC32 per 4 MiB chunk
                     of every file; sealed by a SHA-256 checksum of all of it
    rank00000.bin    rank r's [lo, hi) of each flat buffer's fp32 master, exp_avg,
    rank00001.bin    exp_avg_sq (max_exp_avg_sq): raw little-endian float32, clipped to
    ...              the parameters' end (tail padding is never written)
    model.bin        the flat low-precision parameter buffers, once (rank 0)
    model_extra.pt   with ``model=``: the model's state-dict entries the optimizer does
                     not own (buffers, frozen parameters), once (rank 0)
    extra.pt         ``extra=`` (rank 0's), if given

Every data file starts with a 64-byte header naming its save id and its own name.
Because flat offsets do not depend on the world size (``zero_triton.state.flat``), a loader at
any world size reads exactly the byte ranges of its new shard, verified chunk by chunk.

One job per module: ``files`` (checksummed I/O inside one directory), ``manifest``
(the schema, its seal and its validation), ``directory`` (the lock, the atomic swap,
what may be deleted, where to read), ``protocol`` (the collective save and load, every
phase agreed by all ranks), ``target`` (the optimizer, as a checkpoint sees it),
``offline`` (consolidate, verify, inspect).
"""
import sys

if sys.byteorder != "little":  # the shard files are little-endian by definition
    raise ImportError("zero_triton.checkpoint supports little-endian machines only")

from zero_triton.checkpoint.directory import resolve as _resolve  # noqa: E402
from zero_triton.checkpoint.errors import CheckpointError, ModelMismatchError  # noqa: E402
from zero_triton.checkpoint.files import (CHUNK_BYTES, EXTRA_FILE, MANIFEST,  # noqa: E402
                                          MODEL_EXTRA_FILE, MODEL_FILE, rank_file)
from zero_triton.checkpoint.manifest import FORMAT, STATES, VERSION  # noqa: E402
from zero_triton.checkpoint.protocol import load, save  # noqa: E402
from zero_triton.checkpoint.offline import consolidate, verify  # noqa: E402

__all__ = ["save", "load", "resolve", "consolidate", "verify", "CheckpointError",
           "ModelMismatchError", "FORMAT", "VERSION", "MANIFEST", "MODEL_FILE",
           "MODEL_EXTRA_FILE", "EXTRA_FILE", "CHUNK_BYTES", "STATES", "rank_file"]


def resolve(path) -> tuple[str, dict]:
    """The checkpoint directory that ``load`` would read at ``path``, and its validated
    manifest (``PATH``, or after a save interrupted between its two renames, the
    ``PATH.old-<save id>`` it left)."""
    directory, manifest = _resolve(path)
    directory.close()
    return directory.path, manifest


def __getattr__(name):
    """``zero_triton.checkpoint.main`` (the checkpoint command line) moved to
    ``zero_triton.tools.checkpoint.main``; the old name stays as an alias that warns,
    resolved only when used (the command line is a tool, above this layer)."""
    if name == "main":
        import importlib
        import warnings
        warnings.warn("zero_triton.checkpoint.main moved to zero_triton.tools.checkpoint.main "
                      "(or run `python -m zero_triton checkpoint`)", DeprecationWarning,
                      stacklevel=2)
        return importlib.import_module("zero_triton.tools.checkpoint").main
    raise AttributeError(f"module 'zero_triton.checkpoint' has no attribute {name!r}")
