"""One flat buffer of an optimizer and its rank's shard: the parameters (views of the
buffer), the gradients (``zero_triton.comm.grads``), the buckets that average them
(``zero_triton.comm.buckets``), the master and moments of the shard
(``zero_triton.state.shards``) and the kernel that steps it (``zero_triton.native``)."""
from __future__ import annotations

import math
import weakref

import torch

from zero_triton.comm import buckets
from zero_triton.comm.protocol import Comm
from zero_triton.native import backends
from zero_triton.state import master as master_formats
from zero_triton.state import watch
from zero_triton.state.flat import as_param, flatten_params, real_dtype
from zero_triton.state.shards import ShardState

LOW_PRECISION = (torch.float16, torch.bfloat16)
# The dtypes of flat buffers; complex parameters live in their real dtype's buffer as
# (real, imaginary) pairs (zero_triton.state.flat.real_dtype), float64 ones step in float64.
FLAT_DTYPES = (torch.float32,) + LOW_PRECISION + (torch.float64,)
SUPPORTED = FLAT_DTYPES + (torch.complex64, torch.complex128)


def one_kind(kinds: set, who: str) -> tuple:
    """The one (dtype, device) of ``kinds`` (the parameters of a shard after a move), or
    the error that names the fix: they were moved apart."""
    if len(kinds) != 1:
        found = ", ".join(sorted(f"{d} on {dev}" for d, dev in kinds))
        raise RuntimeError(
            f"zero_triton: {who} were moved to different dtypes or devices ({found}) after the "
            "optimizer was built; move the whole model at once (model.to(device, dtype)) or "
            "build the optimizer after moving it")
    return next(iter(kinds))


# Larger blocks glibc maps afresh at every allocation (its mmap threshold grows only to
# this), paying a page fault per 4 KiB page each step (~0.85 ms per MiB measured on a
# 2-core CPU, 5x a copy): a bucket's averages that large are kept across steps on CPUs.
_C_HEAP_MAX_BYTES = 32 * 2**20


def _keeps_averages(device: torch.device, numel: int, dtype) -> bool:
    """Whether a bucket's averaged shard is kept between steps rather than made during
    each backward: on GPUs the caching allocator hands its block to the next forward's
    activations and back for free; on CPUs only blocks the C heap recycles."""
    if device.type == "cuda":
        return False
    return numel * dtype.itemsize > _C_HEAP_MAX_BYTES


def _norm_term(g: torch.Tensor, norm_type: float, dtype) -> torch.Tensor:
    """sum |g|^norm_type of ``g`` in ``dtype`` (its largest |g| for the inf norm)."""
    if norm_type == math.inf:
        return g.abs().max().to(dtype) if g.numel() else torch.zeros((), dtype=dtype, device=g.device)
    return torch.linalg.vector_norm(g, norm_type, dtype=dtype) ** norm_type


def _remove_all(handles: list) -> None:
    """Remove hook handles (in place: a finalizer holds the same list)."""
    for h in handles:
        h.remove()
    handles.clear()


