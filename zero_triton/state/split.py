"""One shard's state kept in two parts (``offload_fraction``: the first part beside the
parameters, the second in host memory): state elements [0, cut) in ``first``, [cut, n)
in ``second``, each a ``ShardState`` of the same formats over its own segments.

``SplitState`` is what the rest of the package sees as the shard's state: every way out
(state dicts, DCP, checkpoints, the served state, ``opt.state``) reads and writes the
whole shard through ``buffers``/``commit``, ``checkpointed``/``restore`` and the master
and moments parts, which join the two parts on the second's device (a copy: the state is
not live, as int8's is not) and write a joined value back part by part. The step reaches
each part by itself (``Shard``'s sides), and ``cut`` falls on the formats' alignment, so
an int8 block never straddles it: split or not, each element is stepped by the same
arithmetic and its state is the same bits.

The step counts are the first part's (``opt.state``'s ``step`` views show them); the
second takes them at each step (``ShardState.follow``).
"""
from __future__ import annotations

import torch

from .flat import shaped
from .shards import ShardState


def _joined(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    return torch.cat([first.to(second.device), second])


def _carry_pairwise(new, old) -> None:
    """``new``'s parts take ``old``'s, part by part (a re-home: the same split)."""
    if type(old) is not type(new) or old.cut != new.cut:
        raise ValueError(f"a {type(new).__name__} carries over only from one split at the same "
                         f"element ({new.cut}), not from {type(old).__name__}")
    new.first.carry_over(old.first)
    new.second.carry_over(old.second)


class _Split:
    """What the two parts of one kind (master or moments) hold, as one."""

    def __init__(self, first, second, cut: int):
        self.first, self.second, self.cut = first, second, cut
        self.device = second.device

    def _parts(self):
        return (self.first, self.second)

    def _route(self, a: int, b: int):
        """The part holding state elements [a, b) and their range in it."""
        if a >= self.cut:
            return self.second, a - self.cut, b - self.cut
        if b > self.cut:
            raise ValueError(f"state elements [{a}, {b}) straddle the split at {self.cut}")
        return self.first, a, b

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self._parts())

    def carry_over(self, old) -> None:
        _carry_pairwise(self, old)

    def storage(self) -> list:
        return [t for p in self._parts() for t in p.storage()]


class SplitMaster(_Split):
    """A master (``zero_triton.state.master``) in two parts."""

    def __init__(self, first, second, cut: int):
        super().__init__(first, second, cut)
        # Both parts are of one format: its properties are the first's.
        self.format, self.exact, self.keyed = first.format, first.exact, first.keyed
        self.plain, self.stochastic, self.rebase = first.plain, first.stochastic, first.rebase
        # Live only where there is nothing to export (the parameters are the master).
        self.live = first.live and not first.exact
        self.numel = cut + second.numel

    def operands(self, a: int, b: int, param: torch.Tensor) -> tuple:
        part, a, b = self._route(a, b)
        return part.operands(a, b, param)

    def export(self):
        first = self.first.export()
        return None if first is None else _joined(first, self.second.export())

    def checkpointed(self) -> torch.Tensor:
        return _joined(self.first.checkpointed(), self.second.checkpointed())

    def commit(self, master: torch.Tensor) -> None:
        self.first.commit(master[:self.cut].to(self.first.device))
        self.second.commit(master[self.cut:].to(self.second.device))

    def publish(self) -> None:
        for part in self._parts():
            part.publish()

    def seed(self) -> None:
        for part in self._parts():
            part.seed()

    def reseed(self, a: int, b: int, part: torch.Tensor) -> None:
        c = self.cut
        if a < c:
            self.first.reseed(a, min(b, c), part[:min(b, c) - a])
        if b > c:
            self.second.reseed(max(a, c) - c, b - c, part[max(a, c) - a:])

class SplitMoments(_Split):
    """A moment store (``zero_triton.state.protocol.MomentStore``) in two parts."""

    live = False  # export() joins a copy

    def __init__(self, first, second, cut: int):
        super().__init__(first, second, cut)
        # Both parts are of one format: its properties are the first's.
        self.format, self.dtype, self.align, self.keyed = first.format, first.dtype, first.align, first.keyed
        self.numel = cut + second.numel

    @property
    def amsgrad(self) -> bool:
        return self.first.amsgrad

    def ensure_amsgrad(self) -> bool:
        return [p.ensure_amsgrad() for p in self._parts()][0]

    def operands(self, a: int, b: int, amsgrad: bool) -> tuple:
        part, a, b = self._route(a, b)
        return part.operands(a, b, amsgrad)

    def reset(self, amsgrad: bool | None = None) -> None:
        for part in self._parts():
            part.reset(amsgrad)

    def export(self) -> dict:
        first, second = self.first.export(), self.second.export()
        return {k: _joined(first[k], second[k]) for k in first}

    def commit(self, exported: dict) -> None:
        for part, span in ((self.first, slice(0, self.cut)), (self.second, slice(self.cut, None))):
            mine = part.export()
            for key, value in exported.items():
                if key in mine:
                    mine[key].copy_(value[span])
            part.commit(mine)

class _SideBuffers(dict):
    """{key: (the first side's buffer, the second's)}: what ``SplitState.live_buffers``
    hands ``views``."""


class SplitState(ShardState):
    """``first`` (state elements [0, cut)) and ``second`` (the rest) of the state of one
    rank's shard of ``layout`` over the home's ``segments``, as one ``ShardState``."""

    def __init__(self, first: ShardState, second: ShardState, cut: int, layout, segments):
        self.first, self.second, self.cut = first, second, cut
        self.layout, self.segments = layout, segments
        self.device, self.dtype = second.device, first.dtype
        self.master = SplitMaster(first.master, second.master, cut)
        self.moments = SplitMoments(first.moments, second.moments, cut)

    def live_buffers(self) -> dict:
        """Each side's storage, where both are live and every parameter's state lies on
        one side (a whole buffer cut between parameters): ``views`` of it are views of
        the live state, as ``opt.state`` shows torch's; else none."""
        first, second, c = self.first.live_buffers(), self.second.live_buffers(), self.cut
        if any(o < c < o + n for o, n in zip(self.layout.offsets, self.layout.numels())):
            return {}
        return _SideBuffers({k: (v, second[k]) for k, v in first.items() if k in second})

    def views(self, bufs: dict | None = None) -> dict:
        """Per-parameter views of each buffer (world size 1), of ``bufs`` if given: one
        ``buffers()`` (joined) or ``live_buffers()`` (each parameter's from its side)."""
        if not isinstance(bufs, _SideBuffers):
            return super().views(bufs)
        layout, c = self.layout, self.cut
        return {k: [shaped(first[o:o + n], s, st) if o < c else shaped(second[o - c:o - c + n], s, st)
                    for o, n, s, st in zip(layout.offsets, layout.numels(), layout.shapes,
                                           layout.strides)]
                for k, (first, second) in bufs.items()}

    # The step counts are the first part's (what ``param_steps`` and ``step_of`` read;
    # the step counts the parts one by one: ``ShardState.count``, ``follow``).
    step = property(lambda self: self.first.step)
    steps = property(lambda self: self.first.steps)
    history = property(lambda self: self.first.history)

    def set_param_steps(self, steps) -> None:
        for part in (self.first, self.second):
            part.set_param_steps(steps)

    def carry_over(self, old: "ShardState") -> None:
        _carry_pairwise(self, old)
