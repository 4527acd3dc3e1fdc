"""DTensor parameters (FSDP2's ``fully_shard``, tensor parallel, their 2-D mix): the
adapter that steps each parameter's local shard where the engine keeps it.

What the engine owns and what we own:

- The engine owns the parameters' storage and their gradients. FSDP2 all-gathers from
  its own padded shards and sets ``.grad`` (a DTensor) after its reduce-scatter; tensor
  parallel's autograd does the same. Nothing is moved: the kernel updates each local
  shard (``p._local_tensor``) in place, and reads the local gradient at ``step``.
- We own the optimizer state of those local shards: the fp32 master of fp16/bf16 shards,
  the moments and the step counts live in one flat buffer per param group, dtype and
  device (an aligned slot per local shard, ``zero_triton.state.shards``), and the kernel
  steps each shard beside its slot.
- ``opt.state`` and the state dicts hold DTensors over that buffer with each
  parameter's mesh and placements, as torch's optimizers keep theirs for DTensor
  parameters, so ``get_optimizer_state_dict``/``set_optimizer_state_dict`` and
  ``torch.distributed.checkpoint`` work unchanged.

Each rank steps only its local shards: the engine has averaged the gradients already,
so FusedAdam communicates nothing here except clipping's norm, over each mesh.
``LocalShard`` is a ``FlatShard`` (``zero_triton.optim.shard``) whose parameters stay
where the engine keeps them.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from zero_triton.comm.grads import zero_in_place
from zero_triton.comm.protocol import Comm
from zero_triton.native import backends
from zero_triton.optim.shard import FlatShard, one_kind
from zero_triton.state import master as master_formats
from zero_triton.state import watch
from zero_triton.state.flat import FlatLayout
from zero_triton.state.shards import ShardState

_DTENSOR = []  # torch's DTensor class once looked up (None where torch has none)


def dtensor_type():
    """torch's DTensor class, or None where torch has none."""
    if not _DTENSOR:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # torch < 2.5
            try:
                from torch.distributed._tensor import DTensor
            except ImportError:
                DTensor = None
        _DTENSOR.append(DTensor)
    return _DTENSOR[0]


def is_dtensor(t) -> bool:
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


def _local(p) -> torch.Tensor:
    """The local shard of DTensor ``p`` as the engine holds it now (FSDP2 may replace it
    between construction and the first forward: ``reset_sharded_param``)."""
    return p._local_tensor


def _replicas(p) -> int:
    """How many ranks of ``p``'s mesh hold each element of its local shard (the sizes of
    the mesh dimensions it is replicated over)."""
    n = 1
    for d, placement in enumerate(p.placements):
        if placement.is_replicate():
            n *= p.device_mesh.size(d)
    return n


def _check_local(p, t, i: int) -> None:
    if t.numel() and not t.is_contiguous():
        raise ValueError(
            f"DTensor parameter {i} {tuple(p.shape)} has a local shard that is not contiguous "
            f"(shape {tuple(t.shape)}, strides {tuple(t.stride())}); FusedAdam steps contiguous "
            "local shards in place. Make it contiguous before sharding (p.data = "
            "p.data.contiguous()), or optimize it with torch.optim.AdamW(fused=True)")


