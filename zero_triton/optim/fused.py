"""FusedAdam / FusedAdamW: torch.optim.Adam semantics, one fused kernel per flat buffer.

Parameters of one param group, dtype and device are re-homed into one flat buffer
(``zero_triton.state.flat``); a gradient, once backward makes one, moves into a twin grad buffer
and ``.grad`` becomes its view there, so further micro-batches accumulate straight into it
(``zero_triton.comm.grads``; ``.grad`` is None after ``zero_grad`` as in torch). Each rank owns one shard of every buffer: with world size
1 (this module) the shard is the whole buffer and nothing is communicated; ZeroAdam
(``zero_triton.optim.zero``) is the same optimizer with a process group.
"""
from __future__ import annotations


import torch

from zero_triton.comm import buckets, grads
from zero_triton.comm.group import LocalComm
from zero_triton.native.compat import disable_dynamo
from zero_triton.optim import owners, release
from zero_triton.optim import differentiable as plain
from zero_triton.optim import state_dict as adam_state
from zero_triton.optim import compact as compact_state
from zero_triton.optim.checks import (adam_hyperparameters, check_flag, check_group_params,
                                      check_params_argument, group_params,
                                      to_float, with_grads, without_meta)
from zero_triton.optim.edits import UserEdits
from zero_triton.optim.offload import split_host
from zero_triton.optim.protocol import Ranks
from zero_triton.optim.seat import Seat
from zero_triton.optim.ranks import OneRank
from zero_triton.optim.shards import Shards
from zero_triton.optim.spec import Spec


