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
compiler is ``$CXX`` (default ``c++``); ``MAX_JOBS`` caps the parallel compiler calls;
``$ZERO_TRITON_EXT_CFLAGS`` adds flags after the extension's own (``-O0 -g`` for a
debugger: a folder of its own in the cache).

Usage::

    from zero_triton.native import ext as _ext
    mod = _ext.load()
    if mod is not None:
        mod.adam_step(param, grad, exp_avg, exp_avg_sq, None, None, step, lr,
                      0.9, 0.999, 1e-8, 0.0, False, False, False, None, None, None)
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import socket
import subprocess
import sysconfig
import tempfile
import time
from pathlib import Path
from types import ModuleType

from zero_triton.native import cache
from zero_triton.native.cache import (DIR_ENV, RETRY_ENV, TIMEOUT_ENV, BuildFailed, Unavailable,
                                      one_line, say)
from zero_triton.native.flags import CXX_FLAGS as JIT_CFLAGS
from zero_triton.native.flags import OPENMP

__all__ = ["load", "unavailable_reason", "cuda_available", "source_dir", "JIT_CFLAGS"]

DEFAULT_TIMEOUT_S = 300.0


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


# Five compile jobs, MAX_JOBS at a time: the longest 17 s, 71 s in all on one core of a
# two-core x86-64 machine (36 s there with two jobs).
BUILD_TIME = "about 20 s on 5 cores, 40 on 2"


def _cpu_sources(root: Path) -> list[Path]:
    return [root / "adam.cpp"] + sorted((root / "cpu").glob("*.cpp"))


# -- compiling ------------------------------------------------------------------------
def _compiler_error(output: str, returncode: int) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()][:2] or lines[-2:]
    return one_line(" | ".join(errors) or f"exit status {returncode}", 240)