class FlatShard:
    """One flat buffer (a param group's parameters of one dtype and device), its
    gradients (``grad_buffer``: ZeRO-1's full local buffer or ZeRO-2's hand-over to the
    buckets, ``zero_triton.comm.grads``), its buckets (``zero_triton.comm.buckets``), the
    optimizer state of this rank's shard of every bucket (``state``,
    ``zero_triton.state.shards``) and the kernel that steps it.

    Which parameters have a gradient at ``step`` follows torch.optim.Adam's rule (a
    parameter whose ``.grad`` is None is not stepped; ``zero_triton.comm.grads`` says how it
    is told). Parameters that were not stepped keep their state, step count included.
    """

    # The parameters live in our flat buffer (``LocalShard``: their engine's, DTensor).
    engine_owned = False

    def __init__(self, params, comm: Comm, spec, *, amsgrad=False, key=0, reducer=None,
                 bucket_numel=None):
        """The flat buffer of ``params`` built to ``spec`` (``zero_triton.optim.spec``),
        numbered ``key``, its buckets launched by ``reducer`` (None: one rank at stage 1),
        of ``bucket_numel`` elements (None: ``spec.bucket_numel`` for this buffer)."""
        self.params = params
        self.spec = spec
        self.dtype, self.device = real_dtype(params[0].dtype), params[0].device
        # How the parameters are stepped (zero_triton.state.master): an fp32 master beside
        # fp16/bf16 ones (or its low half: "remainder"), none ("stochastic"), or their own.
        self.master_format = spec.master_format(self.dtype)
        self.has_master = master_formats.FORMATS[self.master_format].exact
        reduce_dtype = spec.reduce_dtype
        if bucket_numel is None:
            bucket_numel = spec.bucket_numel(self.dtype, sum(
                p.numel() * (2 if p.is_complex() else 1) for p in params), comm.everyone.world_size)
        if self.has_master and not spec.master_weights:  # before the parameters are re-homed
            raise ValueError(
                f"master_weights=False with {self.dtype} parameters is not supported: Adam "
                "updates vanish in 8-bit mantissas; keep master_weights=None (an fp32 master "
                "for fp16/bf16 parameters) or train the parameters in float32")
        self.comm = comm
        self.bucket_numel, self.key, self.reducer = bucket_numel, key, reducer
        self.flat_param, self.layout = flatten_params(params, world_size=comm.world_size, rehome=True,
                                                      bucket_numel=bucket_numel, align=spec.align)
        self.param_views = [p.detach() for p in params]  # where each parameter lives now
        # Stage 1: the local gradients, .grad views of one buffer; stage 2: none, backward's
        # hooks hand each .grad to its bucket (zero_triton.comm.grads).
        self.grad_buffer = spec.grads(params, self.layout, self.flat_param, reducer)
        sharded = self.grad_buffer.sharded
        # This rank's shard: one segment (buffer lo, hi, state offset) per bucket.
        self.segments = self.layout.shard_segments(comm.rank)
        n = self.layout.shard_numel
        self.param_parts = [self.flat_param[lo:hi] for lo, hi, _ in self.segments]
        # The averaged gradients of the shard, bucket by bucket (``Bucket.averaged``), in
        # reduce_dtype (bf16 grads averaged in fp32); at world size 1 without a wider
        # dtype, the gradients themselves. Otherwise each bucket's is made during
        # backward and let go after the step, unless it is too large to come back from
        # the C heap (``_keeps_averages``).
        wide = reduce_dtype is not None and reduce_dtype != self.dtype
        self.separate_shard = comm.everyone.world_size > 1 or wide or sharded
        out_dtype = reduce_dtype if wide else self.dtype
        own = None if self.separate_shard else self.flat_grad
        local = None if sharded else self.grad_buffer
        self.buckets = [buckets.Bucket((key, k), g, local, own, self.flat_param, comm.rank,
                                       zip(params[g.first:g.end], self.param_views[g.first:g.end]),
                                       out_dtype=out_dtype,
                                       keep_out=_keeps_averages(self.device, g.shard_numel, out_dtype))
                        for k, g in enumerate(self.layout.buckets)]
        self.hooks = self.grad_buffer.register_hooks(self.buckets, reducer)
        # The hooks live on the parameters, which outlive an optimizer that is dropped
        # (a sweep building one per trial): take them off when this buffer goes away.
        weakref.finalize(self, _remove_all, self.hooks)
        self.state = ShardState(self.param_parts, self.segments, self.layout,
                                master=self.master_format, amsgrad=amsgrad, moments=spec.moments)
        # The parameters' writes since the master was last taken from them (zero_triton.state.watch).
        self.versions = watch.ParamVersions(params)
        self.lr = torch.zeros(1, dtype=self.state.dtype, device=self.device)
        if self.dtype == torch.float64 or self.device.type == "meta":
            # The kernels step float32 state: torch's ops step float64. Parameters on the
            # meta device are never stepped (step refuses them until they are materialised).
            self.backend = "torch"
        else:
            self.backend = backends.resolve(spec.backend, self.device)
        self.step_fn = backends.step_function(self.backend, self.state.moments.format)
        self.scratch = torch.empty(n, dtype=self.state.dtype, device=self.device) \
            if self.backend == "torch" else None
        self.fused = self.device.type == "cuda"
        # Host list: which parameters are stepped this step (None: all of them).
        self.stepped = None
        self.exposed_steps = None  # the state.steps optimizer.state[p]["step"] views (world size 1)

    def remove_hooks(self):
        _remove_all(self.hooks)

    def state_views(self, bufs: dict | None = None) -> dict:
        """Per-parameter views of each state buffer (of ``bufs``, one ``state.buffers()``,
        if given), shaped as the parameters (complex for a complex parameter, as
        torch.optim.Adam keeps its moments): what ``opt.state`` and ``state_dict()`` hold."""
        return {k: [as_param(v, p) for v, p in zip(views, self.params)]
                for k, views in self.state.views(bufs).items()}

    def local_views(self, bufs: dict | None = None) -> dict:
        """Per-parameter views of each state buffer as this process holds them (here the
        same as ``state_views``): what a value given for parameter ``i`` is copied into
        after ``local_value``."""
        return self.state_views(bufs)

    def local_value(self, value: torch.Tensor, i: int) -> torch.Tensor:
        """A state value given for parameter ``i`` (a state dict's, ``opt.state``'s), as
        this process holds that parameter's state."""
        return value

    # -- the gradients (zero_triton.comm.grads) ------------------------------------------------
    @property
    def flat_grad(self):
        """The local gradients (ZeRO-1 / FusedAdam), None under ZeRO-2."""
        return self.grad_buffer.flat

    # -- the parameters moved behind our back ------------------------------------------
    def first_moved(self, hint: bool = False) -> int:
        """Index of the first parameter whose storage is no longer its place in the flat
        buffer (``model.to(...)`` after construction), or -1 (``grads``: with the
        extension, the same C loop finds the first foreign ``.grad``)."""
        return self.grad_buffer.first_moved(self.param_views, self.dtype, self.device, hint)

    def rehomed(self) -> "FlatShard":
        """A new FlatShard over the same parameters at their new dtype and device, with
        this one's state carried over (moved to the new device): training continues as
        with an optimizer built after the move."""
        dtype, device = one_kind({(real_dtype(p.dtype), p.device) for p in self.params},
                                 "parameters that share a flat buffer")
        if dtype not in FLAT_DTYPES:
            raise RuntimeError(f"zero_triton: parameters were cast to {dtype} after the optimizer "
                               "was built; FusedAdam steps float32, float16, bfloat16, float64 "
                               "and complex parameters")
        if device.type == "meta":
            raise RuntimeError("zero_triton: parameters were moved to the meta device after the "
                               "optimizer was built; materialise them (model.to_empty + init) "
                               "and build the optimizer afterwards")
        self.remove_hooks()
        if self.reducer is not None:
            self.reducer.wait_all()
        new = FlatShard(self.params, self.comm, self.spec, amsgrad=self.state.amsgrad,
                        key=self.key, reducer=self.reducer, bucket_numel=self.bucket_numel)
        if self.device.type == "meta":  # materialised (model.to_empty): nothing to carry over
            return new
        with torch.no_grad():
            # The new buffer copied every .grad in (Module.to converts them all, views
            # included); which parameters have a gradient is still the old answer.
            new.grad_buffer.carry_over(self.grad_buffer)
            new.state.carry_over(self.state)
            # A parameter whose .data was replaced by other values (p.data = pretrained)
            # starts from them; one that was only moved keeps its exact master.
            new.reseed([i for i in self.versions.written()] + [
                i for i, (p, old) in enumerate(zip(self.params, self.param_views))
                if p.dtype == old.dtype and not torch.equal(p.detach().to(old.device), old)])
        return new

    @torch.no_grad()
    def reseed(self, indices) -> None:
        """The user wrote parameters ``indices`` (their version moved, or their .data was
        replaced): seed this rank's part of their master again from them where they
        differ from it (``Master.reseed``), so the next step starts from what the user
        wrote (fp32 parameters are their own master). An element written with the value
        it had (DDP's broadcast, an EMA swapped back, the same weights loaded) keeps its
        master's extra precision."""
        if not indices:
            return
        wanted = set(indices)
        if self.has_master:
            layout = self.layout
            for part, (lo, hi, s0) in zip(self.param_parts, self.segments):
                ranges = [(i, a, b) for i, a, b in layout.ranges_in(lo, hi) if i in wanted]
                if ranges:
                    part = self.unwritten(part, s0)
                for i, a, b in ranges:
                    x = layout.offsets[i] + a - lo
                    self.state.master.reseed(s0 + x, s0 + x + b - a, part[x:x + b - a])
        self.versions.accept(wanted)

    @torch.no_grad()
    def published(self) -> None:
        """The master was just published into this rank's shard of the parameters (a
        checkpoint's load, whose model file holds the other ranks' shards as the gathers
        left them): hold there what our own gather would write (``Comm.gathered``)."""
        for part in self.param_parts:
            ours = self.comm.gathered(part)
            if ours is not part:
                part.copy_(ours)

    def unwritten(self, part: torch.Tensor, s0: int) -> torch.Tensor:
        """``part`` (this rank's parameters of one segment, its state at ``s0``) with
        what our own gather wrote there (``Comm.gathered``: compressed gathers write the
        master's rounding, quantized) put back to the master's rounding, so that only
        the user's writes differ from it."""
        master = self.state.master.export()
        if master is None:
            return part
        rounded = master[s0:s0 + part.numel()].to(part.dtype)
        ours = self.comm.gathered(rounded)
        return part if ours is rounded else torch.where(part == ours, rounded, part)

    def sync_grads(self):
        """Decide which parameters have a gradient at this step (``self.stepped``: None
        when all do): torch's rule, ``.grad`` not None (``zero_triton.comm.grads``)."""
        self.stepped = self.grad_buffer.sync(self.param_views)

    def zero_grads(self, set_to_none: bool = True):
        """``zero_grad``, as torch.optim.Optimizer's."""
        self.grad_buffer.zero(set_to_none)
        self.stepped = None

    def prepare(self, group, grad_scale, found_inf, clip_coef) -> dict:
        """Count this step and return the kernel's arguments for ``update_bucket``."""
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            self.lr.copy_(lr)
        else:
            self.lr.fill_(lr)
        if found_inf is not None:
            found_inf = found_inf.to(self.device, torch.float32, non_blocking=True)
        if grad_scale is not None:
            grad_scale = grad_scale.to(self.device, torch.float32, non_blocking=True)
        beta1, beta2 = group["betas"]
        kwargs = dict(beta1=float(beta1), beta2=float(beta2), eps=group["eps"],
                      weight_decay=group["weight_decay"], adamw=group["decoupled_weight_decay"],
                      amsgrad=group["amsgrad"], maximize=group["maximize"],
                      grad_scale=grad_scale, found_inf=found_inf, clip_coef=clip_coef)
        runs = self.state.count(self.stepped, found_inf)
        return {"kwargs": kwargs, "runs": runs, "amsgrad": group["amsgrad"]}

    def update(self, plan: dict) -> None:
        """The fused kernel over this rank's whole shard (one process: every bucket)."""
        for k in range(len(self.segments)):
            self.update_bucket(k, plan)

    def update_bucket(self, k: int, plan: dict) -> None:
        """The fused kernel over this rank's shard of bucket ``k``."""
        lo, hi, s0 = self.segments[k]
        runs = [(lo, hi, None)] if plan["runs"] is None else plan["runs"][k]
        for start, end, i in runs:
            self._launch(k, start - lo, end - lo, s0, i, plan)
        self.buckets[k].release()

    def _launch(self, k, a, b, s0, i, plan) -> None:
        """One kernel launch over elements [a, b) of segment ``k`` (state offset ``s0``)."""
        kwargs = plan["kwargs"]
        if self.backend == "torch":
            kwargs = {**kwargs, "scratch": self.scratch[s0 + a:s0 + b]}
        st = self.state
        if st.moments.keyed or st.master.keyed:
            # rounding keyed by the element's place in the canonical layout
            bucket = self.layout.buckets[k]
            index = bucket.canonical_start + self.segments[k][0] - bucket.start + a
            kwargs = {**kwargs, "seed": self.key, "index": index}
        param, param_lp, how = st.master.operands(s0 + a, s0 + b, self.param_parts[k][a:b])
        self.step_fn(param, self.buckets[k].averaged()[a:b],
                     *st.moments.operands(s0 + a, s0 + b, plan["amsgrad"]),
                     param_lp, st.step_of(i), self.lr, **kwargs, **how)

    def grad_norm_term(self, norm_type: float, dtype) -> torch.Tensor:
        """This rank's part of the gradient norm, in ``dtype``: the sum of |g|^norm_type
        over its averaged shard (the largest |g| for the inf norm), for ``clipping`` to
        reduce over the optimizer's ranks."""
        terms = [_norm_term(b.averaged(), norm_type, dtype) for b in self.buckets]
        if not terms:
            return torch.zeros((), dtype=dtype, device=self.device)
        terms = torch.stack(terms)
        return terms.max() if norm_type == math.inf else terms.sum()

    def averaged_grads(self) -> list:
        """This rank's averaged shard of each bucket, in order (zeros where none was
        averaged since the last step)."""
        return [b.averaged() for b in self.buckets]

    def gather_bucket(self, k: int) -> None:
        """Start gathering every rank's updated shard of bucket ``k``."""
        b = self.buckets[k]
        b.gather = self.comm.gather_params(b.param_full, b.param_shard, async_op=True,
                                        name=b.name("all_gather"))
        if self.reducer is not None and self.reducer.overlapped:  # it outlives step(): watch writes
            b.versions = [p._version for p, _ in b.members]

    def nbytes(self) -> dict:
        def size(t):
            return 0 if t is None else t.numel() * t.element_size()
        elem = self.flat_param.element_size()
        return {
            "params": size(self.flat_param),
            "grads": self.grad_buffer.nbytes() + (sum(size(b.grad_out) for b in self.buckets)
                                                  if self.separate_shard else 0),
            **self.state.nbytes(),
            "padding": self.layout.padding * elem * 2,
            "scratch": size(self.scratch),
        }
