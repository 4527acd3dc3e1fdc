"""The launch part of a shard (``zero_triton.optim.shard``): how the step's launches,
each an ``Operands`` with the canonical index of its first element, reach a kernel.

- ``DeviceLaunch``: one kernel launch per run, where the state lives (a flat buffer's
  shard, bucket by bucket as its average lands).
- ``ListLaunch``: every run in one launch where the backend has a list kernel (Triton's,
  for the many small local shards of DTensor parameters), else as ``DeviceLaunch``.
- ``RowsLaunch``: DTensor local shards stepped through their rows
  (``zero_triton.optim.rows``): keyed element by element, int8 scales agreed among the
  ranks that share a block.

These are the package's only callers of a step function (``zero_triton.native.backends``);
a host launch (state in host memory) is the next implementation of the same two methods.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from zero_triton.comm.group import without_python_tls
from zero_triton.kernels import rounding
from zero_triton.kernels.args import Operands, StepArgs
from zero_triton.native import backends
from zero_triton.state.buffers import PLAIN, Buffers, Scratch
from zero_triton.state.int8_rows import RowBlocks


class DeviceLaunch:
    """One launch of ``backend``'s step for ``format`` moments per run."""

    def __init__(self, backend: str, format: str, plain: bool = True):
        self.backend = backend
        self.step = backends.step_function(backend, format)

    def run(self, launches: list, args: StepArgs) -> None:
        """Step each ``(ops, index, k)`` of ``launches``: ``ops`` its tensors, ``index``
        the canonical index of its first element (keys stochastic rounding), ``k`` the
        home's segment it is a run of."""
        for ops, index, _ in launches:
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
        if self.step_list is None or len({ops.grad.dtype for ops, _, _ in launches}) > 1:
            return super().run(launches, args)
        if launches:
            self.step_list([ops for ops, _, _ in launches], args)


class RowsLaunch:
    """DTensor local shards whose elements are not one run of their parameter's canonical
    layout, or whose int8 or int4 blocks other ranks hold a part of (``maps``: each home
    segment's ``RowMap``). Each is stepped by ``backend``'s float32 step (the function
    every format's kernel computes per element) on its moments widened to float32, then:

    - a parameter rounded stochastically (``master_weights="stochastic"``) and bf16
      moments are rounded keyed by each element's canonical index (``RowMap.index``), as
      the kernels key a run, from the step count on the device;
    - int8 and int4 moments are encoded with the scales the ranks that cut the row agree on
      (int4's second moment rounded stochastically, keyed per element and block,
      ``state.int4_rows``): the
      largest magnitude of each rank's part of each block, one MAX all-reduce of the
      table of its rows' blocks per mesh dimension that cuts them (``state.int8_rows``).

    The same bits as the kernels on a layout that holds the blocks whole. Several passes
    over the shard (the fallback for cut rows, not the fast path); the agreement is one
    collective per parameter per step, every rank of the group in the same order (the
    shards' parameters and order are the same on every rank), also when a rank skips the
    step (GradScaler's inf: it contributes nothing and keeps its state, decided on the
    device). Its intermediates come from ``buffers``: ``Kept`` under capturable=True, so
    that a warmed-up step allocates nothing and reads nothing on the host."""

    def __init__(self, backend: str, maps: list, buffers: Buffers = PLAIN):
        self.step = backends.step_function(backend, "fp32")
        self.maps, self.buffers = maps, buffers

    def run(self, launches: list, args: StepArgs) -> None:
        skip = None  # where set (bool [1]), the step keeps the state it had
        if args.found_inf is not None:
            skip = torch.ne(args.found_inf, 0, out=self.buffers.kept(
                "skip", 1, torch.bool, args.found_inf.device))
        for ops, _, k in launches:
            self._one(ops, args, k, Scratch(self.buffers, k, ops.grad.device), skip)

    def _one(self, ops: Operands, args: StepArgs, k: int, tmp: Scratch, skip) -> None:
        rows, n = self.maps[k], ops.grad.numel()
        first, second, third = ops.moments
        blocks = third if isinstance(third, RowBlocks) else None
        keyed = first.dtype == torch.bfloat16  # bf16 moments, rounded stochastically
        if blocks is not None:
            m, v, most = *blocks.widen(tmp), None
        elif keyed:
            m, v = (tmp(name, (n,), torch.float32).copy_(t) for name, t in (("m", first), ("v", second)))
            most = None
        else:
            m, v, most = first, second, third
        param = tmp("param", (n,), torch.float32).copy_(ops.param) if args.stochastic else ops.param
        # The kernel skips on the device where found_inf is set.
        self.step(Operands(param, ops.grad, (m, v, most), ops.param_lp, ops.step, ops.lr,
                           ops.remainder, ops.scratch), args.replace(stochastic=False, index=0))
        rounded = []
        if args.stochastic:
            rounded.append((ops.param, param, rounding.PARAM_STREAM))
        if blocks is None and keyed:
            rounded += [(first, m, rounding.FIRST_STREAM), (second, v, rounding.SECOND_STREAM)]
        if rounded:
            index = self.buffers.constant(("index", k), lambda: rows.index(m.device))
            key, t = tmp("key", (1,), torch.int64), tmp("key scratch", (1,), torch.int64)
            for target, x, stream in rounded:
                bits = rounding.random_bits_at(rounding.key_at(ops.step, args.seed, stream, key, t), index,
                                               out=tmp("bits", (n,), torch.int64),
                                               tmp=tmp.shaped((n,), "scratch"))
                into = target if skip is None else tmp("rounded", (n,), torch.bfloat16)
                rounding.to_bf16_stochastic(x, bits, out=into, tmp=tmp.shaped((n,), "scratch"))
                if skip is not None:
                    torch.where(skip, target, into, out=target)
        if blocks is not None:
            _agree(blocks, m, v, rows, skip, tmp, keys=blocks.keys(ops.step, args.seed, tmp))


