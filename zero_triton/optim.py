"""FusedAdam / FusedAdamW: torch.optim.Adam semantics, one fused kernel per flat buffer.

Parameters of one param group, dtype and device are re-homed into one flat buffer
(``zero_triton.flat``); their ``.grad`` are views of a twin grad buffer, so autograd
accumulates straight into it. Each rank owns one shard of every buffer: with world size
1 (this module) the shard is the whole buffer and nothing is communicated; ZeroAdam
(``zero_triton.zero``) is the same optimizer with a process group.
"""
from __future__ import annotations

import math

import torch

from zero_triton import _ext, backends
from zero_triton.comm import LocalComm, phase
from zero_triton.flat import flatten_params

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_SUPPORTED = (torch.float32,) + _LOW_PRECISION
# Keys torch.optim.Adam keeps in every param group, with the values that describe this
# optimizer: a torch.optim.Adam loading our state dict behaves as its defaults.
_TORCH_GROUP_KEYS = {"foreach": None, "capturable": False, "differentiable": False, "fused": None}


def _check_hyperparameters(lr, betas, eps, weight_decay):
    lr_value = lr.item() if isinstance(lr, torch.Tensor) and lr.numel() == 1 else lr
    if not isinstance(lr_value, (int, float)) or isinstance(lr_value, bool):
        raise ValueError(f"lr must be a float or a 1-element tensor, got {lr!r}; to change it "
                         "during training set optimizer.param_groups[i]['lr']")
    if not 0.0 <= lr_value:
        raise ValueError(f"Invalid learning rate: {lr_value}; lr must be >= 0")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}; eps must be >= 0 (1e-8 is usual)")
    if len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
        raise ValueError(f"Invalid betas: {tuple(betas)}; both must lie in [0, 1), e.g. (0.9, 0.999)")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}; it must be >= 0")


def _with_grads(params):
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


