"""The gradients of one flat buffer, as backward leaves them: ZeRO-1's and ZeRO-2's.

``LocalGrads`` (ZeRO-1, and FusedAdam): every parameter's local gradient lives in one
flat buffer laid out like the parameters, and each ``.grad`` is a view of it, so autograd
accumulates straight into it; the buckets' reduce-scatters read it.

``ShardedGrads`` (ZeRO-2): no such buffer. Backward's hooks hand each ``.grad`` to its
bucket's staging buffer and free it (``zero_triton.buckets``); a rank keeps only its
averaged shard.

Both answer the same questions for ``FlatShard``: did a parameter move (``first_moved``),
which parameters have a gradient at ``step`` (``sync``: torch.optim.Adam's rule, a
parameter whose ``.grad`` is None is not stepped), and start over (``zero``). ``reached``
has one byte per parameter: backward reached it since the last ``zero`` (ZeRO-2: 2 when a
hook took its gradient, 1 when ``sync`` found one set by hand).
"""
from __future__ import annotations

import functools

import torch

from zero_triton import _ext, buckets


def _mark_reached(reached: bytearray, i: int, _param) -> None:
    """Post-accumulate-grad hook: backward reached parameter ``i`` of a flat buffer."""
    reached[i] = 1


class LocalGrads:
    """ZeRO-1 / FusedAdam: the local gradients in one flat buffer, ``.grad`` its views.

    "Has a gradient" means: backward reached the parameter since the last ``zero`` (a
    post-accumulate-grad hook sets ``reached``), or its ``.grad`` is a tensor of its own,
    or, when no backward ran at all, something wrote into the buffer (then every view
    counts: writes by hand into views of one buffer cannot be told apart per parameter).
    """

    sharded = False

    def __init__(self, params, layout, flat_param):
        self.params = params
        self.flat = torch.zeros_like(flat_param)
        self.views = layout.views(self.flat)
        self.reached = bytearray(len(params))
        native = _ext.loaded_or_prebuilt()
        self.check_flat = getattr(native, "flat_status", None)
        self.foreign_hint = None  # first foreign .grad, found by this step's check_flat
        with torch.no_grad():
            for i, (p, view) in enumerate(zip(params, self.views)):
                if p.grad is not None:
                    view.copy_(p.grad)
                    self.reached[i] = 1  # a gradient from before the optimizer counts
                p.grad = view
        self.version = self.flat._version
        self.seen_version = self.version  # the version the last bucket hook saw

    def written_since_hooks(self) -> bool:
        """Something wrote into the gradients after the last bucket hook (another
        micro-batch, GradScaler.unscale_, a DDP wrapper, a hand): every bucket is stale."""
        return self.flat._version != self.seen_version

    def rewritten(self) -> None:
        """The gradients were changed by an op that leaves the version counter alone
        (GradScaler.unscale_'s ``_amp_foreach_non_finite_check_and_unscale_``)."""
        self.seen_version = -1

    def register_hooks(self, bucket_list, reducer) -> list:
        """Hooks that mark ``reached`` (and, with a reducer, launch the buckets)."""
        if reducer is None:
            return [buckets.post_accumulate_hook(p, functools.partial(_mark_reached, self.reached, i))
                    for i, p in enumerate(self.params)]
        return buckets.register_hooks(self.params, self.reached, self.views, bucket_list, reducer)

    def first_moved(self, param_views, dtype, device, hint: bool) -> int:
        """Index of the first parameter whose storage is no longer ``param_views[i]``, or
        -1. With the extension, one C loop also finds the first foreign ``.grad``;
        ``hint=True`` keeps it for the ``sync`` that follows in the same step."""
        if self.check_flat is not None:
            moved, foreign = self.check_flat(self.params, param_views, self.views)
            self.foreign_hint = foreign if hint else None
            return moved
        return _first_moved(self.params, param_views, dtype, device)

    def sync(self, param_views, backward_seen: bool):
        """Point every ``.grad`` back at its view and return which parameters have a
        gradient (None when all do). A ``.grad`` that something replaced
        (``module.zero_grad()`` sets it to None, and autograd then allocates a fresh one)
        is copied in; a None one is zeroed and not stepped."""
        written = self.flat._version != self.version
        reached = self.reached
        start, self.foreign_hint = self.foreign_hint, None
        if start is None and self.check_flat is not None:  # the common case in one C loop
            start = self.check_flat(self.params, param_views, self.views)[1]
        if start is not None and start < 0:
            if backward_seen:
                return None if 0 not in reached else [r == 1 for r in reached]
            return None if written else [False] * len(reached)
        by_hand = written and not backward_seen
        present = []
        for i in range(len(self.params)):
            p, view = self.params[i], self.views[i]
            g = p.grad
            if g is view:
                present.append(reached[i] == 1 or by_hand)
                continue
            if g is None:
                view.zero_()
                reached[i] = 0
                present.append(False)
            else:
                if g.is_sparse:
                    raise RuntimeError(
                        f"parameter {i} ({tuple(p.shape)}) has a sparse gradient; FusedAdam "
                        "needs dense gradients (use torch.optim.SparseAdam for sparse ones)")
                view.copy_(g)
                reached[i] = 1
                present.append(True)
            p.grad = view
        return None if all(present) else present

    def zero(self) -> None:
        """``zero_grad``: zero the buffer, put back any ``.grad`` replaced since."""
        self.flat.zero_()
        if self.foreign_hint != -1:  # some .grad replaced (or no C check): repair
            for p, view in zip(self.params, self.views):
                if p.grad is not view:
                    p.grad = view
        self.mark_zeroed()

    def mark_zeroed(self) -> None:
        """No parameter has a gradient until backward reaches it."""
        self.reached[:] = bytes(len(self.reached))
        self.version = self.flat._version
        self.foreign_hint = None

    def carry_over(self, old: "LocalGrads") -> None:
        """After a re-home: the new buffer copied every ``.grad`` in (Module.to converts
        them all, views included); which parameters have a gradient is the old answer."""
        self.reached[:] = old.reached
        if old.flat._version == old.version:
            self.version = self.flat._version

    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


class ShardedGrads:
    """ZeRO-2: no gradient buffer; backward's hooks hand each ``.grad`` to its bucket."""

    sharded = True
    flat = None
    views = None
    check_flat = None
    foreign_hint = None

    def __init__(self, params, layout, reducer, bucket_list):
        self.params = params
        self.layout = layout
        self.reducer = reducer
        self.buckets = bucket_list
        self.reached = bytearray(len(params))
        self.bucket_of = [k for k, g in enumerate(layout.buckets) for _ in range(g.first, g.end)]

    def register_hooks(self, bucket_list, reducer) -> list:
        return buckets.register_sharded_hooks(self.params, self.reached, self.layout, bucket_list,
                                              reducer)

    def first_moved(self, param_views, dtype, device, hint: bool) -> int:
        return _first_moved(self.params, param_views, dtype, device)

    def sync(self, param_views, backward_seen: bool):
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

    def zero(self) -> None:
        """``zero_grad``: the shard is overwritten by the next step's first average."""
        self.mark_zeroed()

    def mark_zeroed(self) -> None:
        self.reached[:] = bytes(len(self.reached))
        for p in self.params:
            p.grad = None

    def carry_over(self, old: "ShardedGrads") -> None:
        self.reached[:] = old.reached

    def nbytes(self) -> int:
        return 0


def _first_moved(params, param_views, dtype, device) -> int:
    for i, (p, view) in enumerate(zip(params, param_views)):
        if p.data_ptr() != view.data_ptr() or p.dtype != dtype or p.device != device:
            return i
    return -1
