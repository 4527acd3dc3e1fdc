"""ZeroAdam / ZeroAdamW: ZeRO-1 over torch.distributed around the same fused step.

The model is replicated on every rank and not wrapped in DDP; the optimizer does the
gradient sync itself. For every bucket of every flat buffer (``zero_triton.comm.buckets``):

    average grad[bucket] into this rank's shard        # zero_triton.reduce_scatter,
                                                       #   started from backward's hooks
    fused Adam kernel on this rank's shard only        # zero_triton.adam_step
    all_gather_into_tensor(param[bucket], param[shard])  # zero_triton.all_gather, waited
                                                       #   at the end of step, or by each
                                                       #   module's forward (overlap())

fp32 master, exp_avg and exp_avg_sq exist for the shard only: 12 bytes per parameter
divided by the world size.
"""
from __future__ import annotations

import contextlib

import torch
from torch.distributed.algorithms.join import Join, Joinable, _JoinConfig

from zero_triton.comm import agreement, side
from zero_triton.comm.group import GroupComm
from zero_triton.comm.step_flags import StepFlags
from zero_triton.native.compat import disable_dynamo
from zero_triton.optim import join, owners, sharded_state
from zero_triton.optim.ddp_check import AlreadyAveraged
from zero_triton.optim.edits import sharded_state_edit
from zero_triton.optim.served import ServedState
from zero_triton.optim import state_dict as adam_state
from zero_triton.optim.checks import (adam_hyperparameters, check_no_dtensors, check_params_argument,
                                      check_process_group)
from zero_triton.optim.fused import FusedAdam
from zero_triton.optim.spec import Spec
from zero_triton.state import watch

# The calls of an iteration that start collectives: the first of them tells Join.
_PER_ITERATION = ("backward", "step", "clip_grad_norm_", "GradScaler")


def _signature(param_groups) -> list:
    """What every rank must agree on: per group, each parameter's shape and dtype."""
    sig = []
    for gi, group in enumerate(param_groups):
        params = group["params"] if isinstance(group, dict) else group
        if isinstance(params, torch.Tensor):
            params = [params]
        for pi, p in enumerate(params):
            if isinstance(p, tuple):
                p = p[1]
            sig.append((gi, pi, tuple(p.shape), str(p.dtype), bool(p.requires_grad)))
    return sig


def _first_mismatch(mine: list, theirs: list):
    for a, b in zip(mine, theirs):
        if a != b:
            return a, b
    if len(mine) != len(theirs):
        return (f"{len(mine)} parameters", f"{len(theirs)} parameters")
    return None


