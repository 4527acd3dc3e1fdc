"""The native extension's cache folder: where it is, whose it is, what may be loaded from it.

A folder keyed by a hash of the sources, flags, torch and Python versions, under
``$ZERO_TRITON_EXT_DIR`` or torch's extension cache. Only what this user alone can
write is loaded; the built file is checked against its recorded sha256 before every
load; a failed build is recorded so that later starts do not retry it; one process at a
time builds, under an ``flock`` that the kernel drops when its holder dies. The build
itself is ``zero_triton.native.ext``'s.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import socket
import stat
import sys
import time
from pathlib import Path
from types import ModuleType

from zero_triton.native.flags import CXX_FLAGS as JIT_CFLAGS

JIT_NAME = "zero_triton_C"

DIR_ENV = "ZERO_TRITON_EXT_DIR"
TIMEOUT_ENV = "ZERO_TRITON_EXT_TIMEOUT"
RETRY_ENV = "ZERO_TRITON_EXT_RETRY"
CFLAGS_ENV = "ZERO_TRITON_EXT_CFLAGS"

# Part of the folder key: folders written by older versions (torch's ninja build, no
# checksum) are left alone rather than half-trusted.
CACHE_LAYOUT = b"layout 2: own build, sha256, flock"
SO = f"{JIT_NAME}.so"
CHECKSUM = f"{SO}.sha256"
LOCK = "build.lock"
FAILED = "build-failed.json"
TMP_PREFIX = ".build-"
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class Unavailable(Exception):
    """The extension cannot be had here; ``str()`` is the one-line reason."""


class BuildFailed(Unavailable):
    """A build was tried and failed: recorded, so that later starts do not retry it."""


def say(message: str) -> None:
    print(f"zero_triton: {message}", file=sys.stderr, flush=True)


def one_line(text, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    if len(text) > limit:
        half = (limit - 5) // 2
        text = text[:half] + " ... " + text[-half:]
    return text


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def cache_base() -> Path:
    base = os.environ.get(DIR_ENV)
    if base:
        return Path(base).expanduser()
    import torch

    root = os.environ.get("TORCH_EXTENSIONS_DIR")  # torch's own cache, as torch names it
    if root:
        return Path(root).expanduser()
    try:
        from torch.utils.cpp_extension import get_default_build_root

        root = get_default_build_root()
    except ImportError:
        root = str(Path.home() / ".cache" / "torch_extensions")
    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(root) / f"{python}_{accelerator}"


def jit_cflags() -> list[str]:
    """The first-use build's compiler flags: the extension's own (flags.py), then
    ``$ZERO_TRITON_EXT_CFLAGS`` after them, so they win (``-O0 -g`` to step through the
    kernels in a debugger). Part of the folder key: each set of flags has its own build.
    A flag that changes the arithmetic (``-ffast-math``, ``-ffp-contract=fast``) gives a
    step that is no longer bit-identical to the other backends'."""
    try:
        extra = shlex.split(os.environ.get(CFLAGS_ENV, ""))
    except ValueError as exc:
        raise Unavailable(f"{CFLAGS_ENV} cannot be split into flags ({exc}): fix its quoting") from None
    return [*JIT_CFLAGS, *extra]


