"""The optimizer state of one rank's shard of one flat buffer.

A rank's shard of a flat buffer is its shard of every bucket, one after another
(``FlatLayout.shard_segments``: (buffer lo, hi, state offset) per bucket). Its state
lives here, contiguous, on the shard's device:

- ``master``: how the parameters are stepped, a part of its own
  (``zero_triton.state.master``): float32 parameters are their own master, fp16/bf16
  ones keep an fp32 master (or, bf16, its low half beside them: ``"remainder"``, or
  none: ``"none"``, rounded stochastically);
- ``moments``: the Adam moments in a ``MomentStore`` of the format the optimizer was
  built with (``zero_triton.state.moments``; its kernels compute in float32, float64
  for float64 parameters);
- the step count: one device tensor ``step`` while every parameter has the same history,
  one per parameter (``steps``) once some missed a step (no gradient, as torch.optim.Adam
  skips them), with a host label per parameter (``history``) equal for equal counts.

``Shard`` (zero_triton.optim.shard) owns one and hands its slices to the kernel;
``zero_triton.optim.state_dict`` and ``zero_triton.checkpoint`` read and write it through
``buffers()`` (torch's format) and ``commit``, never by a moment's name nor the
master's storage.
"""
from __future__ import annotations

import torch

from .master import SAME
from .master import make as make_master
from .moments import make as make_moments

MASTER = "master_param"  # torch-format key of an fp32 master (fp16/bf16 parameters)


