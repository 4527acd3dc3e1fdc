"""Memory of this process around each phase of a training iteration.

On a GPU, the CUDA caching allocator's counters: bytes allocated now, and the peak
since the phase began (``reset_peak_memory_stats`` at its start). On CPU, the
resident set size from ``/proc/self/status``: ``VmRSS`` now and ``VmHWM``, the high
water mark, which writing 5 to ``/proc/self/clear_refs`` resets to the current RSS at
the start of each phase (Linux). The RSS counts the whole process (Python, torch,
freed memory the allocator kept), so its changes, not its level, are what the model
states explain.
"""
from __future__ import annotations

import contextlib

import torch

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _status_kb(key: str):
    try:
        with open(_STATUS) as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


class MemoryProbe:
    """``with probe.phase("forward"): ...`` records {"current", "peak"} bytes of that
    phase in ``probe.phases``; ``probe.how`` says what was measured."""

    def __init__(self, device: torch.device):
        self.device = device
        self.phases = {}
        if device.type == "cuda":
            self.how = "CUDA caching allocator: memory_allocated (current), max_memory_allocated (peak)"
            self.peak_resets = True
        else:
            self.peak_resets = self._reset_rss_peak()
            self.how = ("resident set size: VmRSS (current), VmHWM (peak) from /proc/self/status"
                        + ("" if self.peak_resets else
                           "; the peak could not be reset per phase (/proc/self/clear_refs), "
                           "so it is the process's peak so far"))

    def _reset_rss_peak(self) -> bool:
        try:
            with open(_CLEAR_REFS, "w") as fh:
                fh.write("5")
            return True
        except OSError:
            return False

    def snapshot(self) -> dict:
        if self.device.type == "cuda":
            return {"current": torch.cuda.memory_allocated(self.device),
                    "peak": torch.cuda.max_memory_allocated(self.device)}
        rss, hwm = _status_kb("VmRSS"), _status_kb("VmHWM")
        return {"current": None if rss is None else rss * 1024,
                "peak": None if hwm is None else hwm * 1024}

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.peak_resets:
            self._reset_rss_peak()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.phases[name] = self.snapshot()
