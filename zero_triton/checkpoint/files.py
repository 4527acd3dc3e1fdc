"""Checksummed files inside one checkpoint directory.

Every data file starts with a 64-byte header naming the save that wrote it and its own
name (``zero_triton checkpoint <save id> <name>``), so that a file of another save, or
another file of this one, is refused when it is read. A CRC32 per 4 MiB chunk covers the
whole file, header included; a loader verifies only the chunks it reads.

Members are opened relative to the directory's file descriptor (a directory swapped
under a reader does not mix two saves), never through a symbolic link, and only when
they are regular files (a FIFO or a device would hang a reader). Their names are the
few the format defines: nothing from a manifest can reach outside the directory.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import stat
import zlib

import numpy as np
import torch

from zero_triton.checkpoint.errors import CheckpointError

MANIFEST = "manifest.json"
MODEL_FILE = "model.bin"
MODEL_EXTRA_FILE = "model_extra.pt"
EXTRA_FILE = "extra.pt"
CHUNK_BYTES = 4 << 20
HEADER_BYTES = 64
MAX_MANIFEST_BYTES = 1 << 30
_MEMBER = re.compile(r"(rank\d{5}\.bin|model\.bin|model_extra\.pt|extra\.pt)\Z")


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.bin"


def is_member_name(name) -> bool:
    """A data file name the format defines (never a path)."""
    return isinstance(name, str) and _MEMBER.match(name) is not None


def header(save_id: str, name: str) -> bytes:
    return f"zero_triton checkpoint {save_id} {name}\n".encode().ljust(HEADER_BYTES, b"\0")


def file_crc(chunk_crcs) -> int:
    """The per-file checksum: CRC32 of the chunk CRCs (one pass over the data, not two)."""
    return zlib.crc32(np.asarray(chunk_crcs, dtype="<u4").tobytes())


def _write_bytes(f, data) -> None:
    """The one place bytes reach the disk (tests replace it to simulate a full disk)."""
    f.write(data)


def as_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor (moved to CPU), without a copy when already there."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.contiguous().view(torch.uint8).numpy())


def fsync_dir(path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Writer:
    """A new file (never an existing one, never through a link) written front to back,
    starting with its header, with a CRC32 per chunk. Use as a context manager: a
    failure closes the file; the caller removes the directory."""

    def __init__(self, directory: str, name: str, save_id: str):
        fd = os.open(os.path.join(directory, name),
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        self.f = os.fdopen(fd, "wb")
        self.bytes, self.chunk_crcs = 0, []
        self._chunk_crc, self._chunk_fill = 0, 0
        self.write(header(save_id, name))

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind is not None:
            with contextlib.suppress(OSError):
                self.f.close()

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
        """Flush and fsync; return the file's manifest record."""
        if self._chunk_fill:
            self.chunk_crcs.append(self._chunk_crc)
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return {"bytes": self.bytes, "crc32": file_crc(self.chunk_crcs), "chunk_bytes": CHUNK_BYTES,
                "chunk_crc32": self.chunk_crcs}