def _run_all(jobs: list[tuple[str, list[str]]], work: Path, deadline: float) -> None:
    """Run (label, command) jobs, MAX_JOBS (default: the CPU count) at a time, each
    with its output in a file; BuildFailed at the first failure or past the deadline."""
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
                    raise BuildFailed(f"cannot run the compiler {command[0]!r} "
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
                    raise BuildFailed(f"{label}: {_compiler_error(output, proc.returncode)}")
            if running and time.monotonic() > deadline:
                raise BuildFailed(f"the build took longer than {_timeout():g} s ({TIMEOUT_ENV})")
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

    cxx = cache.compiler_command()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = []
    for path in [*ce.include_paths(), sysconfig.get_paths()["include"]]:
        includes += ["-isystem", str(path)]
    flags = [f"-DTORCH_EXTENSION_NAME={cache.JIT_NAME}", "-DTORCH_API_INCLUDE_EXTENSION_H",
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-fPIC", "-std=c++20", *cache.jit_cflags()]
    objects = [work / f"{src.stem}.o" for src in sources]
    _run_all([(src.name, [*cxx, *flags, *includes, "-c", str(src), "-o", str(obj)])
              for src, obj in zip(sources, objects)], work, deadline)
    libdirs = [f"-L{p}" for p in ce.library_paths()]
    _run_all([("link", [*cxx, "-shared", *OPENMP, *map(str, objects), *libdirs, "-lc10",
                        "-ltorch_cpu", "-ltorch", "-ltorch_python", "-o", str(work / cache.SO)])],
             work, deadline)
    digest, size = cache.checksum(work / cache.SO)
    (work / cache.CHECKSUM).write_text(f"{digest} {size}\n")
    # .so first: between the two renames a reader sees a mismatch, takes the lock (held
    # by this build) and looks again once it is released.
    os.replace(work / cache.SO, build_dir / cache.SO)
    os.replace(work / cache.CHECKSUM, build_dir / cache.CHECKSUM)


def _compile_jit() -> ModuleType:
    root = source_dir()
    if root is None:
        raise Unavailable("the C++ sources (csrc/adam.cpp) are neither in the installed "
                           "package nor next to it; reinstall zero_triton")
    started = time.time()
    sources = _cpu_sources(root)
    build_dir = cache.cache_dir(sources, root)
    so = build_dir / cache.SO
    cache.check_trusted(build_dir, cache.SO, cache.CHECKSUM, cache.LOCK, cache.FAILED)
    damage = cache.damage(build_dir) if so.exists() else None
    if so.exists() and damage is None:
        return cache.import_so(so)
    retry = cache.env_flag(RETRY_ENV)
    record = cache.recorded_failure(build_dir)
    if record is not None and not retry:
        raise Unavailable(cache.earlier_failure(record, build_dir))
    timeout = _timeout()
    try:
        build_dir.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            build_dir.mkdir(mode=0o700)
        cache.check_trusted(build_dir)  # made by this process, or by whoever was first
        with cache.build_lock(build_dir, timeout) as held:
            # Again: another process may have built it, or failed, while this one waited.
            cache.check_trusted(build_dir, cache.SO, cache.CHECKSUM, cache.FAILED)
            damage = cache.damage(build_dir) if so.exists() else None
            if so.exists() and damage is None:
                return cache.import_so(so)
            record = cache.recorded_failure(build_dir)
            if record is not None and (not retry or record.get("time", 0) >= started):
                raise Unavailable(cache.earlier_failure(record, build_dir))
            if held:
                cache.remove_dead_builds(build_dir)
            _build_recorded(sources, build_dir, damage, timeout)
            with contextlib.suppress(FileNotFoundError):
                (build_dir / cache.FAILED).unlink()
    except OSError as exc:  # the cache cannot be written: no build, nothing to record
        what = f"the cached {so} is damaged ({damage}) and " if damage else ""
        raise Unavailable(f"{what}the CPU extension's cache {build_dir} cannot be written "
                           f"({exc.strerror or exc}); set {DIR_ENV} to a writable "
                           "folder") from None
    return cache.import_so(so)


def _build_recorded(sources, build_dir: Path, damage, timeout: float) -> None:
    """Build into ``build_dir`` (holding its lock) in a work folder of this process's;
    a failure is recorded there, so later starts do not retry, and said as Unavailable."""
    so = build_dir / cache.SO
    work = Path(tempfile.mkdtemp(dir=build_dir, prefix=f"{cache.TMP_PREFIX}"
                                 f"{socket.gethostname()}-{os.getpid()}-"))
    try:
        cxx = cache.compiler_command()[0]
        if shutil.which(cxx) is None:  # said in one line, by the caller
            where = "$CXX" if os.environ.get("CXX") else "PATH"
            raise BuildFailed(f"no C++ compiler: {cxx!r} (from {where}) not found; "
                              "install one (g++) or set CXX")
        if damage is not None:
            say(f"the cached CPU extension {so} is damaged ({damage}); not loading "
                f"it, compiling it again ({BUILD_TIME})")
        else:
            say(f"compiling the CPU extension (once, {BUILD_TIME}; cached in {build_dir})")
        _build(sources, build_dir, work, time.monotonic() + timeout)
    except BuildFailed as exc:
        recorded = cache.record_failure(build_dir, str(exc))
        tail = (f"recorded, later starts do not retry: {cache.retry_hint(build_dir)}"
                if recorded else "the failure could not be recorded")
        raise Unavailable(f"building the CPU extension failed: {exc} ({tail})") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def _load() -> tuple[ModuleType | None, str | None]:
    if cache.env_flag("ZERO_TRITON_NO_EXT"):
        return None, "disabled by ZERO_TRITON_NO_EXT"
    try:
        from zero_triton import _C  # built ahead of time by setup.py

        return _C, None
    except ImportError:
        pass
    try:
        return _compile_jit(), None
    except Unavailable as exc:
        return None, str(exc)
    except Exception as exc:  # no headers, a broken torch, ...
        return None, f"the CPU extension could not be built ({type(exc).__name__}: {one_line(exc)})"


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
