"""Backward's hooks: where a gradient enters its bucket.

A post-accumulate-grad hook on every parameter tells the ``Reducer`` that backward has
reached it (stage 1: the local gradient is a view of the gradient buffer; stage 2: the
``.grad`` is added into the bucket's staging buffer and set to None), and refuses a
gradient that was read or written while its bucket's all-gather was in flight.
"""
from __future__ import annotations

import functools
import weakref

import torch

from zero_triton.comm.buckets import Bucket
from zero_triton.native.compat import disable_dynamo


def _read_before_gathered(bucket: Bucket):
    return RuntimeError(
        f"zero_triton.overlap: backward reached a parameter of bucket {bucket.key[1]} of flat "
        f"buffer {bucket.key[0]} whose all-gather from the last step() was never waited for: the "
        "forward read it before its updated values were known to have arrived, because no "
        "forward pre-hook of a module owning it ran. Either the model was compiled "
        "(torch.compile) into a graph made before zero_triton.overlap(model, optimizer) was "
        "called (compiled graphs skip module hooks added later: call overlap() before the "
        "first forward), or the parameter is read outside the forward of every module that "
        "owns it (make the module that uses it own it, or call optimizer.wait_params() before "
        "the forward)")


def grad_ready(reached: bytearray, i: int, j: int, view: torch.Tensor, bucket: Bucket,
               reducer_ref, param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of parameter ``i`` (``j`` within its bucket)."""
    if bucket.gather is not None:  # zero_triton.overlap: the forward did not wait for it
        raise _read_before_gathered(bucket)
    reached[i] = 1
    g = param.grad
    if g is not view and g is not None and not g.is_sparse and g.dtype == view.dtype \
            and g.device == view.device:
        # .grad was None (zero_grad()): autograd made a tensor of its own; it moves into
        # the flat buffer (a parameter moved by model.to() is re-homed at step instead).
        view.copy_(g)
        param.grad = view
    bucket.grads.hooked()
    reducer = reducer_ref()
    if reducer is not None:
        reducer.note_backward()
        reducer.arrived(bucket, j)


def grad_taken(reached: bytearray, i: int, j: int, lo: int, hi: int, bucket: Bucket,
               reducer_ref, param: torch.Tensor) -> None:
    """ZeRO-2's post-accumulate-grad hook: add ``.grad`` into the bucket's staging
    buffer at [lo, hi) and free it."""
    if bucket.gather is not None:  # zero_triton.overlap: the forward did not wait for it
        raise _read_before_gathered(bucket)
    g = param.grad
    reducer = reducer_ref()
    if g is None or reducer is None:
        return
    if g.dtype != bucket.grad_dtype or g.device != bucket.param_full.device:
        # The parameter moved (model.to() after the optimizer was built): its .grad stays
        # for step(), which re-homes the parameter and takes it then.
        return
    reached[i] = 2  # taken by the hook (1: found at step)
    reducer.note_backward()
    reducer.accept(bucket, j, lo, hi, g, adopt=True)  # .grad is let go just below
    param.grad = None


def before_accumulate(bucket: Bucket, grad):
    """Tensor hook, before autograd adds into ``.grad``: a reduce-scatter still reading
    this bucket's gradients (from an earlier micro-batch) must finish first."""
    if bucket.reduce is not None:
        bucket.wait_reduce()  # on a GPU: the compute stream waits for this bucket only
    return None


def _on_leaf(p: torch.Tensor, register):
    """Register a grad hook also on a parameter frozen right now (a re-home after
    ``requires_grad_(False)``): torch refuses hooks on a tensor that does not require
    grad, and they must fire once the parameter is unfrozen."""
    if p.requires_grad:
        return register()
    p.requires_grad_(True)
    try:
        return register()
    finally:
        p.requires_grad_(False)


# Autograd calls our hooks from inside a compiled training step's backward; they are
# bookkeeping (which gradient arrived, which bucket to launch), so torch.compile runs
# them as they are (``torch._disable_dynamo``, ~0.5 us a call) instead of tracing a
# graph break into each.
def post_accumulate_hook(p: torch.Tensor, fn):
    return _on_leaf(p, lambda: p.register_post_accumulate_grad_hook(disable_dynamo(fn)))


def register_sharded_hooks(params, reached, layout, buckets, reducer) -> list:
    """ZeRO-2's post-accumulate-grad hooks of one flat buffer's parameters."""
    ref = weakref.ref(reducer)
    handles = []
    for b in buckets:
        g = b.geometry
        for j, i in enumerate(range(g.first, g.end)):
            lo = layout.offsets[i] - g.start
            hi = lo + params[i].numel()
            handles.append(post_accumulate_hook(params[i], functools.partial(
                grad_taken, reached, i, j, lo, hi, b, ref)))
    return handles


def register_hooks(params, reached, grad_views, buckets, reducer) -> list:
    """The post-accumulate-grad and before-accumulate hooks of one flat buffer's
    parameters; returns their handles."""
    ref = weakref.ref(reducer)
    handles = []
    for b in buckets:
        g = b.geometry
        for j, i in enumerate(range(g.first, g.end)):
            p = params[i]
            handles.append(post_accumulate_hook(p, functools.partial(
                grad_ready, reached, i, j, grad_views[i], b, ref)))
            handles.append(_on_leaf(p, lambda p=p, b=b: p.register_hook(
                disable_dynamo(functools.partial(before_accumulate, b)))))
    return handles