class FusedAdam(torch.optim.Optimizer, plain.BuildsDifferentiable):
    """Adam with torch.optim.Adam's signature and semantics, one fused kernel per flat
    buffer.

    Args beyond torch's:
        master_weights: None (default) keeps an fp32 master for fp16/bf16 parameters;
            fp32 parameters are their own master. "remainder": bf16 parameters with only
            the master's low 16 bits beside them, the same master for 2 bytes instead of
            4 (zero_triton.kernels.remainder). "remainder8": 8 of those bits, a 24-bit
            master for 1 byte, each step rounded to 2**-16 of the weight. "stochastic": bf16 parameters without
            one, stepped in float32 and rounded back stochastically (a hash of the step
            and the element's place: the same at every world size; zero_triton.kernels.rounding).
        backend: "auto" | "triton" | "cuda" | "cpu" | "torch" (see zero_triton.native.backends).
        moments: "fp32" (default, torch's state) | "bf16" (4 bytes per parameter for both
            moments, stochastic rounding: zero_triton.state.bf16) | "int8" (block-scaled
            8-bit codes, 2.03 bytes: zero_triton.state.int8) | "int4" (4-bit codes two
            to a byte, 1.03 bytes: zero_triton.state.int4).
        offload: None (default) or "cpu": the master and moments in (pinned) host memory,
            stepped there (zero_triton.optim.offload); offload_fraction: the share offloaded
            (1, the default: all; 0.5: the last half, the rest stepped on the device meanwhile).
        grad_release: step each parameter in backward as its gradient is made and free the
            gradient (zero_triton.optim.release): the gradients are never all held.
            ``no_sync()`` keeps them for gradient accumulation; clipping, GradScaler,
            capturable, offload and DTensor parameters are refused with it.

    The parameters' storage moves into flat buffers at construction (a later
    ``model.to(device, dtype)`` is followed at the next step). ``zero_grad`` is torch's:
    ``.grad`` None, or zeroed in place with ``set_to_none=False``. As in
    torch.optim.Adam, a parameter whose ``.grad`` is None at ``step`` is not updated;
    parameters with ``requires_grad=False`` at construction are left out. With
    ``differentiable=True`` it is a ``DifferentiableAdam``: torch's layout and its
    differentiable step (``zero_triton.optim.differentiable``).
    """

    _step_supports_amp_scaling = True
    # A param group whose parameters were replaced is rebuilt over the new ones before
    # its first step (optim/edits.py); ZeroAdam refuses it.
    _rebuilds_replaced_groups = True
    _decoupled_weight_decay = False  # FusedAdamW: True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, *, maximize=False, decoupled_weight_decay=False,
                 master_weights=None, backend="auto", max_grad_norm=None, moments="fp32",
                 offload=None, offload_fraction=None, grad_release=False, foreach=None, fused=None,
                 capturable=False, differentiable=False):
        hyper = adam_hyperparameters(lr, betas, eps, weight_decay, amsgrad, maximize,
                                     decoupled_weight_decay, foreach=foreach, fused=fused,
                                     capturable=capturable, differentiable=differentiable)
        check_params_argument(params, type(self).__name__)
        spec = Spec.build(master_weights=master_weights, backend=backend,
                          max_grad_norm=max_grad_norm, differentiable=differentiable,
                          moments=moments, capturable=capturable) \
            .with_offload(offload=offload, offload_fraction=offload_fraction) \
            .with_release(grad_release)
        if spec.release:
            release.refuse_process_group()
        self._build(params, hyper, spec, LocalComm(), OneRank())

    def _build(self, params, hyper: dict, spec: Spec, comm, ranks: Ranks) -> None:
        """The constructor proper: the param groups' defaults ``hyper`` (torch's
        hyperparameters, ``adam_hyperparameters``) and what the optimizer is built with,
        ``spec``, over ``comm`` (``LocalComm`` here; ZeroAdam passes its process group's),
        meeting the other ranks through ``ranks`` (``zero_triton.optim.ranks``)."""
        if spec.differentiable:  # FusedAdam's are DifferentiableAdams (__new__)
            raise ValueError(f"{type(self).__name__}(differentiable=True) is not supported: autograd "
                             "through a sharded step would need every rank's graph; use "
                             "FusedAdam(differentiable=True) (or torch.optim.Adam) on one process")
        self._spec = spec
        # What the parts are handed instead of the optimizer (zero_triton.optim.seat).
        self._seat = self.__dict__.get("_seat") or Seat(self)
        hyper = {**hyper, "betas": tuple(to_float(b) for b in hyper["betas"])}
        self.grad_norm = None
        self._comm = comm
        self._ranks = ranks
        # opt.state and the user's edits; one rank holds whole parameters' state, which
        # opt.state views.
        self._edits = UserEdits(type(self).__name__, views_state=comm.world_size == 1)
        # Averaged in step() only with bucket_cap_mb=None (safe for ranks reaching different
        # parameters) or capturable=True (a captured step is self-contained).
        self._reducer = buckets.Reducer(comm, staging=spec.capture.staging,
                                        enter=ranks.backward_entry(self._seat),
                                        early=spec.capture.early(spec.bucket_cap_mb))
        self._overlap = None  # a ParamPrefetch once zero_triton.overlap(model, opt) is called
        self._shards = Shards(comm, spec, self._reducer, self._edits, self._rebuilds_replaced_groups)
        self._clipping = spec.clipping(spec.capture.buffers())  # this step's coefficient and norms
        self._pipeline = spec.pipeline(self._seat, comm, self._shards, self._reducer,
                                       self._clipping, ranks, self._edits)
        defaults = {**hyper, **adam_state.group_keys(False, **spec.capture.keywords)}
        # Groups are added one by one, each attaching .grad views: if a later group is
        # rejected, put the earlier groups' gradients back so that a failed constructor
        # leaves the parameters as it found them.
        params, grads_before = with_grads(params)
        try:
            super().__init__(params, defaults)
        except BaseException:
            for p, g in grads_before:
                p.grad = g
            raise
        owners.built()

    # -- construction -------------------------------------------------------------
    @disable_dynamo
    def add_param_group(self, param_group: dict) -> None:
        if not self.param_groups:  # construction: torch.optim.Optimizer's empty state
            self.state = self._edits.tracked
        param_group, params, group = group_params(param_group, self.param_groups, self.defaults)
        check_group_params(params, self.param_groups, materialised=not isinstance(self._comm, LocalComm))
        # Build the flat buffers before registering the group, so an error (no usable
        # backend, say) leaves the optimizer as it was.
        shards = self._shards.build(params, group)
        super().add_param_group(param_group)
        self._edits.add_group(params, group)  # as given: followed if replaced
        self._shards.add(self.param_groups, shards)
        if self._spec.release:  # torch's clipping over them is refused (it would see no .grad)
            owners.register(self, [p for s in shards for p in s.params], routes_clipping=True)

    def _enter(self, entry: str, pairs=None, stale: bool = False, detail: str = "") -> bool:
        """Start a call that reads the state (``step``, the state dicts, clipping,
        checkpoints): follow what the user changed since the last one, agreed by every
        rank (``Ranks.enter``). Returns whether the gradients must be averaged again."""
        return self._ranks.enter(self._seat, entry, pairs, stale, detail)

    # -- what users read; the layers above read the rest through optim.interface ----------
    @property
    def backend(self) -> str | None:
        """The backend that steps the first shard (None before there is one)."""
        return next((shard.backend for _, shard in self._shards.listed(self.param_groups)), None)

    def _shards_loaded(self, shards) -> None:
        """A loader (``zero_triton.checkpoint``) wrote the master and moments of ``shards``
        and the parameters from them: the parameters' writes are ours, and ``opt.state``
        views the new state (one rank)."""
        for shard in shards:
            shard.published()
            shard.versions.accept()
        self._edits.expose(*shards)
        self._ranks.loaded()

    def _overlap_removed(self, prefetch) -> None:
        """``prefetch.remove()`` (``zero_triton.overlap``'s handle): ``step`` waits for its
        all-gathers again."""
        self.wait_params()
        if self._overlap is prefetch:
            self._overlap = None
            self._reducer.set_overlapped(False)

    def wait_params(self) -> None:
        """Wait for the parameter all-gathers still in flight. Only needed with
        ``zero_triton.overlap(model, optimizer)``, where ``step`` returns before the
        parameters have arrived and each module's forward waits for its own. A torch
        operation on a parameter before that forward, on the thread that called
        ``step``, calls it by itself (``comm.pending_reads``), as do the optimizer's
        state dicts, checkpoints and ``step``."""
        self._reducer.wait_gathers()

    def no_sync(self):
        """Gradient accumulation, as DistributedDataParallel's ``no_sync``: backward
        passes inside keep their gradients in ``.grad``, summed as torch sums them. With
        ``grad_release=True`` the first backward outside (the micro-batch that ends the
        accumulation) steps each parameter with the sum and frees it; without, one process
        has nothing to hold back and the context changes nothing (ZeroAdam's holds back
        the averages)."""
        return self._pipeline.accumulating()

    # -- the step -------------------------------------------------------------------
    @disable_dynamo  # eager under torch.compile, as torch.optim.Optimizer's
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch.optim.Optimizer.zero_grad: every ``.grad`` None (``set_to_none``,
        the default; nothing is written), or each gradient zeroed in place and kept, so
        that the parameter is stepped with a zero gradient even if the next backward
        does not reach it."""
        self._reducer.reset()  # reductions still reading the gradients finish first
        for _, shard in self._pipeline.current(hint=True):
            shard.zero_grads(set_to_none)
        self._pipeline.zeroed()

    @torch.no_grad()
    def _unscale_grads_(self, inv_scale, found_inf, per_device: dict, allow_fp16: bool) -> None:
        """GradScaler's unscale of gradients it cannot see, called by its ``unscale_`` /
        ``step``: ZeRO-2's averaged shards (no ``.grad``), checked for inf/nan and
        unscaled by ``inv_scale`` (1 inside ``scaler.step``) into its per-device flags.
        Every other gradient is a ``.grad`` GradScaler sees itself."""
        if self._spec.grads.sharded:
            self._pipeline.reduce(entry="GradScaler")
            grads.unscale_averaged_([f for _, f in self._shards.listed(self.param_groups)], inv_scale, found_inf,
                                    per_device, allow_fp16)

    def _agree_found_inf_(self, per_device: dict) -> None:
        """GradScaler's per-device inf flags agreed by every rank (``Ranks.agree_found_inf``)."""
        self._ranks.agree_found_inf(self._seat, per_device)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *, _grad_scale=None,
                        _in_step: bool = False) -> torch.Tensor:
        """Clip the global gradient norm (over every rank's shard) to ``max_norm``, as
        torch.nn.utils.clip_grad_norm_ would on the full averaged gradient. The
        coefficient is applied inside the next ``step``'s kernel; returns the total
        norm as a tensor (no host sync). Under ZeroAdam, torch.nn.utils.clip_grad_norm_
        over the optimizer's parameters calls this (``zero_triton.integrations.clip_grad``)."""
        norm = self._pipeline.clip(max_norm, norm_type, _grad_scale, _in_step)
        if norm is None:
            return torch.zeros(())
        self.grad_norm = norm
        return norm

    @torch.no_grad()
    def total_grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The global gradient norm (over every rank's shard of the averaged gradients) as
        torch.nn.utils.get_total_norm over every ``.grad`` gives it under DDP, of the
        gradients as this step's clipping left them; a tensor, no host sync. With
        ``clip_grads_with_norm_`` it is ``clip_grad_norm_`` in two calls, as torch splits
        it. Under ZeroAdam, torch.nn.utils.get_total_norm over the optimizer's gradients
        calls this (``zero_triton.integrations.clip_grad``)."""
        return self._clipping.hand_out(self._pipeline.global_norm(norm_type))

    @torch.no_grad()
    def clip_grads_with_norm_(self, max_norm: float, total_norm) -> None:
        """Scale this step's gradients by min(1, max_norm / (total_norm + 1e-6)) inside the
        next ``step``'s kernel, as torch.nn.utils.clip_grads_with_norm_ scales ``.grad``.
        Where the local gradients are not the averaged ones (ZeroAdam at several ranks, or
        stage 2), ``total_norm`` must be one ``total_grad_norm`` returned this step;
        another is refused with the fix, before anything changes."""
        averaged = self._comm.everyone.world_size == 1 and not self._spec.grads.sharded
        self._clipping.clip_with(max_norm, total_norm, local_is_averaged=averaged)

    def step(self, closure=None):
        """One optimizer step. With GradScaler (``scaler.step(opt)``), the scale and the
        inf flag it attaches are applied inside the kernel; a step with inf/nan
        gradients changes nothing. Parameters without a gradient are not updated.
        """
        return self._fused_step(closure)

    # torch.compile runs the fused step as it is, one eager island in the traced code,
    # as torch.optim.Adam(fused=True) runs its kernel: the step is bookkeeping of Python
    # objects (which gradients arrived, which parameters were written) around kernel
    # launches, and tracing it would add guards, not speed.
    @disable_dynamo
    @torch.no_grad()
    def _fused_step(self, closure):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._reducer.wait_gathers()  # the last step's, when the forward did not need them all
        pairs = self._pipeline.current(hint=True)
        if any(shard.device.type == "meta" for _, shard in pairs):
            pairs = without_meta(pairs)
        self._edits.check_frozen()
        norm = self._pipeline.step(pairs, getattr(self, "grad_scale", None),
                                   getattr(self, "found_inf", None), self._spec.max_grad_norm,
                                   overlapped=self._overlap is not None)
        if norm is not None:
            self.grad_norm = norm
        return loss

    # -- copy and pickle ------------------------------------------------------------
    def __getstate__(self) -> dict:
        """What ``copy.deepcopy`` and ``pickle`` keep (``_pickled``)."""
        return _pickled(self)

    def __setstate__(self, saved: dict) -> None:
        _unpickled(self, saved)

    # -- reports --------------------------------------------------------------------
    def memory_report(self) -> dict:
        """This rank's bytes now: low-precision params, grads (the local gradients and,
        under ZeRO, the averaged shard, held from the average in backward to the step's
        kernel; on CPUs a bucket's shard above 32 MiB is kept between steps), fp32 master,
        moments, padding (elements that belong to no parameter, params and grads),
        scratch, the buckets in flight (the reduce-scatters' receive buffers), and what the
        communicator keeps between steps (``comm``: int8 averages' error feedback); with
        ``offload="cpu"``, ``host`` and ``device`` split them by where they live."""
        total = {"params": 0, "grads": 0, "master": 0, "moments": 0, "padding": 0, "scratch": 0,
                 "buckets": self._reducer.bytes, "comm": self._comm.held_bytes(), "host": 0}
        for _, shard in self._shards.listed(self.param_groups):
            for k, v in shard.nbytes().items():
                total[k] += v
        total["optimizer_state"] = total["master"] + total["moments"]
        return split_host(total, [shard for _, shard in self._shards.listed(self.param_groups)])

    # -- state dict (torch.optim.Adam format: zero_triton.optim.state_dict) ------------------
    @disable_dynamo
    def state_dict(self, compact: bool | None = None) -> dict:
        """torch.optim.Adam's format: per-parameter ``step``, ``exp_avg``, ``exp_avg_sq``
        (``max_exp_avg_sq``), ``master_param`` for fp16/bf16 parameters: views of the live
        state (copies of low-bit moments). ``compact=True``: the moments as the store keeps
        them, which ``load_state_dict`` takes back bit for bit (``zero_triton.optim.compact``;
        None: compact within ``zero_triton.compact_state_dicts(opt)``, for DCP). State-dict
        hooks registered on the optimizer run as torch runs them."""
        compact = compact_state.wanted(self, compact)
        check_flag("compact", compact)
        self.wait_params()
        if compact:
            return adam_state.with_state_dict_hooks(
                self, lambda: compact_state.compact(self._seat, self._full_state_dict()))
        return adam_state.with_state_dict_hooks(self, self._full_state_dict)

    @disable_dynamo
    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch.optim.Adam's format (ours or torch's), or the compact one of
        ``state_dict(compact=True)``. Everything is checked before anything changes;
        without ``master_param`` the master is the current parameter upcast.
        Load-state-dict hooks run as torch runs them."""
        self.wait_params()
        adam_state.load_with_hooks(self, state_dict, self._load_full_state_dict)

    def _full_state_dict(self) -> dict:
        return self._ranks.state_dict(self._seat)

    def _load_full_state_dict(self, state_dict: dict) -> None:
        self._ranks.load_state_dict(self._seat, compact_state.expand(state_dict))


class FusedAdamW(FusedAdam):
    """AdamW: FusedAdam with decoupled weight decay (default 1e-2), as torch.optim.AdamW."""

    _decoupled_weight_decay = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, master_weights=None, backend="auto", **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         decoupled_weight_decay=self._decoupled_weight_decay,
                         master_weights=master_weights,
                         backend=backend, **kwargs)


def _pickled(opt) -> dict:
    """What ``copy.deepcopy`` and ``pickle`` keep: the groups (with their
    parameters), the options, and the state in torch.optim.Adam's format. A copy
    is rebuilt from them: new flat buffers over the copied parameters, same state,
    as a deep copy of torch.optim.Adam gives an optimizer of the copied tensors."""
    if not isinstance(opt._comm, LocalComm):
        raise TypeError(
            f"{type(opt).__name__} over a process group cannot be deep-copied or pickled: "
            "its state is sharded over the ranks. Save it with zero_triton.checkpoint.save, "
            "or take consolidated_state_dict() and load it into a new optimizer")
    return {"defaults": opt.defaults, "param_groups": opt.param_groups,
            "state_dict": adam_state.copyable(opt.state_dict()),
            "options": opt._spec.options()}


def _unpickled(opt, saved: dict) -> None:
    """``__setstate__``: a copy rebuilt from what ``_pickled`` kept."""
    if "_plain" in saved:
        raise TypeError("this is a FusedAdam(differentiable=True) pickled by an earlier version; "
                        "build FusedAdam(..., differentiable=True) (a DifferentiableAdam) and load "
                        "the old optimizer's state_dict() into it")
    groups, hyper, options = adam_state.pickled(saved)
    opt._build(groups, hyper, Spec.from_options(options), LocalComm(), OneRank())
    opt.load_state_dict(saved["state_dict"])