def cache_dir(sources: list[Path], root: Path) -> Path:
    import torch

    digest = hashlib.sha256(CACHE_LAYOUT)
    for path in sources + sorted((root / "cpu").glob("*.h")) + sorted(root.glob("*.h")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(" ".join(jit_cflags()).encode())
    digest.update(torch.__version__.encode())
    digest.update(sys.version.encode())
    return cache_base() / f"{JIT_NAME}_{digest.hexdigest()[:16]}"


# -- trust: only what this user alone can write is loaded ------------------------------
def not_private(path: Path) -> str | None:
    """Why ``path`` (the cache folder, its build folder or a file in it) is not this
    user's alone, or None: it must be no link, owned by this user and not writable by
    group or others (as ssh asks of its keys and pip of its cache)."""
    try:
        st = os.lstat(path)
    except OSError:  # missing, or unreachable: whatever uses it next says why
        return None
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def unsafe_ancestor(base: Path) -> str | None:
    """Why a folder above the cache lets another user replace it (owned by someone other
    than root or this user, or writable by all without the sticky bit), or None."""
    for parent in Path(os.path.abspath(base)).parents:
        try:
            st = os.stat(parent)
        except OSError:
            continue
        if st.st_uid not in (0, os.geteuid()):
            return f"{parent} is owned by uid {st.st_uid}"
        if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
            return f"{parent} is writable by all without the sticky bit"
    return None


def check_trusted(build_dir: Path, *files: str) -> None:
    """Refuse (``Unavailable``: one line, then the fallback) a cache that another user
    could have written: code planted there would run in this process."""
    base = build_dir.parent
    why = unsafe_ancestor(base)
    if why is None:
        for path in (base, build_dir, *(build_dir / f for f in files)):
            reason = not_private(path)
            if reason is not None:
                why = f"{path} {reason}"
                break
    if why is not None:
        raise Unavailable(f"the CPU extension's cache is not trusted: {why}, so another user "
                           f"could plant code there; not loading or building in it. Set {DIR_ENV} "
                           "to a folder of your own that only you can write (mode 700)")


def create_private(path: Path) -> int:
    """Open a new file of ours at ``path`` (never an existing file or a planted link)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600)


# -- the cached file and its checksum -------------------------------------------------
def checksum(path: Path) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def damage(build_dir: Path) -> str | None:
    """None when build_dir's .so is the one recorded beside it (size and sha256), else
    what is wrong with it. Reading a short file is harmless; only mapping one (dlopen)
    dies of SIGBUS, so this runs before every load."""
    try:
        fields = (build_dir / CHECKSUM).read_text().split()
        want_hash, want_size = fields[0], int(fields[1])
    except FileNotFoundError:
        return f"no {CHECKSUM} beside it"
    except (OSError, ValueError, IndexError):
        return f"{CHECKSUM} is unreadable"
    try:
        have_hash, have_size = checksum(build_dir / SO)
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}"
    if have_size != want_size:
        return f"{have_size} bytes, {want_size} expected"
    if have_hash != want_hash:
        return "its sha256 is not the recorded one"
    return None


def import_so(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(JIT_NAME, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise Unavailable(f"the cached CPU extension {path} cannot be loaded ({one_line(exc)}); delete "
                           f"{path.parent} to rebuild it") from exc
    return module


# -- the failure record ---------------------------------------------------------------
def compiler_command() -> list[str]:
    return shlex.split(os.environ.get("CXX") or "c++") or ["c++"]


def compiler_identity() -> str:
    """What a failure record is valid for: another compiler deserves another try."""
    command = compiler_command()
    return " ".join([shutil.which(command[0]) or f"{command[0]} (not found)", *command[1:]])


def recorded_failure(build_dir: Path) -> dict | None:
    try:
        record = json.loads((build_dir / FAILED).read_text())
    except (OSError, ValueError):  # none (it is written whole, by a rename), or unreadable
        return None
    if not isinstance(record, dict) or record.get("compiler") != compiler_identity():
        return None
    return record


def record_failure(build_dir: Path, reason: str) -> bool:
    """Best effort: False when the record cannot be written."""
    record = {"reason": reason, "compiler": compiler_identity(), "time": time.time(),
              "pid": os.getpid(), "host": socket.gethostname()}
    tmp = build_dir / f"{FAILED}.{os.getpid()}.{time.monotonic_ns()}"
    try:
        with os.fdopen(create_private(tmp), "w") as f:
            f.write(json.dumps(record) + "\n")
        os.replace(tmp, build_dir / FAILED)
        return True
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        return False


def retry_hint(build_dir: Path) -> str:
    return f"delete {build_dir / FAILED} or set {RETRY_ENV}=1 to retry"


def earlier_failure(record: dict, build_dir: Path) -> str:
    return (f"an earlier build of the CPU extension failed, not retried: {record.get('reason')} "
            f"({retry_hint(build_dir)})")


# -- the build lock -------------------------------------------------------------------
def lock_owner(fd: int) -> str:
    try:
        pid, host, started = os.pread(fd, 200, 0).decode().split()
        return f"pid {pid} on {host} (started {time.time() - float(started):.0f} s ago)"
    except (OSError, ValueError):
        return "another process"


@contextlib.contextmanager
def build_lock(build_dir: Path, timeout: float):
    """Hold ``build.lock`` (flock) while building. Yields True when held; False when
    its owner kept it past ``timeout`` or the file system cannot lock (then the caller
    builds on its own: results are renamed into place, so builders never mix files).
    Never waits longer than ``timeout``. OSError: the folder cannot be written."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield False
        return
    try:  # never through a link planted at its name: that would truncate its target
        fd = os.open(build_dir / LOCK, os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o600)  # not inherited
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Unavailable(f"the CPU extension's cache is not trusted: {build_dir / LOCK} is a "
                               f"symbolic link; not building there. Set {DIR_ENV} to a folder of "
                               "your own that only you can write (mode 700)") from None
        raise
    if os.fstat(fd).st_uid != os.geteuid():
        os.close(fd)
        raise Unavailable(f"the CPU extension's cache is not trusted: {build_dir / LOCK} belongs "
                           f"to another user; not building there. Set {DIR_ENV} to a folder of "
                           "your own that only you can write (mode 700)")
    try:
        deadline = time.monotonic() + timeout
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            except OSError:  # no locks here (some network file systems)
                yield False
                return
            if time.monotonic() >= deadline:
                say(f"{lock_owner(fd)} still holds {build_dir / LOCK} after {timeout:g} s "
                     f"({TIMEOUT_ENV}); building separately")
                yield False
                return
            if not said:
                say(f"waiting for {lock_owner(fd)} to finish compiling the CPU extension "
                     f"(at most {timeout:g} s, {TIMEOUT_ENV})")
                said = True
            time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()} {time.time():.3f}\n".encode(), 0)
        yield True
    finally:
        os.close(fd)  # releases the lock


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, someone else's
        pass
    return True


def remove_dead_builds(build_dir: Path) -> None:
    """Temporary folders of builds on this host whose process is gone (killed)."""
    host = socket.gethostname()
    for entry in build_dir.glob(f"{TMP_PREFIX}*"):
        try:
            owner_host, pid, _ = entry.name[len(TMP_PREFIX):].rsplit("-", 2)
            if owner_host == host and not pid_alive(int(pid)):
                shutil.rmtree(entry, ignore_errors=True)
        except ValueError:
            continue
