"""DTensor parameters (FSDP2's ``fully_shard``, tensor parallel, their 2-D mix): the
adapter that steps each parameter's local shard where the engine keeps it.

What the engine owns and what we own:

- The engine owns the parameters' storage and their gradients. FSDP2 all-gathers from
  its own padded shards and sets ``.grad`` (a DTensor) after its reduce-scatter; tensor
  parallel's autograd does the same. Nothing is moved: the kernel updates each local
  shard (``p._local_tensor``) in place, and reads the local gradient at ``step``.
- We own the optimizer state of those local shards: the fp32 master of fp16/bf16 shards,
  the moments and the step counts live in one flat buffer per param group, dtype and
  device (an aligned slot per local shard, ``zero_triton.state.shards``), and the kernel
  steps each shard beside its slot.
- ``opt.state`` and the state dicts hold DTensors over that buffer with each
  parameter's mesh and placements, as torch's optimizers keep theirs for DTensor
  parameters, so ``get_optimizer_state_dict``/``set_optimizer_state_dict`` and
  ``torch.distributed.checkpoint`` work unchanged.

Each rank steps only its local shards: the engine has averaged the gradients already,
so FusedAdam communicates nothing here except clipping's norm, over each mesh.
``EngineHome`` is a home of ``zero_triton.optim.shard.Shard`` beside ``FlatHome``
(``zero_triton.optim.flat_home``): the same state and kernels, the parameters where the
engine keeps them.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from zero_triton.comm.grads import zero_in_place
from zero_triton.comm.protocol import Comm
from zero_triton.optim.flat_home import one_kind
from zero_triton.optim.launch import ListLaunch, RowsLaunch, settle
from zero_triton.optim.rows import row_map
from zero_triton.state.flat import FlatLayout
from zero_triton.state.moments import FIRST, SECOND

_DTENSOR = []  # torch's DTensor class once looked up (None where torch has none)


def dtensor_type():
    """torch's DTensor class, or None where torch has none."""
    if not _DTENSOR:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # torch < 2.5
            try:
                from torch.distributed._tensor import DTensor
            except ImportError:
                DTensor = None
        _DTENSOR.append(DTensor)
    return _DTENSOR[0]


def is_dtensor(t) -> bool:
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


def _local(p) -> torch.Tensor:
    """The local shard of DTensor ``p`` as the engine holds it now (FSDP2 may replace it
    between construction and the first forward: ``reset_sharded_param``)."""
    return p._local_tensor


def _replicas(p) -> int:
    """How many ranks of ``p``'s mesh hold each element of its local shard (the sizes of
    the mesh dimensions it is replicated over)."""
    n = 1
    for d, placement in enumerate(p.placements):
        if placement.is_replicate():
            n *= p.device_mesh.size(d)
    return n


def blocks_fit(p, block: int) -> bool:
    """Whether DTensor ``p`` keeps block-quantized moments (``block`` > 1): its rows (its
    global shape flattened from the second dimension on) are a whole number of blocks.
    A function of the global shape only: the same answer at every layout. The others
    (1-D biases and norms, thin weights) keep fp32 moments at every layout."""
    if block == 1:
        return True
    shape = tuple(p.shape)
    return len(shape) >= 2 and math.prod(shape[1:]) % block == 0


