"""torch.optim.Adam's state-dict format, both ways, for FusedAdam and ZeroAdam: the
one place that translates between it and the flat, sharded state.

A state dict is ``{"state": {index: {"step", "exp_avg", "exp_avg_sq"[, "max_exp_avg_sq"]
[, "master_param"]}}, "param_groups": [...]}`` with parameters numbered in param-group
order, as torch.optim.Adam writes it (``master_param``: the fp32 master of an fp16/bf16
parameter). ``local_state_dict`` views a single process's live state; ``gathered_state_dict``
collects the shards of every rank, chunk by chunk; ``plan_load`` checks a state dict
against the optimizer and ``apply_load`` copies each rank's part of it in.
"""
from __future__ import annotations

import hashlib
import math

import torch

from zero_triton.comm import serve
from zero_triton.optim.checks import adam_hyperparameters
from zero_triton.optim.export import OWN_KEYS, assembled, exported, live, packed_groups, state_chunks
from zero_triton.optim.shard import written_values
from zero_triton.state.keys import GROUP_FORMATS
from zero_triton.state.flat import real_shape
from zero_triton.state.moments import KEYS as MOMENT_KEYS
from zero_triton.state.moments import MAXIMUM
from zero_triton.state.shards import MASTER

# Keys torch.optim.Adam keeps in every param group, with the values that describe this
# optimizer: a torch.optim.Adam loading our state dict behaves as its defaults.
TORCH_GROUP_KEYS = {"foreach": None, "capturable": False, "differentiable": False, "fused": None}


def group_keys(differentiable: bool, **chosen) -> dict:
    """torch.optim.Adam's implementation keys of a param group, as built (``chosen``: the
    capture mode's, ``zero_triton.optim.capture``)."""
    return {**TORCH_GROUP_KEYS, "differentiable": differentiable, **chosen}


# Elements gathered per rank per round: bounds the receiver's transient buffers to
# world_size * this * 4 bytes on top of the one full copy it returns.
GATHER_CHUNK = 4 << 20


