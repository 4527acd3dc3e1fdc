"""Who wrote what since we last looked: the user's writes to what the optimizer copies.

The user's tensors are the truth and our copies follow them. Three kinds of copy can
fall behind, and each has a cheap witness here:

- **Parameters** (``ParamVersions``): the fp32 master of an fp16/bf16 parameter is a
  copy of it. Our own writes go through the flat buffer, which does not bump a
  parameter's version counter (each parameter is a tensor of its own over its part of
  the buffer); every write of the user's through the parameter does (``load_state_dict``,
  ``nn.init``, ``copy_``, ``clamp_``, ``mul_``). A version that moved since we last
  looked is a parameter whose master must be seeded again from it.
- **``opt.state``** (``TrackedState``): torch.optim.Adam reads its state from this dict
  at every step, so users edit it (assign a moment, reset ``step``, ``state.clear()``,
  ``opt.state = defaultdict(dict)``). Ours is a dict that notes any edit of itself or
  of a parameter's entry, so the step notices with one flag read.
- **State handed out** (``unaliased``): ``state_dict()`` returns views of the live state,
  and they may come back (``opt.load_state_dict(opt.state_dict())``, DCP's in-place
  load): a load copies them before it overwrites what they view.

Nothing here decides what to do about a write: ``FusedAdam`` and ``ZeroAdam`` do (and
under ZeRO, all ranks agree on it: ``zero_triton.comm.agreement``).
"""
from __future__ import annotations

import collections
import operator

import torch

from zero_triton.native import ext as _ext

_VERSION = operator.attrgetter("_version")


class ParamVersions:
    """The version counter of each of ``params`` as we last saw it."""

    __slots__ = ("params", "seen", "first_written")

    def __init__(self, params):
        self.params = params
        self.seen = list(map(_VERSION, params))
        native = _ext.loaded_or_prebuilt()
        self.first_written = getattr(native, "first_written", None)

    def written(self) -> list[int]:
        """Indices of the parameters written through since ``accept`` (a host read of one
        integer per parameter: no device work, no sync; one C loop with the extension)."""
        if self.first_written is not None:
            if self.first_written(self.params, self.seen) < 0:
                return []
        now = list(map(_VERSION, self.params))
        if now == self.seen:
            return []
        return [i for i, (a, b) in enumerate(zip(now, self.seen)) if a != b]

    def accept(self, indices=None) -> None:
        """What the parameters hold now is what our copies hold (all, or ``indices``)."""
        if indices is None:
            self.seen = list(map(_VERSION, self.params))
        else:
            for i in indices:
                self.seen[i] = self.params[i]._version


def _edits(method):
    def edit(self, *args, **kwargs):
        self._edited()
        return method(self, *args, **kwargs)
    edit.__name__ = method.__name__
    return edit


_MUTATORS = ("__setitem__", "__delitem__", "pop", "popitem", "clear", "update", "setdefault",
             "__ior__")


class ParamState(dict):
    """One parameter's entry of ``opt.state``: a dict that tells its owner when edited."""

    __slots__ = ("owner",)

    def __init__(self, owner, *args):
        super().__init__(*args)
        self.owner = owner

    def _edited(self) -> None:
        self.owner.edited = True

    def __reduce__(self):  # pickles (and deep-copies) as the plain dict it stands for
        return dict, (dict(self),)


class TrackedState(collections.defaultdict):
    """``opt.state``: a ``defaultdict(dict)`` as torch's, that sets ``edited`` when it or
    a parameter's entry in it is changed by anything but the optimizer."""

    def __init__(self):
        super().__init__(dict)
        self.edited = False
        self.removed = False  # an entry was deleted (clear, del, pop): a reset for ZeroAdam
        # The optimizer holds state that this table does not list (ZeroAdam at several
        # ranks: each holds shards, not tensors of the parameters' shapes).
        self.elsewhere = False

    def __bool__(self) -> bool:
        """Whether the optimizer has state, as ``if optimizer.state:`` asks it (torch's
        ``get_optimizer_state_dict`` steps an optimizer whose state is empty, with zero
        gradients, to make some): True for a ZeroAdam with parameters, at any rank count."""
        return self.elsewhere or dict.__len__(self) > 0

    def _edited(self) -> None:
        self.edited = True

    def __missing__(self, key):
        # opt.state[p] of a parameter without state (torch makes {}): a new entry, an edit
        # only once something is put in it.
        value = ParamState(self)
        dict.__setitem__(self, key, value)
        return value

    def set_entry(self, key, entry: dict) -> None:
        """The optimizer's own write: not an edit."""
        dict.__setitem__(self, key, ParamState(self, entry))

    def __reduce__(self):  # pickles (and deep-copies) as torch's defaultdict(dict)
        return collections.defaultdict, (dict,), None, None, iter(
            (k, dict(v)) for k, v in self.items())


for _cls in (ParamState, TrackedState):  # every way a dict can change notes an edit
    for _name in _MUTATORS:
        setattr(_cls, _name, _edits(getattr(dict, _name)))


def _removes(method):
    def remove(self, *args, **kwargs):
        self.removed = True
        return method(self, *args, **kwargs)
    remove.__name__ = method.__name__
    return remove


for _name in ("__delitem__", "pop", "popitem", "clear"):
    setattr(TrackedState, _name, _removes(getattr(TrackedState, _name)))


def _storage(t: torch.Tensor) -> int:
    """Where ``t``'s memory starts; a DTensor's is its local shard's (the wrapper has none)."""
    return getattr(t, "_local_tensor", t).untyped_storage().data_ptr()


def unaliased(state_dict: dict, ours) -> dict:
    """``state_dict`` with every tensor of its ``state`` that shares memory with one of
    ``ours`` (the live state buffers and parameters) replaced by a copy, so that a load
    can overwrite ours first and still read what it was given."""
    storages = {_storage(t) for t in ours if t is not None and t.numel()}
    state = state_dict.get("state")
    if not isinstance(state, dict) or not storages:
        return state_dict
    copied = None
    for key, entry in state.items():
        if not isinstance(entry, dict):
            continue
        for name, value in entry.items():
            if (isinstance(value, torch.Tensor) and value.numel()
                    and _storage(value) in storages):
                if copied is None:
                    copied = {k: dict(v) if isinstance(v, dict) else v for k, v in state.items()}
                copied[key][name] = value.clone()
    if copied is None:
        return state_dict
    return {**state_dict, "state": copied}
