"""The optimizers' ``Ranks`` parts (``zero_triton.optim.protocol``): what a step asks of
the other ranks, with one rank (``OneRank``), over a process group (``AgreedRanks``), and
over a process group for a step a CUDA graph can capture (``CapturedRanks``).

FusedAdam is built with a ``OneRank``; ZeroAdam with an ``AgreedRanks`` (or, under
capturable=True, a ``CapturedRanks``: ``zero_triton.optim.capture`` chooses) when its
group has more than one rank. The optimizer's step is the same code either way: it calls its
part, with its ``Seat`` (``zero_triton.optim.seat``: the optimizer's declared face), at
the same points (``enter`` at every call that reads the state, ``agree`` before
the kernels, ``stepped`` after), and the part decides what that takes.
"""
from __future__ import annotations

import torch
from torch.distributed.algorithms.join import Join

from zero_triton.comm import agreement, side
from zero_triton.comm.step_flags import StepFlags
from zero_triton.optim import join, sharded_state
from zero_triton.optim import state_dict as adam_state
from zero_triton.optim.ddp_check import AlreadyAveraged
from zero_triton.optim.edits import reseed_written, sharded_state_edit
from zero_triton.optim.served import CapturedServedState, ServedState
from zero_triton.state import watch

# The calls of an iteration that start collectives: the first of them tells Join.
PER_ITERATION = ("backward", "step", "clip_grad_norm_", "GradScaler")
# Under capturable=True, the calls a CUDA graph may capture: they agree on the device
# (``StepFlags.exchange_on_device``), every other call on the host, after reading what
# the device agreement found.
CAPTURED = ("step", "clip_grad_norm_", "GradScaler")


class OneRank:
    """One rank: a call follows the user's edits; there is nothing to agree on."""

    shadowing = False

    def clipping(self, args) -> None:
        pass

    def enter(self, seat, entry: str, pairs=None, stale: bool = False, detail: str = "") -> bool:
        pairs = pairs if pairs is not None else seat.shards(follow=True)
        edits, shards = seat.edits, [shard for _, shard in pairs]
        edits.check_groups(seat.param_groups)
        if edits.edited(seat.state):
            edits.follow_state(seat.state, shards)
            seat.state = edits.restored(seat.state, [f for _, f in seat.shards()])
        reseed_written(shards)
        return stale

    def backward_entry(self, seat):
        return None  # one rank: backward's launches have nothing to agree on

    def built(self, seat) -> None:
        pass

    def catch_up(self, entry: str, rows) -> None:
        raise AssertionError("one rank has no peers to catch up with")

    def refuse_under_join(self, enabled: bool) -> None:
        pass

    def before_reduce(self, shards) -> None:
        pass

    def after_reduce(self, seat) -> None:
        pass

    def agree(self, seat, shards, found_inf):
        return found_inf

    def agree_found_inf(self, seat, per_device: dict) -> None:
        pass

    def stepped(self, seat) -> None:
        pass

    def loaded(self) -> None:
        pass

    def state_dict(self, seat) -> dict:
        self.enter(seat, "state_dict")
        return adam_state.local_state_dict(seat)

    def load_state_dict(self, seat, state_dict: dict) -> None:
        self.enter(seat, "load_state_dict")
        # What state_dict() handed out may come back (a self-load, DCP's in-place load):
        # copy it before the load overwrites the buffers it views.
        state_dict = watch.unaliased(state_dict, adam_state.live_tensors(seat))
        plan = adam_state.plan_load(seat, state_dict)
        adam_state.apply_load(seat, state_dict, plan)


