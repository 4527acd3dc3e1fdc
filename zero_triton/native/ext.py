"""Build or load the native extension ``zero_triton._C``.

``load()`` returns the module, or None when it cannot be had; ``unavailable_reason()``
then says why, in one line (the caller says it once and falls back). Order:

1. ``import zero_triton._C`` -- built ahead of time by ``ZERO_TRITON_BUILD_EXT=1 pip
   install --no-build-isolation .`` (may include the CUDA kernels).
2. Otherwise compile the CPU kernels on first use (one compiler call per file, run in
   parallel, then a link), cached under ``$ZERO_TRITON_EXT_DIR`` or torch's extension
   cache, in a folder keyed by a hash of the sources, flags, torch and Python versions:
   later runs load it in milliseconds.

The cache folder holds::

    zero_triton_C.so         the extension, only ever put there by an atomic rename of a
                             complete file built in a private temporary folder
    zero_triton_C.so.sha256  "<sha256> <size>" of it, checked before every load: a
                             truncated or altered file is never loaded (mapping one kills
                             the process with SIGBUS); it is rebuilt, said in one line,
                             or skipped when the cache cannot be written
    build.lock               flock()ed by the one process that builds. The kernel drops
                             the lock when that process dies, however it dies, so a
                             killed build leaves nothing that blocks the next one.
    build-failed.json        why the last build failed. Later starts with the same
                             compiler do not retry it: they fall back at once and name the
                             record. Delete it, or set ZERO_TRITON_EXT_RETRY=1, to retry.

Concurrent processes (torchrun ranks) compile once: the others wait for the lock, at
most ``$ZERO_TRITON_EXT_TIMEOUT`` seconds (default 300; also the limit of one build),
then load what it built, or, if its owner is still at it, build on their own. A cache
that cannot be written costs no build attempt and is looked at again on every start.

Sources are looked for inside the installed package first (``zero_triton/csrc``,
copied there by setup.py's build_py), then in the repository's ``csrc/`` (editable
install). ``ZERO_TRITON_NO_EXT=1`` disables the extension (to test the fallback). The
compiler is ``$CXX`` (default ``c++``); ``MAX_JOBS`` caps the parallel compiler calls.

Usage::

    from zero_triton.native import ext as _ext
    mod = _ext.load()
    if mod is not None:
        mod.adam_step(param, grad, exp_avg, exp_avg_sq, None, None, step, lr,
                      0.9, 0.999, 1e-8, 0.0, False, False, False, None, None, None)
"""
from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import ModuleType

__all__ = ["load", "unavailable_reason", "cuda_available", "source_dir", "JIT_CFLAGS"]

# -O3 and -fno-math-errno / -fno-trapping-math let gcc vectorise sqrt, the divides and
# the branch-free fp16 conversions; -ffp-contract=off keeps the per-ISA variants (and
# every machine) bit-identical. No -march: the ISA variants are chosen at run time.
# -fopenmp: at::parallel_for is inlined from ATen/ParallelOpenMP.h, and without it
# the `#pragma omp parallel` there is ignored and the step runs on one thread.
_OPENMP = ["-fopenmp"] if sys.platform.startswith("linux") else []
JIT_CFLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", *_OPENMP]
_JIT_NAME = "zero_triton_C"

DIR_ENV = "ZERO_TRITON_EXT_DIR"
TIMEOUT_ENV = "ZERO_TRITON_EXT_TIMEOUT"
RETRY_ENV = "ZERO_TRITON_EXT_RETRY"
DEFAULT_TIMEOUT_S = 300.0

# Part of the folder key: folders written by older versions (torch's ninja build, no
# checksum) are left alone rather than half-trusted.
_CACHE_LAYOUT = b"layout 2: own build, sha256, flock"
_SO = f"{_JIT_NAME}.so"
_CHECKSUM = f"{_SO}.sha256"
_LOCK = "build.lock"
_FAILED = "build-failed.json"
_TMP_PREFIX = ".build-"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class _Unavailable(Exception):
    """The extension cannot be had here; ``str()`` is the one-line reason."""


class _BuildFailed(_Unavailable):
    """A build was tried and failed: recorded, so that later starts do not retry it."""


def _say(message: str) -> None:
    print(f"zero_triton: {message}", file=sys.stderr, flush=True)


