"""Where a shard's optimizer state lives: the shard's ``place`` (``zero_triton.optim.shard``).

- ``DevicePlace`` (the default): beside the parameters. The kernel reads the averaged
  gradients and writes the parameters where they are.
- ``HostPlace`` (``offload="cpu"``): in host memory, pinned when the parameters are on a
  GPU. The state is a ``ShardState`` over *host mirrors* of this rank's parameter shard
  (``parts``), so every master and moment format is stepped by the host's kernel as it
  is stepped on the device, and every way out of the state (state dicts, DCP,
  checkpoints, the served state) reads host memory. Per segment (a bucket's shard), in
  the order the optimizer steps them: its averaged gradients are copied into a host
  staging buffer (``fetch``, every segment's copy queued before the first waits, in
  order on the device's stream), the host kernel steps the segment once its copy has
  landed (``grad``), and its parameters go back to the device (``done``) before the
  optimizer starts the segment's all-gather. ``MirroredMaster`` keeps the mirrors and
  the device's parameters equal wherever the master reads or writes parameters (a
  load, the user's writes, a re-seed).

Parameters, gradients and communication stay on the device. On CPU parameters the same
pipeline runs with host-to-host copies: it saves nothing there (that is how it is
tested on machines without a GPU).
"""
from __future__ import annotations

import torch

from zero_triton.native import backends

PLACEMENTS = ("cpu",)  # offload=: where the optimizer state may be put


def host_backend(name: str) -> str:
    """The backend that steps offloaded state: the requested one if it runs on the host,
    else the host's best (``backends.resolve("auto", cpu)``: the C++ kernel, else torch)."""
    cpu = torch.device("cpu")
    if name != "auto" and backends.why_not(name, cpu) is None:
        return name
    return backends.resolve("auto", cpu)


def _host_empty(numel: int, dtype: torch.dtype, pin: bool, what: str) -> torch.Tensor:
    """A host buffer (pinned for ``pin``), or the error that names the bytes and the fix."""
    try:
        return torch.empty(numel, dtype=dtype, pin_memory=pin)
    except RuntimeError as exc:
        nbytes = numel * dtype.itemsize
        raise RuntimeError(
            f"offload='cpu' could not allocate {nbytes} bytes ({nbytes / 2**30:.2f} GiB) of "
            f"{'pinned ' if pin else ''}host memory for {what} ({exc}). Free host memory, shard "
            "the state over more ranks (ZeroAdam), store the moments in fewer bytes "
            "(moments='int8' or 'bf16'), or leave offload out") from exc


class DevicePlace:
    """The state beside the parameters: nothing moves."""

    offloaded = False

    def __init__(self, home):
        self.home = home

    def parts(self, param_parts: list) -> list:
        """The parameter views the state is built over: the device's own."""
        return param_parts

    def fetch(self, ks) -> None:
        pass

    def grad(self, k: int) -> torch.Tensor:
        return self.home.grad(k)

    def done(self, ks) -> None:
        pass

    def host_bytes(self) -> int:
        return 0


class HostPlace:
    """The state in host memory, over mirrors of ``home``'s parameter shard (one buffer
    in state order); the averaged gradients staged through a host buffer of the shard's
    size in their dtype."""

    offloaded = True

    def __init__(self, home, grad_dtype: torch.dtype):
        self.home = home
        layout, segments = home.layout, home.segments
        self.cuda = home.device.type == "cuda"
        n = layout.shard_numel
        self.mirror = _host_empty(n, home.dtype, self.cuda, "the parameters' mirror")
        self.staging = {grad_dtype: _host_empty(n, grad_dtype, self.cuda, "the gradients' staging")}
        self.spans = [(s0, s0 + hi - lo) for lo, hi, s0 in segments]
        self.host_parts = [self.mirror[a:b] for a, b in self.spans]
        self.pull()
        self.fetched = {}  # segment -> (its staged gradients, the event its copy records)

    def parts(self, param_parts: list) -> list:
        return self.host_parts

    # -- the step: gradients in, parameters out ---------------------------------------
    def fetch(self, ks) -> None:
        """Queue the copy of each segment's averaged gradients to the host, in order."""
        for k in ks:
            g = self.home.grad(k)
            buf = self.staging.get(g.dtype)
            if buf is None:  # averages in another dtype than the one staged so far
                buf = self.staging[g.dtype] = _host_empty(self.mirror.numel(), g.dtype, self.cuda,
                                                          "the gradients' staging")
            a, b = self.spans[k]
            out = buf[a:b]
            out.copy_(g, non_blocking=self.cuda)
            event = None
            if self.cuda:
                event = torch.cuda.Event()
                event.record()
            self.fetched[k] = (out, event)

    def grad(self, k: int) -> torch.Tensor:
        """Segment ``k``'s gradients on the host, once their copy has landed."""
        out, event = self.fetched.pop(k)
        if event is not None:
            event.synchronize()
        return out

    def done(self, ks) -> None:
        """Segments ``ks`` were stepped: their parameters back to the device (queued on
        the device's stream, ahead of the all-gathers the optimizer starts next)."""
        for k in ks:
            self.home.param_parts[k].copy_(self.host_parts[k], non_blocking=self.cuda)

    # -- the mirrors follow the device's parameters ------------------------------------
    def pull(self) -> None:
        """The mirrors from the device's parameters (the user wrote them, a re-seed)."""
        for part, host in zip(self.home.param_parts, self.host_parts):
            if part.device.type != "meta":
                host.copy_(part)

    def push(self) -> None:
        """The device's parameters from the mirrors (the master wrote them: a load)."""
        for part, host in zip(self.home.param_parts, self.host_parts):
            part.copy_(host)

    def write(self, a: int, b: int, values: torch.Tensor) -> torch.Tensor:
        """State elements [a, b) of the mirror (it is in state order) set to ``values``;
        returns that host range."""
        out = self.mirror[a:b]
        out.copy_(values)
        return out

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.mirror, *self.staging.values()))


class MirroredMaster:
    """A master (``zero_triton.state.master``) over a ``HostPlace``'s mirrors: it is
    that master, and after it writes the parameters (``commit``, ``publish``) the device
    gets them; before it reads them (``seed``, ``reseed``) the mirrors get the device's."""

    def __init__(self, inner, place: HostPlace):
        self.inner, self.place = inner, place

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def commit(self, master: torch.Tensor) -> None:
        self.inner.commit(master)
        self.place.push()

    def publish(self) -> None:
        self.inner.publish()
        self.place.push()

    def seed(self) -> None:
        self.place.pull()
        self.inner.seed()

    def reseed(self, a: int, b: int, part: torch.Tensor) -> None:
        self.inner.reseed(a, b, self.place.write(a, b, part))

    def carry_over(self, old) -> None:
        self.inner.carry_over(getattr(old, "inner", old))


HELD = ("params", "grads", "master", "moments", "padding", "scratch", "buckets", "comm")


def split_host(report: dict, flats) -> dict:
    """``memory_report()``'s bytes with ``device`` beside ``host`` (the flats' offloaded
    state and scratch, the parameters' mirrors and the gradients' staging): what of
    the ``HELD`` kinds is not on the host is on the device."""
    mirrors = sum(flat.place.host_bytes() for flat in flats)
    return {**report, "device": sum(report[k] for k in HELD) - (report["host"] - mirrors)}
