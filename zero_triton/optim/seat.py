"""What an optimizer hands the parts it is composed with: its ``Seat``.

The parts inside ``optim/`` (the ``Ranks`` part, the state dicts' assembly and loads, the
compact and DCP forms, the shard server's view, Join's hook, ``overlap()``) are handed a
``Seat`` instead of the optimizer: the members declared below, no more (no attribute is
passed through by name): of the optimizer's public face, ``param_groups`` and ``state``
and the calls torch's Join makes for a joined rank (``step``, ``zero_grad``,
``clip_grad_norm_``, ``wait_params``); of its own, a short list. A private attribute of
the optimizer is read here and in the optimizers' own modules, nowhere else
(``tests/test_layers.py`` holds that), so a part names exactly what it depends on and a
new part (a host launch, a captured step) adds a member here, not a reach into the
optimizer.

The seat holds the optimizer weakly (the optimizer holds its seat): parts that outlive a
dropped optimizer (the shard server's registry) see ``optimizer`` None.
"""
from __future__ import annotations

import weakref


class Seat:
    """The declared face of one FusedAdam or ZeroAdam for its parts."""

    __slots__ = ("_ref", "__weakref__")

    def __init__(self, optimizer):
        self._ref = weakref.ref(optimizer)

    @property
    def optimizer(self):
        """The optimizer itself (None once it was dropped): for torch's APIs that take it
        (Join), never for its private attributes."""
        return self._ref()

    # -- torch.optim.Optimizer's ----------------------------------------------------------
    @property
    def param_groups(self) -> list:
        return self._ref().param_groups

    @property
    def state(self):
        return self._ref().state

    @state.setter
    def state(self, value) -> None:
        self._ref().state = value

    # -- the public calls Join's hook makes for a joined rank (``optim.join``) -------------
    def step(self, closure=None):
        return self._ref().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._ref().zero_grad(set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0):
        return self._ref().clip_grad_norm_(max_norm, norm_type)

    def wait_params(self) -> None:
        self._ref().wait_params()

    # -- the optimizer's parts ------------------------------------------------------------
    @property
    def comm(self):
        """The communicator (``comm.protocol.Comm``)."""
        return self._ref()._comm

    @property
    def spec(self):
        """The frozen spec it was built to (``optim.spec.Spec``)."""
        return self._ref()._spec

    @property
    def ranks(self):
        """Its ``Ranks`` part (``optim.protocol``)."""
        return self._ref()._ranks

    @property
    def edits(self):
        """What follows the user's edits of ``param_groups`` and ``state`` (``optim.edits``)."""
        return self._ref()._edits

    @property
    def reducer(self):
        """The buckets' launcher (``comm.buckets.Reducer``)."""
        return self._ref()._reducer

    @property
    def gather_chunk(self) -> int:
        """Elements per chunk of a state dict gathered or served over the ranks."""
        return self._ref()._GATHER_CHUNK

    @property
    def join_enabled(self) -> bool:
        """Whether a torch Join context enabled this optimizer's join hook."""
        return self._ref()._join_config.enable

    @property
    def grads_reduced(self) -> bool:
        """Whether this step's gradients were averaged already."""
        return self._ref()._pipeline.reduced

    @property
    def overlap(self):
        """The parameter prefetch ``overlap()`` installed, or None."""
        return self._ref()._overlap

    @overlap.setter
    def overlap(self, prefetch) -> None:
        self._ref()._overlap = prefetch

    def overlap_removed(self, prefetch) -> None:
        """``prefetch`` was removed (its ``remove()``): ``step`` waits for its gathers again."""
        opt = self._ref()
        if opt is not None:
            opt._overlap_removed(prefetch)

    def shards(self, follow: bool = False) -> list:
        """(param group, shard) of every shard, in order (``optim.shards``): as they are,
        or (``follow``) after following parameters moved or replaced since the last call."""
        opt = self._ref()
        return opt._pipeline.current() if follow else opt._shards.listed(opt.param_groups)

    def enter(self, entry: str, pairs=None, stale: bool = False, detail: str = "") -> bool:
        """Start a call that reads the state (``Ranks.enter`` through the optimizer)."""
        return self._ref()._enter(entry, pairs, stale, detail)

    def drop_averages(self) -> None:
        """A step was refused after its averages: average again at the next step, and
        forget the clip coefficient taken from them."""
        self._ref()._pipeline.drop_averages()


def seat_of(optimizer) -> Seat:
    """The seat of a FusedAdam or ZeroAdam (how ``zero_triton.overlap`` reaches its parts)."""
    return optimizer._seat
