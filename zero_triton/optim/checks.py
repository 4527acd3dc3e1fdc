"""FusedAdam's and ZeroAdam's arguments checked before any state changes, with torch.optim's
exception types and messages (and the fix, where torch names none)."""
from __future__ import annotations

import warnings

import torch

from zero_triton.optim.engine_home import is_dtensor
from zero_triton.optim.shard import SUPPORTED


def check_hyperparameters(lr, betas, eps, weight_decay, foreach=None, capturable=False):
    """torch.optim.Adam's checks, with its exception types and messages of our own."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Tensor lr must be 1-element, got shape {tuple(lr.shape)}; pass a "
                             "float or a 1-element tensor")
        if foreach and not capturable:
            raise ValueError("lr as a Tensor is not supported for capturable=False and "
                             "foreach=True (torch.optim.Adam's rule); drop foreach (FusedAdam "
                             "ignores it) or pass capturable=True")
    lr_value = lr.item() if isinstance(lr, torch.Tensor) else lr
    if not isinstance(lr_value, (int, float)) or isinstance(lr_value, bool):
        raise ValueError(f"lr must be a float or a 1-element tensor, got {lr!r}; to change it "
                         "during training set optimizer.param_groups[i]['lr']")
    if not 0.0 <= lr_value:
        raise ValueError(f"Invalid learning rate: {lr_value}; lr must be >= 0")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps!r}; eps must be a float >= 0 (1e-8 is usual)")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r}; give two values, e.g. (0.9, 0.999)")
    tensors = [isinstance(b, torch.Tensor) for b in betas]
    if any(tensors) and not all(tensors):
        raise ValueError(f"betas must be either both floats or both Tensors, got "
                         f"{tuple(type(b).__name__ for b in betas)}")
    for i, beta in enumerate(betas):
        if isinstance(beta, torch.Tensor):
            if foreach and not capturable:
                raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False "
                                 "and foreach=True (torch.optim.Adam's rule); drop foreach")
            if beta.numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element, got shape {tuple(beta.shape)}")
            beta = beta.item()
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta!r}; both betas must lie "
                             "in [0, 1), e.g. (0.9, 0.999)")
    if not isinstance(weight_decay, (int, float)) or isinstance(weight_decay, bool) or not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay!r}; it must be a float >= 0")


def check_drop_in_flags(foreach, fused, capturable, differentiable):
    """torch.optim.Adam's implementation switches: accepted for drop-in use (the step is
    always one fused kernel that reads lr and step on the device, i.e. capturable);
    combinations torch refuses are refused with torch's exception type."""
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together (torch.optim.Adam's "
                           "rule); FusedAdam is always fused: drop both")
    if fused and differentiable:
        raise RuntimeError("`fused` does not support `differentiable` (torch.optim.Adam's rule); "
                           "drop fused=True: with differentiable=True the step is torch's "
                           "differentiable one")


def check_no_shared_memory(existing, params) -> None:
    """Refuse a parameter whose memory overlaps another's (``nn.Parameter(w[:2])`` of a
    parameter ``w``): re-homing gives each its own place in a flat buffer, which would
    silently undo the sharing that the model relies on."""
    spans = []
    for where, group in (("an earlier param group's", existing), ("the group's", params)):
        for i, p in enumerate(group):
            # A DTensor's storage is its engine's and stays so (zero_triton.optim.engine_home).
            if p.numel() == 0 or p.device.type == "meta" or is_dtensor(p):
                continue
            start = p.data_ptr()
            spans.append((p.untyped_storage().data_ptr(), start,
                          start + p.numel() * p.element_size(), f"{where} parameter {i} {tuple(p.shape)}"))
    spans.sort()
    for a, b in zip(spans, spans[1:]):
        if a[0] == b[0] and b[1] < a[2]:
            raise ValueError(
                f"{b[3]} shares memory with {a[3]}; FusedAdam gives every parameter its own "
                "place in a flat buffer, which would break that sharing. Make one parameter "
                "and derive the other from it in forward (tied weights: the same Parameter "
                "object in both modules is fine)")


