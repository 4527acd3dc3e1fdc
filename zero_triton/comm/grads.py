"""The gradients of one flat buffer, as backward leaves them: ZeRO-1's and ZeRO-2's.

``.grad`` is torch's in both: None after ``zero_grad()`` (``set_to_none=True``) and until
backward reaches the parameter, and "has a gradient at ``step``" is torch.optim.Adam's
rule: a parameter whose ``.grad`` is None is not stepped, one with a gradient tensor
(zero or not) is.

``LocalGrads`` (ZeRO-1, and FusedAdam): every parameter's local gradient lives in one
flat buffer laid out like the parameters. When a gradient arrives (autograd's own tensor,
seen by the post-accumulate-grad hook, or one set by hand, found at ``step``) it is copied
into the parameter's view of the buffer and ``.grad`` becomes that view, so the next
micro-batches accumulate in place and the buckets' reduce-scatters read the buffer:
DDP's ``gradient_as_bucket_view`` does the same. The copy replaces the add into a zeroed
buffer, so ``zero_grad()`` writes no memory at all.

``ShardedGrads`` (ZeRO-2): no such buffer. Backward's hooks hand each ``.grad`` to its
bucket's staging buffer and free it (``zero_triton.comm.buckets``); a rank keeps only its
averaged shard.

Both answer the same questions for ``FlatHome``: did a parameter move (``first_moved``),
which parameters have a gradient at ``step`` (``sync``), and start over (``zero``).
"""
from __future__ import annotations

import functools

import torch

from zero_triton.comm import hooks
from zero_triton.native import ext as _ext
from zero_triton.state.buffers import PLAIN
from zero_triton.state.flat import as_param


def zero_in_place(g: torch.Tensor, target: torch.Tensor | None = None) -> None:
    """``zero_grad(set_to_none=False)`` on one gradient, as torch.optim.Optimizer does it:
    out of any graph, then zeroed (``target``: the memory to zero, ``g`` itself by default)."""
    if g.grad_fn is not None:
        g.detach_()
    else:
        g.requires_grad_(False)
    (g if target is None else target).zero_()


def _adopt(views: list, dirty: bytearray, i: int, param) -> None:
    """Post-accumulate-grad hook (world size 1): a gradient that autograd put in a
    tensor of its own (``.grad`` was None) moves into the parameter's view."""
    g = param.grad
    view = views[i]
    if g is not view and g is not None and not g.is_sparse and g.dtype == view.dtype \
            and g.device == view.device:  # else moved by model.to(): the step re-homes it
        view.copy_(g)
        param.grad = view
        dirty[i] = 1


