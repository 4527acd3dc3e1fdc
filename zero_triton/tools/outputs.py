"""Writing the command line's output files: whole, and never through a planted link.

``bench --out D`` and ``profile --out D`` write files of fixed names into a folder that
may be shared. Each file is written to a new temporary file in the same folder (created
with ``O_EXCL | O_NOFOLLOW``: never an existing file or link) and renamed over its name
when complete: a link planted at the name is replaced, never followed, and a reader never
sees half a file.
"""
from __future__ import annotations

import contextlib
import os
import secrets

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)


def _create(path, suffix: str = ""):
    """A new empty file beside ``path``, ours alone (mode 0644): (fd, name)."""
    folder, name = os.path.split(os.fspath(path))
    while True:
        tmp = os.path.join(folder, f".{name}.{secrets.token_hex(6)}.tmp{suffix}")
        try:
            return os.open(tmp, _FLAGS, 0o644), tmp
        except FileExistsError:
            continue


def new_temporary(path, suffix: str = "") -> str:
    """Create a new empty file beside ``path`` for a writer that opens it by name (it is
    ours: no link can stand there) and return its name."""
    fd, tmp = _create(path, suffix)
    os.close(fd)
    return tmp


@contextlib.contextmanager
def replacing(path, mode: str = "w", **kwargs):
    """``with replacing(path) as fh:`` writes a temporary file that replaces ``path``
    when the block ends without an error (and is removed when it raises)."""
    fd, tmp = _create(path)
    try:
        with os.fdopen(fd, mode, **kwargs) as fh:
            yield fh
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
