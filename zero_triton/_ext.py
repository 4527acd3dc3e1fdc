"""Build or load the native extension ``zero_triton._C``.

``load()`` returns the module, or None when it cannot be had; ``unavailable_reason()``
then says why (the caller warns once, loudly, and falls back). Order:

1. ``import zero_triton._C`` -- built ahead of time by ``ZERO_TRITON_BUILD_EXT=1 pip
   install --no-build-isolation .`` (may include the CUDA kernels).
2. Otherwise compile the CPU kernels on first use with torch.utils.cpp_extension
   (ninja when present, else one compiler call per file), cached under
   ``$ZERO_TRITON_EXT_DIR`` or torch's extension cache, in a folder keyed by a hash of
   the sources, flags, torch and Python versions: later runs load it in milliseconds.

Sources are looked for inside the installed package first (``zero_triton/csrc``,
copied there by setup.py's build_py), then in the repository's ``csrc/`` (editable
install). ``ZERO_TRITON_NO_EXT=1`` disables the extension (to test the fallback).

Usage::

    from zero_triton import _ext
    mod = _ext.load()
    if mod is not None:
        mod.adam_step(param, grad, exp_avg, exp_avg_sq, None, None, step, lr,
                      0.9, 0.999, 1e-8, 0.0, False, False, False, None, None, None)
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import subprocess
import sys
import sysconfig
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


def source_dir() -> Path | None:
    """The csrc/ folder holding adam.cpp: inside the package, else the repository's."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "csrc", here.parent / "csrc"):
        if (candidate / "adam.cpp").is_file():
            return candidate
    return None


def _cpu_sources(root: Path) -> list[Path]:
    return [root / "adam.cpp"] + sorted((root / "cpu").glob("*.cpp"))


def _cache_dir(sources: list[Path], root: Path) -> Path:
    import torch

    digest = hashlib.sha256()
    for path in sources + sorted((root / "cpu").glob("*.h")) + [root / "adam.h"]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(" ".join(JIT_CFLAGS).encode())
    digest.update(torch.__version__.encode())
    digest.update(sys.version.encode())
    base = os.environ.get("ZERO_TRITON_EXT_DIR")
    if base:
        base_dir = Path(base).expanduser()
    else:
        try:  # torch's own cache (honours TORCH_EXTENSIONS_DIR)
            from torch.utils.cpp_extension import _get_build_directory

            base_dir = Path(_get_build_directory(_JIT_NAME, verbose=False)).parent
        except (ImportError, TypeError):
            base_dir = Path.home() / ".cache" / "torch_extensions"
    return base_dir / f"{_JIT_NAME}_{digest.hexdigest()[:16]}"


def _import_so(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(_JIT_NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile_without_ninja(sources: list[Path], build_dir: Path) -> Path:
    """One compiler call per source, then a link; used when ninja is missing."""
    import torch
    from torch.utils import cpp_extension as ce

    cxx = os.environ.get("CXX", "c++")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in ce.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    flags = ["-fPIC", "-std=c++20", f"-DTORCH_EXTENSION_NAME={_JIT_NAME}",
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *JIT_CFLAGS]
    objects = []
    for src in sources:
        obj = build_dir / (src.stem + ".o")
        subprocess.run([cxx, *flags, *includes, "-c", str(src), "-o", str(obj)],
                       check=True, capture_output=True, text=True)
        objects.append(str(obj))
    libdirs = [f"-L{p}" for p in ce.library_paths()]
    tmp = build_dir / f"{_JIT_NAME}.so.{os.getpid()}"
    subprocess.run([cxx, "-shared", *_OPENMP, *objects, *libdirs, "-lc10", "-ltorch", "-ltorch_cpu",
                    "-ltorch_python", "-o", str(tmp)], check=True, capture_output=True,
                   text=True)
    final = build_dir / f"{_JIT_NAME}.so"
    os.replace(tmp, final)  # atomic: a concurrent rank never sees half a file
    return final


def _compile_jit() -> ModuleType:
    root = source_dir()
    if root is None:
        raise RuntimeError("the C++ sources (csrc/adam.cpp) are neither in the installed "
                           "package nor next to it; reinstall zero_triton")
    sources = _cpu_sources(root)
    build_dir = _cache_dir(sources, root)
    build_dir.mkdir(parents=True, exist_ok=True)
    so = build_dir / f"{_JIT_NAME}.so"
    if not so.exists():
        print(f"zero_triton: compiling the CPU extension (once, ~20 s; cached in {build_dir})",
              file=sys.stderr, flush=True)
    from torch.utils import cpp_extension as ce

    if ce.is_ninja_available():
        # torch's loader locks the folder, so concurrent ranks compile once.
        return ce.load(name=_JIT_NAME, sources=[str(s) for s in sources],
                       extra_cflags=JIT_CFLAGS, extra_ldflags=_OPENMP,
                       build_directory=str(build_dir),
                       verbose=False)
    if not so.exists():
        so = _compile_without_ninja(sources, build_dir)
    return _import_so(so)


@functools.lru_cache(maxsize=None)
def _load() -> tuple[ModuleType | None, str | None]:
    if os.environ.get("ZERO_TRITON_NO_EXT", "") not in ("", "0"):
        return None, "disabled by ZERO_TRITON_NO_EXT"
    try:
        from zero_triton import _C  # built ahead of time by setup.py

        return _C, None
    except ImportError:
        pass
    try:
        return _compile_jit(), None
    except subprocess.CalledProcessError as exc:
        tail = (exc.stderr or "").strip().splitlines()[-5:]
        return None, f"compiling the CPU extension failed: {' | '.join(tail)}"
    except Exception as exc:  # no compiler, no headers, read-only cache, ...
        text = " ".join(str(exc).split())
        if len(text) > 600:
            text = text[:300] + " ... " + text[-300:]
        return None, f"the CPU extension could not be built ({type(exc).__name__}: {text})"


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