class AgreedRanks:
    """ZeroAdam over a group of several ranks. Each call is agreed host-side first
    (``zero_triton.comm.agreement``): every rank finds locally what changed (param
    groups edited, ``seat.state`` reset or edited, parameters written, gradients changed
    after their bucket was averaged), one exchange tells every rank what all found, and
    every rank then does the same: follows it, or raises. A rank at another call, or a
    step behind, fails every rank there.

    It owns the agreement and its side channel (the gloo group and the shard server that
    answers another rank's ``state_dict()``), the step's flags, what the server answers
    from (``served``, once the optimizer is built), the first step's check that the
    gradients were not averaged before (``averaged_before``) and torch's Join's flags:
    ``shadowing`` while this rank, out of inputs, runs the others' iteration
    (``zero_triton.optim.join``), ``notified`` once this iteration told the Join block
    it still has inputs."""

    def __init__(self, seat, comm, spec):
        # Made after the model check, which every rank passes together: the ordinal (how
        # many ZeroAdams this process built on this group before) is the same on all. The
        # channel lives while an optimizer on this group does, and until the group is
        # destroyed. Whether this process's channel of the group is taken again is agreed
        # by every rank: it closes when its last optimizer is collected, which the garbage
        # collector may have done on some ranks and not yet on others, and a rank making a
        # new channel while another takes the old one would wait for it for ever.
        # Over every rank (hybrid sharding: the whole mesh, not the shard group).
        everyone = comm.everyone
        held = everyone.all_gather_object(side.held(everyone.process_group), "side channel")
        channel = side.channel(everyone.process_group, fresh=not all(held))
        self.agreement = agreement.Agreement(everyone, agreement.next_ordinal(everyone.process_group),
                                             channel)
        self.server = channel.server
        channel.attach(seat.optimizer)
        # Held here (a cycle the garbage collector frees, not a drop): a rank that lets go
        # of its optimizer right after its own state_dict() keeps serving the peers whose
        # requests for its shards are still on their way, instead of closing the channel
        # under them at once.
        self.owner = seat.optimizer
        self.step_flags = StepFlags(comm)
        # grad_release=True: backward steps the shards, so its round's entry agrees on
        # what the step's own entry agrees on before stepping (``_step_found``).
        self.releases = spec.release
        self.ddp_looked = False  # the first releasing backward looks for a DDP wrapper
        self.served = None   # ServedState, once the optimizer is built (``built``)
        self.told = None     # the step's entry agreement's flags, until ``agree`` reads them
        self.shadowing = False
        self.notified = False
        self.clip_args = None
        # Stage 2 refuses a DDP wrapper at step (a .grad written after backward handed
        # it over): no fingerprint needed there.
        self.averaged_before = AlreadyAveraged(everyone, needed=not spec.grads.sharded)

    def clipping(self, args) -> None:
        self.clip_args = args

    def backward_entry(self, seat):
        """What backward's launches call before the first bucket of a round (handed to
        the reducer as it is made): every rank agrees it is in that round."""
        def entered(detail: str) -> None:
            seat.enter("backward", detail=detail)
        return entered

    served_as = ServedState  # what the shard server answers from

    def built(self, seat) -> None:
        """The optimizer is built: the shard server answers from its state."""
        self.served = self.served_as(seat, self.agreement, self.server)

    def catch_up(self, entry: str, rows) -> None:
        """A joined rank's shadow iteration met ``entry`` (``optim.join``'s CatchUp):
        the next check of that call uses the ``rows`` exchanged already."""
        self.agreement.pending = (entry, rows)

    def refuse_under_join(self, enabled: bool) -> None:
        """Join's hook was asked for: refuse what Join cannot average (``AlreadyAveraged``)."""
        self.averaged_before.refuse_under_join(enabled)

    def enter(self, seat, entry: str, pairs=None, stale: bool = False, detail: str = "") -> bool:
        """What this rank found (``_edits_found``, ``_step_found``), one agreement on
        what every rank found, then every rank follows it alike (``_follow``)."""
        self._notify_join(seat, entry)
        pairs = pairs if pairs is not None else seat.shards(follow=True)
        flags, refuse, error = self._edits_found(seat, pairs)
        if entry == "backward" and self.releases and not refuse and not self.ddp_looked:
            refuse, error = self._wrapped_by_ddp(seat)
        if stale:
            flags |= agreement.STALE
        if self.shadowing:
            flags |= agreement.JOINED
        agreed = self.agreement.check(entry, agreement.Row(
            backwards=seat.reducer.backwards, flags=flags, refuse=refuse, detail=detail,
            written=tuple((f.key << 32) + i for _, f in pairs for i in f.versions.written()),
            **self._step_found(seat, entry, pairs)))
        if entry == "step":
            self.told = agreed
        if error is not None:
            raise error
        if entry == "backward" and agreed & agreement.DIFFER:
            self._launches_differ(seat)
        self._follow(seat, entry, agreed, pairs)
        return bool(agreed & agreement.STALE)

    def _wrapped_by_ddp(self, seat) -> tuple:
        """At the first backward that releases: a DistributedDataParallel wrapper (HF
        Trainer and accelerate's ``prepare`` add one at 2+ processes) writes its buckets
        back into ``.grad`` after ZeroAdam took each gradient and stepped with it, which
        the step would refuse only after this backward stepped the shards. Refused here,
        before anything is stepped (a walk over the live objects, once)."""
        self.ddp_looked = True
        error = join.release_under_ddp(seat.param_groups)
        return (0, None) if error is None else (4, error)

    def _notify_join(self, seat, entry: str) -> None:
        """Under Join: this rank still has inputs, said before the iteration's first
        collective, as the joined ranks count before shadowing it (a no-op outside)."""
        if not self.notified and not self.shadowing and entry in PER_ITERATION:
            self.notified = True
            Join.notify_join_context(seat.optimizer)

    @staticmethod
    def _edits_found(seat, pairs) -> tuple:
        """The user's edits this rank finds: (flags, refuse code, the error to raise once
        every rank knows): param groups edited by hand (refused), ``opt.state`` reset
        (RESET) or edited in a way the shards cannot take (refused)."""
        edits = seat.edits
        flags, refuse, error = 0, 0, None
        try:
            edits.check_groups(seat.param_groups)
        except RuntimeError as exc:
            refuse, error = 1, exc
        edit = sharded_state_edit(seat.state, edits.tracked, pairs) if edits.edited(seat.state) else None
        if isinstance(edit, RuntimeError):
            refuse, error = refuse or 3, error or edit
        elif edit == "reset":
            flags |= agreement.RESET
        return flags, refuse, error

    def _step_found(self, seat, entry: str, pairs) -> dict:
        """The call's own questions, where the host can answer them: the step's buckets'
        launch signature, which gradients are missing and the hyperparameters' digest;
        clip_grad_norm_'s arguments for a rank shadowing under Join."""
        found = {}
        if entry == "step":
            reducer = seat.reducer
            found.update(signature=reducer.last_signature if seat.grads_reduced else reducer.signature,
                         missing=agreement.missing_digest([f.stepped for _, f in pairs]),
                         hyper=join.digest(seat.param_groups))
        if entry == "backward" and self.releases:  # the shards step in this backward
            found.update(signature=seat.reducer.signature, hyper=join.digest(seat.param_groups))
        if entry == "clip_grad_norm_" and self.clip_args and seat.join_enabled:
            found["args"] = tuple(float(a) for a in self.clip_args)
        return found

    def _follow(self, seat, entry: str, agreed: int, pairs) -> None:
        """What every rank does with what all found: hyperparameters shared (Join, or
        refused when they differ), an agreed reset of the state, ``opt.state`` made anew
        after edits, the masters of written parameters re-seeded, the server's counts."""
        stepping = entry == "step" or (entry == "backward" and self.releases)
        if stepping and agreed & (agreement.JOINED | agreement.HYPER_DIFFER):
            self._share_hyperparameters(seat)
        if agreed & agreement.RESET:
            for _, shard in pairs:
                shard.state.reset()
                shard.state.set_param_steps([0.0] * len(shard.params))
                shard.reseed(range(len(shard.params)))
        if seat.edits.edited(seat.state):
            # opt.state anew, keeping whatever is not ours
            seat.state = seat.edits.restored(seat.state, [f for _, f in seat.shards()])
        reseeded = reseed_written([shard for _, shard in pairs])
        if agreed & agreement.RESET:
            self.loaded()  # every rank reset its shards: counted as a load
        elif reseeded:
            self.served.written()  # masters seeded from written parameters

    def _share_hyperparameters(self, seat) -> None:
        """At a step where the ranks with inputs hold different hyperparameters, or one
        shadows under Join: every rank sends its own. Different ones among the ranks with
        inputs are refused on every rank (each would step its shard at its own: a
        scheduler stepped on some ranks only, ReduceLROnPlateau fed a rank's own
        metric); a joined rank takes theirs (its own loop, scheduler included, ended)."""
        every = self.agreement.exchange([float(self.shadowing)] + join.hyperparameters(seat.param_groups))
        active = [(rank, row[1:]) for rank, row in enumerate(every) if not row[0]]
        differ = join.first_difference(active)
        if differ is not None:
            raise RuntimeError(
                f"ZeroAdam: the ranks hold different hyperparameters at step {self.agreement.steps} "
                f"({differ}); each rank would step its shard of the parameters at its own. "
                "Change hyperparameters on every rank alike: step schedulers on every rank, "
                "feed ReduceLROnPlateau a metric reduced over the ranks (all_reduce it first), "
                "and set param_groups on every rank. Nothing was stepped")
        if self.shadowing and active:
            join.adopt(seat.param_groups, active[0][1])

    def before_reduce(self, shards) -> None:
        self.averaged_before.before_reduce(shards)

    def after_reduce(self, seat) -> None:
        if self.averaged_before.mine is not None:  # once: exchanged after the reduce-scatter
            self.averaged_before.after_reduce(  # (which fails first)
                [p for g in seat.param_groups for p in g["params"]], seat.join_enabled)

    def agree(self, seat, shards, found_inf):
        """found_inf, which parameters step, and whether every rank launched the same
        buckets, agreed over the ranks; raises if an earlier (GPU) or this step's
        agreement found that they did not. The step's entry agreement (``enter``)
        answers the last two on the host (when every rank lacks the same gradients, if
        any, each rank's own list is the answer); an all-reduce
        (``zero_triton.comm.step_flags``) is needed only for a found_inf (GradScaler: a
        device value) or when the ranks lack different gradients (a parameter steps if
        any rank has its gradient)."""
        if not shards:
            return found_inf
        self._check_launches(seat)
        told, self.told = self.told, None
        if told is not None and found_inf is None and not told & agreement.GRADS_DIFFER:
            if told & agreement.DIFFER:
                self._launches_differ(seat)
            return None
        found_inf, partial = self.step_flags.exchange(shards, found_inf, seat.reducer.last_signature)
        if shards[0].device.type == "cpu":  # read at once: raise before anything is agreed
            self._check_launches(seat)
        return self.step_flags.finish(shards, found_inf, partial)

    def _check_launches(self, seat) -> None:
        if self.step_flags.launches_differed():
            self._launches_differ(seat)

    @staticmethod
    def _launches_differ(seat) -> None:
        seat.drop_averages()
        raise RuntimeError(
            "ZeroAdam: the ranks averaged different buckets during backward (a parameter "
            "that backward reached on some ranks and not on others, e.g. a data-dependent "
            "branch or an expert that got no tokens), so gradients of different buckets "
            "were added together; that step was skipped on every rank. Pass "
            "bucket_cap_mb=None (gradients averaged in step() only, whatever backward "
            "reaches), or make every rank's forward use every parameter")

    def agree_found_inf(self, seat, per_device: dict) -> None:
        """GradScaler's per-device inf flags, max-reduced over the group in place."""
        self.agreement.check("GradScaler", agreement.Row(backwards=seat.reducer.backwards))
        self._reduce_found_inf(seat, per_device)

    @staticmethod
    def _reduce_found_inf(seat, per_device: dict) -> None:
        for flag in per_device.values():
            seat.comm.all_reduce(flag, "max")

    def stepped(self, seat) -> None:
        self.notified = False
        self.served.stepped()
        seat.reducer.reset_backwards()

    def loaded(self) -> None:
        self.served.loaded()

    def state_dict(self, seat) -> dict:
        """The full state on this rank: the other ranks' shards from their shard servers
        (``adam_state.served_state_dict``), wherever those ranks are."""
        if seat.edits.edited(seat.state):
            # seat.state edited on this rank: what the state holds is decided by every rank
            # together at an agreed entry, so this call is collective.
            self.enter(seat, "state_dict")
            return adam_state.gathered_state_dict(seat, None, seat.gather_chunk)
        seat.edits.check_groups(seat.param_groups)
        return adam_state.served_state_dict(seat, self.server, self.agreement.ordinal,
                                            self.served.counts(), seat.gather_chunk)

    @torch.no_grad()
    def load_state_dict(self, seat, state_dict: dict) -> None:
        """Every rank checks the state dict first; if any rejects it, all raise and
        nothing changes. Each rank keeps its shard."""
        self.enter(seat, "load_state_dict")
        # A DCP load's ShardedTensors (``sharded_state_dict``'s): this rank's shards, copied.
        state_dict = sharded_state.localized(state_dict)
        state_dict = watch.unaliased(state_dict, adam_state.live_tensors(seat))
        plan, error = None, None
        try:
            plan = adam_state.plan_load(seat, state_dict)
        except (ValueError, KeyError, TypeError) as exc:
            error = exc
        every = seat.comm.all_gather_object(
            None if error is None else f"{type(error).__name__}: {error}", "load_state_dict")
        if error is not None:
            raise error
        for r, msg in enumerate(every):
            if msg is not None:
                raise ValueError(f"rank {r} rejected the state dict: {msg}; nothing was changed")
        adam_state.apply_load(seat, state_dict, plan)
        self.loaded()


