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
from torch.distributed.algorithms.join import Joinable, _JoinConfig

from zero_triton.comm.group import GroupComm
from zero_triton.comm.compressed import Int8Comm
from zero_triton.comm.hybrid import HybridComm
from zero_triton.native.compat import disable_dynamo
from zero_triton.optim import compact as compact_state
from zero_triton.optim import join, owners, sharded_state, zero_release
from zero_triton.optim import state_dict as adam_state
from zero_triton.optim.checks import (adam_hyperparameters, check_device_mesh, check_flag,
                                      check_no_dtensors, check_params_argument,
                                      check_process_group)
from zero_triton.optim.fused import FusedAdam
from zero_triton.optim.seat import Seat
from zero_triton.state.keys import formats_of
from zero_triton.optim.spec import Spec


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
        device_mesh: instead of ``process_group``, a DeviceMesh: 1-D, the group it holds;
            2-D, hybrid sharding over (replicate, shard) dims (FSDP2's HSDP): the state
            is sharded over each row (``mesh.get_group(1)``, within a node) and every row
            holds a copy; gradients are averaged within the row, then across the rows on
            1/S of them, and parameters all-gathered within the row
            (``zero_triton.comm.hybrid``). The mesh spans every rank.
        reduce_dtype: dtype to average gradients in (e.g. torch.float32 for bf16
            grads); default the gradient's own dtype.
        reduce_dtype="int8": the average sent as int8 blocks (one fp32 scale per 256
            elements), dequantized and summed in float32 in rank order
            (``zero_triton.comm.compressed``), with error feedback: what quantization
            dropped is sent again at the next step (``error_feedback``: True, bf16
            buffers of the local gradients' size; torch.float32; False: none).
        gather_dtype: None (default) or "int8": the parameters all-gathered as int8
            blocks (fp16/bf16 parameters with an fp32 master, which stays exact); every
            rank, the owner too, then holds the same dequantized parameters.
        moments: "fp32" (default) | "bf16" | "int8" | "int4": the Adam moments' format, as
            FusedAdam's; the blocks and the rounding are keyed by the layout, so the
            result does not depend on the world size or the bucket size (bitwise).
        offload: None (default) or "cpu": this rank's master and moments in (pinned)
            host memory, stepped there bucket by bucket, each bucket's parameters copied
            back before its all-gather (zero_triton.optim.offload; the same bits).
            offload_fraction: the share of the state offloaded (1, the default: all; f in
            (0, 1): the last f of each rank's shard, the rest stepped on the device meanwhile).
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
        grad_release: with stage=2, each bucket's shard of the state is stepped in
            backward as its average lands, and the average let go: between backward and
            step() a rank holds only the averages in flight; step() steps what backward
            did not and gathers the parameters (``zero_triton.optim.zero_release``: what
            it refuses, and why). The same bits as without.

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
    _builds_differentiable = False  # refused by its constructor (FusedAdam's is a class: DifferentiableAdam)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, *, maximize=False, decoupled_weight_decay=False,
                 master_weights=None, backend="auto", process_group=None, reduce_dtype=None,
                 max_grad_norm=None, bucket_cap_mb=25, stage=1, moments="fp32", foreach=None,
                 fused=None, capturable=False, differentiable=False, device_mesh=None,
                 gather_dtype=None, error_feedback=True, offload=None, offload_fraction=None,
                 grad_release=False):
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
        zero_release.check(stage, bucket_cap_mb, grad_release)
        check_process_group(process_group)
        check_device_mesh(device_mesh, process_group)
        spec = Spec.build(master_weights=master_weights, backend=backend,
                          reduce_dtype=reduce_dtype, bucket_cap_mb=bucket_cap_mb, stage=stage,
                          max_grad_norm=max_grad_norm, differentiable=differentiable,
                          moments=moments, capturable=capturable).with_wire(gather_dtype, error_feedback) \
            .with_offload(offload=offload, offload_fraction=offload_fraction) \
            .with_release(grad_release)
        compress = _compressing(spec)
        if device_mesh is not None and device_mesh.ndim == 2:
            comm = HybridComm(device_mesh, wrap=compress, buffers=spec.capture.buffers())
        else:
            comm = compress(GroupComm(device_mesh.get_group() if device_mesh is not None
                                      else process_group))
        params = list(params)
        if not params:
            raise ValueError("ZeroAdam got an empty parameter list")
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        for g in groups:  # materialise generators once: we read them twice
            if not isinstance(g["params"], torch.Tensor):
                g["params"] = list(g["params"])
        check_no_dtensors(groups, type(self).__name__)  # before any collective
        _check_mesh_device(device_mesh, groups)
        self._check_same_model(comm, groups, {
            "moments": spec.moments, "master_weights": spec.master_weights,
            "param groups' formats": [formats_of(g) for g in groups],
            "reduce_dtype": str(spec.reduce_codec or spec.reduce_dtype),
            "gather_dtype": spec.gather_codec, "error_feedback": str(spec.error_feedback)})
        # How calls meet the other ranks (zero_triton.optim.ranks): agreed over the group,
        # with the side channel's shard server answering another rank's state_dict();
        # made after the model check, which every rank passes together.
        self._seat = Seat(self)  # what the parts are handed (zero_triton.optim.seat)
        ranks = spec.capture.ranks(self._seat, comm, spec)  # zero_triton.optim.capture
        # torch's Join (uneven inputs): disabled outside a Join block.
        self._join_config = _JoinConfig.construct_disabled_join_config()
        self._build(groups, hyper, spec, comm, ranks)
        self._constructed = True
        ranks.built(self._seat)

    # -- torch's Join (zero_triton.optim.join) ----------------------------------------
    def join_hook(self, **kwargs) -> join.ZeroJoinHook:
        """What a rank that ran out of inputs runs under ``Join`` while others have some
        (``Join`` passes every joinable the same keywords; DDP's
        ``divide_by_initial_world_size`` is the one that concerns averaging)."""
        self._spec.capture.check_join()
        self._pipeline.check_join()
        if not kwargs.get("divide_by_initial_world_size", True):
            raise ValueError(
                "ZeroAdam under Join averages over the initial world size (a joined rank's "
                "gradients count as zeros, DDP's default): divide_by_initial_world_size=False "
                "is not supported; leave it out")
        self._ranks.refuse_under_join(self._join_config.enable)
        return join.ZeroJoinHook(self._seat)

    @property
    def join_device(self) -> torch.device:
        """Where Join's own all-reduces run: the parameters' device."""
        return next((f.device for _, f in self._shards.listed(self.param_groups)), torch.device("cpu"))

    @property
    def join_process_group(self):
        return self._comm.everyone.process_group

    @staticmethod
    def _check_same_model(comm, groups, formats=None):
        """Every rank built the same model, and (``formats``: {"moments": ..,
        "master_weights": ..}) the same state formats: they decide the layout every rank
        shards and what each shard holds."""
        mine = _signature(groups)
        every = comm.all_gather_object((mine, formats))
        for key in formats or {}:
            theirs = [f[key] for _, f in every]
            if any(t != formats[key] for t in theirs):
                raise RuntimeError(
                    f"ZeroAdam: ranks disagree on {key}= ({theirs} by rank); it decides how "
                    "every rank's shard of the state is laid out and stepped, so every rank "
                    "must pass the same one")
        for rank, (theirs, _) in enumerate(every):
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
        if getattr(self, "_constructed", False) and self._pipeline.reduced:
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
            self._check_same_model(self._comm, [param_group],
                                   {"the group's formats": formats_of(param_group)})
        super().add_param_group(param_group)
        # torch's clip_grad_norm_ comes here (``zero_triton.integrations.clip_grad``) when
        # the local gradients are not the averaged ones (several ranks), or there are none
        # (stage 2).
        owners.register(self, [p for f in self._shards.groups[-1] for p in f.params],
                        routes_clipping=self._comm.everyone.world_size > 1 or self._spec.grads.sharded)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation, as DistributedDataParallel's ``no_sync``: backward
        passes inside only accumulate each rank's local gradients; the first backward
        outside (the micro-batch that ends the accumulation) averages them, bucket by
        bucket as it goes, and ``step()`` waits for what is still in flight. Under
        stage 2 every micro-batch is averaged into the shard anyway (there is no full
        gradient buffer to accumulate in): the context changes nothing there, but
        with ``grad_release=True``, where backward inside steps nothing and the first
        backward outside steps each bucket with the sum of the averages."""
        with self._reducer.accumulating(self._spec.grads.sharded), self._pipeline.accumulating():
            yield

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
    def state_dict(self, compact: bool | None = None) -> dict:
        """The full state in torch.optim.Adam's format, as CPU tensors, on the rank that
        calls it: on one rank alone (``if rank == 0: torch.save(opt.state_dict())``, HF
        Trainer's checkpoint) or on every rank. The other ranks' shards come from their
        shard servers (``zero_triton.comm.serve``), chunk by chunk, wherever those ranks
        are (a barrier, the next iteration). ``load_state_dict`` on any world size keeps
        each rank's shard. ``compact=True``: low-bit moments as their store keeps them
        (``zero_triton.optim.compact``). For large models prefer
        ``zero_triton.checkpoint.save`` (each rank writes only its shard). State-dict
        hooks run on the calling rank."""
        return super().state_dict(compact)

    @disable_dynamo  # as torch.optim.Optimizer's
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full state in torch.optim.Adam's format (``consolidated_state_dict()``,
        ``FusedAdam.state_dict()`` or torch.optim.Adam's own), given on every rank; each
        rank keeps its shard. Collective: every rank checks everything first, and if any
        rank rejects the state dict all raise and nothing changes. Without
        ``master_param`` the master is the current parameter upcast. Load-state-dict
        hooks run on every rank."""
        super().load_state_dict(state_dict)

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
            return sharded_state.sharded_state_dict(self._seat, self._pipeline.current())
        return adam_state.with_state_dict_hooks(self, build)

    def consolidated_state_dict(self, to_rank: int | None = 0, *, compact: bool = False):
        """The full state in torch.optim.Adam's format (``FusedAdam.state_dict()``'s:
        per-parameter step, exp_avg, exp_avg_sq, [max_exp_avg_sq], master_param for
        fp16/bf16) on group rank ``to_rank`` (every rank for None), as CPU tensors; None
        on the other ranks. ``compact=True``: low-bit moments as their store keeps them
        (``zero_triton.optim.compact``).

        Collective. Gathered one chunk of one state of one flat buffer at a time, so the
        receiver's peak memory is one full copy plus ``world_size`` chunks (not
        ``world_size`` full copies, where torch's ZeroRedundancyOptimizer runs out)."""
        check_flag("compact", compact)
        self.wait_params()
        self._enter("consolidated_state_dict")
        state_dict = adam_state.gathered_state_dict(self._seat, to_rank, self._GATHER_CHUNK)
        return compact_state.compact(self._seat, state_dict) if compact and state_dict is not None \
            else state_dict


def _compressing(spec):
    """The communicator a group's ``GroupComm`` becomes: itself, or an ``Int8Comm`` over it
    when anything is sent compressed (``zero_triton.comm.compressed``)."""
    if spec.gather_codec is None and spec.reduce_codec is None:
        return lambda comm: comm
    return lambda comm: Int8Comm(comm, gather=spec.gather_codec, reduce=spec.reduce_codec,
                                 feedback=spec.error_feedback,
                                 buffers=spec.capture.buffers())


def _check_mesh_device(device_mesh, groups) -> None:
    """The mesh's device type is the parameters' (its groups' backend moves them)."""
    if device_mesh is None:
        return
    for g in groups:
        params = [g["params"]] if isinstance(g["params"], torch.Tensor) else g["params"]
        for p in params:
            if p.device.type != device_mesh.device_type:
                raise ValueError(
                    f"device_mesh is a {device_mesh.device_type!r} mesh and a parameter is on "
                    f"{p.device}: build the mesh on the parameters' device type "
                    f"(init_device_mesh({p.device.type!r}, ...)) or move the model there first")


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
                 stage=1, device_mesh=None, **torch_flags):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         decoupled_weight_decay=True, master_weights=master_weights,
                         backend=backend, process_group=process_group, device_mesh=device_mesh,
                         reduce_dtype=reduce_dtype,
                         max_grad_norm=max_grad_norm, bucket_cap_mb=bucket_cap_mb, stage=stage,
                         **torch_flags)
