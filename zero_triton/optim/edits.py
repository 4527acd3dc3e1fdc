"""The user's edits, followed: what FusedAdam and ZeroAdam do about the writes that
``zero_triton.state.watch`` witnesses.

Each call that reads the state (``step``, the state dicts, clipping, checkpoints) starts
with ``_enter``: param groups edited by hand are refused, ``opt.state`` edited is
followed (a tensor assigned is copied in, a ``step`` assigned becomes the count, an entry
removed starts its parameter over), parameters written have their master re-seeded.
``opt.state`` itself is a table of views of the flat state (one rank), as torch.optim.Adam's.
"""
from __future__ import annotations

import operator

import torch

from zero_triton.optim import state_dict as adam_state
from zero_triton.optim.checks import check_group_params
from zero_triton.optim.shard import FlatShard


class FollowsUserEdits:
    """FusedAdam's part that keeps ``opt.state`` and the user's writes in step with the
    flat state (its ``_tracked`` table, ``_group_sizes``, ``_views_state``, ``_all_flats``)."""

    def _expose_state(self, *flats: FlatShard) -> None:
        """One rank: optimizer.state[p] holds views of the flat state, as torch.optim.Adam's
        would. Several ranks: a rank holds a shard of each parameter's state, not a tensor
        of its shape, so ``opt.state`` has no entries of ours (``state_dict()`` gathers)."""
        if not self._views_state:
            return
        for flat in flats:
            views, table = flat.state_views(), self._tracked
            for i, p in enumerate(flat.params):
                # A 0-dim view of the count the kernel reads, as torch.optim.Adam's step.
                entry = {"step": flat.state.step_of(i).view(()),
                         **{k: v[i] for k, v in views.items()}}
                old = dict.get(table, p)
                if old and len(old) > len(entry):  # keys a user or a wrapper added stay
                    entry.update({k: v for k, v in old.items() if k not in adam_state.OWN_KEYS})
                table.set_entry(p, entry)
            flat.exposed_steps = flat.state.steps

    def _set_extras(self, others: dict, per_param: dict) -> None:
        """``opt.state`` anew: our entries (world size 1), each parameter's extra keys
        and the entries that are not parameters (``zero_triton.optim.state_dict.extras``)."""
        table = self._tracked
        self.state = table
        dict.clear(table)
        flats = [flat for _, flat in self._all_flats()]
        self._expose_state(*flats)
        for flat in flats:
            for p in flat.params:
                extra = per_param.get(id(p))
                if extra:
                    entry = dict.get(table, p)
                    if entry is None:
                        table.set_entry(p, extra)
                    else:
                        dict.update(entry, extra)
        for key, value in others.items():
            dict.__setitem__(table, key, value)
        table.edited = table.removed = False

    def _enter(self, entry: str, flats=None, stale: bool = False) -> bool:
        """Start a call that reads the state (``step``, the state dicts, clipping,
        checkpoints): follow what the user changed since the last one — param groups
        edited by hand (refused), ``opt.state`` edited (followed), parameters written
        (their master re-seeded). Returns whether gradients must be averaged again
        (``stale``: they changed after their bucket was averaged). ZeroAdam first agrees
        on all of it with every rank (``zero_triton.comm.agreement``)."""
        flats = flats if flats is not None else self._current_flats()
        self._check_groups()
        self._follow_state_edits(flats)
        self._reseed_written(flats)
        return stale

    def _follow_replaced_params(self) -> None:
        """A param group whose parameters were replaced by others (accelerate's FSDP2
        ``prepare`` swaps each for its DTensor after the optimizer was built; DeepSpeed's
        ZeRO-1/2 puts its flat fp32 partition in place of a client optimizer's
        parameters; model surgery) is rebuilt over them, as torch's optimizers simply
        step what ``param_groups`` holds, when none of its parameters has stepped yet.
        After a step their state would be lost: refused with the fix, nothing changed (a
        parameter added or removed then is ``_check_groups``' to refuse). ZeroAdam
        refuses a replacement always (``_rebuilds_replaced_groups``)."""
        for gi, (group, held) in enumerate(zip(self.param_groups, self._group_params)):
            params = group["params"]
            if params is held or (len(params) == len(held) and all(map(operator.is_, params, held))):
                continue
            stepped = any(t > 0 for flat in self._flats[gi] for t in flat.state.param_steps())
            if len(params) != len(held):
                known = {id(q) for q in held}
                replaced = not any(id(p) in known for p in params)
                if not replaced and (stepped or not self._rebuilds_replaced_groups):
                    continue  # added or removed: refused by _check_groups
            who = type(self).__name__
            if not self._rebuilds_replaced_groups:
                raise RuntimeError(
                    f"{who}: the parameters of param group {gi} were replaced in param_groups "
                    "after it was built (accelerate's FSDP2 prepare swaps them for DTensors; "
                    "DeepSpeed's ZeRO puts its flat partition in their place). ZeroAdam shards "
                    "what it was given; with FSDP2 or DeepSpeed use zero_triton.FusedAdamW, else "
                    "build the optimizer over the new parameters")
            if stepped:
                raise RuntimeError(
                    f"{who}: the parameters of param group {gi} were replaced in param_groups "
                    "after the optimizer stepped them; their state would be lost. Build a new "
                    "optimizer over the new parameters (loading the old one's state dict if "
                    "the shapes match). Nothing was changed")
            self._rebuild_group(gi, list(params))

    def _rebuild_group(self, gi: int, params: list) -> None:
        """Param group ``gi`` anew over ``params`` (no state yet): the checks, new shards,
        the old shards' hooks and ``opt.state`` entries removed."""
        others = [g for k, g in enumerate(self.param_groups) if k != gi]
        check_group_params(params, others, materialised=False)
        key = 1 + max((f.key for flats in self._flats for f in flats), default=-1)
        flats = self._group_shards(params, self.param_groups[gi]["amsgrad"], key)
        for flat in self._flats[gi]:
            flat.remove_hooks()
            for p in flat.params:
                dict.pop(self._tracked, p, None)
        self._flats[gi] = flats
        self._group_params[gi] = params
        self._group_sizes[gi] = len(params)
        self._frozen = [(g, p) for g, p in self._frozen if g != gi] + [
            (gi, p) for p in params if not p.requires_grad]
        self._grads_reduced = False
        self._reducer.rebuild([f for fs in self._flats for f in fs])
        self._expose_state(*flats)

    def _check_groups(self) -> None:
        """Refuse parameters added to or removed from ``param_groups`` by hand: the
        optimizer has flat buffers and state for the ones it was given."""
        sizes, groups = self._group_sizes, self.param_groups
        if len(groups) >= len(sizes) and all(
                len(g["params"]) == n for g, n in zip(groups, sizes)):
            if len(groups) == len(sizes):
                return
            # Groups repeated (``param_groups.extend(param_groups)``): the state dict
            # numbers their parameters as torch does; each parameter still steps once.
            known = {id(p) for g in groups[:len(sizes)] for p in g["params"]}
            if all(id(p) in known for g in groups[len(sizes):] for p in g["params"]):
                return
        raise RuntimeError(
            f"{type(self).__name__}: param_groups were edited by hand (now "
            f"{[len(g['params']) for g in self.param_groups]} parameters per group, built with "
            f"{sizes}); the optimizer keeps flat buffers and state for the parameters it was "
            "given and would not train the others. Add parameters with "
            "optimizer.add_param_group({'params': [...]}) (ZeroAdam: on every rank), or build a "
            "new optimizer. Nothing was changed")

    def _state_edited(self) -> bool:
        return self.state is not self._tracked or self._tracked.edited

    def _follow_state_edits(self, flats) -> None:
        """``opt.state`` is what the next step reads, as in torch.optim.Adam: a tensor
        assigned to a parameter's entry is copied into the flat state, a ``step``
        assigned becomes that parameter's count, and a parameter without an entry (after
        ``state.clear()``, ``del state[p]`` or ``opt.state = defaultdict(dict)``) starts
        over: zero moments, step 0, master from the parameter. Everything is checked
        before anything changes."""
        if not self._state_edited():
            return
        user = self.state
        plans = [(flat, adam_state.plan_user_state(flat, user)) for _, flat in flats]
        for flat, (copies, steps, reseed) in plans:
            with torch.no_grad():
                for target, value in copies:
                    target.copy_(value)
            if steps is not None:
                flat.state.set_param_steps(steps)
            flat.reseed(reseed)
        self._restore_state_table()

    def _restore_state_table(self) -> None:
        user = self.state if isinstance(self.state, dict) else {}
        self._set_extras(*adam_state.extras(user, [p for _, f in self._all_flats() for p in f.params]))

    def _reseed_written(self, flats) -> bool:
        """Seed the masters of the parameters written since we last looked; whether any was."""
        wrote = False
        for _, flat in flats:
            written = flat.versions.written()
            wrote |= bool(written)
            flat.reseed(written)
        return wrote


def sharded_state_edit(table, tracked, flats):
    """What a user did to a sharded optimizer's ``opt.state`` (where its entries are not
    views of the state, ZeroAdam at several ranks): "reset" (cleared, or replaced by a
    new table), the error to raise on every rank (our keys put in a parameter's entry,
    which are not read), or None. Anything else (a key that is not a parameter, a
    parameter's extra keys) is kept beside the sharded state, as torch keeps it."""
    params = {id(p) for _, f in flats for p in f.params}
    assigned = not isinstance(table, dict) or any(
        isinstance(k, torch.Tensor) and id(k) in params and isinstance(v, dict)
        and not adam_state.OWN_KEYS.isdisjoint(v) for k, v in dict.items(table))
    if assigned:
        return RuntimeError(
            "ZeroAdam keeps its optimizer state sharded over the ranks: entries "
            "assigned to optimizer.state are not read. To reset the state, call "
            "optimizer.state.clear() (or assign a new defaultdict(dict)) on every "
            "rank; to set it, load a state dict (optimizer.load_state_dict, on every "
            "rank) or a checkpoint. Nothing was changed")
    if table is not tracked or tracked.removed:
        return "reset"
    return None
