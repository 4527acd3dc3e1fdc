"""The launch part of a shard (``zero_triton.optim.shard``): how the step's launches,
each an ``Operands`` with the canonical index of its first element, reach a kernel.

- ``DeviceLaunch``: one kernel launch per run, where the state lives (a flat buffer's
  shard, bucket by bucket as its average lands).
- ``ListLaunch``: every run in one launch where the backend has a list kernel (Triton's,
  for the many small local shards of DTensor parameters), else as ``DeviceLaunch``.

These are the package's only callers of a step function (``zero_triton.native.backends``);
a host launch (state in host memory) is the next implementation of the same two methods.
"""
from __future__ import annotations

from zero_triton.kernels.args import StepArgs
from zero_triton.native import backends


class DeviceLaunch:
    """One launch of ``backend``'s step for ``format`` moments per run."""

    def __init__(self, backend: str, format: str, plain: bool = True):
        self.backend = backend
        self.step = backends.step_function(backend, format)

    def run(self, launches: list, args: StepArgs) -> None:
        """Step each ``(ops, index)`` of ``launches``: ``ops`` its tensors, ``index`` the
        canonical index of its first element (keys stochastic rounding)."""
        for ops, index in launches:
            self.step(ops, args.at(index))


class ListLaunch(DeviceLaunch):
    """Every run in one launch where the backend has a list kernel for ``format`` and the
    parameters have a plain master (``plain``: an fp32 master or their own; a bf16
    parameter rounded stochastically or split with its remainder is stepped one launch
    each), and the runs' gradients share a dtype."""

    def __init__(self, backend: str, format: str, plain: bool = True):
        super().__init__(backend, format)
        self.step_list = backends.list_step_function(backend, format) if plain else None

    def run(self, launches: list, args: StepArgs) -> None:
        if self.step_list is None or len({ops.grad.dtype for ops, _ in launches}) > 1:
            return super().run(launches, args)
        if launches:
            self.step_list([ops for ops, _ in launches], args)