class ZeroAdam(FusedAdam, Joinable):
    """FusedAdam with its state sharded over ``process_group`` (ZeRO stage 1).

    Extra args:
        process_group: the group to shard over (default: the world group).
        reduce_dtype: dtype to average gradients in (e.g. torch.float32 for bf16
            grads); default the gradient's own dtype.
        stage: 1 (default): the optimizer state is sharded, each rank keeps the full
            local gradients. 2: the gradients too: each bucket's gradients are handed
            to the optimizer as backward produces them (``.grad`` is None afterwards)
            and averaged into this rank's shard, so a rank holds 1/N of the gradients
            plus a few buckets. Stage 2 averages every micro-batch (``no_sync`` changes
            nothing) and adds the averages up.
        bucket_cap_mb: MiB of gradients per bucket (DDP's name and default, 25). Each
            bucket is sharded over the ranks on its own, and its average starts during
            backward as soon as backward has finished it (from the second step on:
            the first step learns the order). None: one bucket per flat buffer,
            averaged in ``step()`` only, whatever backward does: for models whose
            ranks reach different parameters (data-dependent routing), where launches
            from backward would pair different buckets across ranks. The result does
            not depend on it (bitwise).

    Uneven inputs (ranks with different numbers of batches): wrap the loop in
    ``torch.distributed.algorithms.join.Join([optimizer])`` (or ``Join([ddp_model,
    optimizer])``), as for DDP and ZeroRedundancyOptimizer; a rank that ran out steps
    its shard with zero gradients until every rank is done (``zero_triton.optim.join``).

    Construction is collective: ranks compare parameter shapes and dtypes and raise on
    every rank at the first mismatch. torch.amp.GradScaler works as is: every rank
    agrees on skipped steps and on the scale (``ZeroGradScaler`` is the same thing).
    ``max_grad_norm`` clips by the global norm inside ``step()``, and so does
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` (``zero_triton.integrations.clip_grad``
    hands it to ``clip_grad_norm_``: torch's own would see this rank's local gradients,
    or at stage 2 none).
    The ``.grad`` of every parameter keeps this rank's local gradient; the averaged
    shard lives in the optimizer. ``no_sync()`` accumulates micro-batches without
    communicating; ``zero_triton.overlap(model, optimizer)`` leaves the parameter
    all-gathers in flight after ``step()`` for the next forward to wait on.
    """

    _rebuilds_replaced_groups = False  # it shards what it was given, agreed by every rank

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, *, maximize=False, decoupled_weight_decay=False,
                 master_weights=None, backend="auto", process_group=None, reduce_dtype=None,
                 max_grad_norm=None, bucket_cap_mb=25, stage=1, foreach=None, fused=None,
                 capturable=False, differentiable=False):
        # torch.optim.Adam's order and messages: the hyperparameters, then the parameters;
        # all before the first collective (the model check), so a bad argument fails on
        # each rank alone.
        hyper = adam_hyperparameters(lr, betas, eps, weight_decay, amsgrad, maximize,
                                     decoupled_weight_decay, foreach=foreach, fused=fused,
                                     capturable=capturable, differentiable=differentiable)
        check_params_argument(params, type(self).__name__)
        if isinstance(params, torch.Tensor):  # one tensor: iterating it would give its rows
            raise TypeError("params argument given to the optimizer should be an iterable of "
                            f"Tensors or dicts, but got {torch.typename(params)}")
        check_process_group(process_group)
        spec = Spec.build(master_weights=master_weights, backend=backend,
                          reduce_dtype=reduce_dtype, bucket_cap_mb=bucket_cap_mb, stage=stage,
                          max_grad_norm=max_grad_norm, differentiable=differentiable)
        comm = GroupComm(process_group)
        params = list(params)
        if not params:
            raise ValueError("ZeroAdam got an empty parameter list")
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        for g in groups:  # materialise generators once: we read them twice
            if not isinstance(g["params"], torch.Tensor):
                g["params"] = list(g["params"])
        check_no_dtensors(groups, type(self).__name__)  # before any collective
        self._check_same_model(comm, groups)
        # Built after the model check, which every rank passes together: the ordinal
        # (how many ZeroAdams this process built on this group before) is the same on all.
        # The side channel (zero_triton.comm.side): the agreements' gloo group and the shard
        # server that answers another rank's state_dict() wherever this rank is; it lives
        # while an optimizer on this group does, and until the group is destroyed.
        channel = side.channel(comm.process_group) if comm.world_size > 1 else None
        self._agreement = agreement.Agreement(comm, agreement.next_ordinal(comm.process_group),
                                              channel) if channel is not None else None
        self._step_flags = StepFlags(comm) if comm.world_size > 1 else None
        self._server = channel.server if channel is not None else None
        self._served = None  # ServedState, once constructed (below)
        if channel is not None:
            channel.attach(self)
        self._told = None  # the step's entry agreement's flags, until _agree reads them
        # torch's Join (uneven inputs): disabled outside a Join block; ``_shadowing`` while
        # this rank, out of inputs, runs the others' iteration (zero_triton.optim.join);
        # ``_notified``: this iteration told the Join block it still has inputs.
        self._join_config = _JoinConfig.construct_disabled_join_config()
        self._shadowing = False
        self._notified = False
        self._clip_args = None  # (max_norm, norm_type) of a clip_grad_norm_ call, for its row
        # One rank: its gradients are trivially 'identical'. Stage 2 refuses a DDP wrapper
        # at step (a .grad written after backward handed it over), no fingerprint needed.
        self._averaged_before = AlreadyAveraged(
            comm, needed=comm.world_size > 1 and not spec.grads.sharded)
        self._build(groups, hyper, spec, comm)
        self._constructed = True
        if self._agreement is not None:
            self._reducer.enter = self._enter_backward
            # What the shard server answers another rank's state_dict() from.
            self._served = ServedState(self, self._agreement, self._server)

    # -- every rank at the same call (zero_triton.comm.agreement) -----------------------------
    def _enter_backward(self, detail: str) -> None:
        self._enter("backward", detail=detail)

    def _enter(self, entry: str, flats=None, stale: bool = False, detail: str = "") -> bool:
        """FusedAdam's ``_enter``, agreed with every rank first: each finds locally what
        changed (param groups edited, opt.state reset or edited, parameters written,
        gradients changed after their bucket was averaged), one host-side exchange tells
        every rank what all found, and then every rank does the same: follows it, or
        raises. A rank at another call, or a step behind, fails every rank here."""
        if self._agreement is None:
            return super()._enter(entry, flats, stale)
        if not self._notified and not self._shadowing and entry in _PER_ITERATION:
            # Under Join: this rank still has inputs, said before the iteration's first
            # collective, as the joined ranks count before shadowing it (a no-op outside).
            self._notified = True
            Join.notify_join_context(self)
        flats = flats if flats is not None else self._current_flats()
        refuse, error = 0, None
        try:
            self._check_groups()
        except RuntimeError as exc:
            refuse, error = 1, exc
        flags = agreement.STALE if stale else 0
        if self._shadowing:
            flags |= agreement.JOINED
        edit = sharded_state_edit(self.state, self._tracked, flats) if self._state_edited() else None
        if isinstance(edit, RuntimeError):
            refuse, error = refuse or 3, error or edit
        elif edit == "reset":
            flags |= agreement.RESET
        signature, missing = None, 0
        if entry == "step":  # the step's own questions, where the host can answer them
            reducer = self._reducer
            signature = reducer.last_signature if self._grads_reduced else reducer.signature
            missing = agreement.missing_digest([f.stepped for _, f in flats])
        written = [(f.key << 32) + i for _, f in flats for i in f.versions.written()]
        args = None  # clip_grad_norm_'s, for a rank shadowing under Join: read only there
        if entry == "clip_grad_norm_" and self._clip_args and self._join_config.enable:
            args = tuple(float(a) for a in self._clip_args)
        hyper = join.digest(self.param_groups) if entry == "step" else 0
        agreed = self._agreement.check(entry, agreement.Row(
            backwards=self._reducer.backwards, flags=flags, written=tuple(written), refuse=refuse,
            detail=detail, signature=signature, missing=missing, args=args or (None, None),
            hyper=hyper))
        if entry == "step":
            self._told = agreed
        if error is not None:
            raise error
        if entry == "step" and agreed & (agreement.JOINED | agreement.HYPER_DIFFER):
            self._share_hyperparameters()
        if agreed & agreement.RESET:
            for _, flat in flats:
                flat.state.reset()
                flat.state.set_param_steps([0.0] * len(flat.params))
                flat.reseed(range(len(flat.params)))
        if self._state_edited():
            self._restore_state_table()  # kept: whatever is not ours
        reseeded = self._reseed_written(flats)
        if agreed & agreement.RESET:
            self._loaded()  # every rank reset its shards: counted as a load
        elif reseeded:
            self._served.written()  # masters seeded from written parameters
        return bool(agreed & agreement.STALE)

    def _stepped(self) -> None:
        self._notified = False
        if self._agreement is not None:
            self._served.stepped()
            self._reducer.backwards = 0

    def _loaded(self) -> None:
        """A load (or an agreed reset) wrote the state on every rank: count it."""
        self._served.loaded()

    def _shards_loaded(self, flats) -> None:
        super()._shards_loaded(flats)
        if self._agreement is not None:
            self._loaded()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *, _grad_scale=None,
                        _in_step: bool = False) -> torch.Tensor:
        # Its agreement row carries the arguments: a rank shadowing under Join makes the
        # same call (zero_triton.optim.join).
        self._clip_args = None if _in_step else (max_norm, norm_type)
        try:
            return super().clip_grad_norm_(max_norm, norm_type, _grad_scale=_grad_scale,
                                           _in_step=_in_step)
        finally:
            self._clip_args = None

    # -- torch's Join (zero_triton.optim.join) ----------------------------------------
    def join_hook(self, **kwargs) -> join.ZeroJoinHook:
        """What a rank that ran out of inputs runs under ``Join`` while others have some
        (``Join`` passes every joinable the same keywords; DDP's
        ``divide_by_initial_world_size`` is the one that concerns averaging)."""
        if not kwargs.get("divide_by_initial_world_size", True):
            raise ValueError(
                "ZeroAdam under Join averages over the initial world size (a joined rank's "
                "gradients count as zeros, DDP's default): divide_by_initial_world_size=False "
                "is not supported; leave it out")
        self._averaged_before.refuse_under_join(self._join_config.enable)
        return join.ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """Where Join's own all-reduces run: the parameters' device."""
        return next((f.device for flats in self._flats for f in flats), torch.device("cpu"))

    @property
    def join_process_group(self):
        return self._comm.process_group

    def _share_hyperparameters(self) -> None:
        """At a step where the ranks with inputs hold different hyperparameters, or one
        shadows under Join: every rank sends its own. Different ones among the ranks with
        inputs are refused on every rank (each would step its shard at its own: a
        scheduler stepped on some ranks only, ReduceLROnPlateau fed a rank's own
        metric); a joined rank takes theirs (its own loop, scheduler included, ended)."""
        every = self._agreement.exchange([float(self._shadowing)] + join.hyperparameters(self.param_groups))
        active = [(rank, row[1:]) for rank, row in enumerate(every) if not row[0]]
        differ = join.first_difference(active)
        if differ is not None:
            raise RuntimeError(
                f"ZeroAdam: the ranks hold different hyperparameters at step {self._agreement.steps} "
                f"({differ}); each rank would step its shard of the parameters at its own. "
                "Change hyperparameters on every rank alike: step schedulers on every rank, "
                "feed ReduceLROnPlateau a metric reduced over the ranks (all_reduce it first), "
                "and set param_groups on every rank. Nothing was stepped")
        if self._shadowing and active:
            join.adopt(self.param_groups, active[0][1])

    @staticmethod
    def _check_same_model(comm, groups):
        mine = _signature(groups)
        every = comm.all_gather_object(mine)
        for rank, theirs in enumerate(every):
            mismatch = _first_mismatch(mine, theirs)
            if mismatch is not None:
                a, b = mismatch
                raise RuntimeError(
                    f"ZeroAdam: ranks disagree on the model: rank {comm.rank} has {_describe(a)}, "
                    f"rank {rank} has {_describe(b)}; every rank must build the same model "
                    "(same parameters, shapes, dtypes and param groups) before the optimizer")

    @disable_dynamo  # as torch.optim.Optimizer's
    def add_param_group(self, param_group: dict) -> None:
        """Collective when called after construction: every rank must add the same group."""
        if getattr(self, "_constructed", False) and self._grads_reduced:
            # The step's averages exist already (every rank took them together), without
            # the new group's: its gradients would never be averaged this step, and
            # averaging everything again would lose stage 2's, held nowhere else.
            raise RuntimeError(
                "ZeroAdam.add_param_group after this step's gradients were averaged "
                "(clip_grad_norm_, or GradScaler.unscale_ at stage 2) and before step(): the "
                "new group's gradients would not be averaged with them, and its parameters "
                "would be stepped as if they were zero. Add the group before backward or after "
                "step(); nothing was changed")
        if getattr(self, "_constructed", False):
            if not isinstance(param_group["params"], torch.Tensor):
                param_group["params"] = list(param_group["params"])
            check_no_dtensors([param_group], type(self).__name__, len(self.param_groups))
            self._check_same_model(self._comm, [param_group])
        super().add_param_group(param_group)
        # torch's clip_grad_norm_ comes here (``zero_triton.integrations.clip_grad``) when
        # the local gradients are not the averaged ones (several ranks), or there are none
        # (stage 2).
        owners.register(self, [p for f in self._flats[-1] for p in f.params],
                        routes_clipping=self._comm.world_size > 1 or self._spec.grads.sharded)

    def _before_reduce(self, flats) -> None:
        self._averaged_before.before_reduce(flats)

    def _reduce_grads(self, flats=None, entry: str = "step"):
        super()._reduce_grads(flats, entry)
        if self._averaged_before.mine is not None:  # once: exchanged after the reduce-scatter
            self._averaged_before.after_reduce(  # (which fails first)
                [p for g in self.param_groups for p in g["params"]], self._join_config.enable)

    def _agree(self, flats, found_inf):
        """found_inf, which parameters step, and whether every rank launched the same
        buckets, agreed over the ranks; raises if an earlier (GPU) or this step's
        agreement found that they did not. The step's entry agreement (``_enter``)
        answers the last two on the host (when every rank lacks the same gradients, if
        any, each rank's own list is the answer); an all-reduce
        (``zero_triton.comm.step_flags``) is needed only for a found_inf (GradScaler: a
        device value) or when the ranks lack different gradients (a parameter steps if
        any rank has its gradient)."""
        if self._step_flags is None or not flats:
            return found_inf
        self._check_launches()
        told, self._told = self._told, None
        if told is not None and found_inf is None and not told & agreement.GRADS_DIFFER:
            if told & agreement.DIFFER:
                self._launches_differ()
            return None
        found_inf, partial = self._step_flags.exchange(flats, found_inf,
                                                       self._reducer.last_signature)
        if flats[0].device.type == "cpu":  # read at once: raise before anything is agreed
            self._check_launches()
        return self._step_flags.finish(flats, found_inf, partial)

    def _check_launches(self) -> None:
        if self._step_flags.launches_differed():
            self._launches_differ()

    def _launches_differ(self) -> None:
        self._grads_reduced = False
        self._clipping.coef = None
        raise RuntimeError(
            "ZeroAdam: the ranks averaged different buckets during backward (a parameter "
            "that backward reached on some ranks and not on others, e.g. a data-dependent "
            "branch or an expert that got no tokens), so gradients of different buckets "
            "were added together; that step was skipped on every rank. Pass "
            "bucket_cap_mb=None (gradients averaged in step() only, whatever backward "
            "reaches), or make every rank's forward use every parameter")

    @torch.no_grad()
    def _unscale_grads_(self, inv_scale, found_inf, per_device: dict, allow_fp16: bool) -> None:
        """Stage 2, called by GradScaler's ``unscale_`` / ``step``: the gradients are no
        ``.grad`` GradScaler could see, so the averaged shards are checked for inf/nan
        (and unscaled by ``inv_scale``, 1 inside ``scaler.step``) here, recorded in
        GradScaler's per-device flags."""
        if not self._spec.grads.sharded:
            return
        self._reduce_grads(entry="GradScaler")
        for _, flat in self._all_flats():
            shards = flat.averaged_grads()
            if not shards:
                continue
            if not allow_fp16 and shards[0].dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            flag = per_device.get(flat.device)
            if flag is None:
                flag = per_device[flat.device] = torch.zeros_like(found_inf, device=flat.device)
            torch._amp_foreach_non_finite_check_and_unscale_(shards, flag, inv_scale.to(flat.device))

    def _agree_found_inf_(self, per_device: dict) -> None:
        """GradScaler's per-device inf flags, max-reduced over the group in place."""
        if self._agreement is not None:
            self._agreement.check("GradScaler", agreement.Row(backwards=self._reducer.backwards))
        for flag in per_device.values():
            self._comm.all_reduce(flag, "max")

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation, as DistributedDataParallel's ``no_sync``: backward
        passes inside only accumulate each rank's local gradients; the first backward
        outside (the micro-batch that ends the accumulation) averages them, bucket by
        bucket as it goes, and ``step()`` waits for what is still in flight. Under
        stage 2 every micro-batch is averaged into the shard anyway (there is no full
        gradient buffer to accumulate in): the context changes nothing there."""
        reducer = self._reducer
        before = reducer.sync
        reducer.sync = self._spec.grads.sharded
        try:
            yield
        finally:
            reducer.sync = before

    @property
    def stage(self) -> int:
        """1: each rank keeps its local gradients until the step; 2: backward hands them
        over bucket by bucket and keeps only the rank's shard of the average."""
        return self._spec.stage

    @property
    def process_group(self):
        """The process group the state is sharded over (None: the default group)."""
        return self._comm.group

    @property
    def world_size(self) -> int:
        """The number of ranks the state is sharded over."""
        return self._comm.world_size

    @property
    def rank(self) -> int:
        """This rank's index in ``process_group``: it steps the rank-th shard."""
        return self._comm.rank

    # -- full (torch.optim.Adam-format) state dicts: zero_triton.optim.state_dict -------------
    _GATHER_CHUNK = adam_state.GATHER_CHUNK

    @disable_dynamo  # as torch.optim.Optimizer's
    def state_dict(self) -> dict:
        """The full state in torch.optim.Adam's format, as CPU tensors, on the rank that
        calls it: on one rank alone (``if rank == 0: torch.save(opt.state_dict())``, HF
        Trainer's checkpoint) or on every rank. The other ranks' shards come from their
        shard servers (``zero_triton.comm.serve``), chunk by chunk, wherever those ranks
        are (a barrier, the next iteration). ``load_state_dict`` on any world size keeps
        each rank's shard. For large models prefer ``zero_triton.checkpoint.save`` (each
        rank writes only its shard). State-dict hooks run on the calling rank."""
        return super().state_dict()

    @disable_dynamo  # as torch.optim.Optimizer's
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full state in torch.optim.Adam's format (``consolidated_state_dict()``,
        ``FusedAdam.state_dict()`` or torch.optim.Adam's own), given on every rank; each
        rank keeps its shard. Collective: every rank checks everything first, and if any
        rank rejects the state dict all raise and nothing changes. Without
        ``master_param`` the master is the current parameter upcast. Load-state-dict
        hooks run on every rank."""
        super().load_state_dict(state_dict)

    def _full_state_dict(self) -> dict:
        if self._comm.world_size == 1:
            return super()._full_state_dict()
        if self._state_edited():
            # opt.state edited on this rank: what the state holds is decided by every rank
            # together at an agreed entry, so this call is collective, as before.
            self._enter("state_dict")
            return adam_state.gathered_state_dict(self, None, self._GATHER_CHUNK)
        self._check_groups()
        return adam_state.served_state_dict(self, self._server, self._agreement.ordinal,
                                            self._served.counts(),
                                            self._GATHER_CHUNK)

    @disable_dynamo  # as torch.optim.Optimizer's
    def sharded_state_dict(self) -> dict:
        """This rank's shard of the state in torch.optim.Adam's format, for
        torch.distributed.checkpoint: ``step`` a tensor per parameter, each state tensor
        a ShardedTensor of the parameter's shape whose local shards are views of this
        rank's state (``zero_triton.optim.sharded_state``), so that ``dcp.save`` writes
        ~1/world_size of it per rank and ``dcp.load`` reshards to any world size.
        ``get_optimizer_state_dict(model, opt)`` returns it (``zero_triton.integrations.
        dcp``); ``load_state_dict`` takes it back. Collective (every rank agrees on the
        state first). State-dict hooks run as for ``state_dict``."""
        self.wait_params()

        def build():
            self._enter("sharded_state_dict")
            return sharded_state.sharded_state_dict(self, self._current_flats())
        return adam_state.with_state_dict_hooks(self, build)

    def consolidated_state_dict(self, to_rank: int | None = 0):
        """The full state in torch.optim.Adam's format (``FusedAdam.state_dict()``'s:
        per-parameter step, exp_avg, exp_avg_sq, [max_exp_avg_sq], master_param for
        fp16/bf16) on group rank ``to_rank`` (every rank for None), as CPU tensors; None
        on the other ranks.

        Collective. Gathered one chunk of one state of one flat buffer at a time, so the
        receiver's peak memory is one full copy plus ``world_size`` chunks (not
        ``world_size`` full copies, where torch's ZeroRedundancyOptimizer runs out)."""
        self.wait_params()
        self._enter("consolidated_state_dict")
        return adam_state.gathered_state_dict(self, to_rank, self._GATHER_CHUNK)

    @torch.no_grad()
    def _load_full_state_dict(self, state_dict: dict) -> None:
        if self._comm.world_size == 1:
            return super()._load_full_state_dict(state_dict)
        self._enter("load_state_dict")
        # A DCP load's ShardedTensors (``sharded_state_dict``'s): this rank's shards, copied.
        state_dict = sharded_state.localized(state_dict)
        state_dict = watch.unaliased(state_dict, self._live_tensors())
        plan, error = None, None
        try:
            plan = adam_state.plan_load(self, state_dict)
        except (ValueError, KeyError, TypeError) as exc:
            error = exc
        every = self._comm.all_gather_object(
            None if error is None else f"{type(error).__name__}: {error}", "load_state_dict")
        if error is not None:
            raise error
        for r, msg in enumerate(every):
            if msg is not None:
                raise ValueError(f"rank {r} rejected the state dict: {msg}; nothing was changed")
        adam_state.apply_load(self, state_dict, plan)
        self._loaded()


def _describe(entry) -> str:
    if isinstance(entry, tuple) and len(entry) == 5:
        gi, pi, shape, dtype, rg = entry
        return f"group {gi} parameter {pi} of shape {list(shape)} {dtype}" + ("" if rg else " (frozen)")
    return str(entry)


class ZeroAdamW(ZeroAdam):
    """ZeroAdam with decoupled weight decay (default 1e-2), as torch.optim.AdamW."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, master_weights=None, backend="auto",
                 process_group=None, reduce_dtype=None, max_grad_norm=None, bucket_cap_mb=25,
                 stage=1, **torch_flags):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         decoupled_weight_decay=True, master_weights=master_weights,
                         backend=backend, process_group=process_group, reduce_dtype=reduce_dtype,
                         max_grad_norm=max_grad_norm, bucket_cap_mb=bucket_cap_mb, stage=stage,
                         **torch_flags)
