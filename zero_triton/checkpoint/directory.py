"""Where a checkpoint lives on disk: the lock, the atomic swap, and what may be deleted.

A save to ``PATH`` (all under an exclusive lock on ``PATH``'s sibling
``.NAME.zero_triton-lock``, which is removed when the save ends):

1. refuses unless ``PATH`` is missing, empty, or a checkpoint of ours: a sealed manifest
   and nothing else in it than the files that manifest lists;
2. writes into ``PATH.tmp-<save id>``, which holds a marker file (``.zero_triton-save``)
   naming the save until the manifest is in;
3. writes ``manifest.json`` last, fsyncs, renames ``PATH`` to ``PATH.old-<its save id>``,
   the new directory to ``PATH``, and removes the old one;
4. removes leftovers of interrupted saves to ``PATH`` that are recognisably ours (the name
   pattern above, and contents that are only our files, with our marker or sealed
   manifest naming the same save id). Nothing else is ever deleted.

``resolve`` falls back to a ``PATH.old-<save id>`` (same rules) only when ``PATH`` does
not exist: a save interrupted between its two renames.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import re
import shutil
import socket
import stat
import time
import warnings

try:
    import fcntl
except ImportError:  # not POSIX: saves are not serialised (said once, see SaveLock)
    fcntl = None

from zero_triton.checkpoint import manifest as mf
from zero_triton.checkpoint.errors import CheckpointError
from zero_triton.checkpoint.files import MANIFEST, Directory, fsync_dir, is_member_name

MARKER = ".zero_triton-save"
_ID = r"[0-9a-f]{16}"


def tmp_path(path: str, save_id: str) -> str:
    return f"{path}.tmp-{save_id}"


def old_path(path: str, save_id: str) -> str:
    return f"{path}.old-{save_id}"


# -- the lock ---------------------------------------------------------------------------
class SaveLock:
    """An exclusive ``flock`` serialising saves to one path (released by the kernel if
    the process dies, so it is never stale). Waits up to ``timeout`` seconds for another
    save to finish, then raises naming it."""

    def __init__(self, path: str, timeout: float):
        self.path, self.timeout = path, timeout
        head, tail = os.path.split(path)
        self.lock_path = os.path.join(head, f".{tail}.zero_triton-lock")
        self.fd = None

    def __enter__(self):
        if fcntl is None:
            _warn_unlocked(os.path.dirname(self.path), "no flock on this system")
            return self
        deadline = time.monotonic() + self.timeout
        while True:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    os.close(fd)  # a filesystem without locks: say so once, save unlocked
                    with contextlib.suppress(OSError):
                        os.unlink(self.lock_path)
                    _warn_unlocked(os.path.dirname(self.path), exc.strerror)
                    return self
                if not isinstance(exc, BlockingIOError):
                    os.close(fd)
                    raise
                os.close(fd)
                if time.monotonic() >= deadline:
                    raise CheckpointError(
                        f"another save to {self.path} is in progress ({self._owner()}); waited "
                        f"{self.timeout:g} s: let it finish, or save to another path") from None
                time.sleep(0.05)
                continue
            # The holder before us may have removed the file after we opened it: the lock
            # counts only while the name still points to the file we locked.
            try:
                same = os.stat(self.lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": time.time()}).encode())
        self.fd = fd
        return self

    def _owner(self) -> str:
        try:
            with open(self.lock_path) as f:
                who = json.loads(f.read(4096))
            since = time.strftime("%H:%M:%S", time.localtime(float(who["since"])))
            return f"process {int(who['pid'])} on {str(who['host'])[:64]}, since {since}"
        except (OSError, ValueError, KeyError, TypeError):
            return f"{self.lock_path} is locked"

    def __exit__(self, *exc):
        if self.fd is None:  # unlocked: see _warn_unlocked
            return
        with contextlib.suppress(OSError):
            os.unlink(self.lock_path)  # while still holding it: see __enter__
        os.close(self.fd)
        self.fd = None


@functools.lru_cache(maxsize=None)
def _warn_unlocked(directory: str, why: str) -> None:
    warnings.warn(f"zero_triton.checkpoint.save: cannot lock files in {directory} "
                  f"({why}): saves to one path from two jobs at once are not "
                  "serialised on this filesystem", stacklevel=4)


# -- what is ours -------------------------------------------------------------------------
def _manifest_bytes(directory: Directory) -> tuple[bytes, str]:
    """The bytes of ``directory``'s manifest and its path; FileNotFoundError when none."""
    source = os.path.join(directory.path, MANIFEST)
    f, size = directory.open(MANIFEST, "manifest")
    with f:
        if size > mf.MAX_MANIFEST_BYTES:
            raise CheckpointError(f"{source} is {size:,} bytes, more than any manifest; it is "
                                  "not a zero_triton manifest")
        return f.read(), source