class Directory:
    """A checkpoint directory held open: members are opened relative to it."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def removed(self) -> bool:
        """Whether the directory was deleted since it was opened (a save replaced it)."""
        try:
            return os.fstat(self.fd).st_nlink == 0
        except OSError:
            return True

    def listdir(self) -> list[str]:
        return os.listdir(self.fd)

    def open(self, name: str, what: str = "checkpoint file"):
        """``(file, size)`` of the regular file ``name`` in this directory; raises
        FileNotFoundError when it is missing and CheckpointError when it is anything
        else than a plain regular file here."""
        if name != MANIFEST and not is_member_name(name):
            raise CheckpointError(f"{what} {name!r} in {self.path} is not a file name the "
                                  "checkpoint format defines; the manifest is damaged")
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=self.fd)
        except FileNotFoundError:
            raise
        except OSError as exc:
            if os.path.islink(os.path.join(self.path, name)):
                raise CheckpointError(f"{what} {name} in {self.path} is a symbolic link; a "
                                      "checkpoint holds regular files only: replace it by the "
                                      "file itself") from exc
            raise CheckpointError(f"cannot open {what} {name} in {self.path}: "
                                  f"{exc.strerror or exc}") from exc
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                    else "a device or socket")
            raise CheckpointError(f"{what} {name} in {self.path} is {kind}, not a regular file; "
                                  "the checkpoint is damaged: load an earlier one")
        return os.fdopen(fd, "rb"), st.st_size


class Reader:
    """Reads byte ranges of one checkpoint file, verifying every chunk it touches and,
    first, that its header names this save and this file."""

    def __init__(self, directory: Directory, name: str, record: dict, save_id: str):
        self.name, self.record, self.directory = name, record, directory.path
        try:
            self.f, size = directory.open(name)
        except FileNotFoundError:
            raise CheckpointError(
                f"checkpoint file {name} (written by rank {record['rank']}) is missing from "
                f"{directory.path}; the checkpoint is incomplete: load an earlier one") from None
        if size != record["bytes"]:
            self.f.close()
            raise CheckpointError(f"checkpoint file {name} in {directory.path} is truncated or was "
                                  f"replaced: {size} bytes, the manifest says {record['bytes']}")
        try:
            got = bytearray(HEADER_BYTES)
            self.read_into(0, memoryview(got))
        except CheckpointError:
            self.f.close()
            raise
        if bytes(got) != header(save_id, name):
            self.f.close()
            text = bytes(got).rstrip(b"\0").decode("ascii", "replace").strip()
            raise CheckpointError(
                f"checkpoint file {name} in {directory.path} belongs to another save (its header "
                f"says {text!r}, the manifest is save {save_id}): files of different checkpoints "
                "were mixed; load an earlier checkpoint")

    def close(self) -> None:
        self.f.close()

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
                raise CheckpointError(
                    f"checksum mismatch in checkpoint file {self.name} (chunk {c}, bytes {cs}..): "
                    "the file is corrupted; load an earlier checkpoint")
            c += 1

    def read_blob(self):
        data = bytearray(self.record["bytes"] - HEADER_BYTES)
        self.read_into(HEADER_BYTES, memoryview(data))
        try:
            return torch.load(io.BytesIO(data), weights_only=True)
        except Exception as exc:  # verified bytes that torch cannot read: say which file
            raise CheckpointError(f"checkpoint file {self.name} in {self.directory} cannot be "
                                  f"read back ({type(exc).__name__}: {one_line(exc)})") from exc


class Readers(dict):
    """The files of one checkpoint, opened on first use."""

    def __init__(self, directory: Directory, manifest: dict):
        super().__init__()
        self.directory, self.files, self.save_id = directory, manifest["files"], manifest["save_id"]

    def get_reader(self, name) -> Reader:
        if name not in self:
            self[name] = Reader(self.directory, name, self.files[name], self.save_id)
        return self[name]

    def close(self) -> None:
        for reader in self.values():
            reader.close()


def one_line(exc, limit=300) -> str:
    """``exc`` (or any text) on one line, at most ``limit`` characters and " ..."."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + " ..."


def _round_trip(obj) -> tuple[bytes | None, Exception | None]:
    """``(torch.save bytes, None)`` when ``torch.load(weights_only=True)`` reads them
    back, else ``(None, the error)``."""
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as exc:
        return None, exc
    return buffer.getvalue(), None


def _first_unloadable(obj, where: str):
    """``(where, obj)`` of the innermost value below ``obj`` that does not load back."""
    items = (obj.items() if isinstance(obj, dict) else enumerate(obj)
             if isinstance(obj, (list, tuple)) else ())
    for key, value in items:
        if _round_trip(value)[1] is not None:
            return _first_unloadable(value, f"{where}[{key!r}]")
    return where, obj


def encode(obj, what: str, plain_tensors_ok: bool = False) -> bytes:
    """``torch.save`` bytes of ``obj``, refused with the offending entry named when
    ``torch.load(weights_only=True)`` could not read them back (a checkpoint that saves
    but never loads is lost). ``plain_tensors_ok``: only non-tensor values of a dict are
    round-tripped (a model's state dict may be large; its tensors always load)."""
    if plain_tensors_ok and isinstance(obj, dict):
        probe = {k: v for k, v in obj.items() if type(v) not in (torch.Tensor, torch.nn.Parameter)}
    else:
        probe = obj
    data, error = _round_trip(probe)
    if error is not None:
        where, value = _first_unloadable(probe, what)
        raise CheckpointError(
            f"{where} ({type(value).__name__}) could not be loaded back "
            f"({type(error).__name__}: {one_line(error)}); a checkpoint holds what "
            "torch.load(weights_only=True) reads: tensors, numbers, strings, lists, tuples, "
            "dicts (pass vars(args) for an argparse.Namespace, or register the class with "
            "torch.serialization.add_safe_globals in every process that saves and loads); "
            "nothing was written")
    if probe is obj:  # the bytes just checked are the ones to write
        return data
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()
