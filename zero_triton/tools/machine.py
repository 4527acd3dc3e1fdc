"""Facts about the machine a benchmark ran on: the commit, the CPU, the last-level cache."""
from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import torch


def cache_bytes(device) -> int:
    """Last-level cache: a working set below ~2x this would time the cache, not DRAM."""
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20))
    best = 0
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in root.glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
            value = int(text.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
            best = max(best, value)
        except (OSError, ValueError):
            continue
    return best or (32 << 20)


def git_commit():
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return commit, bool(dirty)
    except (OSError, subprocess.SubprocessError):
        return None, None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
