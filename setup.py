"""Build script for zero_triton.

Environment flags
-----------------
ZERO_TRITON_BUILD_EXT=1   build the native extension zero_triton._C ahead of time
                          (C++ CPU kernels; CUDA kernels too when torch has CUDA and
                          nvcc is found). Use with `pip install --no-build-isolation .`
                          so the build sees the installed torch.
(unset)                   pure-Python install; the CPU extension is compiled on first
                          use with torch.utils.cpp_extension and cached.
ZERO_TRITON_BUILD_CUDA=0  with ZERO_TRITON_BUILD_EXT=1: CPU kernels only, even where
                          CUDA is found.
TORCH_CUDA_ARCH_LIST      not used: the CUDA kernels are built for sm_80 and sm_90
                          (-gencode: CUDA_GENCODE in zero_triton/native/flags.py).
MAX_JOBS                  parallel compile jobs (torch's BuildExtension, with ninja).

Compiler flags of the extension: -O3 -fno-math-errno -fno-trapping-math (so gcc
vectorises sqrt, the divides and the fp16/bf16 conversions), -ffp-contract=off (every
ISA variant gives the same bits) and, on Linux, -fopenmp (at::parallel_for's threads). No -march: the CPU kernel is compiled for
baseline, AVX2 and AVX-512 (target pragmas) and picks one at run time.

A regular install copies csrc/ into the package as zero_triton/csrc (build_py), so a
first-use compile works from site-packages; an editable install uses the repository's
csrc/ directly.
"""
import os
import runpy
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
# The compiler flags, one list for both builds (the first-use build reads the same file):
# loaded by path, the package cannot be imported before it is built.
FLAGS = runpy.run_path(str(HERE / "zero_triton" / "native" / "flags.py"))
CXX_FLAGS, NVCC_FLAGS, OPENMP = FLAGS["CXX_FLAGS"], FLAGS["NVCC_FLAGS"], FLAGS["OPENMP"]


class BuildPyWithCsrc(build_py):
    """build_py that also ships csrc/ inside the package (zero_triton/csrc)."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # editable: zero_triton.native.ext finds the repository's csrc/ directly
        target = Path(self.build_lib) / "zero_triton" / "csrc"
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(HERE / "csrc", target,
                        ignore=shutil.ignore_patterns("*.o", "*.so", "__pycache__"))


def native_extensions():
    """(ext_modules, cmdclass additions) for ZERO_TRITON_BUILD_EXT=1, else nothing.

    torch is imported only here, so the default install stays pure-Python and fast.
    """
    if os.environ.get("ZERO_TRITON_BUILD_EXT", "0") in ("", "0"):
        print("zero_triton: skipping the native extension (set ZERO_TRITON_BUILD_EXT=1 to "
              "build it; otherwise the CPU kernels are compiled on first use)", file=sys.stderr)
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension as ce
    except ImportError as exc:
        raise SystemExit(f"ZERO_TRITON_BUILD_EXT=1 needs torch at build time ({exc}); "
                         "install torch, then `pip install --no-build-isolation .`") from exc

    sources = ["csrc/adam.cpp"] + sorted(str(p.relative_to(HERE)) for p in
                                         (HERE / "csrc" / "cpu").glob("*.cpp"))
    want_cuda = os.environ.get("ZERO_TRITON_BUILD_CUDA", "1") not in ("", "0")
    why_not = None
    if not want_cuda:
        why_not = "ZERO_TRITON_BUILD_CUDA=0"
    elif torch.version.cuda is None:
        why_not = f"torch {torch.__version__} is built without CUDA"
    elif ce.CUDA_HOME is None:
        why_not = "nvcc / CUDA_HOME not found"
    if why_not is None:
        sources += ["csrc/cuda/adam_kernel.cu", "csrc/cuda/adam_cuda.cpp"]
        ext = ce.CUDAExtension(
            "zero_triton._C", sources, define_macros=[("ZERO_TRITON_WITH_CUDA", "1")],
            extra_compile_args={"cxx": CXX_FLAGS, "nvcc": NVCC_FLAGS},
            extra_link_args=OPENMP)
        print(f"zero_triton: building zero_triton._C with CPU and CUDA kernels "
              f"(sm_80, sm_90; CUDA_HOME={ce.CUDA_HOME})", file=sys.stderr)
    else:
        ext = ce.CppExtension("zero_triton._C", sources, extra_compile_args={"cxx": CXX_FLAGS},
                              extra_link_args=OPENMP)
        print(f"zero_triton: building zero_triton._C with CPU kernels only; skipped the CUDA "
              f"kernels: {why_not}", file=sys.stderr)
    build_ext = ce.BuildExtension.with_options(use_ninja=ce.is_ninja_available())
    if not ce.is_ninja_available():
        print("zero_triton: ninja not found, compiling one file at a time", file=sys.stderr)
    return [ext], {"build_ext": build_ext}


EXT_MODULES, EXT_CMDCLASS = native_extensions()

PACKAGES = ["zero_triton", "zero_triton.native", "zero_triton.state", "zero_triton.comm", "zero_triton.optim",
            "zero_triton.integrations", "zero_triton.checkpoint", "zero_triton.memory",
            "zero_triton.tools", "zero_triton.tools.bench", "zero_triton.tools.profiling",
            "zero_triton.kernels"]
PACKAGE_DIR = {"zero_triton": "zero_triton"}

# triton is not required: torch's CUDA wheels bring the triton they were built with, and
# the CPU path never imports it. The "triton" extra adds it where torch does not (the
# tests run the Triton kernels on CPU tensors under its interpreter).
# The supported range, tested by .ci/torch-matrix (README, "Tested torch versions").
install_requires = ["torch>=2.7,<2.15", "numpy"]
DOCS = ["mkdocs>=1.6", "mkdocstrings[python]>=0.26"]
TRITON = "triton; platform_system == 'Linux'"

setup(
    name="zero_triton",
    version="0.1.0",
    description="Fused, ZeRO-sharded Adam/AdamW for PyTorch with Triton and native kernels",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    package_data={"zero_triton": ["csrc/*.cpp", "csrc/*.h", "csrc/cpu/*.cpp", "csrc/cpu/*.h", "csrc/cuda/*.cu", "csrc/cuda/*.cpp", "csrc/cuda/*.h"]},
    install_requires=install_requires,
    extras_require={"test": ["pytest", "pytest-xdist", "hypothesis", "accelerate", "transformers", "expecttest", "deepspeed",
                             "pyyaml", TRITON, *DOCS],
                    "bench": ["matplotlib"], "peers": ["deepspeed", "bitsandbytes", "torchao"],
                    "triton": [TRITON], "docs": DOCS},
    ext_modules=EXT_MODULES,
    cmdclass={"build_py": BuildPyWithCsrc, **EXT_CMDCLASS},
    entry_points={"console_scripts": ["zero-triton=zero_triton.tools.cli:main"]},
)
