"""What a checkpoint reads from and writes into an optimizer: the one place that knows
FusedAdam's and ZeroAdam's insides (process group, flat buffers, shard ranges, state
tensors, per-parameter step counts)."""
from __future__ import annotations

import warnings

import torch

from zero_triton.checkpoint.manifest import NOT_HYPER, dtype_name, plain_names
from zero_triton.optim.interface import internals
from zero_triton.state.flat import unflatten_into
from zero_triton.state.moments import MAXIMUM

# What torch's LR schedulers write into param groups (OneCycleLR and CyclicLR cycle the
# momentum, i.e. Adam's betas, too).
SCHEDULED = frozenset(("lr", "initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum",
                       "betas", "momentum"))


def _jsonable(value):
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (tuple, list)):
        items = [_jsonable(v) for v in value]
        return _SKIP if any(i is _SKIP for i in items) else items
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return _SKIP


_SKIP = object()


def own_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU holding only its own bytes: ``torch.save`` writes a view's whole
    storage (a tied weight would carry its flat buffer along). A copy only for views."""
    t = t.detach().cpu()
    if t.untyped_storage().nbytes() > t.numel() * t.element_size():
        t = t.clone(memory_format=torch.contiguous_format)
    return t


class Target:
    """One optimizer (FusedAdam or ZeroAdam), seen as a checkpoint sees it."""

    def __init__(self, optimizer, entry: str = "checkpoint.save", compact: bool = False):
        view = internals(optimizer)
        if view is None:
            raise TypeError(f"zero_triton.checkpoint saves and loads zero_triton optimizers "
                            f"(FusedAdam, FusedAdamW, ZeroAdam, ZeroAdamW), not "
                            f"{type(optimizer).__name__}; use torch.save(optimizer.state_dict())")
        self.optimizer = optimizer
        self.compact = compact  # int8 moments saved as their codes and scales
        self.view = view
        self.comm = view.comm
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.writes = self.comm.replica == 0  # one copy of the shards is written
        optimizer.wait_params()  # all-gathers left in flight by overlap
        # Every rank is here (ZeroAdam), and the optimizer follows what the user changed:
        # parameters moved or written, opt.state edited.
        shards = view.shards(reader=entry)
        self.flats = [flat for _, flat in shards]
        self.flat_groups = [gi for gi, _ in shards]
        for flat in self.flats:
            flat.home.checkpointable(entry)
            if flat.dtype == torch.float64 or any(p.is_complex() for p in flat.params):
                raise TypeError(
                    f"zero_triton.checkpoint ({entry}) stores float32, float16 and bfloat16 "
                    "parameters; this optimizer has float64 or complex ones. Save "
                    "optimizer.state_dict() with torch.save (ZeroAdam: consolidated_state_dict()) "
                    "or use torch.distributed.checkpoint")

    # -- reading -------------------------------------------------------------------------
    @staticmethod
    def states(flat) -> dict:
        """This rank's shard of each optimizer state of ``flat`` (float32, one tensor in
        state order: its shard of every bucket; an fp32 master spread over several
        buckets is a copy)."""
        return flat.state.checkpointed()

    def saved_states(self, flat) -> dict:
        """What a save writes of ``flat``: ``states``, or with ``compact`` the int8 store's
        codes and scales as they are (``ShardState.compact_checkpointed``)."""
        if self.compact:
            stored = flat.state.compact_checkpointed()
            if stored is not None:
                return stored
        return self.states(flat)

    def flat_entries(self) -> list[dict]:
        """Per flat buffer: group, dtype, numel, whether it keeps an fp32 master, step(s)."""
        out = []
        for gi, flat in zip(self.flat_groups, self.flats):
            steps = flat.state.param_steps()
            entry = {"group": gi, "dtype": dtype_name(flat.dtype), "numel": flat.layout.numel,
                     "has_master": flat.has_master, "step": float(max(steps, default=0.0)),
                     "states": list(self.saved_states(flat))}
            if flat.state.steps is not None:  # parameters that missed steps count their own
                entry["param_steps"] = [float(s) for s in steps]
            out.append(entry)
        return out

    def param_entries(self, model=None) -> list[dict]:
        """Every parameter, in state-dict order: name (wrapper prefixes stripped), shape,
        dtype, group, and the flat buffer and offset it lives at (None when frozen)."""
        names = {}
        if model is not None:
            named = list(model.named_parameters())
            plain = plain_names(n for n, _ in named)
            names = {id(p): plain[n] for n, p in named}
        where, strides = {}, {}
        for k, flat in enumerate(self.flats):
            for p, offset, stride in zip(flat.params, flat.layout.canonical_offsets,
                                         flat.layout.strides):
                where[id(p)] = (k, offset)
                strides[id(p)] = stride
        entries, index = [], 0
        for gi, group in enumerate(self.optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                k, offset = where.get(id(p), (None, None))
                named = id(p) in names
                entries.append({"name": names[id(p)] if named else f"param_groups[{gi}].params[{j}]",
                                "named": named, "index": index, "group": gi, "shape": list(p.shape),
                                "dtype": dtype_name(p.dtype), "flat": k, "offset": offset})
                stride = strides.get(id(p))
                if stride is not None:  # stored in this memory order (channels_last)
                    entries[-1]["stride"] = list(stride)
                index += 1
        return entries

    def hyperparameters(self) -> list[dict]:
        groups = []
        for group in self.optimizer.param_groups:
            kept = {}
            for k, v in group.items():
                if k not in NOT_HYPER and (j := _jsonable(v)) is not _SKIP:
                    kept[k] = j
            groups.append(kept)
        return groups

    def model_extra(self, model) -> dict:
        """``model``'s state-dict entries the optimizer does not own (buffers, frozen
        parameters), by plain name, each holding only its own bytes."""
        mine = {id(q) for flat in self.flats for q in flat.params}
        named = list(model.named_parameters())
        param_names = plain_names(n for n, _ in named)
        owned = {param_names[n] for n, p in named if id(p) in mine}
        state = model.state_dict()
        state_names = plain_names(state)
        return {state_names[n]: own_bytes(t) if isinstance(t, torch.Tensor) else t
                for n, t in state.items() if state_names[n] not in owned}

    # -- writing -------------------------------------------------------------------------
    @torch.no_grad()
    def apply(self, plan: dict, manifest: dict, model=None) -> None:
        """Put a read and checked checkpoint into the optimizer (and model): only copies
        of tensors whose sizes were checked, so nothing here can fail half-way."""
        self._apply_hyperparameters(manifest["param_groups"])
        for k, flat in enumerate(self.flats):
            saved, got = manifest["flats"][k], plan["states"][k]
            flat.state.set_param_steps(saved.get("param_steps") or [saved["step"]] * len(flat.params))
            unflatten_into(flat.params, plan["params"][k], flat.layout.canonical)
            # A state the checkpoint holds and this store lacks (a running maximum) is
            # stored from now on; one it lacks is zero.
            if MAXIMUM in got and not flat.state.amsgrad:  # (the store's keys, no export)
                flat.state.ensure_amsgrad()
            bufs = self.states(flat)
            for name, buf in bufs.items():
                if name in got:
                    buf.copy_(got[name])
                elif name != "master":
                    buf.zero_()
            flat.state.restore(bufs)
        # The masters are the checkpoint's, not the parameters' writes.
        self.view.shards_loaded(self.flats)
        if plan["model_extra"]:
            current = model.state_dict()
            for n, t in plan["model_extra"].items():
                current[n].copy_(t)

    def _apply_hyperparameters(self, saved_groups) -> None:
        diffs = []
        for gi, (group, saved) in enumerate(zip(self.optimizer.param_groups, saved_groups)):
            # Every torch LR scheduler puts initial_lr in the groups: the values it moves
            # differ on every resume (it set them for its first epoch), so they are
            # restored without a word; any other difference is the user's and is named.
            scheduled = SCHEDULED if "initial_lr" in group else ()
            for k, v in saved.items():
                if k in NOT_HYPER:
                    continue
                mine = group.get(k)
                if _jsonable(mine) != v and k not in scheduled:
                    diffs.append(f"group {gi} {k}: {v} (was {mine})")
                if isinstance(mine, torch.Tensor):
                    mine.fill_(v)  # a tensor lr stays a tensor
                else:
                    group[k] = tuple(v) if k == "betas" else v
        if diffs:
            warnings.warn(f"zero_triton.checkpoint.load: the checkpoint's hyperparameters replace "
                          f"the optimizer's: {'; '.join(diffs)}", stacklevel=4)
