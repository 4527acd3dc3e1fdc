"""Where a shard's parameters and gradients live when they are ours: one flat buffer
(the parameters re-homed as its views), its gradients (``zero_triton.comm.grads``:
ZeRO-1's local buffer or ZeRO-2's hand-over) and the buckets that average them
(``zero_triton.comm.buckets``). A home of ``zero_triton.optim.shard.Shard``, beside
``engine_home.EngineHome`` (DTensor parameters, where their engine keeps them)."""
from __future__ import annotations

import functools
import math
import weakref

import torch

from zero_triton.comm import buckets
from zero_triton.comm.protocol import Comm
from zero_triton.optim.launch import DeviceLaunch
from zero_triton.state.flat import as_param, flatten_params, real_dtype
from zero_triton.state import moments as moment_formats
from zero_triton.state.moments import FIRST, SECOND
from zero_triton.state.param_view import ParamView

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


def norm_term(g: torch.Tensor, norm_type: float, out: torch.Tensor) -> torch.Tensor:
    """sum |g|^norm_type of ``g`` into ``out`` (a 0-dim tensor of the sum's dtype; its
    largest |g| for the inf norm)."""
    if not g.numel():
        return out.zero_()
    torch.linalg.vector_norm(g, norm_type, dtype=out.dtype, out=out)
    return out if norm_type == math.inf else out.pow_(norm_type)


def _tell(watcher: weakref.WeakMethod, k: int, landed: bool) -> None:
    w = watcher()
    if w is not None:
        w(k, landed)


def _remove_all(handles: list) -> None:
    """Remove hook handles (in place: a finalizer holds the same list)."""
    for h in handles:
        h.remove()
    handles.clear()