def _one_line(text, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    if len(text) > limit:
        half = (limit - 5) // 2
        text = text[:half] + " ... " + text[-half:]
    return text


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def _timeout() -> float:
    try:
        value = float(os.environ.get(TIMEOUT_ENV, ""))
    except ValueError:
        return DEFAULT_TIMEOUT_S
    return value if value > 0 else DEFAULT_TIMEOUT_S


def source_dir() -> Path | None:
    """The csrc/ folder holding adam.cpp: inside the package, else the repository's."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "csrc", package.parent / "csrc"):
        if (candidate / "adam.cpp").is_file():
            return candidate
    return None


def _cpu_sources(root: Path) -> list[Path]:
    return [root / "adam.cpp"] + sorted((root / "cpu").glob("*.cpp"))


def _cache_base() -> Path:
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


def _cache_dir(sources: list[Path], root: Path) -> Path:
    import torch

    digest = hashlib.sha256(_CACHE_LAYOUT)
    for path in sources + sorted((root / "cpu").glob("*.h")) + sorted(root.glob("*.h")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(" ".join(JIT_CFLAGS).encode())
    digest.update(torch.__version__.encode())
    digest.update(sys.version.encode())
    return _cache_base() / f"{_JIT_NAME}_{digest.hexdigest()[:16]}"


# -- trust: only what this user alone can write is loaded ------------------------------
def _not_private(path: Path) -> str | None:
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


def _unsafe_ancestor(base: Path) -> str | None:
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


def _check_trusted(build_dir: Path, *files: str) -> None:
    """Refuse (``_Unavailable``: one line, then the fallback) a cache that another user
    could have written: code planted there would run in this process."""
    base = build_dir.parent
    why = _unsafe_ancestor(base)
    where = None
    if why is None:
        for path in (base, build_dir, *(build_dir / f for f in files)):
            reason = _not_private(path)
            if reason is not None:
                where, why = path, f"{path} {reason}"
                break
    if why is not None:
        raise _Unavailable(f"the CPU extension's cache is not trusted: {why}, so another user "
                           f"could plant code there; not loading or building in it. Set {DIR_ENV} "
                           "to a folder of your own that only you can write (mode 700)")


def _create_private(path: Path) -> int:
    """Open a new file of ours at ``path`` (never an existing file or a planted link)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)


# -- the cached file and its checksum -------------------------------------------------
def _checksum(path: Path) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _damage(build_dir: Path) -> str | None:
    """None when build_dir's .so is the one recorded beside it (size and sha256), else
    what is wrong with it. Reading a short file is harmless; only mapping one (dlopen)
    dies of SIGBUS, so this runs before every load."""
    try:
        fields = (build_dir / _CHECKSUM).read_text().split()
        want_hash, want_size = fields[0], int(fields[1])
    except FileNotFoundError:
        return f"no {_CHECKSUM} beside it"
    except (OSError, ValueError, IndexError):
        return f"{_CHECKSUM} is unreadable"
    try:
        have_hash, have_size = _checksum(build_dir / _SO)
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}"
    if have_size != want_size:
        return f"{have_size} bytes, {want_size} expected"
    if have_hash != want_hash:
        return "its sha256 is not the recorded one"
    return None


