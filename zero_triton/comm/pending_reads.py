"""Parameters read while their all-gather is in flight wait for it first.

Under ``zero_triton.overlap`` ``step()`` returns with the all-gathers still writing the
parameters, and each module's forward waits for its own. Between ``step()`` and that
forward, anything else that touches a parameter (an EMA update, ``swa_utils``'
``AveragedModel``, logging a weight norm, ``p.detach().clone()``, ``print(p)``, a write
such as ``p.copy_(x)`` or ``p.data = x``) would read values half old and half new, or
be undone when the gather lands. ``PendingReads``, a torch function mode pushed by
``step()`` on the thread that called it (at the bottom of the mode stack) and dropped
when the next forward begins, sees every torch operation in that window: one whose
tensors lie in a parameter buffer still being gathered waits for all the gathers first,
then runs. Metadata (``.grad``, ``.shape``, ``requires_grad_``, ``numel()``) waits for
nothing, so ``zero_grad()``, GradScaler, schedulers and data loading keep the gathers
hidden.

Writes from another thread (the mode is per thread) are still caught at the next wait
(``buckets._written_while_gathering``). A process forked in that window (DataLoader
workers, started at each epoch's ``iter(loader)``, right after the last ``step()``) would
inherit the mode on its stack, checking its every operation for the parent's gathers and
waiting on collectives it does not take part in: the child drops every guard at once.
"""
from __future__ import annotations

import os
import weakref

import torch
from torch.overrides import TorchFunctionMode

from zero_triton.native import compat
from zero_triton.native.compat import DeviceContext, disable_dynamo

# Methods that read no parameter values: what a step, zero_grad or a freeze touches.
_METADATA = frozenset({
    "data_ptr", "numel", "nelement", "size", "dim", "ndimension", "stride", "storage_offset",
    "element_size", "is_contiguous", "is_floating_point", "is_complex", "requires_grad_",
    "register_hook", "register_post_accumulate_grad_hook", "retain_grad", "__len__",
    "__hash__", "get_device", "is_shared", "is_pinned", "untyped_storage",
})
_DESCRIPTOR_CALLS = ("__get__", "__set__", "__delete__")


def _metadata(func) -> bool:
    """Attribute access (``p.grad``, ``p.shape``, reading ``p.data``: the alias it
    returns is itself watched) or a method from ``_METADATA``. Assigning ``p.data = x``
    is a write: the gather landing after it would put its values back."""
    name = getattr(func, "__name__", "")
    if name in _DESCRIPTOR_CALLS:
        return not (name == "__set__" and getattr(getattr(func, "__self__", None), "__name__", "") == "data")
    return name in _METADATA


def _plain(a) -> bool:
    """A tensor that can lie in our buffers: a parameter or a plain tensor (a view, the
    alias ``.data`` returns). Fake and functional tensors (what torch.compile traces
    with) and wrapper subclasses hold no memory of ours."""
    return type(a) is torch.Tensor or isinstance(a, torch.nn.Parameter)


def _tensors(args, kwargs):
    for a in args:
        if _plain(a):
            yield a
        elif isinstance(a, (list, tuple)):  # foreach ops, torch.cat, stack
            for t in a:
                if _plain(t):
                    yield t
    if kwargs:
        yield from _tensors(kwargs.values(), None)


def _address(t: torch.Tensor):
    try:
        return t.data_ptr()
    except Exception:  # sparse or storage-less tensors hold none of ours
        return None


class PendingReads(TorchFunctionMode):
    """Waits for ``reducer``'s gathers before the first torch operation on a tensor that
    lies in one of ``ranges`` ([lo, hi) byte addresses of the buffers being gathered)."""

    def __init__(self, reducer, ranges):
        super().__init__()
        self.reducer_ref = weakref.ref(reducer)
        self.ranges = ranges
        self.active = True
        _LIVE.add(self)

    def touches(self, args, kwargs) -> bool:
        for t in _tensors(args, kwargs):
            ptr = _address(t)
            if ptr is not None:
                for lo, hi in self.ranges:
                    if lo <= ptr < hi:
                        return True
        return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.active and not _metadata(func):
            _wait_if_touched(self, args, kwargs)
        return func(*args, **kwargs)


# Run as it is inside a function torch.compile traces (a graph break at each operation
# while the gathers are pending): a compiled graph would otherwise read the parameters
# without the check.
@disable_dynamo
def _wait_if_touched(guard: PendingReads, args, kwargs) -> None:
    if guard.active and guard.touches(args, kwargs):
        guard.active = False
        reducer = guard.reducer_ref()
        if reducer is not None:
            reducer.wait_gathers()


def push(mode: TorchFunctionMode) -> None:
    """Put ``mode`` at the bottom of this thread's torch function mode stack (above the
    default device's ``DeviceContext``, which keeps the bottom), as torch puts
    ``DeviceContext`` there: a ``with`` mode entered before ``step()`` and left after it
    pops its own mode, not this one."""
    compat.require(compat.MODE_STACK, "overlap()'s guard of parameter reads", "2.4")
    stack = [torch._C._pop_torch_function_stack()
             for _ in range(torch._C._len_torch_function_stack())][::-1]  # bottom first
    at = 1 if stack and DeviceContext is not None and isinstance(stack[0], DeviceContext) else 0
    stack.insert(at, mode)
    for m in stack:
        torch._C._push_on_torch_function_stack(m)


def drop(mode: TorchFunctionMode) -> bool:
    """Take ``mode`` off this thread's torch function mode stack, the modes above it
    kept in their order. False when it is not there (another thread's, or the mode is
    running its own ``__torch_function__``, which takes it off the stack meanwhile)."""
    above = []
    found = False
    for _ in range(torch._C._len_torch_function_stack()):
        m = torch._C._pop_torch_function_stack()
        if m is mode:
            found = True
            break
        above.append(m)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)
    return found


def drop_all(modes: list) -> None:
    """The optimizer is gone: its guards that are still on a stack go with it."""
    for mode in modes:
        mode.active = False
        drop(mode)
    modes.clear()


_LIVE: "weakref.WeakSet[PendingReads]" = weakref.WeakSet()


class ReadGuards:
    """The guards of one optimizer's overlapped ``step()`` calls: from the step until
    the next forward, a torch operation on a parameter waits for the gathers (a
    ``PendingReads`` on the mode stack). Those not off the stack yet, the newest last
    (one, unless a drop failed); those left there (no forward came) go with the owner."""

    def __init__(self):
        self.guards: list = []
        weakref.finalize(self, drop_all, self.guards)

    @property
    def active(self) -> bool:
        """A guard is still on a mode stack."""
        return bool(self.guards)

    @property
    def latest(self):
        """The guard of the latest overlapped ``step()`` until the next forward, or None."""
        return self.guards[-1] if self.guards else None

    def push(self, waiter, ranges) -> None:
        """Guard the parameters at byte ``ranges``; a read waits through ``waiter``."""
        guard = PendingReads(waiter, ranges)
        push(guard)
        self.guards.append(guard)

    def release(self) -> None:
        """The forward has begun (its hooks wait from here on), or the gathers are waited.
        A guard that is not on this thread's stack now (running its own check) stays
        listed, inactive, until a later release or the owner's end drops it."""
        for guard in list(self.guards):
            guard.active = False
            if drop(guard):
                self.guards.remove(guard)


def _forget_in_child() -> None:
    """A forked child has none of the parent's gathers to wait for."""
    for mode in list(_LIVE):
        mode.active = False
        drop(mode)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
