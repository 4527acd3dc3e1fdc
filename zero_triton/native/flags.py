"""The extension's compiler flags, read by both builds: ahead of time (setup.py loads this
file by path) and on first use (``zero_triton.native.ext``). Plain Python, no imports
beyond ``sys``: setup.py reads it before the package can be imported.

-O3 and -fno-math-errno / -fno-trapping-math let gcc vectorise sqrt, the divides and the
branch-free fp16 conversions; -ffp-contract=off keeps the per-ISA variants (and every
machine) bit-identical. No -march: the ISA variants are chosen at run time. -fopenmp:
at::parallel_for is inlined from ATen/ParallelOpenMP.h, and without it the ``#pragma omp
parallel`` there is ignored and the step runs on one thread.
"""
import sys

OPENMP = ["-fopenmp"] if sys.platform.startswith("linux") else []
CXX_FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", *OPENMP]
# Ahead-of-time CUDA build: Ampere and Hopper.
CUDA_GENCODE = ["-gencode", "arch=compute_80,code=sm_80",
                "-gencode", "arch=compute_90,code=sm_90"]
NVCC_FLAGS = ["-O3", *CUDA_GENCODE]
