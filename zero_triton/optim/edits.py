"""The user's edits, followed: what FusedAdam and ZeroAdam do about the writes that
``zero_triton.state.watch`` witnesses.

Each call that reads the state (``step``, the state dicts, clipping, checkpoints) starts
by following them (``zero_triton.optim.ranks``, every rank together under ZeRO): param
groups edited by hand are refused, ``opt.state`` edited is followed (a tensor assigned
is copied in, a ``step`` assigned becomes the count, an entry removed starts its
parameter over), parameters written have their master re-seeded.
``opt.state`` itself is a table of views of the flat state (one rank), as torch.optim.Adam's.
"""
from __future__ import annotations

import operator

import torch

from zero_triton.optim import export
from zero_triton.optim import state_dict as adam_state
from zero_triton.optim.shard import Shard
from zero_triton.state.keys import GROUP_FORMATS, formats_of
from zero_triton.state import watch


class UserEdits:
    """The part of an optimizer that keeps ``opt.state`` and the user's writes in step
    with the flat state. It owns what that takes: the table ``opt.state`` is
    (``tracked``), each param group's parameters as given (``group_params``) and the
    parameters left out frozen (``frozen``); ``views_state``: one rank, whose
    ``opt.state`` holds views of the state. The optimizer hands it the flat buffers and
    its ``param_groups`` and ``state`` at each call."""

    def __init__(self, who: str, views_state: bool):
        self.who = who
        self.views_state = views_state
        self.tracked = watch.TrackedState()
        self.group_params: list[list] = []   # per group, as given (followed if replaced)
        self.group_formats: list[dict] = []  # per group, the state formats it named
        self.frozen: list = []               # (group index, parameter) left out at construction

    def add_group(self, params: list, group: dict) -> None:
        """A param group was built over ``params`` (frozen ones included), in the state
        formats ``group`` names (``Spec.for_group``)."""
        gi = len(self.group_params)
        self.group_params.append(params)
        self.group_formats.append(formats_of(group))
        self.frozen.extend((gi, p) for p in params if not p.requires_grad)

    def regroup(self, gi: int, params: list, old_shards) -> None:
        """Param group ``gi`` was rebuilt over ``params``: the old shards' entries go."""
        for shard in old_shards:
            for p in shard.params:
                dict.pop(self.tracked, p, None)
        self.group_params[gi] = params
        self.frozen = [(g, p) for g, p in self.frozen if g != gi] + [
            (gi, p) for p in params if not p.requires_grad]

    # -- opt.state -----------------------------------------------------------------
    def expose(self, *shards: Shard) -> None:
        """One rank: optimizer.state[p] holds views of the flat state, as torch.optim.Adam's
        would. Several ranks: a rank holds a shard of each parameter's state, not a tensor
        of its shape, so ``opt.state`` has no entries of ours (``state_dict()`` gathers)."""
        if not self.views_state:
            return
        for shard in shards:
            # A store whose export is a copy (int8 codes, a master joined from its
            # remainder) has no views to show: state_dict() holds its values.
            views = shard.state_views(shard.state.live_buffers())
            table = self.tracked
            for i, p in enumerate(shard.params):
                # A 0-dim view of the count the kernel reads, as torch.optim.Adam's step.
                entry = {"step": shard.state.step_of(i).view(()),
                         **{k: v[i] for k, v in views.items()}}
                old = dict.get(table, p)
                if old and len(old) > len(entry):  # keys a user or a wrapper added stay
                    entry.update({k: v for k, v in old.items() if k not in export.OWN_KEYS})
                table.set_entry(p, entry)
            shard.exposed_steps = shard.state.steps

    def table(self, shards, others: dict, per_param: dict) -> watch.TrackedState:
        """``opt.state`` anew, to assign: our entries (world size 1), each parameter's
        extra keys and the entries that are not parameters (``export.extras``)."""
        table = self.tracked
        dict.clear(table)
        self.expose(*shards)
        for shard in shards:
            for p in shard.params:
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
        return table

    def restored(self, state, shards) -> watch.TrackedState:
        """``opt.state`` anew after the user's edits were followed, keeping whatever in
        ``state`` is not ours."""
        user = state if isinstance(state, dict) else {}
        return self.table(shards, *export.extras(user, [p for f in shards for p in f.params]))

    def edited(self, state) -> bool:
        """Whether ``opt.state`` (``state``) was replaced or edited since we last wrote it."""
        return state is not self.tracked or self.tracked.edited

    def follow_state(self, state, shards) -> None:
        """``opt.state`` is what the next step reads, as in torch.optim.Adam: a tensor
        assigned to a parameter's entry is copied into the flat state, a ``step``
        assigned becomes that parameter's count, and a parameter without an entry (after
        ``state.clear()``, ``del state[p]`` or ``opt.state = defaultdict(dict)``) starts
        over: zero moments, step 0, master from the parameter. Everything is checked
        before anything changes; what is written goes back to each store (``commit``)."""
        plans = [(shard, adam_state.plan_user_state(shard, state)) for shard in shards]
        for shard, (bufs, copies, steps, reseed) in plans:
            with torch.no_grad():
                for target, value in copies:
                    target.copy_(value)
            if copies:
                shard.state.commit(bufs)
            if steps is not None:
                shard.state.set_param_steps(steps)
            shard.reseed(reseed)

    # -- param groups ----------------------------------------------------------------
    def check_groups(self, param_groups) -> None:
        """Refuse parameters added to or removed from ``param_groups`` by hand (the
        optimizer has flat buffers and state for the ones it was given), and a group's
        state formats changed by hand (its state is stored in them)."""
        if not self._same_parameters(param_groups):
            raise RuntimeError(
                f"{self.who}: param_groups were edited by hand (now "
                f"{[len(g['params']) for g in param_groups]} parameters per group, built with "
                f"{[len(ps) for ps in self.group_params]}); the optimizer keeps flat buffers and "
                "state for the parameters it was given and would not train the others. Add "
                "parameters with optimizer.add_param_group({'params': [...]}) (ZeroAdam: on every "
                "rank), or build a new optimizer. Nothing was changed")
        for gi, (group, built) in enumerate(zip(param_groups, self.group_formats)):
            now = formats_of(group)
            if now == built:
                continue
            key = next(k for k in GROUP_FORMATS if (k in now, now.get(k)) != (k in built, built.get(k)))
            was, is_ = (repr(d[key]) if key in d else "the optimizer's" for d in (built, now))
            raise RuntimeError(
                f"{self.who}: param group {gi}'s {key}= was changed by hand (built with {was}, "
                f"now {is_}); a group's state is laid out and stored in its formats when it is "
                "added. Build a new optimizer with the formats you want (its load_state_dict "
                "takes this one's state in any format), or add the parameters as a new group. "
                "Nothing was changed")

    def _same_parameters(self, param_groups) -> bool:
        """``param_groups`` hold the parameters the optimizer was given, group by group
        (groups repeated after them, ``param_groups.extend(param_groups)``, allowed: the
        state dict numbers their parameters as torch does; each still steps once)."""
        sizes = [len(ps) for ps in self.group_params]
        if len(param_groups) < len(sizes) or any(
                len(g["params"]) != n for g, n in zip(param_groups, sizes)):
            return False
        if len(param_groups) == len(sizes):  # the usual case, at every step: no set built
            return True
        known = {id(p) for g in param_groups[:len(sizes)] for p in g["params"]}
        return all(id(p) in known for g in param_groups[len(sizes):] for p in g["params"])

    def replaced_groups(self, param_groups, flats_per_group, rebuilds: bool) -> list:
        """The param groups whose parameters were replaced by others, to rebuild over
        them: (group index, the new parameters). accelerate's FSDP2 ``prepare`` swaps each
        for its DTensor after the optimizer was built; DeepSpeed's ZeRO-1/2 puts its flat
        fp32 partition in place of a client optimizer's parameters; model surgery. torch's
        optimizers simply step what ``param_groups`` holds, and so do we when none of the
        group's parameters has stepped yet; after a step their state would be lost:
        refused with the fix, nothing changed (a parameter added or removed then is
        ``check_groups``' to refuse). ``rebuilds`` False (ZeroAdam): refused always."""
        out = []
        for gi, (group, held) in enumerate(zip(param_groups, self.group_params)):
            params = group["params"]
            if params is held or (len(params) == len(held) and all(map(operator.is_, params, held))):
                continue
            stepped = any(t > 0 for shard in flats_per_group[gi] for t in shard.state.param_steps())
            if len(params) != len(held):
                known = {id(q) for q in held}
                replaced = not any(id(p) in known for p in params)
                if not replaced and (stepped or not rebuilds):
                    continue  # added or removed: refused by check_groups
            if not rebuilds:
                raise RuntimeError(
                    f"{self.who}: the parameters of param group {gi} were replaced in "
                    "param_groups after it was built (accelerate's FSDP2 prepare swaps them for "
                    "DTensors; DeepSpeed's ZeRO puts its flat partition in their place). ZeroAdam "
                    "shards what it was given; with FSDP2 or DeepSpeed use zero_triton.FusedAdamW, "
                    "else build the optimizer over the new parameters")
            if stepped:
                raise RuntimeError(
                    f"{self.who}: the parameters of param group {gi} were replaced in "
                    "param_groups after the optimizer stepped them; their state would be lost. "
                    "Build a new optimizer over the new parameters (loading the old one's state "
                    "dict if the shapes match). Nothing was changed")
            out.append((gi, list(params)))
        return out

    def check_frozen(self) -> None:
        """Refuse a gradient on a parameter that was frozen when the optimizer was built."""
        for gi, p in self.frozen:
            if p.requires_grad and p.grad is not None:
                raise RuntimeError(
                    f"a parameter of param group {gi} ({tuple(p.shape)}) had requires_grad=False "
                    "when the optimizer was built and now has a gradient: the optimizer keeps no "
                    "state for it and would not train it. Unfreeze it before building the "
                    "optimizer, or add it with optimizer.add_param_group({'params': [p]})")


def reseed_written(shards) -> bool:
    """Seed the masters of the parameters written since we last looked; whether any was."""
    wrote = False
    for shard in shards:
        written = shard.versions.written()
        wrote |= bool(written)
        shard.reseed(written)
    return wrote


def sharded_state_edit(table, tracked, shards):
    """What a user did to a sharded optimizer's ``opt.state`` (where its entries are not
    views of the state, ZeroAdam at several ranks): "reset" (cleared, or replaced by a
    new table), the error to raise on every rank (our keys put in a parameter's entry,
    which are not read), or None. Anything else (a key that is not a parameter, a
    parameter's extra keys) is kept beside the sharded state, as torch keeps it."""
    params = {id(p) for _, f in shards for p in f.params}
    assigned = not isinstance(table, dict) or any(
        isinstance(k, torch.Tensor) and id(k) in params and isinstance(v, dict)
        and not export.OWN_KEYS.isdisjoint(v) for k, v in dict.items(table))
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