def check_params_argument(params, who: str) -> None:
    """Refuse what is not an iterable of parameters (or of param-group dicts) with the fix,
    before anything is built."""
    if isinstance(params, torch.nn.Module):
        raise TypeError(f"{who}(model): pass model.parameters() (or param-group dicts), not the "
                        f"{type(params).__name__} module itself")
    if isinstance(params, torch.Tensor):
        return  # torch.optim.Optimizer refuses it with its own message
    if params is None or isinstance(params, (str, bytes, int, float, dict)) or not hasattr(params, "__iter__"):
        raise TypeError(f"{who}: params must be an iterable of tensors or of param-group dicts "
                        f"(e.g. model.parameters()), got {type(params).__name__}")


def check_flag(name: str, value) -> None:
    if not (isinstance(value, bool) or (isinstance(value, int) and value in (0, 1))):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def to_float(x):
    return float(x.item()) if isinstance(x, torch.Tensor) else x


def with_grads(params):
    """(params with every group's parameters listed, [(tensor, its .grad)]). Generators
    are consumed here, so the lists are what torch.optim.Optimizer gets."""
    if isinstance(params, torch.Tensor):
        return params, []  # torch.optim.Optimizer refuses it with its own message
    params = list(params)
    tensors = []
    for i, item in enumerate(params):
        if isinstance(item, dict):
            members = item["params"]
            members = [members] if isinstance(members, torch.Tensor) else list(members)
            params[i] = {**item, "params": members}
        else:
            members = [item]
        for m in members:
            t = m[1] if isinstance(m, tuple) else m
            if isinstance(t, torch.Tensor) and t.is_leaf:
                tensors.append((t, t.grad))
    return params, tensors


def check_no_dtensors(groups: list, who: str, first_group: int = 0) -> None:
    """ZeroAdam refuses DTensor parameters (FSDP2's ``fully_shard``, tensor parallel),
    before anything is built or communicated: the engine shards them already, and
    FusedAdam steps them where it keeps them. ``groups``: param-group dicts with their
    parameters listed, the first numbered ``first_group``."""
    for gi, group in enumerate(groups, first_group):
        members = group["params"]
        members = [members] if isinstance(members, torch.Tensor) else members
        for i, p in enumerate(members):
            p = p[1] if isinstance(p, tuple) else p
            if is_dtensor(p):
                raise TypeError(
                    f"{who}: parameter {i} of param group {gi} is a DTensor {tuple(p.shape)} "
                    f"with placements {tuple(p.placements)}: the engine that made it (FSDP2's "
                    "fully_shard, tensor parallel) shards it already, and ZeroAdam would shard "
                    "it again. Optimize DTensor parameters with zero_triton.FusedAdamW (the "
                    "one-line swap from torch.optim.AdamW: it steps each local shard where the "
                    "engine keeps it), or build ZeroAdam over the plain, unsharded model")


def check_group_params(params: list, param_groups: list, *, materialised: bool) -> None:
    """A new param group's ``params``: tensors on one device, leaves, of a supported dtype,
    with dense gradients, in no other group of ``param_groups``, sharing no memory with
    theirs; with ``materialised`` (ZeroAdam), none on the meta device."""
    seen = {id(p) for g in param_groups for p in g["params"]}
    devices = {p.device for p in params if isinstance(p, torch.Tensor)}
    if len(devices) > 1:
        raise ValueError(
            f"one param group holds parameters on several devices {sorted(map(str, devices))}; "
            "split them into one param group per device")
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameter {i} of the group is a {type(p).__name__}, not a tensor")
        if id(p) in seen:
            raise ValueError(
                f"some parameters appear in more than one parameter group: parameter {i} of "
                f"the new group ({tuple(p.shape)}) is already in another param group; give "
                "each parameter to exactly one group")
        if not p.is_leaf:
            raise ValueError(f"parameter {i} is not a leaf tensor; optimize leaves (nn.Parameter)")
        if p.dtype not in SUPPORTED and p.requires_grad:  # (frozen ones are left out, as torch's
            # optimizers leave a parameter without gradients: an int8 weight of a quantised model)
            raise ValueError(f"parameter {i} is {p.dtype}; FusedAdam handles float32, "
                             "float16, bfloat16, float64, complex64 and complex128 parameters")
        if p.grad is not None and p.grad.is_sparse:
            raise ValueError(f"parameter {i} has a sparse gradient; use torch.optim.SparseAdam")
        if p.device.type == "meta" and materialised:
            raise ValueError(f"parameter {i} ({tuple(p.shape)}) is on the meta device: it has "
                             "no data to shard; materialise the model first (model.to_empty("
                             "device=...) and initialise it), then build ZeroAdam")
    check_no_shared_memory([q for g in param_groups for q in g["params"]], params)


