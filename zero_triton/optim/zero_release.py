"""Gradient release over ranks: ``ZeroAdam(..., stage=2, grad_release=True)`` steps each
bucket's shard of the state as its average lands in backward, and lets the average go.

At stage 2 a rank holds no full gradients: backward's hooks add each ``.grad`` into its
bucket's staging buffer and free it, and each bucket's average lands in this rank's 1/N
shard (``comm.buckets``). Released, the shard is stepped as each bucket's average lands
and the average is let go at once, so between backward and ``step()`` a rank holds no
gradient shard either, only the averages still in flight; the Adam kernels run under
backward instead of after it. ``step()`` steps what backward did not (the buckets whose
average lands in ``step()``: a bucket some rank's backward did not finish, the last one
in flight on CPUs), then gathers every bucket's parameters as the plain step does.

How, with no thread, poll or new collective: the reducer already tells a watcher when
each average starts and lands (``Bucket.watch``, which offload uses to copy averages to
the host as they land): on CPUs at the host's wait for it, which backward makes for every
average but the newest (``Reducer._settle``); on GPUs behind the average on the side
stream. A bucket launched by a backward outside ``no_sync()`` is armed at its start and
stepped when it lands (``_Landing``), parameter by parameter (``Shard.step_param``: the
kernel of the whole step on that run, its count taken alone), so that it gets the bits
the plain step gives it: the same kernel, average, count and hyperparameters.

What the ranks must agree on before anything is stepped is agreed at the entry every
rank already makes before a round of backward's launches (``Ranks.backward_entry``): the
hyperparameters (a digest; different ones are refused there, nothing stepped) and the
buckets launched so far this step (ranks that launched different ones refuse before
stepping). Which parameters step needs no agreement in backward: a bucket is launched by
backward only once every parameter of it has its gradient on this rank, and a parameter
steps if any rank has its gradient; the rest is agreed at ``step()`` as without release.

What it composes with and what it refuses (each error says why and what to use):

- gradient accumulation: backward inside ``opt.no_sync()`` averages into the shard as
  stage 2 always does, and steps nothing; the first backward outside it steps each
  bucket with the sum of the averages;
- refused: ``stage=1`` (it keeps the full local gradients, which is what release frees),
  ``bucket_cap_mb=None`` (nothing is averaged in backward), ``max_grad_norm`` and
  clipping (the global norm needs every average first), GradScaler (its inf check too),
  ``capturable``, ``offload``, torch's Join, a second backward outside ``no_sync()``
  before ``step()`` (the first one stepped this rank's shard, which only ``step()``
  gathers to the other ranks), and gradients written after backward stepped with them.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

from zero_triton.optim import join
from zero_triton.optim.pipeline import StepPipeline
from zero_triton.optim.release import _FIXES, _current_task, _needs_every_gradient
from zero_triton.state.param_view import Run


def check(stage: int, bucket_cap_mb, grad_release) -> None:
    """ZeroAdam's ``grad_release`` against its stage and buckets, before anything is
    built."""
    if not grad_release or not isinstance(grad_release, int):  # check_flag says what is wrong
        return
    if stage != 2:
        raise ValueError(
            "ZeroAdam(grad_release=True) needs stage=2: at stage 1 each rank keeps its full "
            "local gradients until step(), which is what gradient release frees; pass "
            "stage=2 (each rank then holds only the averages in flight)")
    if bucket_cap_mb is None:
        raise ValueError(
            "ZeroAdam(grad_release=True) cannot be used with bucket_cap_mb=None: the "
            "gradients are then averaged in step() only, so nothing lands during backward to "
            "be stepped and released; pass a bucket size (the default, 25)")


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread."""
    return _current_task() not in (None, -1)


_TWICE_FIX = ("a second backward outside opt.no_sync() before step(), or a .grad written or "
              "zero_grad() between backward and step(). The shard a backward stepped reaches "
              "the other ranks only through step()'s gathers: call step() after each backward "
              "that releases, and run the micro-batches before the last one inside "
              "opt.no_sync() (under accelerate's accumulate(), set model.no_sync = "
              "opt.no_sync before accelerator.prepare_model(model, evaluation_mode=True): "
              "accelerate enters it for the micro-batches that do not sync)")


def _stepped_twice(k: int, key: int) -> RuntimeError:
    return RuntimeError(
        f"ZeroAdam(grad_release=True): bucket {k} of flat buffer {key} was averaged again "
        f"after backward had stepped this rank's shard with its average: {_TWICE_FIX}")