class FlatShard:
    """One flat buffer (a param group's parameters of one dtype and device) and the
    optimizer state of this rank's shard of it."""

    def __init__(self, params, comm, *, master_weights, backend, amsgrad=False, reduce_dtype=None):
        self.params = params
        self.dtype, self.device = params[0].dtype, params[0].device
        self.comm = comm
        self.flat_param, self.layout = flatten_params(params, world_size=comm.world_size, rehome=True)
        self.flat_grad = torch.zeros_like(self.flat_param)
        self.grad_views = self.layout.views(self.flat_grad)
        native = _ext.loaded_or_prebuilt()
        self._first_foreign_grad = getattr(native, "first_foreign_grad", None)
        with torch.no_grad():
            for p, view in zip(params, self.grad_views):
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
        lo, hi = self.layout.shard_range(comm.rank)
        self.shard = (lo, hi)
        n = hi - lo
        self.param_shard = self.flat_param[lo:hi]
        # Wider reduction (bf16 grads averaged in fp32) needs a buffer of that dtype.
        self.reduce_buf = None
        if reduce_dtype is not None and reduce_dtype != self.dtype:
            self.reduce_buf = torch.zeros(self.layout.padded_numel, dtype=reduce_dtype, device=self.device)
        self.grad_shard = (self.reduce_buf if self.reduce_buf is not None else self.flat_grad)[lo:hi]
        self.has_master = self.dtype in _LOW_PRECISION
        if self.has_master and not master_weights:
            raise ValueError(
                f"master_weights=False with {self.dtype} parameters is not supported: Adam "
                "updates vanish in 8-bit mantissas; keep master_weights=None (an fp32 master "
                "for fp16/bf16 parameters) or train the parameters in float32")
        self.master = self.param_shard.float() if self.has_master else self.param_shard
        f32 = dict(dtype=torch.float32, device=self.device)
        self.exp_avg = torch.zeros(n, **f32)
        self.exp_avg_sq = torch.zeros(n, **f32)
        self.max_exp_avg_sq = torch.zeros(n, **f32) if amsgrad else None
        self.step = torch.zeros(1, **f32)
        self.lr = torch.zeros(1, **f32)
        self.skipped = torch.zeros(1, **f32)
        self.one = torch.ones(1, **f32)  # step += one: a Python 1.0 would be wrapped in a new tensor
        self.backend = backends.resolve(backend, self.device)
        self.step_fn = backends.step_function(self.backend)
        self.scratch = torch.empty(n, **f32) if self.backend == "torch" else None
        self.fused = self.device.type == "cuda"

    def ensure_amsgrad(self) -> bool:
        """Allocate max_exp_avg_sq (amsgrad switched on after construction); True if new."""
        if self.max_exp_avg_sq is None:
            self.max_exp_avg_sq = torch.zeros_like(self.exp_avg)
            return True
        return False

    def state_buffers(self) -> dict:
        """This rank's shard of each state buffer, keyed as torch.optim.Adam keys its
        per-parameter state (``master_param`` only for fp16/bf16 parameters)."""
        bufs = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.max_exp_avg_sq is not None:
            bufs["max_exp_avg_sq"] = self.max_exp_avg_sq
        if self.has_master:
            bufs["master_param"] = self.master
        return bufs

    def state_views(self) -> dict:
        """Per-parameter views of the state (world size 1: the shard is the whole buffer)."""
        return {k: self.layout.views(b) for k, b in self.state_buffers().items()}

    def sync_grads(self):
        """Point every ``.grad`` back at its view of the flat grad buffer. A ``.grad``
        that something replaced (``module.zero_grad()`` sets it to None, and autograd
        then allocates a fresh one) is copied in; a missing one counts as zero."""
        start = 0
        if self._first_foreign_grad is not None:  # the common case in one C loop
            start = self._first_foreign_grad(self.params, self.grad_views)
            if start < 0:
                return
        for i in range(start, len(self.params)):
            p, view = self.params[i], self.grad_views[i]
            g = p.grad
            if g is view:
                continue
            if g is None:
                view.zero_()
            else:
                if g.is_sparse:
                    raise RuntimeError(
                        f"parameter {i} ({tuple(p.shape)}) has a sparse gradient; FusedAdam "
                        "needs dense gradients (use torch.optim.SparseAdam for sparse ones)")
                view.copy_(g)
            p.grad = view

    def reduce_grads(self):
        if self.reduce_buf is not None:
            self.reduce_buf.copy_(self.flat_grad)
            self.comm.reduce_scatter_avg(self.grad_shard, self.reduce_buf)
        else:
            self.comm.reduce_scatter_avg(self.grad_shard, self.flat_grad)

    def update(self, group, grad_scale, found_inf, clip_coef):
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            self.lr.copy_(lr)
        else:
            self.lr.fill_(lr)
        if found_inf is not None:
            found_inf = found_inf.to(self.device, torch.float32, non_blocking=True)
            # torch's fused Adam convention: a skipped step does not count.
            self.skipped.copy_(found_inf).clamp_(max=1.0)
            self.step.add_(self.one).sub_(self.skipped)
        else:
            self.step.add_(self.one)
        if grad_scale is not None:
            grad_scale = grad_scale.to(self.device, torch.float32, non_blocking=True)
        beta1, beta2 = group["betas"]
        extra = {"scratch": self.scratch} if self.backend == "torch" else {}
        self.step_fn(
            self.master, self.grad_shard, self.exp_avg, self.exp_avg_sq,
            self.max_exp_avg_sq if group["amsgrad"] else None,
            self.param_shard if self.has_master else None,
            self.step, self.lr,
            beta1=float(beta1), beta2=float(beta2), eps=group["eps"],
            weight_decay=group["weight_decay"], adamw=group["decoupled_weight_decay"],
            amsgrad=group["amsgrad"], maximize=group["maximize"],
            grad_scale=grad_scale, found_inf=found_inf, clip_coef=clip_coef, **extra)

    def gather_params(self):
        self.comm.all_gather(self.flat_param, self.param_shard)

    def nbytes(self) -> dict:
        def size(t):
            return 0 if t is None else t.numel() * t.element_size()
        elem = self.flat_param.element_size()
        return {
            "params": size(self.flat_param),
            "grads": size(self.flat_grad) + size(self.reduce_buf),
            "master": size(self.master) if self.has_master else 0,
            "moments": size(self.exp_avg) + size(self.exp_avg_sq) + size(self.max_exp_avg_sq),
            "padding": self.layout.padding * elem * 2,
            "scratch": size(self.scratch),
        }