def read_manifest(directory: Directory, validate: bool = True) -> dict:
    """The sealed (and, by default, validated) manifest of an open directory; raises
    FileNotFoundError when there is none."""
    data, source = _manifest_bytes(directory)
    manifest = mf.parse(data, source)
    if validate:
        mf.validate(manifest, source)
    return manifest


def _ours_any_version(directory: Directory) -> dict:
    """The manifest of a checkpoint this or an earlier zero_triton wrote: sealed (current
    version), or format version 1 (before the seal), which a save may still replace."""
    data, source = _manifest_bytes(directory)
    try:
        return mf.parse(data, source)
    except CheckpointError:
        try:
            claim = json.loads(data)
        except (ValueError, RecursionError):
            claim = None
        if (isinstance(claim, dict) and claim.get("format") == mf.FORMAT
                and type(claim.get("version")) is int and claim["version"] == 1):
            return claim
        raise


def _only_ours(path: str, names, allowed) -> list[str]:
    """Entries of ``path`` that are not regular files named in ``allowed``."""
    foreign = []
    for name in names:
        st = os.lstat(os.path.join(path, name))
        if name not in allowed or not stat.S_ISREG(st.st_mode):
            foreign.append(name)
    return foreign


def check_replaceable(path: str) -> str | None:
    """Raise unless a save may replace ``path``; return the save id found there (None
    when there is nothing or an empty directory)."""
    if not os.path.lexists(path):
        return None
    if os.path.islink(path):
        raise CheckpointError(f"{path} is a symbolic link; refusing to replace it: save to the "
                              "directory it points to, or to another path")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} exists and is not a checkpoint directory; refusing to "
                              "replace it: choose another path")
    with Directory(path) as d:
        names = d.listdir()
        if not names:
            return None
        if MANIFEST not in names:
            raise CheckpointError(f"{path} exists and is not a checkpoint directory (no {MANIFEST});"
                                  " refusing to replace it: choose another path")
        try:
            manifest = _ours_any_version(d)
            save_id = manifest.get("save_id")  # None in a version 1 checkpoint
            files = manifest.get("files")
            if not ((save_id is None or isinstance(save_id, str) and re.fullmatch(_ID, save_id))
                    and isinstance(files, dict) and all(is_member_name(n) for n in files)):
                raise CheckpointError("its save id or file list is malformed")
        except (CheckpointError, OSError) as exc:
            raise CheckpointError(f"{path} holds a {MANIFEST} that is not a valid zero_triton "
                                  f"checkpoint manifest ({exc}); refusing to replace it: remove "
                                  "it yourself or choose another path") from None
        foreign = _only_ours(path, names, set(files) | {MANIFEST})
    if foreign:
        shown = ", ".join(sorted(foreign)[:5]) + (" ..." if len(foreign) > 5 else "")
        raise CheckpointError(f"{path} holds entries a checkpoint does not ({shown}); refusing "
                              "to replace it: move them out, or choose another path")
    return save_id


