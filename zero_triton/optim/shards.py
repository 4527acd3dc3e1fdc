"""An optimizer's shards, per param group: built (``zero_triton.optim.build``), followed
when the user moves or replaces their parameters, and listed, here only.

``groups[g]`` holds param group g's shards (one per dtype of its plain tensors, then its
DTensors'). ``listed`` gives every (param group, shard) pair as they are; ``followed``
the same after following what the user changed since (parameters moved by
``model.to(device or dtype)``, parameters replaced in ``param_groups``): their shards
are built again, the state carried over, and the reducer takes the new buckets.
"""
from __future__ import annotations

import weakref

from zero_triton.optim.build import build_shards
from zero_triton.optim.checks import check_group_params
from zero_triton.optim.shard import Shard


class Shards:
    """The shards of one optimizer over ``comm``, built to ``spec``, their buckets
    launched by ``reducer``, ``opt.state`` kept by ``edits`` (``optim.edits.UserEdits``);
    ``rebuilds_replaced``: a param group whose parameters were replaced is built again
    over the new ones (FusedAdam), rather than refused (ZeroAdam)."""

    def __init__(self, comm, spec, reducer, edits, rebuilds_replaced: bool):
        self.comm, self.spec, self.reducer, self.edits = comm, spec, reducer, edits
        self.rebuilds_replaced = rebuilds_replaced
        self.groups: list[list[Shard]] = []
        self.watchers = []  # told when shards are built or built again (``on_change``)

    def build(self, params, group: dict, key: int | None = None, index: int | None = None) -> list:
        """The shards of the trainable ``params`` of param group ``group``, number
        ``index`` (None: a new group), numbered from ``key`` (None: after every shard
        there is), built to the optimizer's spec with the group's own state formats
        (``Spec.for_group``)."""
        key = sum(map(len, self.groups)) if key is None else key
        index = len(self.groups) if index is None else index
        sharded = self.comm.everyone.world_size > 1 or self.spec.grads.sharded
        return build_shards([p for p in params if p.requires_grad], self.comm,
                            self.spec.for_group(group), amsgrad=group["amsgrad"], key=key,
                            reducer=self.reducer if sharded else None, group=index)

    def on_change(self, watcher) -> None:
        """``watcher(param_groups)`` (a bound method, held weakly) is told each time shards
        are built or built again."""
        self.watchers.append(weakref.WeakMethod(watcher))

    def _changed(self, param_groups: list) -> None:
        """Shards were built or built again: the reducer takes their buckets, the
        watchers are told."""
        self.reducer.rebuild([s for _, s in self.listed(param_groups)])
        for ref in self.watchers:
            watcher = ref()
            if watcher is not None:
                watcher(param_groups)

    def add(self, param_groups: list, shards: list) -> None:
        """The shards of the group just added to ``param_groups``, taken."""
        self.groups.append(shards)
        self._changed(param_groups)
        self.edits.expose(*shards)
        self.edits.tracked.elsewhere = not self.edits.views_state and any(self.groups)

    def listed(self, param_groups: list) -> list:
        """(param group, shard) of every shard, in order, as they are."""
        return [(group, s) for group, shards in zip(param_groups, self.groups) for s in shards]

    def followed(self, param_groups: list, hint: bool = False) -> tuple:
        """``listed`` after following parameters replaced in ``param_groups``
        (``UserEdits.replaced_groups``) or moved since the last call (``hint``: a cheap
        first look, ``Shard.first_moved``); and whether any shard was built again."""
        changed = False
        for gi, params in self.edits.replaced_groups(param_groups, self.groups, self.rebuilds_replaced):
            self._rebuild_group(param_groups, gi, params)
            changed = True
        moved = False
        for shards in self.groups:
            for k, shard in enumerate(shards):
                if shard.first_moved(hint) < 0:
                    continue
                shards[k] = shard.rehomed()
                moved = True
                self.edits.expose(shards[k])
        if moved:
            self._changed(param_groups)
        return self.listed(param_groups), changed or moved

    def _rebuild_group(self, param_groups: list, gi: int, params: list) -> None:
        """Param group ``gi`` anew over ``params`` (no state yet): the checks, new shards,
        the old shards' hooks and ``opt.state`` entries removed."""
        others = [g for k, g in enumerate(param_groups) if k != gi]
        check_group_params(params, others, materialised=False)
        key = 1 + max((s.key for shards in self.groups for s in shards), default=-1)
        shards = self.build(params, param_groups[gi], key, gi)
        for shard in self.groups[gi]:
            shard.remove_hooks()
        self.edits.regroup(gi, params, self.groups[gi])
        self.groups[gi] = shards
        self._changed(param_groups)
        self.edits.expose(*shards)
