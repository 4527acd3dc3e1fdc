"""Memory of this process around each phase of a training iteration.

On a GPU, the CUDA caching allocator's counters: bytes allocated now, and the peak
since the phase began (``reset_peak_memory_stats`` at its start). On CPU, the
resident set size from ``/proc/self/status``: ``VmRSS`` now and ``VmHWM``, the high
water mark, which writing 5 to ``/proc/self/clear_refs`` resets to the current RSS at
the start of each phase (Linux). The RSS counts the whole process (Python, torch,
freed memory the allocator kept), so its changes, not its level, are what the model
states explain.

On CPU with glibc, also ``"in_use"``/``"in_use_peak"``: the bytes malloc has handed out
and not had back (``mallinfo2``: heap blocks in use plus mmapped blocks), sampled every
millisecond during a phase by a thread, and ``"kept_free"``: freed heap memory glibc
still holds, at the sample where the RSS was highest. The RSS peak less ``in_use_peak``
is what the allocator keeps beyond what the process holds (fragments of the heap that
freed blocks leave, which glibc's growing mmap threshold moves blocks of up to 32 MiB
into), so a configuration that frees early can hold less and still show the same RSS.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import threading

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


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _glibc_mallinfo2():
    """glibc's ``mallinfo2`` (2.33+), or None elsewhere (musl, macOS, older glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _glibc_mallinfo2()
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
SAMPLE_S = 0.001


def _allocator():
    """(bytes malloc has handed out, free bytes it keeps in its heaps), or None."""
    if _MALLINFO2 is None:
        return None
    m = _MALLINFO2()
    return m.uordblks + m.hblkhd, m.fordblks


def _rss_bytes():
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class _Sampler:
    """A thread that samples the allocator and the RSS until stopped."""

    def __init__(self):
        self.in_use_peak = 0
        self.rss_peak = -1
        self.kept_free = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zero_triton memory probe", daemon=True)

    def _sample(self):
        used, free = _allocator()
        rss = _rss_bytes() or 0
        self.in_use_peak = max(self.in_use_peak, used)
        if rss > self.rss_peak:
            self.rss_peak, self.kept_free = rss, free

    def _run(self):
        while not self._stop.wait(SAMPLE_S):
            self._sample()

    def __enter__(self):
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()


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
                           "so it is the process's peak so far")
                        + ("; in use: glibc mallinfo2 (heap blocks in use + mmapped blocks), "
                           f"sampled every {SAMPLE_S * 1e3:.0f} ms" if _MALLINFO2 is not None else ""))

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
        alloc = _allocator()
        return {"current": None if rss is None else rss * 1024,
                "peak": None if hwm is None else hwm * 1024,
                "in_use": None if alloc is None else alloc[0]}

    @contextlib.contextmanager
    def phase(self, name: str):
        sampler = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            if self.peak_resets:
                self._reset_rss_peak()
            if _MALLINFO2 is not None:
                sampler = _Sampler().__enter__()
        try:
            yield
        finally:
            if sampler is not None:
                sampler.__exit__()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.phases[name] = self.snapshot()
        if sampler is not None:
            self.phases[name].update(in_use_peak=sampler.in_use_peak, kept_free=sampler.kept_free)