def _averaged_again() -> RuntimeError:
    return RuntimeError(
        "ZeroAdam(grad_release=True): gradients changed after their buckets' averages "
        "started, on some rank, so every bucket would be averaged again, and backward may "
        f"have stepped with the first averages already: {_TWICE_FIX}. Nothing more was "
        "stepped")


class _Landing:
    """What one shard's buckets tell when an average starts and lands (``Bucket.watch``,
    through ``FlatHome.watch_averages``): armed at a start in a releasing backward, the
    bucket is stepped at its landing."""

    def __init__(self, pipeline: "ZeroReleasePipeline", gi: int, shard):
        self.pipeline = weakref.ref(pipeline)
        self.gi, self.shard = gi, shard

    def tell(self, k: int, landed: bool) -> None:
        pipeline = self.pipeline()
        if pipeline is not None:
            pipeline.told(self.gi, self.shard, k, landed)


class ZeroReleasePipeline(StepPipeline):
    """ZeroAdam's step with ``grad_release=True``: each bucket's shard stepped as its
    average lands in backward (``told``), ``step()`` stepping the rest and gathering
    everything (``update``). The stages that need every average first (clipping,
    GradScaler's unscale) refuse."""

    def __init__(self, seat, comm, shards, reducer, clipping, ranks, edits):
        super().__init__(seat, comm, shards, reducer, clipping, ranks, edits)
        self.held = 0          # depth of no_sync() blocks: backward's averages step nothing
        self.task = None       # the backward whose first releasing launch was seen
        self.armed = set()     # (shard key, bucket) whose average in flight will be stepped
        self.released = {}     # shard key -> buckets stepped by backward since the last step
        self.counted = {}      # shard key -> parameters counted since the last step
        self.landings = []     # held here: the buckets hold their ``tell`` weakly
        self.runs = {}         # (shard key, bucket) -> {parameter: its run on this rank}
        self.ddp_looked = False  # one rank: the first releasing backward looks for a DDP
        shards.on_change(self.attach)

    def attach(self, param_groups: list) -> None:
        """The shards of ``param_groups`` (built or built again) tell their averages here."""
        self.landings, self.runs = [], {}
        for gi, shards in enumerate(self.shards.groups):
            for shard in shards:
                landing = _Landing(self, gi, shard)
                shard.home.watch_averages(landing.tell)
                self.landings.append(landing)

    @contextlib.contextmanager
    def accumulating(self):
        """Backward's averages go into the shard and step nothing inside this block; the
        first backward after it steps with their sum."""
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1

    def check_join(self) -> None:
        raise ValueError(
            "ZeroAdam(grad_release=True) cannot be used under torch's Join: a rank out of "
            "inputs steps its shard with zero gradients at step(), while the others' "
            "backward stepped theirs as their averages landed; build the optimizer without "
            "grad_release for uneven inputs")

    # -- backward ----------------------------------------------------------------------------
    def told(self, gi: int, shard, k: int, landed: bool) -> None:
        """Bucket ``k`` of ``shard``'s average starts (``landed`` False: armed when a
        backward outside ``no_sync()`` launched it) or has landed (stepped if armed)."""
        key = (shard.key, k)
        if not landed:
            if k in self.released.get(shard.key, ()):
                self.armed.discard(key)
                if _in_backward():  # new gradients for a bucket this step already stepped
                    raise _stepped_twice(k, shard.key)
                return  # step()'s relaunch of every bucket: nothing staged since, zeros added
            if self.held or not _in_backward():
                self.armed.discard(key)
                return
            task = _current_task()
            if task != self.task:
                self._entered(task)
            self.armed.add(key)
            return
        if key in self.armed:
            self.armed.discard(key)
            self.released.setdefault(shard.key, set()).add(k)
            self.step_bucket(self.seat.param_groups[gi], shard, k, None)

    def _entered(self, task: int) -> None:
        """The first releasing launch of a backward. Over several ranks the round's entry
        (``Ranks.backward_entry``) agreed just before it; one rank follows the user's edits
        here, as ``step()`` would."""
        pairs = self.shards.listed(self.seat.param_groups)
        if self.comm.everyone.world_size == 1:
            if not self.ddp_looked:  # over ranks, the entry's row refuses it (optim.ranks)
                self.ddp_looked = True
                error = join.release_under_ddp(self.seat.param_groups)
                if error is not None:
                    raise error
            self.ranks.enter(self.seat, "backward", pairs)
        self.task = task
        for group, s in pairs:
            if group["amsgrad"] and s.state.ensure_amsgrad():
                self.edits.expose(s)

    def step_bucket(self, group, shard, k: int, stepped) -> None:
        """Step this rank's shard of bucket ``k`` with its average, parameter by parameter
        (those ``stepped`` says have a gradient; None: all), each counted alone, then let
        the average go."""
        geometry = shard.layout.buckets[k]
        lo, hi, s0 = shard.segments[k]
        runs = self.runs.get((shard.key, k))
        if runs is None:  # once per bucket of a shard (re-built shards: ``attach``)
            runs = self.runs[shard.key, k] = {
                run.index: run for run in shard.by_param.runs(lo=s0, hi=s0 + hi - lo)}
        grad = shard.home.grad(k)
        counted = self.counted.setdefault(shard.key, bytearray(len(shard.params)))
        for i in range(geometry.first, geometry.end):
            if stepped is not None and not stepped[i]:
                continue
            run = runs.get(i, Run(i, 0, 0, 0))  # none of it on this rank: only counted
            at = run.at - s0
            shard.step_param(group, run, grad[at:at + run.b - run.a])
            counted[i] = 1
        if grad.is_cuda:  # read on this stream (the side stream, in backward): freed after it
            grad.record_stream(torch.cuda.current_stream(grad.device))
        shard.home.finished(k)

    def averaging_again(self, again: bool) -> None:
        """Every bucket is averaged again (agreed: a gradient changed after its bucket's
        average started, on some rank). Stage 2 does so for micro-batches whose launches
        stopped at a bucket backward did not finish, and nothing was stepped then; but a
        bucket backward stepped that has new gradients since (another backward, a .grad
        written, ``zero_grad()``) would be stepped twice: asked of every rank (one
        exchange, only at such a step) and refused alike everywhere."""
        if not again:
            return
        buckets = {s.key: s.buckets for _, s in self.shards.listed(self.seat.param_groups)}
        changed = any(buckets[key][k].stale for key, ks in self.released.items() for k in ks
                      if key in buckets)
        if any(self.comm.everyone.all_gather_object(changed, "grad_release")):
            raise _averaged_again()

    # -- the stages that need every average ----------------------------------------------------
    def global_norm(self, norm_type: float, averaged: bool = False):  # clip()'s too
        raise _needs_every_gradient(
            "The global gradient norm (clipping by it, or measuring it)",
            "under ZeroAdam each rank stepped its buckets' averaged shards as they landed. "
            "Leave grad_release out to clip or measure the norm")

    def rescaled(self) -> None:
        raise _needs_every_gradient(*_FIXES["GradScaler"])

    # -- step() ------------------------------------------------------------------------------
    def step(self, pairs: list, grad_scale, found_inf, max_grad_norm, overlapped: bool):
        if grad_scale is not None or found_inf is not None:
            self.rescaled()
        return super().step(pairs, None, None, max_grad_norm, overlapped)

    def update(self, pairs: list, grad_scale, found_inf) -> None:
        """The buckets backward did not step, stepped as the plain step steps them (their
        averages have landed: ``reduce`` waited for them), each bucket's gather started
        as soon as it is stepped; the step counts labelled once for the whole step."""
        self.armed.clear()
        self.task = None
        released, self.released = self.released, {}
        if not released:  # nothing landed in a releasing backward: the plain step
            self.counted = {}
            return super().update(pairs, grad_scale, found_inf)
        by_key = {s.key: (group, s) for group, s in pairs}
        if self.comm.world_size == 1:
            for group, s in pairs:
                for k in range(len(s.segments)):
                    if k not in released.get(s.key, ()):
                        self.step_bucket(group, s, k, s.stepped)
                    else:
                        s.home.finished(k)
        else:
            for b in self.reducer.start_gathers():
                group, s = by_key[b.key[0]]
                if b.key[1] not in released.get(s.key, ()):
                    self.step_bucket(group, s, b.key[1], s.stepped)
                else:  # an average of zeros, if step() averaged every bucket again
                    s.home.finished(b.key[1])
                s.gather_bucket(b.key[1])
        counted, self.counted = self.counted, {}
        for _, s in pairs:
            mask = counted.get(s.key)
            if mask is not None:
                s.state.settle(list(map(bool, mask)))
