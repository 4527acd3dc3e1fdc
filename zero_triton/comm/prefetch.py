"""Parameter all-gathers overlapped with the next forward: ``zero_triton.overlap``.

Without it, ``step()`` starts each bucket's all-gather as soon as that bucket's kernel
is done and waits for all of them before returning. With it, ``step()`` returns with
the all-gathers in flight, and a forward pre-hook on every module that owns parameters
waits for the buckets holding that module's own parameters only: the gathers of later
layers run while the earlier layers compute. The optimizer's state dicts, checkpoints
and next ``step`` wait for whatever is left, and until the forward begins any torch
operation on a parameter (an EMA, a weight norm) waits for them all first
(``pending_reads``). A module that uses another module's parameter functionally (not
through that module's forward) must own it too (tied weights: the same Parameter in both modules).
A forward that read a parameter without waiting (that, or a graph compiled by
torch.compile before ``overlap`` was called, which skips the hooks) is refused by the
backward hooks that follow (``hooks.grad_ready``), before the step.
"""
from __future__ import annotations

import functools
import weakref

import torch
from torch.overrides import TorchFunctionMode

from zero_triton.comm.group import phase
from zero_triton.native.compat import disable_dynamo, tree_leaves


# The hooks below are bookkeeping and waits on collectives: inside a compiled forward
# they run as they are (``torch._disable_dynamo``, a graph break at each module that
# waits), like the gradient hooks (``zero_triton.comm.buckets``), rather than being traced.
@disable_dynamo
def _wait_for_own(reducer_ref, reads, module, _args):
    """Forward pre-hook: wait for the buckets of the module's own parameters, and of the
    parameters its forward was seen reading that it does not own (``reads``)."""
    reducer = reducer_ref()
    if reducer is None:
        return
    if reducer.reads.active:  # the forward has begun: its hooks wait from here
        reducer.reads.release()
    if not reducer.gathering:
        return
    where = reducer.bucket_of_param
    params = list(module._parameters.values())
    extra = reads.get(module)
    if extra:
        params.extend(extra)
    for p in params:
        b = where.get(id(p)) if p is not None else None
        if b is not None and b.gather is not None:
            with phase("zero_triton.all_gather", p.is_cuda):
                b.wait_gather()


class _ReadRecorder(TorchFunctionMode):
    """During one forward: which module's forward (the innermost running) first reads
    each parameter, by any op, autograd or not (``.detach()``, ``torch.no_grad()``
    statistics, a tied weight read by its parent before the child runs)."""

    def __init__(self, watched: dict):
        super().__init__()
        self.watched = watched  # id(parameter) -> parameter
        self.stack: list = []
        self.first: dict = {}   # id(parameter) -> (module, parameter)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.stack:
            for a in tree_leaves((args, kwargs)):
                if isinstance(a, torch.Tensor) and id(a) in self.watched and id(a) not in self.first:
                    self.first[id(a)] = (self.stack[-1], a)
        return func(*args, **kwargs)


class _Learner:
    """Learns, in the first forward of ``root`` after ``overlap()``, which parameters each
    module's forward reads that it does not own; their buckets are then waited for at
    that module's pre-hook too. That forward waits for every gather first."""

    def __init__(self, root, reducer_ref, reads: dict, owners: dict, handles: list, waiter):
        self.root, self.reducer_ref, self.reads, self.owners = root, reducer_ref, reads, owners
        self.recorder = None
        self.handles = handles
        self.waiter = waiter  # module -> None: give a module without parameters a waiting hook
        self.done = False

    @disable_dynamo
    def before(self, module, _args):
        if self.done:
            return
        if module is self.root and self.recorder is None:
            _wait_for_all(self.reducer_ref)
            reducer = self.reducer_ref()
            watched = {id(p): p for p in self.root.parameters()} if reducer is not None else {}
            self.recorder = _ReadRecorder(watched)
            self.recorder.__enter__()
        if self.recorder is not None:
            self.recorder.stack.append(module)

    @disable_dynamo
    def after(self, module, _args, _out):
        rec = self.recorder
        if self.done or rec is None:
            return
        if rec.stack and rec.stack[-1] is module:
            rec.stack.pop()
        if module is self.root:
            rec.__exit__(None, None, None)
            self.recorder, self.done = None, True
            for module, p in rec.first.values():
                if id(p) not in self.owners.get(module, ()):
                    if module not in self.reads and not self.owners.get(module):
                        self.waiter(module)
                    self.reads.setdefault(module, []).append(p)
            _remove(self.handles)  # learned: these hooks cost every forward nothing more


@disable_dynamo
def _wait_for_all(reducer_ref, *_args, **_kwargs):
    reducer = reducer_ref()
    if reducer is not None:
        reducer.wait_gathers()


def _remove(handles: list) -> None:
    for h in handles:
        h.remove()
    handles.clear()


class ParamPrefetch:
    """The hooks that ``overlap`` puts on a model; ``remove()`` takes them off (then
    ``step()`` waits for its all-gathers again)."""

    def __init__(self, model: torch.nn.Module, reducer, on_remove=None):
        """``reducer``: the buckets whose gathers the hooks wait; ``on_remove``: a weak
        reference to what ``remove()`` calls first, with this handle (its owner's)."""
        ref = weakref.ref(reducer)
        self.handles = []
        self.reads: dict = {}  # module -> parameters its forward reads and does not own
        owners = {m: {id(p) for p in m._parameters.values() if p is not None} for m in model.modules()}
        self.learning: list = []
        learner = _Learner(model, ref, self.reads, owners, self.learning, lambda m: self.handles.append(
            m.register_forward_pre_hook(functools.partial(_wait_for_own, ref, self.reads))))
        for m in model.modules():
            self.learning.append(m.register_forward_pre_hook(learner.before))
            self.learning.append(m.register_forward_hook(learner.after, always_call=True))
            if any(p is not None for p in m._parameters.values()):
                self.handles.append(m.register_forward_pre_hook(
                    functools.partial(_wait_for_own, ref, self.reads)))
                # state_dict() of this module or any module above it (every saver) reads
                # the parameters, and load_state_dict() writes them: wait for them all
                # (a gather landing after the load would overwrite it).
                self.handles.append(m.register_state_dict_pre_hook(functools.partial(_wait_for_all, ref)))
                self.handles.append(m.register_load_state_dict_pre_hook(
                    functools.partial(_wait_for_all, ref)))
        self._on_remove = on_remove
        # A dropped optimizer must not leave hooks (holding nothing of it) on the model.
        weakref.finalize(reducer, _remove, self.handles)
        weakref.finalize(reducer, _remove, self.learning)

    def remove(self) -> None:
        removed = self._on_remove() if self._on_remove is not None else None
        if removed is not None:
            removed(self)
        _remove(self.handles)
        _remove(self.learning)