def keeps_blocks(p, block: int) -> bool:
    """Whether every run of ``block`` elements of DTensor ``p``'s rows lies whole in one
    rank's local shard, on every rank, for its placements: the local shards then hold
    the whole parameter's blocks and the kernels step them as they are. A parameter whose
    blocks fit (``blocks_fit``) but not whole on one rank (a tensor-parallel cut of its
    rows whose part is not a multiple of ``block``: 128 of a 512-element row at tp=4) is
    stepped through its rows (``zero_triton.optim.rows``), its ranks agreeing on the
    scales of the blocks they share (``zero_triton.state.int8_rows``).

    - ``Shard(0)``, FSDP's ``_StridedShard(0)`` and ``Replicate`` cut no row: whole at every
      world size (uneven last shards and empty ones too).
    - ``Shard(d)``, d >= 1: each rank's part of a row must be a multiple of ``block`` long
      at this mesh size (``cols / n`` and ``cols`` both); a strided cut of a row never is."""
    if not blocks_fit(p, block):
        return False
    if block == 1:
        return True
    shape = tuple(p.shape)
    for d, placement in enumerate(p.placements):
        if placement.is_replicate() or placement.is_partial():
            continue
        dim = placement.dim % len(shape)
        if dim == 0:
            continue
        if type(placement).__name__ != "Shard":
            return False
        inner = math.prod(shape[dim + 1:])
        chunk = -(-shape[dim] // p.device_mesh.size(d))
        if (chunk * inner) % block or (shape[dim] * inner) % block:
            return False
    return True


def cuts_rows(p) -> bool:
    """Whether a placement of DTensor ``p`` cuts its rows (shards a dimension after the
    first): its local elements' global indices are then not one run."""
    shape = tuple(p.shape)
    return any(not pl.is_replicate() and not pl.is_partial() and 0 < pl.dim % max(len(shape), 1)
               for pl in p.placements)


def _check_local(p, t, i: int) -> None:
    if t.numel() and not t.is_contiguous():
        raise ValueError(
            f"DTensor parameter {i} {tuple(p.shape)} has a local shard that is not contiguous "
            f"(shape {tuple(t.shape)}, strides {tuple(t.stride())}); FusedAdam steps contiguous "
            "local shards in place. Make it contiguous before sharding (p.data = "
            "p.data.contiguous()), or optimize it with torch.optim.AdamW(fused=True)")


def scales_placements(p, shared: bool) -> list:
    """The placements of DTensor ``p``'s moments' block scales, a DTensor of global shape
    (rows, row length / block, 2): its rows split as ``p``'s (``Shard(0)``, ``_StridedShard(0)``);
    a cut of its rows splits the blocks as ``Shard(1)`` where each rank holds whole blocks,
    and replicates them where ranks share blocks (``shared``: each then holds the agreed
    scales of every block of its rows, ``zero_triton.state.int8_rows``)."""
    from torch.distributed.tensor import Replicate, Shard
    out = []
    for pl in p.placements:
        if pl.is_replicate() or pl.is_partial() or pl.dim % len(p.shape) == 0:
            out.append(pl)
        else:
            out.append(Replicate() if shared else Shard(1))
    return out


class EngineGrads:
    """The gradients of DTensor parameters, where the engine puts them: read at the step
    (``sync``), never moved. ``grads[i]``: parameter ``i``'s local gradient, flat, at
    this step (None without one)."""

    sharded = False
    flat = None

    def __init__(self, params, locals_):
        self.params = params
        self.numels = [t.numel() for t in locals_]
        self.grads = [None] * len(params)

    def written_since_hooks(self) -> bool:  # no bucket ever reads them
        return False

    def rewritten(self) -> None:
        pass

    def register_hooks(self, bucket_list, reducer) -> list:
        return []

    def sync(self, param_views):
        """Take each parameter's local gradient (one with other placements than its
        parameter's is redistributed to them first, as torch's optimizers do on
        DTensors: every rank does so, in the same order) and return which parameters
        have one (None when all do)."""
        present, grads = [], self.grads
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                grads[i] = None
                present.append(False)
                continue
            if is_dtensor(g):
                if g.device_mesh != p.device_mesh or tuple(g.placements) != tuple(p.placements):
                    g = g.redistribute(p.device_mesh, p.placements)
                g = g._local_tensor
            if g.is_sparse:
                raise RuntimeError(
                    f"parameter {i} ({tuple(p.shape)}) has a sparse gradient; FusedAdam "
                    "needs dense gradients (use torch.optim.SparseAdam for sparse ones)")
            if g.numel() != self.numels[i]:
                raise RuntimeError(
                    f"the gradient of DTensor parameter {i} {tuple(p.shape)} has "
                    f"{g.numel()} local elements, its local shard {self.numels[i]}: give it "
                    "the parameter's placements (p.grad = DTensor with p.placements)")
            grads[i] = g.reshape(-1)
            present.append(True)
        return None if all(present) else present

    def zero(self, set_to_none: bool = True) -> None:
        """``zero_grad``, as torch.optim.Optimizer's: ``.grad`` None, or zeroed in place."""
        for p in self.params:
            if set_to_none:
                p.grad = None
                continue
            g = p.grad
            if g is not None:
                zero_in_place(g, g._local_tensor if is_dtensor(g) else None)
        self.grads = [None] * len(self.params)

    def carry_over(self, old) -> None:
        pass

    def nbytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.grads if g is not None)