def with_state_dict_hooks(opt, build) -> dict:
    """``build()`` between the optimizer's state-dict pre- and post-hooks
    (``register_state_dict_pre_hook`` / ``_post_hook``), run as torch.optim.Optimizer
    runs them: a post-hook's non-None result replaces the state dict."""
    for hook in getattr(opt, "_optimizer_state_dict_pre_hooks", {}).values():
        hook(opt)
    state_dict = build()
    for hook in getattr(opt, "_optimizer_state_dict_post_hooks", {}).values():
        result = hook(opt, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def load_with_hooks(opt, state_dict: dict, load) -> None:
    """``load(state_dict)`` between the load-state-dict pre-hooks (which may return a
    replacement) and post-hooks, as torch.optim.Optimizer runs them (on a shallow copy:
    the caller's dict is not changed)."""
    state_dict = state_dict.copy()
    for hook in getattr(opt, "_optimizer_load_state_dict_pre_hooks", {}).values():
        result = hook(opt, state_dict)
        if result is not None:
            state_dict = result
    load(state_dict)
    for hook in getattr(opt, "_optimizer_load_state_dict_post_hooks", {}).values():
        hook(opt)


def torch_group(hyperparameters: dict, indices: list) -> dict:
    """A param group as torch.optim.Adam's state dict holds it, from saved
    hyperparameters (betas as a tuple) and the group's parameter indices."""
    group = dict(hyperparameters)
    if "betas" in group:
        group["betas"] = tuple(group["betas"])
    group.update(TORCH_GROUP_KEYS)
    group["params"] = list(indices)
    return group


def local_state_dict(opt) -> dict:
    """torch.optim.Adam's format: per-parameter ``step``, ``exp_avg``,
    ``exp_avg_sq`` (``max_exp_avg_sq``), plus ``master_param`` for fp16/bf16
    parameters. Tensors are views of the live state, as torch's are."""
    if opt.comm.world_size > 1:
        raise RuntimeError(
            "state_dict() of a sharded optimizer would hold only this rank's shard; use "
            "consolidated_state_dict() for torch.optim.Adam's format, or "
            "zero_triton.checkpoint.save for a sharded checkpoint")
    return exported(opt, [shard for _, shard in opt.shards(follow=True)], live)


def copyable(state_dict: dict) -> dict:
    """``state_dict`` with each tensor subclass of its state (the DTensor views of the
    state of DTensor parameters) cloned: ``copy.deepcopy`` and ``pickle`` of a subclass
    that views another tensor's memory fail ("invalid python storage"); plain views are
    copied by them as they are."""
    state = {k: {n: v.clone() if isinstance(v, torch.Tensor) and type(v) is not torch.Tensor
                 and not isinstance(v, torch.nn.Parameter) else v for n, v in e.items()}
             if isinstance(e, dict) else e for k, e in state_dict["state"].items()}
    return {**state_dict, "state": state}


def pickled(saved: dict) -> tuple[list, dict, dict]:
    """(param groups, hyperparameters, options) to rebuild an optimizer from what its
    ``__getstate__`` kept (``copy.deepcopy``, ``pickle``)."""
    d = saved["defaults"]
    groups = [{k: v for k, v in g.items() if k != "param_names"} | (
        {"params": list(zip(g["param_names"], g["params"]))} if "param_names" in g else {})
        for g in saved["param_groups"]]
    hyper = adam_hyperparameters(d["lr"], d["betas"], d["eps"], d["weight_decay"], d["amsgrad"],
                                 d["maximize"], d["decoupled_weight_decay"])
    return groups, hyper, saved["options"]


def live_tensors(opt) -> list:
    """The tensors a state dict's entries may alias: state buffers and parameters."""
    out = []
    for _, shard in opt.shards():
        out.extend(shard.state.moments.storage())
        out.extend(shard.state.master.storage())
        out.append(shard.flat_param)
        out.extend(shard.param_parts)
    return out


def _as_param_policy(p, key, value):
    """torch.optim.Optimizer.load_state_dict's cast of a loaded extra: floating tensors
    to the parameter's dtype and device, other tensors to its device."""
    if not isinstance(value, torch.Tensor) or key == "step":
        return value
    if p.is_floating_point() and value.is_floating_point():
        return value.to(dtype=p.dtype, device=p.device)
    return value.to(device=p.device)


def loaded_extras(opt, state_dict) -> tuple[dict, dict]:
    """What a loaded state dict puts in ``opt.state`` beside our own keys: (entries not
    of a parameter, {id(p): p's extra keys}), as torch.optim.Optimizer loads them."""
    index = {}
    for group, saved in zip(opt.param_groups, state_dict["param_groups"]):
        index.update({idx: p for p, idx in zip(group["params"], saved["params"])})
    others, per_param = {}, {}
    for key, entry in state_dict["state"].items():
        p = index.get(key)
        if p is None:
            others[key] = entry
        elif isinstance(entry, dict):
            extra = {k: _as_param_policy(p, k, v) for k, v in entry.items() if k not in OWN_KEYS}
            if extra:
                per_param[id(p)] = extra
    return others, per_param


def plan_load(opt, state_dict) -> list:
    """Check ``state_dict`` against the optimizer (groups, parameter counts, finite
    steps, state shapes) and return, per flat buffer, ``(flat, entries, steps)``:
    nothing changes here, so a bad state dict leaves the optimizer as it was."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"the state dict has {len(saved_groups)} param groups, this optimizer "
                         f"{len(opt.param_groups)}; build the optimizer with the same groups")
    ids = {}
    for gi, (group, saved) in enumerate(zip(opt.param_groups, saved_groups)):
        if len(group["params"]) != len(saved["params"]):
            raise ValueError(f"param group {gi} has {len(group['params'])} parameters, the "
                             f"state dict's {len(saved['params'])}")
        ids.update({id(p): idx for p, idx in zip(group["params"], saved["params"])})
    saved_state, plan = state_dict["state"], []
    index = {id(group): gi for gi, group in enumerate(opt.param_groups)}
    for group, shard in opt.shards():
        gi = index[id(group)]
        entries = [saved_state.get(ids[id(p)]) for p in shard.params]
        if all(e is None for e in entries):
            plan.append((shard, None, None))
            continue
        # A parameter torch.optim.Adam never stepped (no gradient yet) has no state.
        steps = [0.0 if e is None else float(e["step"]) for e in entries]
        if not all(math.isfinite(t) and t >= 0 for t in steps):
            raise ValueError(f"param group {gi} has a step that is not a finite count >= 0 "
                             f"({sorted(set(steps))}); the state dict is corrupt")
        for i, (p, e) in enumerate(zip(shard.params, entries)):
            if e is None:
                continue
            for key in (*MOMENT_KEYS, MASTER):
                if key in e and tuple(e[key].shape) != real_shape(p) and not (
                        p.is_complex() and tuple(e[key].shape) == tuple(p.shape)):
                    raise ValueError(f"state '{key}' of parameter {i} in param group {gi} "
                                     f"has shape {tuple(e[key].shape)}, the parameter "
                                     f"{tuple(p.shape)}")
        for key in dict.fromkeys(k for e in entries if e is not None for k in e):
            gap = shard.by_param.uncovered([None if e is None else e.get(key) for e in entries])
            if gap is not None:
                i, a, b = gap
                raise ValueError(
                    f"state '{key}' of parameter {i} in param group {gi}: the "
                    f"loaded shards lack elements of [{a}, {b}), which this rank "
                    "owns. Load the checkpoint into the state dict this "
                    "optimizer's get_optimizer_state_dict returns (dcp.load), "
                    "then call set_optimizer_state_dict")
        plan.append((shard, entries, steps))
    return plan


def apply_load(opt, state_dict, plan) -> None:
    """Copy a checked state dict in: hyperparameters, then each flat buffer's shard."""
    others, per_param = loaded_extras(opt, state_dict)
    for group, saved in zip(opt.param_groups, state_dict["param_groups"]):
        for k, v in saved.items():  # saved names win, as in torch; ours stay if it has none
            if k != "params" and k not in GROUP_FORMATS:  # formats: this optimizer's, as built
                group[k] = v
        group.setdefault("decoupled_weight_decay", False)
    for shard, entries, step in plan:
        load_shard(shard, entries, step)
        shard.versions.accept()  # the master is what was loaded (or the parameters now)
    opt.state = opt.edits.table([f for _, f in opt.shards()], others, per_param)


@torch.no_grad()
def load_shard(shard, entries, step) -> None:
    """Copy this rank's shard (every bucket's) of each full per-parameter state in."""
    state = shard.state
    state.set_param_steps(step if step is not None else [0.0] * len(shard.params))
    # Zeros wherever the entries hold nothing; a running maximum from now on if one has it.
    has_max = entries is not None and any(e is not None and MAXIMUM in e for e in entries)
    state.reset(amsgrad=has_max or None)
    state.master.seed()
    if entries is None:
        return
    targets = state.buffers()
    for key, buf in targets.items():
        shard.by_param.pack([shard.local_value(e[key], i) if e is not None and key in e else None
                             for i, e in enumerate(entries)], buf)
    state.commit(targets)
    # Every rank decides this from the same state dict: the all-gather is collective.
    if shard.has_master and any(e is not None and MASTER in e for e in entries):
        state.master.publish()
        for k, bucket in enumerate(shard.buckets):
            shard.gather_bucket(k)
            bucket.wait_gather()


@torch.no_grad()
def gathered_state_dict(opt, to_rank: int | None = 0, chunk_elems: int = GATHER_CHUNK):
    """``ZeroAdam.consolidated_state_dict``: the shards of every rank gathered into
    torch.optim.Adam's format on ``to_rank`` (every rank for None), ``chunk_elems``
    elements of one state of one flat buffer per round; None on the other ranks."""
    comm = opt.comm
    if to_rank is not None and not 0 <= to_rank < comm.world_size:
        raise ValueError(f"to_rank must be in [0, {comm.world_size}) or None (every rank), "
                         f"got {to_rank}")
    me = to_rank is None or comm.rank == to_rank

    def pieces(part, rows):
        n = part.numel()
        if to_rank is None:  # every rank receives: one all-gather per chunk
            received = rows.view(-1)[:comm.world_size * n]
            comm.all_gather(received, part)
            return received.view(comm.world_size, n)
        out = [rows[r, :n] for r in range(comm.world_size)] if me else None
        comm.gather(part, out, to_rank, "consolidated_state_dict gather")
        return out

    return exported(opt, [shard for _, shard in opt.shards(follow=True)],
                    assembled(pieces, comm.world_size, chunk_elems, me, on_host=False))


def shard_chunks(shards, chunk_elems: int = GATHER_CHUNK):
    """This rank's shards of every state of ``shards``, in the chunks ``assembled`` takes
    them (``export.state_chunks``)."""
    for shard in shards:
        for _, _, part in state_chunks(shard.state.buffers(), shard.layout.shard_numel, chunk_elems):
            yield part


def layout_digest(shards) -> int:
    """A digest of what ``shard_chunks`` sends (sizes, states, dtypes): two ranks with
    the same digest send and expect the same sequence."""
    words = repr([(f.layout.numel, f.layout.shard_numel, len(f.params), str(f.state.dtype),
                   sorted(f.state.buffers())) for f in shards]).encode()
    return int.from_bytes(hashlib.blake2b(words, digest_size=7).digest(), "little")


@torch.no_grad()
def served_state_dict(opt, server, ordinal: int, counts: list, chunk_elems: int = GATHER_CHUNK):
    """``ZeroAdam.state_dict()`` on this rank alone: every peer's shards asked of its
    shard server (``zero_triton.comm.serve``), which answers wherever that rank's main
    thread is, assembled into torch.optim.Adam's format. The master of a parameter this
    rank sees written since the last step is taken from the parameter, as that step's
    entry (on every rank alike) would seed it. ``counts``: this rank's steps and loads."""
    shards = [shard for _, shard in opt.shards(follow=True)]
    comm = opt.comm
    steps, loads = counts
    # The ranks holding this copy's shards (every rank but replicas'), by shard.
    shard_of = {member: s for s, member in enumerate(comm.members)}
    with server.ask(ordinal, [steps, layout_digest(shards), loads], comm.members) as reply:
        # What each peer that said yes sends: read to the end (``drain``) if this raises.
        reply.expect([(part.numel(), shard.state.dtype) for shard in shards
                      for part in shard_chunks([shard], chunk_elems)])
        for peer, header in sorted(reply.headers.items()):
            if header[0] != serve.OK:
                raise RuntimeError(_refusal(peer, header, comm.rank, counts, reply.reasons.get(peer)))

        def pieces(part, rows):
            n = part.numel()
            reply.receive({peer: rows[shard_of[peer], :n] for peer in reply.sending})
            out = [rows[r, :n] for r in range(comm.world_size)]
            out[comm.rank] = part
            return out

        state_dict = exported(opt, shards, assembled(pieces, comm.world_size, chunk_elems, True,
                                                     on_host=True))
    ids = packed_groups(opt)[1]
    for shard in shards:
        written = shard.versions.written() if shard.state.has_master else ()
        if written:
            masters = [state_dict["state"][ids[id(p)]][MASTER] for p in shard.params]
            seen = _unwritten_params(shard, comm, masters)
        for i in written:
            m = masters[i]
            p = seen[i].to(m.device).reshape(m.shape)
            m.copy_(shard.state.master.rebase(m, p))
    return state_dict


def _unwritten_params(shard, comm, masters: list) -> list:
    """``shard``'s parameters as the user sees them, with what our own (compressed)
    gathers wrote from ``masters`` put back to the masters' rounding: every rank's
    shard of every bucket, by the rule ``Shard.unwritten`` applies to this rank's
    (``zero_triton.optim.shard.written_values``)."""
    params = [p.detach() for p in shard.params]
    probe = masters[0].new_zeros(0).to(shard.dtype)
    if comm.gathered(probe) is probe:  # exact gathers: nothing of ours to tell apart
        return params
    layout = shard.layout
    fm = torch.zeros(layout.padded_numel, dtype=torch.float32)
    fp = torch.zeros(layout.padded_numel, dtype=shard.dtype)
    for view, m in zip(layout.views(fm), masters):
        view.copy_(m.reshape(view.shape))
    for view, p in zip(layout.views(fp), params):
        view.copy_(p.reshape(view.shape))
    seen = fp.clone()
    for r in range(layout.world_size):
        for lo, hi, _ in shard.by_param.segments_of(r):
            seen[lo:hi] = written_values(fp[lo:hi], fm[lo:hi], comm)
    return list(layout.views(seen))


def _refusal(peer: int, header: list, rank: int, counts: list, reason: str | None = None) -> str:
    status, their_steps, their_loads = header[0], header[1], header[2]
    steps, loads = counts
    head = f"ZeroAdam.state_dict() on rank {rank} asked rank {peer} for its shards: "
    if status == serve.NO_OPTIMIZER:
        return head + ("it has no such optimizer (built on fewer ranks, or deleted there); build "
                       "the ZeroAdam on every rank of its process group")
    if status == serve.STEPS:
        return head + (f"it has taken {their_steps} steps and this rank {steps}. Every rank must "
                       "call step() once per iteration (a rank that skips a step, e.g. on a NaN "
                       "loss, must skip it everywhere). Nothing was changed")
    if status == serve.LOADS:
        return head + (f"it has loaded state {their_loads} times and this rank {loads} "
                       "(load_state_dict, zero_triton.checkpoint.load, a reset of opt.state): "
                       "load on every rank alike. Nothing was changed")
    if status == serve.LAYOUT:
        return head + ("its parameters are not this rank's (a param group added on some ranks "
                       "only?): add param groups on every rank alike. Nothing was changed")
    return head + (f"it failed to read them ({reason or 'its stderr shows the error'}). "
                   "Nothing was changed")


def plan_user_state(shard, user):
    """(the state buffers the copies write into, copies, new step counts or None,
    parameters to re-seed) for one flat buffer from the user's ``opt.state``; raises on
    entries it cannot take. The buffers go back to the store once written
    (``ShardState.commit``)."""
    bufs = shard.state.buffers()
    views, counts = shard.local_views(bufs), shard.state.param_steps()
    copies, reseed, steps_changed = [], [], False
    for i, p in enumerate(shard.params):
        entry = dict.get(user, p) if isinstance(user, dict) else None
        if not entry:  # no state: torch.optim.Adam starts this parameter over
            copies.extend((v[i], torch.zeros((), dtype=v[i].dtype)) for k, v in views.items()
                          if k != MASTER)
            reseed.append(i)
            counts[i], steps_changed = 0.0, True
            continue
        for key, v in views.items():
            given = entry.get(key)
            if given is None:
                if key == MASTER:  # torch's own format: the master is the parameter
                    reseed.append(i)
                elif key == MAXIMUM:
                    copies.append((v[i], torch.zeros((), dtype=v[i].dtype)))
                elif not shard.state.moments.live:
                    pass  # never shown in opt.state (int8's codes): kept as they are
                else:
                    raise ValueError(
                        f"optimizer.state[p] of parameter {i} {tuple(p.shape)} has no "
                        f"'{key}'; assign a tensor of the parameter's shape, or delete the "
                        "whole entry (del optimizer.state[p]) to start it over")
                continue
            if isinstance(given, torch.Tensor):
                given = shard.local_value(given, i)
            if not isinstance(given, torch.Tensor) or given.numel() != v[i].numel():
                raise ValueError(
                    f"optimizer.state[p]['{key}'] of parameter {i} {tuple(p.shape)} must be "
                    f"a tensor of {v[i].numel()} elements, got "
                    f"{tuple(given.shape) if isinstance(given, torch.Tensor) else type(given).__name__}")
            if given.data_ptr() != v[i].data_ptr() or given.device != v[i].device:
                copies.append((v[i], given.detach().reshape(v[i].shape)))
        s = entry.get("step")
        mine = shard.state.step_of(i)
        if isinstance(s, torch.Tensor) and s.data_ptr() == mine.data_ptr():
            continue
        value = float(s) if isinstance(s, (int, float, torch.Tensor)) and (
            not isinstance(s, torch.Tensor) or s.numel() == 1) else None
        if value is None or not math.isfinite(value) or value < 0:
            raise ValueError(f"optimizer.state[p]['step'] of parameter {i} {tuple(p.shape)} "
                             f"must be a count >= 0 (a number or 1-element tensor), got {s!r}")
        counts[i], steps_changed = value, True
    return bufs, copies, counts if steps_changed else None, reseed