def _import_so(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(_JIT_NAME, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise _Unavailable(f"the cached CPU extension {path} cannot be loaded ({_one_line(exc)}); delete "
                           f"{path.parent} to rebuild it") from exc
    return module


# -- the failure record ---------------------------------------------------------------
def _compiler_command() -> list[str]:
    return shlex.split(os.environ.get("CXX") or "c++") or ["c++"]


def _compiler_identity() -> str:
    """What a failure record is valid for: another compiler deserves another try."""
    command = _compiler_command()
    return " ".join([shutil.which(command[0]) or f"{command[0]} (not found)", *command[1:]])


def _recorded_failure(build_dir: Path) -> dict | None:
    try:
        record = json.loads((build_dir / _FAILED).read_text())
    except (OSError, ValueError):  # none (it is written whole, by a rename), or unreadable
        return None
    if not isinstance(record, dict) or record.get("compiler") != _compiler_identity():
        return None
    return record


def _record_failure(build_dir: Path, reason: str) -> bool:
    """Best effort: False when the record cannot be written."""
    record = {"reason": reason, "compiler": _compiler_identity(), "time": time.time(),
              "pid": os.getpid(), "host": socket.gethostname()}
    tmp = build_dir / f"{_FAILED}.{os.getpid()}.{time.monotonic_ns()}"
    try:
        with os.fdopen(_create_private(tmp), "w") as f:
            f.write(json.dumps(record) + "\n")
        os.replace(tmp, build_dir / _FAILED)
        return True
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        return False


def _retry_hint(build_dir: Path) -> str:
    return f"delete {build_dir / _FAILED} or set {RETRY_ENV}=1 to retry"


def _earlier_failure(record: dict, build_dir: Path) -> str:
    return (f"an earlier build of the CPU extension failed, not retried: {record.get('reason')} "
            f"({_retry_hint(build_dir)})")


# -- the build lock -------------------------------------------------------------------
def _lock_owner(fd: int) -> str:
    try:
        pid, host, started = os.pread(fd, 200, 0).decode().split()
        return f"pid {pid} on {host} (started {time.time() - float(started):.0f} s ago)"
    except (OSError, ValueError):
        return "another process"


@contextlib.contextmanager
def _build_lock(build_dir: Path, timeout: float):
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
        fd = os.open(build_dir / _LOCK, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600)  # not inherited
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _Unavailable(f"the CPU extension's cache is not trusted: {build_dir / _LOCK} is a "
                               f"symbolic link; not building there. Set {DIR_ENV} to a folder of "
                               "your own that only you can write (mode 700)") from None
        raise
    if os.fstat(fd).st_uid != os.geteuid():
        os.close(fd)
        raise _Unavailable(f"the CPU extension's cache is not trusted: {build_dir / _LOCK} belongs "
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
                _say(f"{_lock_owner(fd)} still holds {build_dir / _LOCK} after {timeout:g} s "
                     f"({TIMEOUT_ENV}); building separately")
                yield False
                return
            if not said:
                _say(f"waiting for {_lock_owner(fd)} to finish compiling the CPU extension "
                     f"(at most {timeout:g} s, {TIMEOUT_ENV})")
                said = True
            time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()} {time.time():.3f}\n".encode(), 0)
        yield True
    finally:
        os.close(fd)  # releases the lock


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, someone else's
        pass
    return True


def _remove_dead_builds(build_dir: Path) -> None:
    """Temporary folders of builds on this host whose process is gone (killed)."""
    host = socket.gethostname()
    for entry in build_dir.glob(f"{_TMP_PREFIX}*"):
        try:
            owner_host, pid, _ = entry.name[len(_TMP_PREFIX):].rsplit("-", 2)
            if owner_host == host and not _pid_alive(int(pid)):
                shutil.rmtree(entry, ignore_errors=True)
        except ValueError:
            continue


# -- compiling ------------------------------------------------------------------------
def _compiler_error(output: str, returncode: int) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()][:2] or lines[-2:]
    return _one_line(" | ".join(errors) or f"exit status {returncode}", 240)


def _run_all(jobs: list[tuple[str, list[str]]], work: Path, deadline: float) -> None:
    """Run (label, command) jobs, MAX_JOBS (default: the CPU count) at a time, each
    with its output in a file; _BuildFailed at the first failure or past the deadline."""
    try:
        limit = int(os.environ.get("MAX_JOBS", "0"))
    except ValueError:
        limit = 0
    limit = max(1, limit or os.cpu_count() or 1)
    pending, running = list(jobs), []
    try:
        while pending or running:
            while pending and len(running) < limit:
                label, command = pending.pop(0)
                log = open(work / f"{label}.log", "w+")
                try:
                    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT)
                except OSError as exc:
                    log.close()
                    raise _BuildFailed(f"cannot run the compiler {command[0]!r} "
                                       f"({exc.strerror or exc}); set CXX") from exc
                running.append((label, proc, log))
            for entry in list(running):
                label, proc, log = entry
                if proc.poll() is None:
                    continue
                running.remove(entry)
                log.seek(0)
                output = log.read()
                log.close()
                if proc.returncode != 0:
                    raise _BuildFailed(f"{label}: {_compiler_error(output, proc.returncode)}")
            if running and time.monotonic() > deadline:
                raise _BuildFailed(f"the build took longer than {_timeout():g} s ({TIMEOUT_ENV})")
            if running:
                time.sleep(0.05)
    finally:
        for _, proc, log in running:
            proc.kill()
            proc.wait()
            log.close()


