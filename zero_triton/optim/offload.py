"""Where a shard's optimizer state lives: the shard's ``place`` (``zero_triton.optim.shard``).

- ``DevicePlace`` (the default): beside the parameters. The kernel reads the averaged
  gradients and writes the parameters where they are.
- ``HostPlace`` (``offload="cpu"``): in host memory, pinned when the parameters are on a
  GPU. The state is a ``ShardState`` over *host mirrors* of this rank's parameter shard
  (``parts``), so every master and moment format is stepped by the host's kernel as it
  is stepped on the device, and every way out of the state (state dicts, DCP,
  checkpoints, the served state) reads host memory. Per segment (a bucket's shard):
  its averaged gradients are copied into a host staging buffer as the bucket's average
  lands during backward (``averaged``: on the side stream behind the average on GPUs,
  at the reducer's wait on CPUs), or at the step for buckets backward did not average
  and averages written since (``fetch``); in the order the optimizer steps them, the
  host kernel steps the segment once its copy has landed (``grad``), and its parameters
  go back to the device (``done``) before the optimizer starts the segment's all-gather.
  The place is the master's ``mirror`` (``zero_triton.state.master``): it keeps the
  mirrors and the device's parameters equal wherever the master reads or writes
  parameters (a load, the user's writes, a re-seed).

Parameters, gradients and communication stay on the device. On CPU parameters the same
pipeline runs with host-to-host copies: it saves nothing there (that is how it is
tested on machines without a GPU).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from zero_triton.native import backends
from zero_triton.state.master import Same

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


class Piece(NamedTuple):
    """A run of one of the home's segments that one part of the state holds: segment
    ``k``'s elements [off, off + hi - lo), flat buffer [lo, hi), at ``s0`` in its part."""
    k: int
    off: int
    lo: int
    hi: int
    s0: int


def whole(segments) -> list:
    """The home's ``segments`` (lo, hi, state offset) as the pieces of one part."""
    return [Piece(k, 0, lo, hi, s0) for k, (lo, hi, s0) in enumerate(segments)]


def split(segments, cut: int) -> tuple:
    """The home's ``segments`` cut at state element ``cut``: the pieces before it and
    after it (empty ones left out), each at its offset from its own part's start."""
    first, second = [], []
    for k, (lo, hi, s0) in enumerate(segments):
        x = min(max(cut - s0, 0), hi - lo)  # elements of segment k before the cut
        if x > 0:
            first.append(Piece(k, 0, lo, lo + x, s0))
        if x < hi - lo:
            second.append(Piece(k, x, lo + x, hi, s0 + x - cut))
    return first, second


class Pieces:
    """What both places (``optim.protocol.Place``) share: the pieces each holds and, per
    home segment, which; each piece's views of the home's parameters and gradients."""

    def __init__(self, home, held):
        self.home, self.pieces = home, held
        # Whether the pieces are the home's segments themselves (there is no split).
        self.whole = len(held) == len(home.segments) and all(
            p.off == 0 and p.hi - p.lo == home.segments[p.k][1] - home.segments[p.k][0]
            for p in held)
        self.of_segment = {}
        for j, p in enumerate(held):
            self.of_segment.setdefault(p.k, []).append(j)

    def device_part(self, j: int) -> torch.Tensor:
        """Piece ``j``'s parameters on the device (the home's view of them)."""
        p = self.pieces[j]
        part = self.home.param_parts[p.k]
        return part if self.whole else part[p.off:p.off + p.hi - p.lo]

    def home_grad(self, j: int) -> torch.Tensor:
        """Piece ``j``'s averaged gradients where the home keeps them."""
        p = self.pieces[j]
        grad = self.home.grad(p.k)
        return grad if self.whole else grad[p.off:p.off + p.hi - p.lo]


