#!/usr/bin/env python
"""Time one optimizer step: zero_triton vs torch.optim.Adam vs a memory-kernel limit.

A thin script over ``zero_triton.tools.bench.main`` (the same as ``python -m zero_triton
bench``), kept in the package so that an installed zero_triton can run it. Examples::

    python bench/step.py --device cpu                 # CSV/JSON/PNG under bench/results
    python bench/step.py --device cuda --sizes 64M,256M,1B
    python bench/step.py --quick --device cpu         # smoke run, seconds
"""
import sys

from zero_triton.tools.bench import main
from zero_triton.tools.console import run

if __name__ == "__main__":
    sys.exit(run(main, sys.argv[1:]))