class FlatHome:
    """``params`` (one dtype and device) re-homed into one flat buffer of this rank's
    layout, built to ``spec`` (``zero_triton.optim.spec``): ``segments`` (buffer lo, hi,
    state offset) are this rank's shard of each bucket, ``param_parts`` their views.

    Which parameters have a gradient at a step follows torch.optim.Adam's rule (a
    parameter whose ``.grad`` is None is not stepped; ``zero_triton.comm.grads`` says
    how it is told)."""

    # The parameters live in our flat buffer (EngineHome: their engine's, DTensor), and
    # we gather them after the step, bucket by bucket.
    gathers = True

    def __init__(self, params, comm: Comm, spec, *, key=0, reducer=None, bucket_numel=None):
        """The flat buffer of ``params``, numbered ``key``, its buckets launched by
        ``reducer`` (None: one rank at stage 1), of ``bucket_numel`` elements (None:
        ``spec.bucket_numel`` for this buffer)."""
        self.params, self.comm, self.spec = params, comm, spec
        self.dtype, self.device = real_dtype(params[0].dtype), params[0].device
        if bucket_numel is None:
            bucket_numel = spec.bucket_numel(self.dtype, sum(
                p.numel() * (2 if p.is_complex() else 1) for p in params), comm.everyone.world_size)
        self.key, self.reducer, self.bucket_numel = key, reducer, bucket_numel
        self.seed = key  # stochastic rounding's seed: the buffer's number
        self.rows = False  # every segment a run of the canonical layout
        self.flat_param, self.layout = flatten_params(params, world_size=comm.world_size, rehome=True,
                                                      bucket_numel=bucket_numel, align=spec.align)
        self.param_views = [p.detach() for p in params]  # where each parameter lives now
        # Stage 1: the local gradients, .grad views of one buffer; stage 2: none, backward's
        # hooks hand each .grad to its bucket (zero_triton.comm.grads).
        self.grad_buffer = spec.grads(params, self.layout, self.flat_param, reducer)
        sharded = self.grad_buffer.sharded
        self.segments = self.layout.shard_segments(comm.rank)
        self.param_parts = [self.flat_param[lo:hi] for lo, hi, _ in self.segments]
        # The averaged gradients of the shard, bucket by bucket (``Bucket.averaged``), in
        # reduce_dtype (bf16 grads averaged in fp32); at world size 1 without a wider
        # dtype, the gradients themselves. Otherwise each bucket's is made during
        # backward and let go after the step, unless the staging keeps it (``comm.staging``:
        # too large to come back from the C heap, or a captured step reads it).
        reduce_dtype = spec.reduce_dtype
        wide = reduce_dtype is not None and reduce_dtype != self.dtype
        self.separate_shard = comm.everyone.world_size > 1 or wide or sharded
        out_dtype = reduce_dtype if wide else self.dtype
        own = None if self.separate_shard else self.flat_grad
        local = None if sharded else self.grad_buffer
        self.buckets = [buckets.Bucket((key, k), g, local, own, self.flat_param, comm.rank,
                                       zip(params[g.first:g.end], self.param_views[g.first:g.end]),
                                       out_dtype=out_dtype,
                                       keep_out=spec.capture.staging.keeps_averages(
                                           self.device, g.shard_numel, out_dtype))
                        for k, g in enumerate(self.layout.buckets)]
        self.hooks = self.grad_buffer.register_hooks(self.buckets, reducer)
        # The hooks live on the parameters, which outlive an optimizer that is dropped
        # (a sweep building one per trial): take them off when this buffer goes away.
        weakref.finalize(self, _remove_all, self.hooks)

    def remove_hooks(self) -> None:
        _remove_all(self.hooks)

    def launch(self, backend: str, format: str, plain: bool, buffers):
        """How a side's launches reach the kernel (``optim.launch``): one per run, bucket
        by bucket as the averages land."""
        return DeviceLaunch(backend, format, plain)

    def watch_averages(self, watcher) -> None:
        """``watcher(k, landed)`` (a bound method, held weakly: the buckets outlive no
        optimizer) is told when an average of bucket ``k`` starts (``landed`` False) and
        when it has landed (True): offload copies segment ``k``'s to the host then,
        while backward runs (``buckets.Bucket.watch``)."""
        ref = weakref.WeakMethod(watcher)
        for k, b in enumerate(self.buckets):
            b.watch_with(functools.partial(_tell, ref, k))

    @property
    def flat_grad(self):
        """The local gradients (ZeRO-1 / FusedAdam), None under ZeRO-2."""
        return self.grad_buffer.flat

    # -- the step's operands ---------------------------------------------------------------
    def grad(self, k: int) -> torch.Tensor:
        """The averaged gradients of segment ``k`` (this rank's shard of bucket ``k``)."""
        return self.buckets[k].averaged()

    def canonical(self, k: int) -> int:
        """The canonical index (``FlatLayout``: the same at every world size) of segment
        ``k``'s first element: what keys its stochastic rounding."""
        bucket = self.layout.buckets[k]
        return bucket.canonical_start + self.segments[k][0] - bucket.start

    def finished(self, k: int) -> None:
        """Segment ``k`` was stepped: its bucket's averages may go."""
        self.buckets[k].release()

    def gather(self, k: int) -> None:
        """Start gathering every rank's updated shard of bucket ``k``."""
        self.buckets[k].start_gather(self.comm, self.reducer is not None and self.reducer.overlapped)

    def grad_norm_terms(self, norm_type: float, out: torch.Tensor) -> None:
        """This rank's part of the gradient norm, bucket by bucket, into ``out`` (one
        element per bucket, in the sum's dtype): the sum of |g|^norm_type over each
        bucket's averaged shard (its largest |g| for the inf norm)."""
        for b, term in zip(self.buckets, out):
            norm_term(b.averaged(), norm_type, term)

    @classmethod
    def norm_total(cls, homes: list, comm: Comm, norm_type: float, buffers) -> torch.Tensor:
        """The sum of |g|^norm_type (the largest |g| for inf) over every rank's averaged
        shards of ``homes``, a 1-element tensor: per home its buckets' terms, then over
        the homes (the two sums torch.stack(...).sum() made, into ``buffers``' kept
        tensors), then over ``comm``'s ranks, in float64 there: the sum of per-shard
        parts then rounds to the same float32 for any bucket size."""
        inf = norm_type == math.inf
        acc = torch.float32 if inf or comm.world_size == 1 else torch.float64
        reduce = torch.amax if inf else torch.sum
        device = homes[0].device
        total = buffers.kept("total", 1, acc, device)
        counts = [len(h.buckets) for h in homes]
        terms = buffers.kept("terms", sum(counts), acc, device)
        totals = buffers.kept("totals", len(homes), acc, device)
        at = 0
        for i, (h, n) in enumerate(zip(homes, counts)):
            h.grad_norm_terms(norm_type, terms[at:at + n])
            if n:
                reduce(terms[at:at + n], dim=0, out=totals[i])
            else:
                totals[i].zero_()
            at += n
        reduce(totals, dim=0, keepdim=True, out=total)
        comm.all_reduce(total, "max" if inf else "sum")
        return total

    # -- the state, per parameter ----------------------------------------------------------
    def views(self, views: dict) -> dict:
        """Per-parameter state views shaped as the parameters (complex for a complex
        parameter, as torch.optim.Adam keeps its moments)."""
        return {k: [as_param(v, p) for v, p in zip(vs, self.params)] for k, vs in views.items()}

    def local_views(self, views: dict) -> dict:
        return self.views(views)

    def local_value(self, value: torch.Tensor, i: int) -> torch.Tensor:
        """A state value given for parameter ``i``, as this process holds it: as given."""
        return value

    # -- the parameters moved behind our back ------------------------------------------
    def compact_entry(self, moments, i: int, entry: dict) -> dict | None:
        """Parameter ``i``'s moments, given in torch's ``entry``, as ``moments`` (the
        shard's store, either side of an offload's cut) keeps them, for the compact state
        dict (``optim.compact``): its elements in the flat buffer's (its blocks') order,
        encoded by the store's format; None for fp32 moments (torch's ``entry`` as it is)."""
        if moments.format == "fp32":
            return None
        view = ParamView(self.layout, self.segments)
        first, second = (view.elements(i, entry[k].detach().cpu()) for k in (FIRST, SECOND))
        encode = moment_formats.FORMATS[moments.format].compact
        return encode(first, second, self.layout.shapes[i], view.stride(i))

    def checkpointable(self, entry: str) -> None:
        """zero_triton.checkpoint saves our flat buffers (raises, naming the fix, for a
        home it cannot save)."""

    def first_moved(self, hint: bool = False) -> tuple:
        """(index of the first parameter whose storage is no longer its place in the flat
        buffer (``model.to(...)`` after construction) or -1, the parameters followed where
        they are: none here). ``hint``: with the extension, the same C loop finds the
        first foreign ``.grad``."""
        return self.grad_buffer.first_moved(self.param_views, self.dtype, self.device, hint), ()

    def rehomed(self) -> "FlatHome":
        """A new home of the same parameters at their new dtype and device (this one's
        hooks removed, its averages finished)."""
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
        return FlatHome(self.params, self.comm, self.spec, key=self.key, reducer=self.reducer,
                        bucket_numel=self.bucket_numel)

    def carry_over(self, old: "FlatHome", written: list) -> list:
        """Take ``old``'s gradients (Module.to converted every .grad, views included;
        which parameters have one is still the old answer); returns the parameters whose
        values the user replaced (``written``, and a ``p.data = pretrained`` of the same
        dtype): their masters start from them, one only moved keeps its exact master."""
        self.grad_buffer.carry_over(old.grad_buffer)
        return list(written) + [i for i, (p, before) in enumerate(zip(self.params, old.param_views))
                                if p.dtype == before.dtype
                                and not torch.equal(p.detach().to(before.device), before)]

    def nbytes(self) -> dict:
        def size(t):
            return 0 if t is None else t.numel() * t.element_size()
        return {"params": size(self.flat_param),
                "grads": self.grad_buffer.nbytes() + (sum(size(b.grad_out) for b in self.buckets)
                                                      if self.separate_shard else 0),
                "padding": self.layout.padding * self.flat_param.element_size() * 2}