def _build(sources: list[Path], build_dir: Path, work: Path, deadline: float) -> None:
    """Compile and link in the private folder ``work``, then rename the .so and its
    checksum into build_dir: a process killed at any point leaves no .so or a whole one."""
    import torch
    from torch.utils import cpp_extension as ce

    cxx = _compiler_command()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = []
    for path in [*ce.include_paths(), sysconfig.get_paths()["include"]]:
        includes += ["-isystem", str(path)]
    flags = [f"-DTORCH_EXTENSION_NAME={_JIT_NAME}", "-DTORCH_API_INCLUDE_EXTENSION_H",
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-fPIC", "-std=c++20", *JIT_CFLAGS]
    objects = [work / f"{src.stem}.o" for src in sources]
    _run_all([(src.name, [*cxx, *flags, *includes, "-c", str(src), "-o", str(obj)])
              for src, obj in zip(sources, objects)], work, deadline)
    libdirs = [f"-L{p}" for p in ce.library_paths()]
    _run_all([("link", [*cxx, "-shared", *_OPENMP, *map(str, objects), *libdirs, "-lc10",
                        "-ltorch_cpu", "-ltorch", "-ltorch_python", "-o", str(work / _SO)])],
             work, deadline)
    digest, size = _checksum(work / _SO)
    (work / _CHECKSUM).write_text(f"{digest} {size}\n")
    # .so first: between the two renames a reader sees a mismatch, takes the lock (held
    # by this build) and looks again once it is released.
    os.replace(work / _SO, build_dir / _SO)
    os.replace(work / _CHECKSUM, build_dir / _CHECKSUM)


def _compile_jit() -> ModuleType:
    root = source_dir()
    if root is None:
        raise _Unavailable("the C++ sources (csrc/adam.cpp) are neither in the installed "
                           "package nor next to it; reinstall zero_triton")
    started = time.time()
    sources = _cpu_sources(root)
    build_dir = _cache_dir(sources, root)
    so = build_dir / _SO
    _check_trusted(build_dir, _SO, _CHECKSUM, _LOCK, _FAILED)
    damage = _damage(build_dir) if so.exists() else None
    if so.exists() and damage is None:
        return _import_so(so)
    retry = _env_flag(RETRY_ENV)
    record = _recorded_failure(build_dir)
    if record is not None and not retry:
        raise _Unavailable(_earlier_failure(record, build_dir))
    timeout = _timeout()
    try:
        build_dir.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            build_dir.mkdir(mode=0o700)
        _check_trusted(build_dir)  # made by this process, or by whoever was first
        with _build_lock(build_dir, timeout) as held:
            # Again: another process may have built it, or failed, while this one waited.
            _check_trusted(build_dir, _SO, _CHECKSUM, _FAILED)
            damage = _damage(build_dir) if so.exists() else None
            if so.exists() and damage is None:
                return _import_so(so)
            record = _recorded_failure(build_dir)
            if record is not None and (not retry or record.get("time", 0) >= started):
                raise _Unavailable(_earlier_failure(record, build_dir))
            if held:
                _remove_dead_builds(build_dir)
            work = Path(tempfile.mkdtemp(dir=build_dir, prefix=f"{_TMP_PREFIX}"
                                         f"{socket.gethostname()}-{os.getpid()}-"))
            try:
                cxx = _compiler_command()[0]
                if shutil.which(cxx) is None:  # said in one line, by the caller
                    where = "$CXX" if os.environ.get("CXX") else "PATH"
                    raise _BuildFailed(f"no C++ compiler: {cxx!r} (from {where}) not found; "
                                       "install one (g++) or set CXX")
                if damage is not None:
                    _say(f"the cached CPU extension {so} is damaged ({damage}); not loading "
                         "it, compiling it again (~20 s)")
                else:
                    _say(f"compiling the CPU extension (once, ~20 s; cached in {build_dir})")
                _build(sources, build_dir, work, time.monotonic() + timeout)
            except _BuildFailed as exc:
                recorded = _record_failure(build_dir, str(exc))
                tail = (f"recorded, later starts do not retry: {_retry_hint(build_dir)}"
                        if recorded else "the failure could not be recorded")
                raise _Unavailable(f"building the CPU extension failed: {exc} ({tail})") from None
            finally:
                shutil.rmtree(work, ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                (build_dir / _FAILED).unlink()
    except OSError as exc:  # the cache cannot be written: no build, nothing to record
        what = f"the cached {so} is damaged ({damage}) and " if damage else ""
        raise _Unavailable(f"{what}the CPU extension's cache {build_dir} cannot be written "
                           f"({exc.strerror or exc}); set {DIR_ENV} to a writable "
                           "folder") from None
    return _import_so(so)


@functools.lru_cache(maxsize=None)
def _load() -> tuple[ModuleType | None, str | None]:
    if _env_flag("ZERO_TRITON_NO_EXT"):
        return None, "disabled by ZERO_TRITON_NO_EXT"
    try:
        from zero_triton import _C  # built ahead of time by setup.py

        return _C, None
    except ImportError:
        pass
    try:
        return _compile_jit(), None
    except _Unavailable as exc:
        return None, str(exc)
    except Exception as exc:  # no headers, a broken torch, ...
        return None, f"the CPU extension could not be built ({type(exc).__name__}: {_one_line(exc)})"


def load() -> ModuleType | None:
    """The ``zero_triton._C`` module (prebuilt or compiled and cached), or None."""
    return _load()[0]


def loaded_or_prebuilt() -> ModuleType | None:
    """The extension when using it costs no build: already loaded, or built ahead of
    time by setup.py. Never compiles (a Triton-only run should not pay for a build)."""
    if _load.cache_info().currsize or importlib.util.find_spec("zero_triton._C") is not None:
        return load()
    return None


def unavailable_reason() -> str | None:
    """Why ``load()`` returns None, or None when the extension is available."""
    return _load()[1]


def cuda_available() -> bool:
    """Whether the loaded extension has the CUDA kernels (only a setup.py build can)."""
    module = load()
    return bool(module is not None and getattr(module, "with_cuda", False))