class LocalGrads:  # implements comm.protocol.GradHolder
    """ZeRO-1 / FusedAdam: the local gradients in one flat buffer, each ``.grad`` None or
    its view of it.

    ``dirty[i]``: parameter ``i``'s view holds values written since it was last zeroed.
    A view whose parameter has no gradient at ``step`` is zeroed there when dirty (a
    bucket averages a whole range, and clipping takes the norm of the whole buffer), so
    the buffer never needs zeroing as a whole.
    """

    sharded = False

    def __init__(self, params, layout, flat_param, reducer=None):
        self.params = params
        self.flat = PLAIN.zeros(flat_param.shape, flat_param.dtype, flat_param.device)
        self.views = [as_param(v, p) for v, p in zip(layout.views(self.flat), params)]
        self.dirty = bytearray(len(params))
        self.bucket_of = None  # index of each parameter's bucket, with a reducer
        self.buckets = None
        native = _ext.loaded_or_prebuilt()
        self.check_flat = getattr(native, "flat_status", None)
        self.foreign_hint = None  # first .grad that is not its view, found by this step's check_flat
        with torch.no_grad():
            for i, (p, view) in enumerate(zip(params, self.views)):
                if p.grad is not None:  # a gradient from before the optimizer counts
                    view.copy_(p.grad)
                    self.dirty[i] = 1
                    p.grad = view
        self.seen_version = self.flat._version  # the version the last bucket hook saw

    def hooked(self) -> None:
        """A bucket hook moved a gradient in: what the buffer holds now is what the hooks saw."""
        self.seen_version = self.flat._version

    def written_since_hooks(self) -> bool:
        """Something wrote into the gradients after the last bucket hook (another
        micro-batch, GradScaler.unscale_, a DDP wrapper, a hand): every bucket is stale."""
        return self.flat._version != self.seen_version

    def rewritten(self) -> None:
        """The gradients were changed by an op that leaves the version counter alone
        (GradScaler.unscale_'s ``_amp_foreach_non_finite_check_and_unscale_``)."""
        self.seen_version = -1

    def register_hooks(self, bucket_list, reducer) -> list:
        """Hooks that move arriving gradients into the views (and, with a reducer,
        launch the buckets)."""
        if reducer is None:
            return [hooks.post_accumulate_hook(p, functools.partial(_adopt, self.views, self.dirty, i))
                    for i, p in enumerate(self.params)]
        self.buckets = bucket_list
        self.bucket_of = [k for k, b in enumerate(bucket_list)
                          for _ in range(b.geometry.first, b.geometry.end)]
        return hooks.register_hooks(self.params, self.dirty, self.views, bucket_list, reducer)

    def first_moved(self, param_views, dtype, device, hint: bool) -> int:
        """Index of the first parameter whose storage is no longer ``param_views[i]``, or
        -1. With the extension, one C loop also finds the first ``.grad`` that is not
        its view; ``hint=True`` keeps it for the ``sync`` that follows in the same step."""
        if self.check_flat is not None:
            moved, foreign = self.check_flat(self.params, param_views, self.views)
            self.foreign_hint = foreign if hint else None
            return moved
        return _first_moved(self.params, param_views, dtype, device)

    def sync(self, param_views):
        """Move every ``.grad`` that is a tensor of its own (set by hand, or by a wrapper)
        into its view, zero the dirty views of parameters without a gradient, and return
        which parameters have one (None when all do)."""
        start, self.foreign_hint = self.foreign_hint, None
        if start is None and self.check_flat is not None:
            start = self.check_flat(self.params, param_views, self.views)[1]
        if start is not None and start < 0:
            return None  # every .grad is its view
        start = start or 0
        n = len(self.params)
        present = [True] * n
        dirty, views = self.dirty, self.views
        clean = self.flat._version == self.seen_version
        changed = False  # a launched bucket's gradients changed
        for i in range(start, n):
            p, view = self.params[i], views[i]
            g = p.grad
            if g is view:
                continue
            if g is None:
                present[i] = False
                if dirty[i]:
                    view.zero_()
                    dirty[i] = 0
                    changed |= self._launched(i)
                continue
            if g.is_sparse:
                raise RuntimeError(
                    f"parameter {i} ({tuple(p.shape)}) has a sparse gradient; FusedAdam "
                    "needs dense gradients (use torch.optim.SparseAdam for sparse ones)")
            view.copy_(g)
            dirty[i] = 1
            p.grad = view
            changed = True
        if clean and not changed:  # only views no launched bucket reads were zeroed
            self.seen_version = self.flat._version
        return None if all(present) else present

    def _launched(self, i: int) -> bool:
        return self.buckets is not None and self.buckets[self.bucket_of[i]].launched

    def zero(self, set_to_none: bool = True) -> None:
        """``zero_grad``: every ``.grad`` None (``set_to_none``), or each gradient
        tensor zeroed in place, as torch.optim.Optimizer.zero_grad does."""
        if set_to_none:
            for p in self.params:
                p.grad = None
            self.foreign_hint = None
            return
        views = self.views
        everywhere = self.foreign_hint == -1 or all(p.grad is v for p, v in zip(self.params, views))
        if everywhere:
            self.flat.zero_()
            self.dirty[:] = bytes(len(self.dirty))
        else:
            for i, (p, view) in enumerate(zip(self.params, views)):
                g = p.grad
                if g is None:
                    continue
                zero_in_place(g)
                if g is view:
                    self.dirty[i] = 0
        self.seen_version = self.flat._version
        self.foreign_hint = None

    def carry_over(self, old: "LocalGrads") -> None:
        """After a re-home: Module.to converted every ``.grad`` (views of the old buffer
        included) and the constructor copied them in; nothing else carries over."""

    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


