"""The step as one pipeline: reduce -> clip -> agree -> prepare -> launch -> gather.

FusedAdam's ``step()`` (and ZeroAdam's: the same optimizer over a group) runs this part,
composed of the parts the optimizer was built with and handed in once: the shards
(``optim.shards``), the reducer that averages their buckets (``comm.buckets``), clipping
(``optim.clipping``), the ``Ranks`` part (``optim.ranks``: what each stage agrees with
the other ranks), the communicator and the user's edits (``optim.edits``). Each stage
tells a part what it needs through its methods' arguments; the pipeline owns one fact of
its own, whether this step's gradients were averaged already (``reduced``), which
clipping, GradScaler and the step itself share.
"""
from __future__ import annotations

import contextlib

from zero_triton.comm.group import phase


class StepPipeline:
    """The step of one optimizer, whose declared face its parts are handed (``seat``:
    ``optim.seat.Seat``)."""

    def __init__(self, seat, comm, shards, reducer, clipping, ranks, edits):
        self.seat, self.comm, self.shards, self.reducer = seat, comm, shards, reducer
        self.clipping, self.ranks, self.edits = clipping, ranks, edits
        self.reduced = False  # this step's gradients were averaged (once per step)

    def accumulating(self):
        """``no_sync()``'s part here: nothing held back (gradient release holds back its
        steps)."""
        return contextlib.nullcontext()

    def check_join(self) -> None:
        """torch's Join may shadow this step on a rank out of inputs."""

    def current(self, hint: bool = False) -> list:
        """(param group, shard) of every shard after following what the user moved or
        replaced (``Shards.followed``): a shard built again has no averages yet."""
        pairs, changed = self.shards.followed(self.seat.param_groups, hint)
        if changed:
            self.reduced = False
        return pairs

    # -- reduce ------------------------------------------------------------------------
    def reduce(self, pairs=None, entry: str = "step") -> None:
        """Average the gradients (once per step), after the ranks' entry into ``entry``;
        a step whose gradients are averaged already only enters."""
        pairs = pairs or self.current()
        if self.reduced:
            self.ranks.enter(self.seat, entry, pairs)
            self.ranks.after_reduce(self.seat)
            return
        shards = [s for _, s in pairs]
        for s in shards:
            s.sync_grads()
        buffers = [s.grad_buffer for s in shards]
        stale = self.reducer.changed_since_launch(buffers)
        if self.reducer.round_agreed:  # finish what every rank started in backward first
            self.reducer.complete_round()
        again = self.ranks.enter(self.seat, entry, pairs, stale)
        self.averaging_again(again)
        self.ranks.before_reduce(shards)
        if self.comm.everyone.world_size > 1 or any(s.separate_shard for s in shards):
            with phase("zero_triton.reduce_scatter", any(s.fused for s in shards)):
                self.reducer.finish(buffers, again)
        self.reduced = True
        self.ranks.after_reduce(self.seat)

    def averaging_again(self, again: bool) -> None:
        """The ranks agreed whether every bucket is averaged again at this step (``again``:
        a gradient changed after its bucket's average started): the plain step does so."""

    def rescaled(self) -> None:
        """GradScaler.unscale_ rescaled the local gradients in place, without bumping
        their version counter: the averages taken from them, or started by backward, are
        stale (ZeRO-2 unscales its averaged shards instead)."""
        local = [s.grad_buffer for _, s in self.shards.listed(self.seat.param_groups)
                 if not s.grad_buffer.sharded]
        for buffer in local:
            buffer.rewritten()
        if local:
            self.reduced = False

    def zeroed(self) -> None:
        """``zero_grad``: no averages, no clipping this step."""
        self.reduced = False
        self.clipping.reset()

    def drop_averages(self) -> None:
        """A step was refused after its averages: average again at the next step, and
        forget the clip coefficient taken from them."""
        self.reduced = False
        self.clipping.forget()

    # -- clip ----------------------------------------------------------------------------
    def clip(self, max_norm: float, norm_type: float, grad_scale=None, in_step: bool = False):
        """Clip by the global norm of the averaged gradients (``Clipping.clip``); returns
        the norm, None without shards. ``in_step``: the step's own ``max_grad_norm``,
        after its reduce."""
        # The call's arguments go in its agreement row: a rank shadowing under Join makes
        # the same call (zero_triton.optim.join).
        self.ranks.clipping(None if in_step else (max_norm, norm_type))
        try:
            total = self.global_norm(norm_type, averaged=in_step)
        finally:
            self.ranks.clipping(None)
        return None if total is None else self.clipping.clip(total, max_norm, grad_scale)

    def global_norm(self, norm_type: float, averaged: bool = False):
        """The ``norm_type`` norm of the averaged gradients over every rank's shard, None
        without shards; ``averaged``: the step has entered and averaged already."""
        if not averaged:
            self.reduce(entry="clip_grad_norm_")
        shards = [s for _, s in self.shards.listed(self.seat.param_groups)]
        return self.clipping.global_norm(shards, self.comm, float(norm_type)) if shards else None

    # -- the step --------------------------------------------------------------------------
    def step(self, pairs: list, grad_scale, found_inf, max_grad_norm, overlapped: bool):
        """One step of the shards of ``pairs`` (GradScaler's ``grad_scale`` and
        ``found_inf``, or None; ``overlapped``: the next forward waits for the gathers):
        reduce, clip by ``max_grad_norm`` (None: no), agree, then prepare, launch and
        gather shard by shard, or bucket by bucket over several ranks. Returns the norm
        clipped by, None without clipping."""
        self.reduce(pairs)
        norm = None
        if max_grad_norm is not None:  # on top of any clipping called since backward
            norm = self.clip(max_grad_norm, 2.0, grad_scale, in_step=True)
        found_inf = self.ranks.agree(self.seat, [s for _, s in pairs], found_inf)
        for group, s in pairs:
            if group["amsgrad"] and s.state.ensure_amsgrad():
                self.edits.expose(s)
        cuda = any(s.fused for _, s in pairs)
        with phase("zero_triton.adam_step", cuda):
            self.update(pairs, grad_scale, found_inf)
        if self.comm.world_size > 1:
            if not overlapped:
                with phase("zero_triton.all_gather", cuda):
                    self.reducer.wait_gathers()
            else:
                self.reducer.guard_reads()
        if self.edits.views_state:
            for _, s in pairs:
                if s.exposed_steps is not s.state.steps:  # one step became several, or back
                    self.edits.expose(s)
        self.reduced = False
        self.clipping.reset()
        self.ranks.stepped(self.seat)
        return norm

    def update(self, pairs: list, grad_scale, found_inf) -> None:
        """Count the step and run the kernels of the shards of ``pairs``, starting each
        bucket's all-gather over several ranks."""
        plans = {s.key: (s, s.prepare(group, grad_scale, found_inf, self.clipping.coef))
                 for group, s in pairs}  # each shard moves the coefficient to its state
        self._launch(plans)

    def _launch(self, plans: dict) -> None:
        """Each shard's kernels (``plans``: shard key -> (shard, its prepared plan)); over
        several ranks bucket by bucket, each bucket's all-gather started as soon as its
        kernel is done."""
        if self.comm.world_size == 1:
            for s, plan in plans.values():
                s.update(plan)
            return
        for b in self.reducer.start_gathers():
            s, plan = plans[b.key[0]]
            s.update_bucket(b.key[1], plan)
            s.gather_bucket(b.key[1])