class EngineGrads:
    """The gradients of DTensor parameters, where the engine puts them: read at the step
    (``sync``), never moved. ``grads[i]``: parameter ``i``'s local gradient, flat, at
    this step (None without one)."""

    stage = 0  # not ZeRO's: the engine's own (FSDP2, tensor parallel)
    sharded = False
    flat = None

    def __init__(self, params, locals_):
        self.params = params
        self.numels = [t.numel() for t in locals_]
        self.grads = [None] * len(params)

    def written_since_hooks(self) -> bool:  # no bucket ever reads them
        return False

    def rewritten(self) -> None:
        pass

    def register_hooks(self, bucket_list, reducer) -> list:
        return []

    def sync(self, param_views):
        """Take each parameter's local gradient (one with other placements than its
        parameter's is redistributed to them first, as torch's optimizers do on
        DTensors: every rank does so, in the same order) and return which parameters
        have one (None when all do)."""
        present, grads = [], self.grads
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                grads[i] = None
                present.append(False)
                continue
            if is_dtensor(g):
                if g.device_mesh != p.device_mesh or tuple(g.placements) != tuple(p.placements):
                    g = g.redistribute(p.device_mesh, p.placements)
                g = g._local_tensor
            if g.is_sparse:
                raise RuntimeError(
                    f"parameter {i} ({tuple(p.shape)}) has a sparse gradient; FusedAdam "
                    "needs dense gradients (use torch.optim.SparseAdam for sparse ones)")
            if g.numel() != self.numels[i]:
                raise RuntimeError(
                    f"the gradient of DTensor parameter {i} {tuple(p.shape)} has "
                    f"{g.numel()} local elements, its local shard {self.numels[i]}: give it "
                    "the parameter's placements (p.grad = DTensor with p.placements)")
            grads[i] = g.reshape(-1)
            present.append(True)
        return None if all(present) else present

    def zero(self, set_to_none: bool = True) -> None:
        """``zero_grad``, as torch.optim.Optimizer's: ``.grad`` None, or zeroed in place."""
        for p in self.params:
            if set_to_none:
                p.grad = None
                continue
            g = p.grad
            if g is not None:
                zero_in_place(g, g._local_tensor if is_dtensor(g) else None)
        self.grads = [None] * len(self.params)

    def carry_over(self, old) -> None:
        pass

    def nbytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.grads if g is not None)