class FusedAdam(torch.optim.Optimizer):
    """Adam with torch.optim.Adam's signature and semantics, one fused kernel per flat
    buffer.

    Args beyond torch's:
        master_weights: None (default) keeps an fp32 master for fp16/bf16 parameters;
            fp32 parameters are their own master.
        backend: "auto" | "triton" | "cuda" | "cpu" | "torch" (see zero_triton.backends).

    The parameters' storage moves into flat buffers at construction: build the
    optimizer after ``model.to(device, dtype)``. ``zero_grad`` zeroes the buffers and
    keeps the ``.grad`` views. Unlike torch.optim.Adam, a parameter whose gradient is
    None at ``step`` is stepped with a zero gradient (its moments decay); parameters
    with ``requires_grad=False`` are left out entirely.
    """

    _step_supports_amp_scaling = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, *, maximize=False, decoupled_weight_decay=False,
                 master_weights=None, backend="auto", _comm=None, _reduce_dtype=None):
        _check_hyperparameters(lr, betas, eps, weight_decay)
        if backend not in backends.NAMES:
            raise ValueError(f"unknown backend {backend!r}; choose one of {backends.NAMES}")
        self._comm = _comm if _comm is not None else LocalComm()
        self._backend = backend
        self._master_weights = True if master_weights is None else bool(master_weights)
        self._reduce_dtype = _reduce_dtype
        self._flats: list[list[FlatShard]] = []   # per param group
        self._grads_reduced = False
        self._clip_coef = None
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, decoupled_weight_decay=decoupled_weight_decay,
                        **_TORCH_GROUP_KEYS)
        # Groups are added one by one, each attaching .grad views: if a later group is
        # rejected, put the earlier groups' gradients back so that a failed constructor
        # leaves the parameters as it found them.
        params, grads_before = _with_grads(params)
        try:
            super().__init__(params, defaults)
        except BaseException:
            for p, g in grads_before:
                p.grad = g
            raise

    # -- construction -------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        params = list(params)
        if params and isinstance(params[0], tuple):  # (name, tensor) pairs
            params = [p for _, p in params]
        group = {**self.defaults, **param_group}
        _check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        devices = {p.device for p in params}
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameter {i} of the group is a {type(p).__name__}, not a tensor")
            if id(p) in seen:
                raise ValueError(
                    f"parameter {i} of the new group ({tuple(p.shape)}) is already in another "
                    "param group; give each parameter to exactly one group")
            if not p.is_leaf:
                raise ValueError(f"parameter {i} is not a leaf tensor; optimize leaves (nn.Parameter)")
            if p.dtype not in _SUPPORTED:
                raise ValueError(f"parameter {i} is {p.dtype}; FusedAdam handles float32, "
                                 "float16 and bfloat16 parameters (complex: view_as_real first)")
            if p.grad is not None and p.grad.is_sparse:
                raise ValueError(f"parameter {i} has a sparse gradient; use torch.optim.SparseAdam")
        if len(devices) > 1:
            raise ValueError(
                f"one param group holds parameters on several devices {sorted(map(str, devices))}; "
                "split them into one param group per device")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter appears twice in one param group; list it once")
        # Build the flat buffers before registering the group, so an error (no usable
        # backend, say) leaves the optimizer as it was.
        trainable = [p for p in params if p.requires_grad]
        if trainable:
            backends.resolve(self._backend, trainable[0].device)  # raises with the fix
        flats = []
        for dtype in _SUPPORTED:
            members = [p for p in trainable if p.dtype == dtype]
            if members:
                flats.append(FlatShard(members, self._comm, master_weights=self._master_weights,
                                       backend=self._backend, amsgrad=group["amsgrad"],
                                       reduce_dtype=self._reduce_dtype))
        super().add_param_group(param_group)
        self._flats.append(flats)
        if self._comm.world_size == 1:
            for flat in flats:
                self._expose_state(flat)

    def _expose_state(self, flat: FlatShard):
        """optimizer.state[p] holds views of the flat state, as torch.optim.Adam's would."""
        views = flat.state_views()
        for i, p in enumerate(flat.params):
            self.state[p] = {"step": flat.step, **{k: v[i] for k, v in views.items()}}

    def _all_flats(self):
        for group, flats in zip(self.param_groups, self._flats):
            for flat in flats:
                yield group, flat

    # -- the step -------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat grad buffers. The ``.grad`` views stay (``set_to_none`` is
        accepted for compatibility and ignored: the buffers are the gradients)."""
        for _, flat in self._all_flats():
            flat.flat_grad.zero_()
            for p, view in zip(flat.params, flat.grad_views):
                if p.grad is not view:
                    p.grad = view
        self._grads_reduced = False
        self._clip_coef = None

    def _reduce_grads(self):
        if self._grads_reduced:
            return
        flats = [flat for _, flat in self._all_flats()]
        for flat in flats:
            flat.sync_grads()
        if self._comm.world_size > 1 or any(f.reduce_buf is not None for f in flats):
            with phase("zero_triton.reduce_scatter", any(f.fused for f in flats)):
                for flat in flats:
                    flat.reduce_grads()
        self._grads_reduced = True

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm (over every rank's shard) to ``max_norm``, as
        torch.nn.utils.clip_grad_norm_ would on the full averaged gradient. The
        coefficient is applied inside the next ``step``'s kernel; returns the total
        norm as a tensor (no host sync)."""
        norm_type = float(norm_type)
        self._reduce_grads()
        flats = [flat for _, flat in self._all_flats()]
        if not flats:
            return torch.zeros(())
        device = flats[0].device
        if norm_type == math.inf:
            parts = [flat.grad_shard.abs().max().float() if flat.grad_shard.numel() else
                     torch.zeros((), device=device) for flat in flats]
            total = torch.stack([p.to(device) for p in parts]).max()
            self._comm.all_reduce(total, "max")
        else:
            parts = [torch.linalg.vector_norm(flat.grad_shard, norm_type, dtype=torch.float32) ** norm_type
                     for flat in flats]
            total = torch.stack([p.to(device) for p in parts]).sum()
            self._comm.all_reduce(total, "sum")
            total = total ** (1.0 / norm_type)
        self._clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0).reshape(1)
        return total

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step. With GradScaler (``scaler.step(opt)``), the scale and the
        inf flag it attaches are applied inside the kernel; a step with inf/nan
        gradients changes nothing."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None:
            self._comm.all_reduce(found_inf, "max")  # every rank skips together
        self._reduce_grads()
        flats = list(self._all_flats())
        for group, flat in flats:
            if group["amsgrad"] and flat.ensure_amsgrad() and self._comm.world_size == 1:
                self._expose_state(flat)
        cuda = any(flat.fused for _, flat in flats)
        with phase("zero_triton.adam_step", cuda):
            for group, flat in flats:
                clip = self._clip_coef.to(flat.device) if self._clip_coef is not None else None
                flat.update(group, grad_scale, found_inf, clip)
        if self._comm.world_size > 1:
            with phase("zero_triton.all_gather", cuda):
                for _, flat in flats:
                    flat.gather_params()
        self._grads_reduced = False
        self._clip_coef = None
        return loss

    # -- reports --------------------------------------------------------------------
    def memory_report(self) -> dict:
        """This rank's bytes: low-precision params, grads, fp32 master, moments,
        padding (elements that belong to no parameter, params and grads), scratch."""
        total = {"params": 0, "grads": 0, "master": 0, "moments": 0, "padding": 0, "scratch": 0}
        for _, flat in self._all_flats():
            for k, v in flat.nbytes().items():
                total[k] += v
        total["optimizer_state"] = total["master"] + total["moments"]
        return total

    # -- state dict (torch.optim.Adam format) ------------------------------------------
    def _packed_groups(self):
        """torch's param_groups with parameters replaced by their state-dict index, and
        the map id(param) -> index."""
        groups, ids = [], {}
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(len(ids), len(ids) + len(group["params"])))
            ids.update({id(p): i for p, i in zip(group["params"], packed["params"])})
            groups.append(packed)
        return groups, ids

    def state_dict(self) -> dict:
        """torch.optim.Adam's format: per-parameter ``step``, ``exp_avg``,
        ``exp_avg_sq`` (``max_exp_avg_sq``), plus ``master_param`` for fp16/bf16
        parameters. Tensors are views of the live state, as torch's are."""
        if self._comm.world_size > 1:
            raise RuntimeError(
                "state_dict() of a sharded optimizer would hold only this rank's shard; use "
                "consolidated_state_dict() for torch.optim.Adam's format, or "
                "zero_triton.checkpoint.save for a sharded checkpoint")
        groups, ids = self._packed_groups()
        state = {}
        for _, flat in self._all_flats():
            views = flat.state_views()
            for i, p in enumerate(flat.params):
                # A step tensor of its own per parameter: torch.optim.Adam increments
                # each one, a shared one would count N times per step.
                state[ids[id(p)]] = {"step": flat.step[0].detach().to("cpu", copy=True),
                                     **{k: v[i] for k, v in views.items()}}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch.optim.Adam's format (ours or torch's). Everything is checked
        before anything changes; without ``master_param`` the master is the current
        parameter upcast."""
        plan = self._plan_full_load(state_dict)
        self._apply_full_load(state_dict, plan)

    def _apply_full_load(self, state_dict, plan) -> None:
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            for k, v in saved.items():
                if k not in ("params", "param_names"):
                    group[k] = v
            group.setdefault("decoupled_weight_decay", False)
        for flat, entries, step in plan:
            self._load_shard(flat, entries, step)
        if self._comm.world_size == 1:
            for _, flat in self._all_flats():
                self._expose_state(flat)

    def _plan_full_load(self, state_dict) -> list:
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"the state dict has {len(saved_groups)} param groups, this optimizer "
                             f"{len(self.param_groups)}; build the optimizer with the same groups")
        ids = {}
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError(f"param group {gi} has {len(group['params'])} parameters, the "
                                 f"state dict's {len(saved['params'])}")
            ids.update({id(p): idx for p, idx in zip(group["params"], saved["params"])})
        saved_state, plan = state_dict["state"], []
        for gi, flats in enumerate(self._flats):
            for flat in flats:
                entries = [saved_state.get(ids[id(p)]) for p in flat.params]
                if all(e is None for e in entries):
                    plan.append((flat, None, 0.0))
                    continue
                if any(e is None for e in entries):
                    raise ValueError(f"the state dict has state for some parameters of param group "
                                     f"{gi} but not for parameter {entries.index(None)}; the optimizer "
                                     "steps a group's parameters together")
                steps = {float(e["step"]) for e in entries}
                if len(steps) != 1:
                    raise ValueError(f"parameters of param group {gi} have different steps "
                                     f"{sorted(steps)}; one step is kept per flat buffer")
                for i, (p, e) in enumerate(zip(flat.params, entries)):
                    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"):
                        if key in e and tuple(e[key].shape) != tuple(p.shape):
                            raise ValueError(f"state '{key}' of parameter {i} in param group {gi} "
                                             f"has shape {tuple(e[key].shape)}, the parameter "
                                             f"{tuple(p.shape)}")
                plan.append((flat, entries, steps.pop()))
        return plan

    @torch.no_grad()
    def _load_shard(self, flat, entries, step) -> None:
        """Copy this rank's [lo, hi) of each full per-parameter state into the shard."""
        flat.exp_avg.zero_()
        flat.exp_avg_sq.zero_()
        flat.step.fill_(step)
        has_max = entries is not None and all("max_exp_avg_sq" in e for e in entries)
        if has_max:
            flat.ensure_amsgrad()
        elif flat.max_exp_avg_sq is not None:
            flat.max_exp_avg_sq.zero_()
        if flat.has_master:
            flat.master.copy_(flat.param_shard)
        if entries is None:
            return
        lo, hi = flat.shard
        targets = flat.state_buffers()
        if not has_max:
            targets.pop("max_exp_avg_sq", None)  # zeroed above: not every entry has it
        for i, a, b in flat.layout.ranges_in(lo, hi):
            o = flat.layout.offsets[i] + a - lo
            for key, buf in targets.items():
                if key in entries[i]:
                    buf[o:o + b - a].copy_(entries[i][key].reshape(-1)[a:b])
        # Every rank decides this from the same state dict: the all-gather is collective.
        if flat.has_master and all("master_param" in e for e in entries):
            flat.param_shard.copy_(flat.master)
            flat.gather_params()


class FusedAdamW(FusedAdam):
    """AdamW: FusedAdam with decoupled weight decay (default 1e-2), as torch.optim.AdamW."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, master_weights=None, backend="auto", **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         decoupled_weight_decay=True, master_weights=master_weights,
                         backend=backend, **kwargs)