class DevicePlace(Pieces, Same):
    """The state beside the parameters: nothing moves (as the master's mirror, ``Same``:
    its views are the parameters)."""

    offloaded = False

    def __init__(self, home, held):
        super().__init__(home, held)
        self.device_parts = home.param_parts if self.whole else \
            [self.device_part(j) for j in range(len(held))]

    def parts(self) -> list:
        """The parameter views the state is built over: the device's own (a list the
        home, or ``refresh``, updates in place)."""
        return self.device_parts

    def refresh(self) -> None:
        """The engine swapped parameters: the views of a part of them follow."""
        if not self.whole:
            self.device_parts[:] = [self.device_part(j) for j in range(len(self.pieces))]

    def fetch(self, js) -> None:
        pass

    def forget(self) -> None:
        pass

    def grad(self, j: int) -> torch.Tensor:
        return self.home_grad(j)

    def done(self, js) -> None:
        pass

    def host_bytes(self) -> int:
        return 0


class HostPlace(Pieces):
    """The state in host memory, over mirrors of the ``held`` pieces of ``home``'s
    parameter shard (one buffer of the part's ``n`` state elements, in state order); the
    averaged gradients staged through a host buffer of the mirror's size in their dtype."""

    offloaded = True

    def __init__(self, home, grad_dtype: torch.dtype, held, n: int):
        super().__init__(home, held)
        self.cuda = home.device.type == "cuda"
        self.mirror = _host_empty(n, home.dtype, self.cuda, "the parameters' mirror")
        self.staging = {grad_dtype: _host_empty(n, grad_dtype, self.cuda, "the gradients' staging")}
        self.spans = [(p.s0, p.s0 + p.hi - p.lo) for p in held]
        self.host_parts = [self.mirror[a:b] for a, b in self.spans]
        self.pull()
        # piece -> (its staged gradients, the event its copy records, the averaged
        # tensor's (address, version) copied; None: stale)
        self.fetched = {}
        self.copies = 0  # gradient copies to the host so far
        home.watch_averages(self.averaged)

    def parts(self) -> list:
        return self.host_parts

    def refresh(self) -> None:  # the device's views are looked up at each copy
        pass

    # -- the step: gradients in, parameters out ---------------------------------------
    def averaged(self, k: int, landed: bool) -> None:
        """The home's bucket ``k`` was averaged (``landed``: its average is in, during
        backward; else one has started, and what was copied of the last is stale):
        copy segment ``k``'s pieces to the host now (``FlatHome.watch_averages``)."""
        js = self.of_segment.get(k, ())
        if landed:
            self.fetch(js)
        else:
            self._stale(js)

    def forget(self) -> None:
        """The averages were written where the copies cannot see it (GradScaler's
        unscale of ZeRO-2's shards, ``zero_grad``): every copy taken is stale."""
        self._stale(list(self.fetched))

    def _stale(self, js) -> None:
        for j in js:
            taken = self.fetched.get(j)
            if taken is not None:
                self.fetched[j] = (taken[0], taken[1], None)

    def fetch(self, js) -> None:
        """Queue the copy of each piece's averaged gradients to the host, in order,
        unless the copy taken as its average landed still holds them (the same tensor,
        not written since: its version)."""
        for j in js:
            g = self.home_grad(j)
            mark = (g.data_ptr(), g._version)
            taken = self.fetched.get(j)
            if taken is not None:
                if taken[2] == mark:
                    continue
                if taken[1] is not None:  # a stale copy into the same buffer goes first
                    torch.cuda.current_stream(g.device).wait_event(taken[1])
            buf = self.staging.get(g.dtype)
            if buf is None:  # averages in another dtype than the one staged so far
                buf = self.staging[g.dtype] = _host_empty(self.mirror.numel(), g.dtype, self.cuda,
                                                          "the gradients' staging")
            a, b = self.spans[j]
            out = buf[a:b]
            out.copy_(g, non_blocking=self.cuda)
            event = None
            if self.cuda:
                event = torch.cuda.Event()
                event.record()
            self.fetched[j] = (out, event, mark)
            self.copies += 1

    def grad(self, j: int) -> torch.Tensor:
        """Piece ``j``'s gradients on the host, once their copy has landed."""
        out, event, _ = self.fetched.pop(j)
        if event is not None:
            event.synchronize()
        return out

    def done(self, js) -> None:
        """Pieces ``js`` were stepped: their parameters back to the device (queued on
        the device's stream, ahead of the all-gathers the optimizer starts next)."""
        for j in js:
            self.device_part(j).copy_(self.host_parts[j], non_blocking=self.cuda)

    # -- the mirrors follow the device's parameters ------------------------------------
    def pull(self) -> None:
        """The mirrors from the device's parameters (the user wrote them, a re-seed)."""
        for j, host in enumerate(self.host_parts):
            part = self.device_part(j)
            if part.device.type != "meta":
                host.copy_(part)

    def push(self) -> None:
        """The device's parameters from the mirrors (the master wrote them: a load)."""
        for j, host in enumerate(self.host_parts):
            self.device_part(j).copy_(host)

    def write(self, a: int, b: int, values: torch.Tensor) -> torch.Tensor:
        """State elements [a, b) of the mirror (it is in state order) set to ``values``;
        returns that host range."""
        out = self.mirror[a:b]
        out.copy_(values)
        return out

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.mirror, *self.staging.values()))