def adam_hyperparameters(lr, betas, eps, weight_decay, amsgrad, maximize, decoupled_weight_decay,
                         **torch_flags) -> dict:
    """torch.optim.Adam's hyperparameters checked in torch's order, with its messages, and
    returned as the param groups' defaults. ``torch_flags``: ``foreach``, ``fused``,
    ``capturable`` and ``differentiable`` as given (``check_drop_in_flags``)."""
    foreach, fused = torch_flags.get("foreach"), torch_flags.get("fused")
    capturable = torch_flags.get("capturable", False)
    check_hyperparameters(lr, betas, eps, weight_decay, foreach, capturable)
    check_drop_in_flags(foreach, fused, capturable, torch_flags.get("differentiable", False))
    check_flag("amsgrad", amsgrad)
    check_flag("maximize", maximize)
    return dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                maximize=maximize, decoupled_weight_decay=decoupled_weight_decay)


def group_params(param_group: dict, param_groups: list, defaults: dict) -> tuple:
    """A param group as ``add_param_group`` takes it, checked as torch checks it: its
    parameters a tensor or a list, all named ((name, tensor) pairs) or none, as the
    groups before it; a parameter given twice kept once (torch warns the same); the
    hyperparameters. Returns (the group to register, its tensors, the group with the
    defaults filled in)."""
    params = param_group["params"]
    if isinstance(params, torch.Tensor):
        params = [params]
    params = list(params)
    named = [isinstance(p, tuple) for p in params]
    if any(named) and not all(named):
        raise ValueError("all optimizer params should be with/without names. Some param names "
                         "are missing: give every parameter of the group as a (name, tensor) "
                         "pair, or none")
    if params and all(named):  # (name, tensor) pairs
        params = [p for _, p in params]
    if param_groups and ("param_names" in param_groups[0]) != (params != [] and all(named)):
        raise ValueError("all optimizer param groups should be with/without names. cannot add "
                         f"param group {'with' if all(named) else 'without'} names to the "
                         "optimizer: name every group's parameters, or none")
    if len({id(p) for p in params}) != len(params):
        warnings.warn("optimizer contains a parameter group with duplicate parameters; each "
                      "one is kept once (FusedAdam steps a parameter once per step)", stacklevel=4)
        first = {}
        for i, p in enumerate(params):
            first.setdefault(id(p), i)
        keep = sorted(first.values())
        raw = param_group["params"]
        raw = [raw] if isinstance(raw, torch.Tensor) else list(raw)
        param_group = {**param_group, "params": [raw[i] for i in keep]}
        params = [params[i] for i in keep]
    group = {**defaults, **param_group}
    betas = group["betas"]
    check_hyperparameters(group["lr"], betas, group["eps"], group["weight_decay"],
                          group.get("foreach"), group.get("capturable", False))
    if isinstance(betas, (tuple, list)) and any(isinstance(b, torch.Tensor) for b in betas):
        param_group = {**param_group, "betas": tuple(to_float(b) for b in betas)}
    return param_group, params, group