class CapturedRanks(AgreedRanks):
    """``AgreedRanks`` for a step a CUDA graph can capture (capturable=True, chosen in
    ``zero_triton.optim.capture``): the calls a graph may capture (``CAPTURED``) follow
    this rank's own findings and agree on the device (``StepFlags.exchange_on_device``),
    with no host agreement and no host read; every other call reads what those device
    agreements found first (``_check_device_agreement``), then agrees on the host as
    ``AgreedRanks`` does. The shard server answers after the device
    (``CapturedServedState``)."""

    served_as = CapturedServedState

    def enter(self, seat, entry: str, pairs=None, stale: bool = False, detail: str = "") -> bool:
        if entry in CAPTURED:
            return self._enter_captured(seat, pairs, stale)
        self._check_device_agreement()
        return super().enter(seat, entry, pairs, stale, detail)

    def _enter_captured(self, seat, pairs, stale: bool) -> bool:
        """A captured call's entry: what this rank can follow alone (its param groups
        checked, written parameters re-seeded); an ``opt.state`` edit, which every rank
        must agree on, is refused with the fix."""
        pairs = pairs if pairs is not None else seat.shards(follow=True)
        edits = seat.edits
        edits.check_groups(seat.param_groups)
        if edits.edited(seat.state):
            raise RuntimeError(
                "ZeroAdam(capturable=True): opt.state was edited, which every rank must agree "
                "on, and a step that a CUDA graph can capture agrees on the device only. Load "
                "state with opt.load_state_dict (collective, agreed on the host), or build the "
                "optimizer without capturable=True")
        if reseed_written([shard for _, shard in pairs]):
            self.served.written()
        return stale

    def _check_device_agreement(self) -> None:
        """A call that agrees on the host first reads what the captured steps' device
        agreement found (the same on every rank: it was all-reduced)."""
        if self.step_flags.diverged_on_device():
            raise RuntimeError(
                "ZeroAdam(capturable=True): at a step since the last call that agreed on the "
                "host, the ranks held different step counts, lrs or gradients present (a rank "
                "replayed or stepped more often than the others, or a scheduler stepped on "
                "some ranks only); every rank has skipped its steps since, changing nothing. "
                "Step (and replay) on every rank alike, and change the lr on every rank")

    def agree(self, seat, shards, found_inf):
        """Agreed on the device: the step counts, lrs and gradients present are compared
        there, and a step the ranks disagree on changes nothing (read at the next host
        agreement)."""
        if not shards:
            return found_inf
        return self.step_flags.exchange_on_device(shards, found_inf,
                                                  [g["lr"] for g in seat.param_groups])

    def agree_found_inf(self, seat, per_device: dict) -> None:
        """Max-reduced on the device, with no host agreement first."""
        self._reduce_found_inf(seat, per_device)

    def state_dict(self, seat) -> dict:
        self._check_device_agreement()
        return super().state_dict(seat)