class ShardedGrads:  # implements comm.protocol.GradHolder
    """ZeRO-2: no gradient buffer; backward's hooks hand each ``.grad`` to its bucket."""

    sharded = True
    flat = None
    views = None
    check_flat = None
    foreign_hint = None

    def __init__(self, params, layout, flat_param, reducer=None):
        self.params = params
        self.layout = layout
        self.reducer = reducer
        self.buckets = None  # register_hooks gives them
        # Has a gradient this step: 0 no, 1 a .grad found at step, 2 taken by backward's
        # hook, 3 a zero gradient kept by zero_grad(set_to_none=False).
        self.reached = bytearray(len(params))
        self.bucket_of = [k for k, g in enumerate(layout.buckets) for _ in range(g.first, g.end)]

    def register_hooks(self, bucket_list, reducer) -> list:
        self.buckets = bucket_list
        return hooks.register_sharded_hooks(self.params, self.reached, self.layout, bucket_list,
                                              reducer)

    def written_since_hooks(self) -> bool:
        """Nothing to write: a gradient is added to its bucket by the hook that takes it
        (a later one makes the bucket stale, ``Reducer.arrived``)."""
        return False

    def rewritten(self) -> None:
        """Nothing held here: GradScaler unscales the averaged shards (ZeroAdam)."""

    def first_moved(self, param_views, dtype, device, hint: bool) -> int:
        return _first_moved(self.params, param_views, dtype, device)

    def sync(self, param_views):
        """A ``.grad`` that no hook took (set by hand, or left from before the optimizer)
        goes into its bucket like one from backward; one written after the hook took it
        (a DistributedDataParallel wrapper writing back its average) is refused: it would
        count twice."""
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            if self.reached[i] == 2:
                raise RuntimeError(
                    f"ZeroAdam(stage=2): parameter {i} ({tuple(p.shape)}) got a .grad after "
                    "backward had handed its gradient over: something wrote it afterwards, "
                    "almost always a DistributedDataParallel wrapper (accelerate, HF Trainer) "
                    "copying its average back. With stage 2 the gradients live in the "
                    "optimizer: do not wrap the model in DDP, or use stage=1 (which works "
                    "under DDP)")
            if g.is_sparse:
                raise RuntimeError(f"parameter {i} ({tuple(p.shape)}) has a sparse gradient; "
                                   "FusedAdam needs dense gradients")
            b = self.buckets[self.bucket_of[i]]
            lo = self.layout.offsets[i] - b.geometry.start
            self.reducer.accept(b, i - b.geometry.first, lo, lo + p.numel(), g.detach())
            p.grad = None
            self.reached[i] = 1
        return None if 0 not in self.reached else [r != 0 for r in self.reached]

    def zero(self, set_to_none: bool = True) -> None:
        """``zero_grad``: the shard is overwritten by the next step's first average.
        ``set_to_none=False`` keeps, as torch does, a zero gradient for every parameter
        that had one: it is stepped (moments decay, weight decay applies) even if the
        next backward does not reach it (``reached`` 3)."""
        reached = self.reached
        for i, p in enumerate(self.params):
            g = p.grad
            if set_to_none:
                p.grad = None
                reached[i] = 0
            elif g is not None:  # set by hand: zeroed in place, handed over at step
                zero_in_place(g)
                reached[i] = 0
            elif reached[i]:
                reached[i] = 3

    def carry_over(self, old: "ShardedGrads") -> None:
        self.reached[:] = old.reached

    def nbytes(self) -> int:
        return 0


def unscale_averaged_(flats, inv_scale, found_inf, per_device: dict, allow_fp16: bool) -> None:
    """GradScaler's check and unscale of the averaged shards of ``flats`` (ZeRO-2's
    gradients, which are no ``.grad`` it could see), recorded in its per-device flags."""
    for flat in flats:
        shards = flat.averaged_grads()
        if not shards:
            continue
        if not allow_fp16 and shards[0].dtype == torch.float16:
            raise ValueError("Attempting to unscale FP16 gradients.")
        flag = per_device.get(flat.device)
        if flag is None:
            flag = per_device[flat.device] = torch.zeros_like(found_inf, device=flat.device)
        torch._amp_foreach_non_finite_check_and_unscale_(shards, flag, inv_scale.to(flat.device))
        flat.averages_written()  # in place, without bumping their version


def _first_moved(params, param_views, dtype, device) -> int:
    for i, (p, view) in enumerate(zip(params, param_views)):
        if p.data_ptr() != view.data_ptr() or p.dtype != view.dtype or p.device != device:
            return i
    return -1


class ReleasedGrads:  # implements comm.protocol.GradHolder
    """Gradient release (``zero_triton.optim.release``): no gradient buffer. Backward's
    hook on each parameter hands its final gradient to ``target`` (the optimizer's
    release, held weakly: ``(holder, i, param)``), which steps the parameter with it and
    frees it; a ``.grad`` the hook left (inside ``accumulating()``, set by hand) is a
    tensor of the user's, which ``step`` steps. ``sharded``: no local buffer (nothing is
    averaged: one process)."""

    sharded = True
    flat = None
    views = None
    check_flat = None
    foreign_hint = None

    def __init__(self, params, layout, flat_param, reducer=None):
        self.params = params
        self.target = None  # a weakref.WeakMethod, set when the optimizer takes the shard

    def register_hooks(self, bucket_list, reducer) -> list:
        return [hooks.post_accumulate_hook(p, functools.partial(self._arrived, i))
                for i, p in enumerate(self.params)]

    def _arrived(self, i: int, param) -> None:
        target = None if self.target is None else self.target()
        if target is not None:
            target(self, i, param)

    def written_since_hooks(self) -> bool:
        return False

    def rewritten(self) -> None:
        """Nothing held here."""

    def first_moved(self, param_views, dtype, device, hint: bool) -> int:
        return _first_moved(self.params, param_views, dtype, device)

    def sync(self, param_views):
        """Which parameters have a ``.grad`` (None when all do)."""
        present = [p.grad is not None for p in self.params]
        for i, p in enumerate(self.params):
            if present[i] and p.grad.is_sparse:
                raise RuntimeError(f"parameter {i} ({tuple(p.shape)}) has a sparse gradient; "
                                   "FusedAdam needs dense gradients")
        return None if all(present) else present

    def zero(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                zero_in_place(p.grad)

    def carry_over(self, old) -> None:
        """Nothing is held: the ``.grad`` tensors are the user's."""

    def nbytes(self) -> int:
        return 0


# A ZeRO stage -> how its gradients are held (``comm.protocol.GradHolder``): the one place a
# stage is turned into behaviour (``optim.spec.Spec.grads``).
HOLDERS = {1: LocalGrads, 2: ShardedGrads}