def _agree(blocks: RowBlocks, m: torch.Tensor, v: torch.Tensor, rows, skip=None, tmp=None,
           keys=None) -> None:
    """Encode ``m`` and ``v`` into ``blocks`` with the scales the ranks that cut ``rows``
    agree on (a rank that skips the step, ``skip`` set, contributes nothing and keeps its
    codes); ``keys``: the step's rounding keys (``RowBlocks.keys``)."""
    agreed = blocks.maxima(m, v, tmp)
    if skip is not None:
        agreed.masked_fill_(skip, 0)
    for group in rows.groups:
        agreed = _all_reduce_max(agreed, group)
    blocks.narrow(m, v, agreed, skip, tmp, keys)


def _all_reduce_max(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` (int32) all-reduced by MAX over ``group``, on the device its backend
    reduces on (NCCL: the current CUDA device; a host tensor goes there and back), launched
    as every collective of ours is (``without_python_tls``). A failure names the phase."""
    on = t
    if dist.get_backend(group) == "nccl" and t.device.type != "cuda":
        on = t.to(torch.device("cuda", torch.cuda.current_device()))
    try:
        with without_python_tls():
            dist.all_reduce(on, op=dist.ReduceOp.MAX, group=group)
    except RuntimeError as exc:
        raise RuntimeError(
            f"zero_triton: the moments' scales' agreement of a DTensor parameter stepped through "
            f"its rows failed on rank {dist.get_rank()}: {exc} (a peer rank probably died or "
            "stopped calling the collective)") from exc
    return on if on is t else on.to(t.device)


def settle(store, s0: int, rows) -> None:
    """Encode piece ``s0`` of an ``Int8RowMoments`` whose moments were loaded in torch's
    format and not stepped since, with the scales its sharers agree on (collective over
    ``rows.groups``, as the step's agreement)."""
    blocks = store.blocks(store, s0, rows)
    _agree(blocks, *blocks.widen(), rows)