def check_process_group(process_group) -> None:
    """ZeroAdam's ``process_group``: None (the default group) or a group this rank is in."""
    import torch.distributed as dist
    if process_group is None:
        return
    if process_group is getattr(dist.GroupMember, "NON_GROUP_MEMBER", ()):
        raise ValueError(
            f"process_group: this rank ({dist.get_rank()}) is not one of the group's ranks "
            "(torch.distributed.new_group(ranks) returns a placeholder on the other ranks): "
            "build the ZeroAdam only on the ranks of its group, e.g. `if rank in ranks:`")
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed ProcessGroup (e.g. "
                        f"torch.distributed.new_group(ranks)) or None for the default group, "
                        f"got {process_group!r}; the backend (nccl, gloo) is chosen by "
                        "init_process_group")


def check_device_mesh(device_mesh, process_group) -> None:
    """ZeroAdam's ``device_mesh``: None, a 1-D DeviceMesh (its group, as
    ``process_group``), or a 2-D one of (replicate, shard) dims over every rank, FSDP2's
    HSDP convention; this rank in it; not both a mesh and a group."""
    if device_mesh is None:
        return
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a torch.distributed DeviceMesh (init_device_mesh("
                        f"'cuda', (replicas, shards), mesh_dim_names=('replicate', 'shard'))) or "
                        f"None, got {device_mesh!r}")
    if process_group is not None:
        raise ValueError("pass device_mesh or process_group, not both: a 1-D mesh is the "
                         "group it holds (ZeroAdam(..., process_group=mesh.get_group()))")
    if device_mesh.ndim not in (1, 2):
        raise ValueError(
            f"device_mesh has {device_mesh.ndim} dims {device_mesh.mesh_dim_names}: ZeroAdam "
            "shards over a 1-D mesh, or a 2-D (replicate, shard) one; pass the data-parallel "
            "dims of a larger mesh, e.g. mesh['dp_replicate', 'dp_shard']")
    if device_mesh.get_coordinate() is None:
        raise ValueError(f"device_mesh does not cover the ranks: this rank ({dist.get_rank()}) "
                         f"is not in it ({device_mesh.mesh.tolist()}); build the ZeroAdam on "
                         "the mesh's ranks only")
    if device_mesh.ndim == 1:
        return
    names = device_mesh.mesh_dim_names
    if names is not None:
        first, second = (n.lower() for n in names)
        if "shard" in first and "replicate" in second:
            raise ValueError(
                f"device_mesh's dims are {names}: ZeroAdam (as FSDP2's HSDP) takes (replicate, "
                "shard), the shard dim last, so that a shard group is a row of nearby ranks; "
                "build it as init_device_mesh(device, (replicas, shards), "
                "mesh_dim_names=('replicate', 'shard'))")
        if "replicate" not in first or "shard" not in second:
            raise ValueError(
                f"device_mesh's dims are {names}: a 2-D mesh for ZeroAdam is (replicate, shard) "
                "data parallelism (FSDP2's HSDP); name them ('replicate', 'shard') (or "
                "('dp_replicate', 'dp_shard')), or pass the data-parallel sub-mesh of a "
                "larger one")
    world = dist.get_world_size()
    if device_mesh.size() != world:
        raise ValueError(
            f"device_mesh does not cover the ranks: its {device_mesh.size()} ranks "
            f"{device_mesh.mesh.tolist()} are not the {world} of the default group; a 2-D mesh "
            "spans every rank (to shard over part of them, pass a 1-D mesh or a "
            "process_group)")


def without_meta(shards) -> list:
    """The flats to step when some are on the meta device: those have no data, so a
    gradient on one is refused (torch's error); without one they are not stepped."""
    for _, shard in shards:
        if shard.device.type == "meta" and any(p.grad is not None for p in shard.params):
            raise RuntimeError(
                "`fused=True` requires all the params to be floating point Tensors of "
                "supported devices (torch.optim.Adam's message): these parameters are on "
                "the meta device and have no data. Materialise the model (model.to_empty("
                "device=...) and initialise it), then build the optimizer over its "
                "parameters (to_empty makes new Parameter objects). Nothing was changed")
    return [(g, f) for g, f in shards if f.device.type != "meta"]