class EngineHome:
    """The local shards of a param group's DTensor parameters of one dtype and device:
    their state in one flat buffer, one segment (an aligned slot) per parameter, the
    kernel run on each shard in place."""

    # The parameters' storage and gradients are their engine's (DTensor): clipping
    # reduces their norm over each parameter's mesh, checkpoints go through DCP.
    gathers = False  # the engine gathers its parameters itself
    # No buckets, no flat buffer of ours: the engine averages and gathers.
    flat_param, flat_grad, reducer, bucket_numel = None, None, None, None
    separate_shard = False  # the engine's gradients are stepped where they are
    buckets, hooks = (), ()

    def __init__(self, params, comm: Comm, spec, *, key=0, maps=None, seed=None, rows=False):
        locals_ = [_local(p) for p in params]
        for i, (p, t) in enumerate(zip(params, locals_)):
            if p.is_complex():
                raise ValueError(f"DTensor parameter {i} {tuple(p.shape)} is {p.dtype}; FusedAdam "
                                 "steps real DTensor parameters (float32, float16, bfloat16, "
                                 "float64)")
            if t.device.type == "meta":
                raise ValueError(
                    f"DTensor parameter {i} {tuple(p.shape)} is on the meta device: it has no "
                    "data to step. Materialise the model first (model.to_empty(device=...) "
                    "and initialise it, e.g. reset_parameters()), then build the optimizer")
            _check_local(p, t, i)
        self.params, self.comm, self.spec, self.key = params, comm, spec, key
        self.dtype, self.device = locals_[0].dtype, locals_[0].device
        # One aligned slot of state per local shard: segment i is parameter i's.
        self.layout = FlatLayout.build([tuple(t.shape) for t in locals_], align=spec.align)
        self.segments = [(o, o + t.numel(), o) for o, t in zip(self.layout.offsets, locals_)]
        self.locals = locals_
        # Where each local shard lies in its parameter (``zero_triton.optim.rows``), and
        # where its stochastic rounding is keyed: its elements' indices in the canonical
        # layout of the param group's DTensor parameters of this dtype (the global shapes
        # one after another: ``zero_triton.optim.build``), the same at every layout. A
        # ``rows`` home's local shards are not runs of that layout (a cut row) or hold
        # int8 blocks other ranks share: its launch keys and scales them element by
        # element (``zero_triton.optim.launch.RowsLaunch``).
        if maps is None:
            whole = FlatLayout.build([tuple(p.shape) for p in params], align=spec.align)
            maps = [row_map(p, f"DTensor parameter {i} {tuple(p.shape)}", base)
                    for i, (p, base) in enumerate(zip(params, whole.offsets))]
        self.maps, self.rows = list(maps), rows
        self.seed = key if seed is None else seed
        self.keys = [m.start() if m.affine else s0 for m, (_, _, s0) in zip(self.maps, self.segments)]
        self.param_parts = [t.view(-1) for t in locals_]  # updated in place if the engine swaps
        self.param_views = self.param_parts
        self.grad_buffer = EngineGrads(params, locals_)

    def remove_hooks(self) -> None:
        pass

    def launch(self, backend: str, format: str, plain: bool, buffers):
        """How a side's launches reach the kernel (``optim.launch``): every local shard in
        one list launch, or through its rows (``rows``, in ``buffers``)."""
        if self.rows:
            return RowsLaunch(backend, self.maps, buffers)
        return ListLaunch(backend, format, plain)

    def watch_averages(self, watcher) -> None:
        """The engine averages these gradients in its own hooks and hands them over at
        the step (``EngineGrads.sync``): there is no landing to tell of, so offload
        copies them when the step begins."""

    # -- the step's operands ---------------------------------------------------------------
    def grad(self, k: int) -> torch.Tensor:
        """Parameter ``k``'s local gradient at this step (``EngineGrads.sync``)."""
        return self.grad_buffer.grads[k]

    def canonical(self, k: int) -> int:
        """Where segment ``k``'s stochastic rounding is keyed (``keys``)."""
        return self.keys[k]

    def finished(self, k: int) -> None:
        pass

    def gather(self, k: int) -> None:  # the engine gathers its own parameters
        pass

    def grad_norm_term(self, norm_type: float, dtype, buffers) -> torch.Tensor:
        """The ``norm_type`` norm's term of these gradients over every rank of their
        meshes: the sum of |g|^norm_type (each element once: a local shard replicated
        over a mesh dimension is counted once) or the largest |g|, reduced over each
        parameter's mesh; computed in ``buffers``' ``kept`` tensors (``state.buffers.Kept``
        under capturable=True: nothing is allocated)."""
        inf = norm_type == math.inf
        by_mesh: dict = {}
        for i, p in enumerate(self.params):  # every mesh takes part, with or without gradients
            by_mesh.setdefault(p.device_mesh, []).append(i)
        totals = buffers.kept(f"engine {self.key} meshes", len(by_mesh), dtype, self.device)
        for (mesh, members), total in zip(by_mesh.items(), totals):
            terms = buffers.kept(f"engine {self.key} terms", len(members), dtype, self.device)
            for i, term in zip(members, terms):
                g, p = self.grad_buffer.grads[i], self.params[i]
                if g is None or not g.numel():
                    term.zero_()
                    continue
                torch.linalg.vector_norm(g, norm_type, dtype=dtype, out=term)
                if not inf:
                    term.pow_(norm_type).div_(_replicas(p))
            (torch.amax if inf else torch.sum)(terms, dim=0, out=total)
            op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
            for d in range(mesh.ndim):  # over the whole mesh, one dimension at a time
                if mesh.size(d) > 1:
                    dist.all_reduce(total, op=op, group=mesh.get_group(d))
        out = buffers.kept(f"engine {self.key} term", 1, dtype, self.device).view(())
        if not by_mesh:
            return out.zero_()
        return (torch.amax if inf else torch.sum)(totals, dim=0, out=out)

    @classmethod
    def norm_total(cls, homes: list, comm: Comm, norm_type: float, buffers) -> torch.Tensor:
        """The sum of |g|^norm_type (the largest |g| for inf) of ``homes``' gradients over
        every rank of their meshes, a 1-element tensor: each home's term reduced over its
        meshes (``grad_norm_term``, float64 but for inf), then added up here."""
        inf = norm_type == math.inf
        acc = torch.float32 if inf else torch.float64
        device = homes[0].device
        total = buffers.kept("total", 1, acc, device)
        terms = buffers.kept("engine terms", len(homes), acc, device)
        for h, term in zip(homes, terms):
            term.copy_(h.grad_norm_term(norm_type, acc, buffers))
        (torch.amax if inf else torch.sum)(terms, dim=0, keepdim=True, out=total)
        return total

    # -- the state, as DTensors ---------------------------------------------------------
    def views(self, views: dict) -> dict:
        """Per-parameter DTensors over each state view, with the parameter's mesh,
        placements, shape and stride (their local tensors are views of the buffer)."""
        cls = dtensor_type()
        return {k: [cls.from_local(v, p.device_mesh, p.placements, run_check=False,
                                   shape=p.shape, stride=p.stride())
                    for v, p in zip(vs, self.params)]
                for k, vs in views.items()}

    def local_views(self, views: dict) -> dict:
        return views

    def local_value(self, value: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s local part of ``value``: a DTensor (redistributed to the
        parameter's placements if it has others: collective, as every rank loads), or a
        whole tensor of the parameter's global shape (this rank's part is taken, no
        communication), or already a tensor of the local shard's shape."""
        p = self.params[i]
        if is_dtensor(value):
            if value.device_mesh != p.device_mesh or tuple(value.placements) != tuple(p.placements):
                value = value.redistribute(p.device_mesh, p.placements)
            return value._local_tensor
        local = self.locals[i]
        if tuple(value.shape) == tuple(p.shape) and tuple(p.shape) != tuple(local.shape):
            from torch.distributed.tensor import distribute_tensor
            return distribute_tensor(value.to(local.device), p.device_mesh, p.placements,
                                     src_data_rank=None)._local_tensor
        return value

    # -- the engine's parameters --------------------------------------------------------
    def compact_entry(self, moments, i: int, entry: dict) -> dict | None:
        """DTensor parameter ``i``'s moments as ``moments`` (the shard's store) keeps them,
        as DTensors, for the compact state dict (``optim.compact``): the codes with its mesh
        and placements, the scales of shape (rows, row length / block, 2)
        (``scales_placements``); None for fp32 moments (torch's ``entry`` as it is). The
        same keys and global shapes at every layout: DCP moves them between layouts."""
        from torch.distributed.tensor import DTensor
        fmt = moments.format
        if fmt == "fp32":
            return None
        p, local = self.params[i], self.locals[i]
        lo, hi, s0 = self.segments[i]
        mesh, placements = p.device_mesh, p.placements

        def shared(t, shape=None, stride=None, placements=placements):
            return DTensor.from_local(t, mesh, placements, run_check=False,
                                      shape=shape or p.shape, stride=stride or p.stride())
        n = hi - lo
        if fmt == "bf16":
            return {FIRST: shared(moments.exp_avg[s0:s0 + n].view(local.shape).clone()),
                    SECOND: shared(moments.exp_avg_sq[s0:s0 + n].view(local.shape).clone())}
        shape, block = tuple(p.shape), moments.block
        global_scales = (shape[0], math.prod(shape[1:]) // block, 2)
        if self.rows:
            if s0 in moments.pending:  # loaded in torch's format, not stepped since: agree now
                settle(moments, s0, self.maps[i])
            scales = moments.table(s0)
        else:
            per_row = math.prod(local.shape[1:]) // block
            scales = moments.scales[s0 // block:(s0 + n) // block].reshape(local.shape[0], per_row, 2)
        first, second, scales_key = moments.COMPACT
        codes = moments.codes(s0, s0 + n)
        return {first: shared(codes[0].view(local.shape).clone()),
                second: shared(codes[1].view(local.shape).clone()),
                scales_key: shared(scales.clone(), global_scales, (global_scales[1] * 2, 2, 1),
                                   scales_placements(p, self.rows))}

    def checkpointable(self, entry: str) -> None:
        """zero_triton.checkpoint cannot save these shards (their engine owns them): raises
        with DCP, the way they are saved."""
        raise TypeError(
            f"zero_triton.checkpoint ({entry}) saves the flat buffers FusedAdam and "
            "ZeroAdam own; this optimizer steps DTensor parameters (FSDP2, tensor "
            "parallel), whose shards their engine owns. Save it with "
            "torch.distributed.checkpoint: dcp.save({'optim': get_optimizer_state_dict("
            "model, optimizer)}, checkpoint_id=...) (torch.distributed.checkpoint."
            "state_dict), as for torch.optim.AdamW")

    def first_moved(self, hint: bool = False) -> tuple:
        """(index of the first parameter whose local shard changed dtype or device
        (``model.to``) or -1, the parameters whose shard the engine replaced with another
        of the same kind: FSDP2's ``reset_sharded_param``, ``load_state_dict(assign=True)``).
        Those are followed here: stepped where they are now (the shard re-seeds their
        masters where their values differ)."""
        swapped = []
        for i, (p, t) in enumerate(zip(self.params, self.locals)):
            now = _local(p)
            if now is t:
                continue
            if now.dtype != self.dtype or now.device != self.device or now.numel() != t.numel():
                return i, ()
            _check_local(p, now, i)
            swapped.append(i)
        for i in swapped:
            self.locals[i] = _local(self.params[i])
            self.param_parts[i] = self.locals[i].view(-1)
        return -1, swapped

    def rehomed(self) -> "EngineHome":
        """A new home of the same parameters at their local shards' new dtype or device."""
        one_kind({(_local(p).dtype, _local(p).device) for p in self.params},
                 "DTensor parameters of one param group")
        shapes = [tuple(_local(p).shape) for p in self.params]
        if shapes != [tuple(t.shape) for t in self.locals]:
            raise RuntimeError(
                "zero_triton: the local shards of DTensor parameters changed shape after the "
                f"optimizer was built (now {shapes}); their state cannot follow them. Build the "
                "optimizer after the model is sharded and materialised")
        return EngineHome(self.params, self.comm, self.spec, key=self.key, maps=self.maps,
                          seed=self.seed, rows=self.rows)

    def carry_over(self, old: "EngineHome", written: list) -> list:
        """Nothing of the engine's to take; no master to re-seed (the DTensors' writes
        are followed at the next step)."""
        return []

    def nbytes(self) -> dict:
        return {"params": sum(t.numel() * t.element_size() for t in self.locals),
                "grads": self.grad_buffer.nbytes(), "padding": 0}