class LocalShard(FlatShard):
    """The local shards of a param group's DTensor parameters of one dtype and device:
    their state in one flat buffer, one segment (an aligned slot) per parameter, the
    kernel run on each shard in place. Built by ``zero_triton.optim.build``."""

    # The parameters' storage and gradients are their engine's (DTensor): clipping
    # reduces their norm over each parameter's mesh, checkpoints go through DCP.
    engine_owned = True

    def __init__(self, params, comm: Comm, spec, *, amsgrad=False, key=0):
        locals_ = [_local(p) for p in params]
        for i, (p, t) in enumerate(zip(params, locals_)):
            if p.is_complex():
                raise ValueError(f"DTensor parameter {i} {tuple(p.shape)} is {p.dtype}; FusedAdam "
                                 "steps real DTensor parameters (float32, float16, bfloat16, "
                                 "float64)")
            if t.device.type == "meta":
                raise ValueError(
                    f"DTensor parameter {i} {tuple(p.shape)} is on the meta device: it has no "
                    "data to step. Materialise the model first (model.to_empty(device=...) "
                    "and initialise it, e.g. reset_parameters()), then build the optimizer")
            _check_local(p, t, i)
        self.params = params
        self.dtype, self.device = locals_[0].dtype, locals_[0].device
        self.master_format = spec.master_format(self.dtype)  # zero_triton.state.master
        self.has_master = master_formats.FORMATS[self.master_format].exact
        self.spec = spec
        if self.has_master and not spec.master_weights:
            raise ValueError(
                f"master_weights=False with {self.dtype} parameters is not supported: Adam "
                "updates vanish in 8-bit mantissas; keep master_weights=None (an fp32 master "
                "for fp16/bf16 parameters) or train the parameters in float32")
        self.comm, self.key = comm, key
        self.bucket_numel, self.reducer = None, None
        # One aligned slot of state per local shard: segment i is parameter i's.
        self.layout = FlatLayout.build([tuple(t.shape) for t in locals_], align=spec.align)
        self.segments = [(o, o + t.numel(), o) for o, t in zip(self.layout.offsets, locals_)]
        self.locals = locals_
        self.param_parts = [t.view(-1) for t in locals_]  # updated in place if the engine swaps
        self.param_views = self.param_parts
        self.flat_param = None
        self.grad_buffer = EngineGrads(params, locals_)
        self.separate_shard = False  # the engine's gradients are stepped where they are
        self.buckets, self.hooks = [], []
        self.state = ShardState(self.param_parts, self.segments, self.layout,
                                master=self.master_format, amsgrad=amsgrad, moments=spec.moments)
        self.versions = watch.ParamVersions(params)  # the DTensors' own writes, not ours
        self.lr = torch.zeros(1, dtype=self.state.dtype, device=self.device)
        self.backend = "torch" if self.dtype == torch.float64 else backends.resolve(spec.backend, self.device)
        self.step_fn = backends.step_function(self.backend, self.state.moments.format)
        # one launch for all, or None (a bf16 parameter stepped itself, rounded
        # stochastically or split with its remainder: one launch each)
        self.step_list = None if not self.state.master.plain else \
            backends.list_step_function(self.backend, self.state.moments.format)
        self.scratch = torch.empty(self.layout.shard_numel, dtype=self.state.dtype, device=self.device) \
            if self.backend == "torch" else None
        self.fused = self.device.type == "cuda"
        self.stepped = None
        self.exposed_steps = None
        self._slot_key, self._slot_views = None, None

    @property
    def flat_grad(self):
        return None

    # -- the engine's parameters --------------------------------------------------------
    def first_moved(self, hint: bool = False) -> int:
        """Index of the first parameter whose local shard changed dtype or device
        (``model.to``), or -1. A shard the engine replaced with another of the same kind
        (FSDP2's ``reset_sharded_param``, ``load_state_dict(assign=True)``) is followed
        here: stepped where it is now, its master re-seeded where its values differ."""
        swapped = []
        for i, (p, t) in enumerate(zip(self.params, self.locals)):
            now = _local(p)
            if now is t:
                continue
            if now.dtype != self.dtype or now.device != self.device or now.numel() != t.numel():
                return i
            _check_local(p, now, i)
            swapped.append(i)
        for i in swapped:
            self.locals[i] = _local(self.params[i])
            self.param_parts[i] = self.locals[i].view(-1)
        if swapped:
            self._slot_key = None  # the kernel's operands name the parameters' views
            self.reseed(swapped)
        return -1

    def rehomed(self) -> "LocalShard":
        """A new LocalShard over the same parameters at their local shards' new dtype or
        device, this one's state carried over."""
        one_kind({(_local(p).dtype, _local(p).device) for p in self.params},
                 "DTensor parameters of one param group")
        shapes = [tuple(_local(p).shape) for p in self.params]
        if shapes != [tuple(t.shape) for t in self.locals]:
            raise RuntimeError(
                "zero_triton: the local shards of DTensor parameters changed shape after the "
                f"optimizer was built (now {shapes}); their state cannot follow them. Build the "
                "optimizer after the model is sharded and materialised")
        new = LocalShard(self.params, self.comm, self.spec, amsgrad=self.state.amsgrad, key=self.key)
        with torch.no_grad():
            new.state.carry_over(self.state)
        return new

    # -- the state, as DTensors ---------------------------------------------------------
    def state_views(self, bufs: dict | None = None) -> dict:
        """Per-parameter DTensors over each state buffer (of ``bufs`` if given), with the
        parameter's mesh, placements, shape and stride (their local tensors are views of
        the buffer)."""
        cls = dtensor_type()
        return {k: [cls.from_local(v, p.device_mesh, p.placements, run_check=False,
                                   shape=p.shape, stride=p.stride())
                    for v, p in zip(views, self.params)]
                for k, views in self.state.views(bufs).items()}

    def local_views(self, bufs: dict | None = None) -> dict:
        return self.state.views(bufs)

    def local_value(self, value: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s local part of ``value``: a DTensor (redistributed to the
        parameter's placements if it has others: collective, as every rank loads), or a
        whole tensor of the parameter's global shape (this rank's part is taken, no
        communication), or already a tensor of the local shard's shape."""
        p = self.params[i]
        if is_dtensor(value):
            if value.device_mesh != p.device_mesh or tuple(value.placements) != tuple(p.placements):
                value = value.redistribute(p.device_mesh, p.placements)
            return value._local_tensor
        local = self.locals[i]
        if tuple(value.shape) == tuple(p.shape) and tuple(p.shape) != tuple(local.shape):
            from torch.distributed.tensor import distribute_tensor
            return distribute_tensor(value.to(local.device), p.device_mesh, p.placements,
                                     src_data_rank=None)._local_tensor
        return value

    # -- the step -----------------------------------------------------------------------
    def _slots(self, amsgrad: bool) -> list:
        """Per segment, the kernel's operands of its state slot: (its ``param``, its
        ``param_lp``, the master's keywords: ``Master.operands``; then the moments',
        ``MomentStore.operands``), made again only when a parameter's view or a state
        buffer is replaced (amsgrad switched on, a re-home) or amsgrad changes."""
        st = self.state
        key = (st.master, st.moments, st.amsgrad, amsgrad)
        if self._slot_key is None or any(a is not b for a, b in zip(key, self._slot_key)):
            self._slot_views = [(*st.master.operands(s0, s0 + hi - lo, part),
                                 *st.moments.operands(s0, s0 + hi - lo, amsgrad))
                                for part, (lo, hi, s0) in zip(self.param_parts, self.segments)]
            self._slot_key = key
        return self._slot_views

    def update(self, plan: dict) -> None:
        """The kernel over every local shard stepped this step: one launch with a backend
        that takes lists (Triton), else one per shard."""
        runs, grads, slots = plan["runs"], self.grad_buffer.grads, self._slots(plan["amsgrad"])
        members = [k for k, (lo, hi, _) in enumerate(self.segments)
                   if hi > lo and (runs is None or runs[k])]
        kwargs, amsgrad, st = plan["kwargs"], plan["amsgrad"], self.state
        if self.step_list is None or len({grads[k].dtype for k in members}) > 1:
            for k in members:
                param, param_lp, how, *moments = slots[k]
                lo, hi, s0 = self.segments[k]
                if self.scratch is not None:  # the torch backend's work space
                    kwargs = {**plan["kwargs"], "scratch": self.scratch[s0:s0 + hi - lo]}
                if st.moments.keyed or st.master.keyed:  # the engine's placement
                    kwargs = {**kwargs, "seed": self.key, "index": s0}
                self.step_fn(param, grads[k], *moments, param_lp, st.step_of(k), self.lr,
                             **kwargs, **how)
            return
        self.step_list([slots[k][0] for k in members], [grads[k] for k in members],
                       [slots[k][3] for k in members], [slots[k][4] for k in members],
                       [slots[k][5] for k in members] if amsgrad else None,
                       [slots[k][1] for k in members] if self.has_master else None,
                       [st.step_of(k) for k in members], self.lr, **kwargs)

    def grad_norm_term(self, norm_type: float, dtype) -> torch.Tensor:
        """The ``norm_type`` norm's term of these gradients over every rank of their
        meshes: the sum of |g|^norm_type (each element once: a local shard replicated
        over a mesh dimension is counted once) or the largest |g|, reduced over each
        parameter's mesh."""
        by_mesh: dict = {}
        for p, g in zip(self.params, self.grad_buffer.grads):
            # Every mesh takes part, with or without gradients: its ranks reduce together.
            if g is None or not g.numel():
                term = torch.zeros((), dtype=dtype, device=self.device)
            elif norm_type == math.inf:
                term = g.abs().max().to(dtype)
            else:
                term = torch.linalg.vector_norm(g, norm_type, dtype=dtype) ** norm_type / _replicas(p)
            by_mesh.setdefault(p.device_mesh, []).append(term)
        totals = []
        for mesh, terms in by_mesh.items():
            total = torch.stack(terms)
            total = total.max() if norm_type == math.inf else total.sum()
            op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
            for d in range(mesh.ndim):  # over the whole mesh, one dimension at a time
                if mesh.size(d) > 1:
                    dist.all_reduce(total, op=op, group=mesh.get_group(d))
            totals.append(total)
        if not totals:
            return torch.zeros((), dtype=dtype, device=self.device)
        total = torch.stack(totals)
        return total.max() if norm_type == math.inf else total.sum()

    def gather_bucket(self, k: int) -> None:  # the engine gathers its own parameters
        pass

    def nbytes(self) -> dict:
        def size(t):
            return 0 if t is None else t.numel() * t.element_size()
        return {"params": sum(size(t) for t in self.locals),
                "grads": self.grad_buffer.nbytes(),
                **self.state.nbytes(),
                "padding": 0,
                "scratch": size(self.scratch)}