def _recognisably_ours(path: str, save_id: str) -> dict | None:
    """The manifest (or ``{}`` for an unfinished save) of a leftover directory named with
    ``save_id`` when it is one of ours: a real directory holding only files a checkpoint
    holds, with our marker or a sealed manifest naming the same save."""
    if os.path.islink(path) or not os.path.isdir(path):
        return None
    try:
        with Directory(path) as d:
            names = d.listdir()
            if _only_ours(path, names, {n for n in names if is_member_name(n)} | {MANIFEST, MARKER}):
                return None
            if MANIFEST in names:
                manifest = read_manifest(d, validate=False)
                return manifest if manifest.get("save_id") == save_id else None
            if MARKER in names:
                with open(os.path.join(path, MARKER)) as f:
                    return {} if f.read(64).strip() == save_id else None
    except (OSError, ValueError, CheckpointError):
        return None
    return None


def _leftovers(path: str, kind: str):
    """``(directory, save id)`` of siblings named ``PATH.<kind>-<save id>``."""
    head, tail = os.path.split(path)
    pattern = re.compile(re.escape(tail) + rf"\.{kind}-({_ID})\Z")
    try:
        names = os.listdir(head)
    except OSError:
        return
    for name in names:
        if (match := pattern.match(name)):
            yield os.path.join(head, name), match.group(1)


def make_tmp(path: str, save_id: str) -> str:
    tmp = tmp_path(path, save_id)
    os.mkdir(tmp)
    with open(os.path.join(tmp, MARKER), "w") as f:
        f.write(save_id)
    return tmp


def remove_tmp(tmp: str, save_id: str) -> None:
    """Remove this save's temporary directory (only if it is still recognisably ours)."""
    if _recognisably_ours(tmp, save_id) is not None:
        shutil.rmtree(tmp, ignore_errors=True)


def commit(tmp: str, path: str, save_id: str, manifest_bytes: bytes) -> None:
    """manifest.json last, fsynced; then swap the directory into place (under the lock)."""
    with open(os.path.join(tmp, MANIFEST), "xb") as f:
        f.write(manifest_bytes)
        f.flush()
        os.fsync(f.fileno())
    os.remove(os.path.join(tmp, MARKER))
    fsync_dir(tmp)
    old_id = check_replaceable(path)  # again: someone may have written there meanwhile
    old = None
    if os.path.lexists(path):
        old = old_path(path, old_id or save_id)
        os.rename(path, old)
    try:
        # Between these two renames PATH does not exist; resolve() falls back to PATH.old-*.
        os.rename(tmp, path)
    except OSError:
        if old is not None:
            os.rename(old, path)
        raise
    fsync_dir(os.path.dirname(path))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    for kind in ("tmp", "old"):  # interrupted saves of ours to this path
        for leftover, leftover_id in _leftovers(path, kind):
            if _recognisably_ours(leftover, leftover_id) is not None:
                shutil.rmtree(leftover, ignore_errors=True)


# -- where to read -----------------------------------------------------------------------
def resolve(path) -> tuple[Directory, dict]:
    """The open checkpoint directory at ``path`` and its validated manifest. When ``PATH``
    does not exist, falls back to the newest ``PATH.old-<save id>`` of ours (a save
    interrupted between its two renames). The caller closes the directory."""
    path = os.path.abspath(os.fspath(path))
    if os.path.lexists(path):
        if not os.path.isdir(path):
            raise CheckpointError(f"{path} is {'a file' if os.path.isfile(path) else 'not a directory'};"
                                  f" pass the checkpoint directory (the one holding {MANIFEST})")
        candidates = [path]
    else:
        olds = [(m.get("time", 0), d) for d, sid in _leftovers(path, "old")
                if (m := _recognisably_ours(d, sid))]
        candidates = [d for _, d in sorted(olds, reverse=True)]
    for candidate in candidates:
        try:
            directory = Directory(candidate)
        except FileNotFoundError:
            continue
        try:
            return directory, read_manifest(directory)
        except FileNotFoundError:
            directory.close()
        except BaseException:
            directory.close()
            raise
    raise CheckpointError(f"no checkpoint at {path}: {MANIFEST} not found (a save that never "
                          "finished leaves no manifest)")