class ShardState:
    """``param_parts``: this rank's shard of the flat parameter buffer, one view per
    segment; ``layout``: the buffer's FlatLayout; ``segments``: this rank's."""

    def __init__(self, param_parts, segments, layout, *, master: str = "own", amsgrad: bool,
                 moments: str = "fp32", numel: int | None = None, rows: dict | None = None,
                 mirror=SAME):
        self.param_parts, self.segments, self.layout = param_parts, segments, layout
        self.device = param_parts[0].device
        n = layout.shard_numel if numel is None else numel  # a part of the shard: its own size
        # ``mirror``: who keeps param_parts equal to the model's parameters where they are
        # copies of them (``state.master``).
        self.master = make_master(master, param_parts, segments, n, self.device, mirror)
        # float64 parameters keep float64 state (torch steps them in float64); every
        # other dtype float32.
        self.dtype = torch.float64 if param_parts[0].dtype == torch.float64 else torch.float32
        # ``rows``: each piece's RowMap by its state offset, for local shards stepped
        # through their rows (int8 blocks other ranks share: ``state.int8_rows``).
        self.moments = make_moments(moments, n, self.dtype, self.device, amsgrad, rows=rows)
        f32 = dict(dtype=torch.float32, device=self.device)  # step counts
        self.step = torch.zeros(1, **f32)
        self.steps = None    # per-parameter counts (float32, on the device) once they differ
        self.history = None  # host labels, equal for parameters with the same history
        self.skipped = torch.zeros(1, **f32)
        self.one = torch.ones(1, **f32)  # step += one: a Python 1.0 would be wrapped in a new tensor

    # -- the buffers ----------------------------------------------------------------
    @property
    def has_master(self) -> bool:
        """Whether an fp32 master is kept beside the parameters (torch's ``master_param``)."""
        return self.master.exact

    def live_buffers(self) -> dict:
        """The part of ``buffers()`` that is the storage itself: what ``opt.state`` shows
        views of, as torch.optim.Adam's state (a store whose export is a copy shows
        none: int8 codes, a master joined from its remainder)."""
        bufs = self.moments.export() if self.moments.live else {}
        if self.has_master and self.master.live:
            bufs[MASTER] = self.master.export()
        return bufs

    @property
    def amsgrad(self) -> bool:
        """Whether the running maximum of the second moment is stored."""
        return self.moments.amsgrad

    def ensure_amsgrad(self) -> bool:
        """Store the running maximum (amsgrad switched on after construction); True if new."""
        return self.moments.ensure_amsgrad()

    def reset(self, amsgrad: bool | None = None) -> None:
        """The moments zero (``amsgrad``: see ``MomentStore.reset``); the step counts and
        the master are the caller's."""
        self.moments.reset(amsgrad)

    def buffers(self) -> dict:
        """This shard of each state buffer in torch.optim.Adam's format, keyed as torch
        keys its per-parameter state (``master_param`` only for fp16/bf16 parameters):
        the moments' ``export()``; what is written into them is taken back by
        ``commit``."""
        bufs = self.moments.export()
        if self.has_master:
            bufs[MASTER] = self.master.export()
        return bufs

    def commit(self, bufs: dict) -> None:
        """Take back what was written into ``buffers()``'s tensors."""
        self.moments.commit({k: v for k, v in bufs.items() if k != MASTER})
        if MASTER in bufs:
            self.master.commit(bufs[MASTER])

    def views(self, bufs: dict | None = None) -> dict:
        """Per-parameter views of each buffer (world size 1: the shard is the whole
        buffer), of ``bufs`` if given (one ``buffers()``, to ``commit`` once written)."""
        return {k: self.layout.views(b) for k, b in (self.buffers() if bufs is None else bufs).items()}

    def checkpointed(self) -> dict:
        """What a sharded checkpoint saves, float32 in state order (a master that is not
        one tensor over the shard is a copy)."""
        return {"master": self.master.checkpointed(), **self.moments.export()}

    def compact_checkpointed(self) -> dict | None:
        """``checkpointed()`` with the moments as their store keeps them (int8 codes and
        scales, the storage itself), or None for a store without a compact form."""
        stored = getattr(self.moments, "stored", None)
        return None if stored is None else {"master": self.master.checkpointed(), **stored()}

    def restore(self, bufs: dict) -> None:
        """Take back what was written into ``checkpointed()``'s tensors: the moments, the
        master and the parameters from it."""
        self.moments.commit({k: v for k, v in bufs.items() if k != "master"})
        self.master.commit(bufs["master"])
        self.master.publish()

    def nbytes(self) -> dict:
        return {"master": self.master.nbytes(), "moments": self.moments.nbytes()}

    def carry_over(self, old: "ShardState") -> None:
        """Take ``old``'s state (the same parameters, re-homed to another device or
        dtype). Same precision (a device move): the old master is exact; after a cast the
        master is the parameters as they are now, as for an optimizer built after it."""
        self.moments.carry_over(old.moments)
        self.step.copy_(old.step)
        if old.steps is not None:
            self.steps = old.steps.to(self.device)
            self.history = list(old.history)
        self.master.carry_over(old.master)

    # -- the step count -------------------------------------------------------------
    def param_steps(self) -> list:
        """Each parameter's own step count (host floats, one read of the device)."""
        if self.steps is not None:
            return self.steps.tolist()
        return [float(self.step[0])] * len(self.layout.offsets)

    def set_param_steps(self, steps) -> None:
        """Per-parameter step counts (host floats): one ``step`` while they agree."""
        if all(t == steps[0] for t in steps):
            self.step.fill_(steps[0])
            self.steps, self.history = None, None
            return
        self.steps = torch.tensor(steps, dtype=torch.float32, device=self.device)
        labels = {}
        self.history = [labels.setdefault(t, len(labels)) for t in steps]

    def step_of(self, i) -> torch.Tensor:
        """The step count the kernel reads for a run starting at parameter ``i``."""
        return self.step if i is None or self.steps is None else self.steps[i:i + 1]

    def count(self, stepped, found_inf):
        """Count this step (a step GradScaler skips does not count, as in torch's fused
        Adam) for the parameters ``stepped`` (host list of bools; None: all of them).
        Returns None when one kernel run per segment does, else, per segment, the
        (start, end, first parameter) buffer ranges whose parameters are stepped and
        share one step count (padding between them included)."""
        if found_inf is not None:
            self.skipped.copy_(found_inf).clamp_(max=1.0)
        if stepped is None and self.steps is None:  # the common case
            self.step.add_(self.one)
            if found_inf is not None:
                self.step.sub_(self.skipped)
            return None
        n = len(self.layout.offsets)
        stepped = stepped if stepped is not None else [True] * n
        if self.steps is None:
            self.steps = self.step.expand(n).clone()
            self.history = [0] * n
        counted = [i for i in range(n) if stepped[i]]
        if counted:
            inc = (self.one - self.skipped) if found_inf is not None else self.one
            idx = torch.tensor(counted, dtype=torch.long, device=self.device)
            self.steps.index_add_(0, idx, inc.expand(len(counted)))
        labels = {}
        self.history = [labels.setdefault((h, s), len(labels)) for h, s in zip(self.history, stepped)]
        if len(labels) == 1:  # one history for all (e.g. none had a gradient): one step again
            self.step.copy_(self.steps[0:1])
            self.steps, self.history = None, None
        return self.runs(stepped)

    def count_one(self, i: int) -> torch.Tensor:
        """Count a step of parameter ``i`` alone (gradient release: each parameter stepped
        as backward makes its gradient) and return its count, the step's operand. Counted
        on the device as ``count`` counts; ``settle`` labels the histories after."""
        if self.steps is None:
            n = len(self.layout.offsets)
            self.steps = self.step.expand(n).clone()
            self.history = [0] * n
        step = self.steps[i:i + 1]
        step.add_(self.one)
        return step

    def settle(self, stepped: list) -> None:
        """After ``count_one`` of the parameters ``stepped`` (host list of bools): their
        histories labelled as ``count`` labels them, one count for all again where every
        parameter has stepped alike."""
        if self.steps is None:
            return
        labels = {}
        self.history = [labels.setdefault((h, s), len(labels)) for h, s in zip(self.history, stepped)]
        if len(labels) == 1:
            self.step.copy_(self.steps[0:1])
            self.steps, self.history = None, None

    def follow(self, lead: "ShardState", stepped, runs) -> list | None:
        """Take the step counts ``lead`` (the state of the same parameters' other
        elements) just counted, which returned ``runs``, and return this state's runs
        for the same ``stepped``: two parts of one shard count as one."""
        self.step.copy_(lead.step)
        if lead.steps is None:
            self.steps, self.history = None, None
        else:
            self.steps, self.history = lead.steps.to(self.device), list(lead.history)
        if runs is None:
            return None
        return self.runs(stepped if stepped is not None else [True] * len(self.layout.offsets))

    def runs(self, stepped: list) -> list:
        """Per segment, the (start, end, first parameter) buffer ranges whose parameters
        are ``stepped`` (host list of bools) and share one step count (padding between
        them included)."""
        layout, history = self.layout, self.history
        out = []
        for lo, hi, _ in self.segments:
            runs, last = [], None
            for i, a, b in layout.ranges_in(lo, hi):
                if not stepped[i]:
                    last = None
                    continue
                start, end = layout.offsets[i] + a, layout.offsets[i] + b
                if last == i - 1 and (history is None or history[i] == history[last]):
                    runs[-1][1] = end
                else:
                    runs.append([start, end, i])
                last = i
            out.append(runs)
        return out
