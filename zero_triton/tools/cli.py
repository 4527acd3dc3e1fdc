"""python -m zero_triton demo | memory | bench | profile | info | checkpoint"""
from __future__ import annotations

import os
import platform
import sys

from zero_triton.tools.console import run

USAGE = """usage: python -m zero_triton COMMAND [options]

commands:
  demo        train the seed's MLP with ZeroAdam on N ranks (default 4, gloo on CPU)
  memory      memory per rank of DDP and ZeRO-1/2/3 for mixed-precision Adam
  bench       time one optimizer step against torch and the memory limit
  profile     profile training steps of a GPT (ZeroAdamW vs DDP + AdamW): traces,
              forward/backward/communication split, bytes on the wire, memory per phase
  info        versions, devices, and which backends are usable here (and why not)
  checkpoint  inspect | consolidate a sharded checkpoint

`python -m zero_triton COMMAND --help` for each command's options."""


def info(argv=None) -> int:
    import argparse

    import torch
    argparse.ArgumentParser(
        prog="python -m zero_triton info",
        description="Versions, devices, and which backends are usable here (and why not)."
    ).parse_args(argv)

    from zero_triton import __version__
    from zero_triton.native import backends, compat
    print(f"zero_triton {__version__}")
    print(f"python      {platform.python_version()} ({platform.machine()})")
    lo, hi = (".".join(map(str, v)) for v in compat.TESTED_TORCH)
    tested = "tested" if compat.tested_torch() else "NOT tested: outside"
    print(f"torch       {torch.__version__} (CUDA {torch.version.cuda or 'none'}; "
          f"{tested} {lo} to {hi}, docs/install.md)")
    try:
        import triton
        print(f"triton      {triton.__version__}")
    except ImportError:
        print("triton      not installed")
    devices = ["cpu"] + [f"cuda:{i} {torch.cuda.get_device_name(i)}"
                         for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else ["cpu"]
    print(f"devices     {', '.join(devices)}")
    print(f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}")
    print()
    print(f"{'backend':8s} {'device':6s} usable")
    for name, device, reason in backends.availability():
        print(f"{name:8s} {device:6s} {'yes' if reason is None else 'no: ' + reason}")
    print()
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        try:
            print(f"backend='auto' on {device} -> {backends.resolve('auto', torch.device(device))}")
        except Exception as exc:
            print(f"backend='auto' on {device} -> error: {exc}")
    return 0


def main(argv=None) -> int:
    return run(_dispatch, argv)


def _dispatch(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from zero_triton.tools.demo import main as demo
        return demo(rest)
    if command == "memory":
        from zero_triton.tools.memory import main as memory
        return memory(rest)
    if command == "bench":
        from zero_triton.tools.bench import main as bench
        return bench(rest)
    if command == "profile":
        from zero_triton.tools.profiling import main as profile
        return profile(rest)
    if command == "info":
        return info(rest)
    if command == "checkpoint":
        from zero_triton.tools.checkpoint import main as checkpoint
        return checkpoint(rest)
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2