HELD = ("params", "grads", "master", "moments", "padding", "scratch", "buckets", "comm")


def cut_at(layout, fraction: float) -> int:
    """Where a shard of ``layout`` splits for ``offload_fraction``: the state element
    nearest (1 - fraction) of the shard on the moments' alignment (an int8 block is never
    cut). A shard that is a whole buffer (one process; an engine's local shards) splits
    between parameters, nearest the same point, so that each parameter's state lies on one
    side and ``opt.state`` shows views of it, as torch's optimizers do."""
    n = layout.shard_numel
    if fraction >= 1:
        return 0
    target = (1.0 - fraction) * n
    if layout.world_size == 1:
        return min((*layout.offsets, n), key=lambda o: (abs(o - target), o))
    return min(n, round(target / layout.align) * layout.align)


class Beside:
    """offload=None: the state beside the parameters, in one side."""

    keywords: dict = {}  # what a copy of the optimizer is built with again

    def places(self, home, grad_dtype: torch.dtype) -> list:
        """(place, elements, first element) of each side of ``home``'s shard."""
        return [(DevicePlace(home, whole(home.segments)), home.layout.shard_numel, 0)]


class Offloaded(Beside):
    """offload="cpu": ``fraction`` of each shard's state in host memory (``cut_at``),
    the rest beside the parameters."""

    def __init__(self, fraction: float = 1.0):
        self.fraction = fraction
        self.keywords = {"offload": "cpu", "offload_fraction": fraction}

    def places(self, home, grad_dtype: torch.dtype) -> list:
        n = home.layout.shard_numel
        cut = cut_at(home.layout, self.fraction)
        if cut == 0:
            return [(HostPlace(home, grad_dtype, whole(home.segments), n), n, 0)]
        if cut == n:  # too few elements to split: all of them beside the parameters
            return super().places(home, grad_dtype)
        first, second = split(home.segments, cut)
        return [(DevicePlace(home, first), cut, 0),
                (HostPlace(home, grad_dtype, second, n - cut), n - cut, cut)]


BESIDE = Beside()


def split_host(report: dict, flats) -> dict:
    """``memory_report()``'s bytes with ``device`` beside ``host`` (the flats' offloaded
    state and scratch, the parameters' mirrors and the gradients' staging): what of
    the ``HELD`` kinds is not on the host is on the device."""
    mirrors = sum(flat.place.host_bytes() for flat in flats)
    return {**report, "device": sum(report[k] for k in HELD) - (report["host"] - mirrors)}
