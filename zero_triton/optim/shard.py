"""One shard of an optimizer: the parameters of a param group of one dtype and device
and this rank's part of their optimizer state, built from two parts.

- Its **home**, where the parameters and gradients live: ``FlatHome``
  (``zero_triton.optim.flat_home``: our flat buffer, its gradients and the buckets that
  average them) or ``EngineHome`` (``zero_triton.optim.engine_home``: the local shards of
  DTensor parameters, where FSDP2 or tensor parallel keep them).
- Its **launch** (``zero_triton.optim.launch``): how the step's operands reach a kernel
  (one launch per run, or one list launch).

The state of the shard (``zero_triton.state.shards``) and the step's records
(``zero_triton.kernels.args``) are the same whatever the home and the launch: the shard
turns each run of a segment into ``Operands``, the step's hyperparameters into one
``StepArgs``, and hands both to its launch, the one place a step function is called.
"""
from __future__ import annotations

import torch

from zero_triton.comm.protocol import Comm
from zero_triton.kernels.args import Operands, StepArgs
from zero_triton.native import backends
from zero_triton.optim.engine_home import EngineHome
from zero_triton.optim.flat_home import FLAT_DTYPES, LOW_PRECISION, SUPPORTED, FlatHome, one_kind
from zero_triton.optim.offload import BESIDE, host_backend
from zero_triton.state import master as master_formats
from zero_triton.state import watch
from zero_triton.state.flat import real_dtype
from zero_triton.state.param_view import ParamView
from zero_triton.state.shards import ShardState
from zero_triton.state.split import SplitState

__all__ = ["Shard", "FLAT_DTYPES", "LOW_PRECISION", "SUPPORTED", "one_kind"]


class Shard:
    """A ``home`` (``FlatHome`` or ``EngineHome``) and the optimizer state of this
    rank's part of it (``state``), stepped through a launch part. Built by
    ``Shard.flat`` / ``Shard.engine`` (``zero_triton.optim.build``).

    Parameters that were not stepped keep their state, step count included."""

    def __init__(self, home, spec, *, amsgrad: bool = False, key: int = 0):
        self.home, self.spec, self.key = home, spec, key
        self.dtype, self.device = home.dtype, home.device
        # How the parameters are stepped (zero_triton.state.master): an fp32 master beside
        # fp16/bf16 ones (or its low half: "remainder"), none ("stochastic"), or their own.
        self.master_format = spec.master_format(self.dtype)
        self.has_master = master_formats.FORMATS[self.master_format].exact
        # Where the state lives (zero_triton.optim.offload), in one or two sides: beside
        # the parameters, in host memory over mirrors of them (offload="cpu"), or its
        # first elements beside them and the rest (offload_fraction) in host memory.
        # Parameters on the meta device are offloaded once materialised (re-homed).
        try:
            self.sides = self._sides(home, spec, amsgrad)
        except RuntimeError:  # host memory refused: the home's hooks go with it
            home.remove_hooks()
            raise
        self.state = self.sides[0].state if len(self.sides) == 1 else SplitState(
            self.sides[0].state, self.sides[1].state, self.sides[1].cut, home.layout, home.segments)
        host = [side for side in self.sides if side.place.offloaded]
        self.offloaded = bool(host)
        self.place = host[0].place if host else self.sides[0].place  # the offloaded side's
        self.backend = self.sides[0].backend
        # Where each parameter's state lives in every rank's shard: what every way out of
        # the state reads and writes it by (zero_triton.state.param_view).
        self.by_param = ParamView(home.layout, home.segments)
        # The parameters' writes since the master was last taken from them (zero_triton.state.watch).
        self.versions = watch.ParamVersions(home.params)
        self.fused = self.device.type == "cuda"
        # Host list: which parameters are stepped this step (None: all of them).
        self.stepped = None
        self.exposed_steps = None  # the state.steps optimizer.state[p]["step"] views (world size 1)
        # Rounding keyed by the element's place in the canonical layout (bf16 moments, a
        # stochastically rounded parameter): the launches carry their first element's index.
        self.keyed = self.state.moments.keyed or self.state.master.keyed

    def _sides(self, home, spec, amsgrad: bool) -> list:
        """The state's sides, where the spec's placement puts them
        (``zero_triton.optim.offload``): one, or two split at an element."""
        placement = BESIDE if self.device.type == "meta" else spec.placement
        return [Side(self, place, n, amsgrad, cut=cut)
                for place, n, cut in placement.places(home, spec.reduce_dtype or self.dtype)]

    @classmethod
    def flat(cls, params, comm: Comm, spec, *, amsgrad=False, key=0, reducer=None,
             bucket_numel=None) -> "Shard":
        """``params`` re-homed into a flat buffer of ours (``FlatHome``)."""
        cls._check_master(spec, real_dtype(params[0].dtype))  # before the parameters are re-homed
        spec.capture.check_backend(spec.backend, real_dtype(params[0].dtype), params[0].device)
        return cls(FlatHome(params, comm, spec, key=key, reducer=reducer, bucket_numel=bucket_numel),
                   spec, amsgrad=amsgrad, key=key)

    @classmethod
    def engine(cls, params, comm: Comm, spec, *, amsgrad=False, key=0, maps=None, rows=False,
               seed=None) -> "Shard":
        """DTensor ``params`` stepped where their engine keeps them (``EngineHome``;
        ``maps``, ``rows``, ``seed``: ``zero_triton.optim.build.engine_shards``)."""
        home = EngineHome(params, comm, spec, key=key, maps=maps, rows=rows, seed=seed)
        cls._check_master(spec, home.dtype)
        spec.capture.check_backend(spec.backend, home.dtype, home.device)
        return cls(home, spec, amsgrad=amsgrad, key=key)

    @staticmethod
    def _check_master(spec, dtype) -> None:
        if master_formats.FORMATS[spec.master_format(dtype)].exact and not spec.master_weights:
            raise ValueError(
                f"master_weights=False with {dtype} parameters is not supported: Adam "
                "updates vanish in 8-bit mantissas; keep master_weights=None (an fp32 master "
                "for fp16/bf16 parameters) or train the parameters in float32")

    # -- what the home holds ---------------------------------------------------------------
    params = property(lambda self: self.home.params)
    layout = property(lambda self: self.home.layout)
    segments = property(lambda self: self.home.segments)
    param_parts = property(lambda self: self.home.param_parts)
    grad_buffer = property(lambda self: self.home.grad_buffer)
    flat_param = property(lambda self: self.home.flat_param)
    flat_grad = property(lambda self: self.home.flat_grad)
    buckets = property(lambda self: self.home.buckets)
    separate_shard = property(lambda self: self.home.separate_shard)
    bucket_numel = property(lambda self: self.home.bucket_numel)

    def remove_hooks(self):
        self.home.remove_hooks()

    def state_views(self, bufs: dict | None = None) -> dict:
        """Per-parameter views of each state buffer (of ``bufs``, one ``state.buffers()``,
        if given) as the home presents its parameters (shaped as the parameters, complex
        for a complex one; DTensors for DTensor parameters): what ``opt.state`` and
        ``state_dict()`` hold."""
        return self.home.views(self.state.views(bufs))

    def local_views(self, bufs: dict | None = None) -> dict:
        """Per-parameter views of each state buffer as this process holds them: what a
        value given for parameter ``i`` is copied into after ``local_value``."""
        return self.home.local_views(self.state.views(bufs))

    def local_value(self, value: torch.Tensor, i: int) -> torch.Tensor:
        """A state value given for parameter ``i`` (a state dict's, ``opt.state``'s), as
        this process holds that parameter's state."""
        return self.home.local_value(value, i)

    # -- the parameters moved behind our back ------------------------------------------
    def first_moved(self, hint: bool = False) -> int:
        """Index of the first parameter that moved out of its home (``model.to(...)``
        after construction), or -1. Parameters the engine swapped for others of the same
        kind are followed here, their masters re-seeded where their values differ."""
        i, swapped = self.home.first_moved(hint)
        if swapped:
            for side in self.sides:  # the kernel's operands name the parameters' views
                side.place.refresh()
                side.whole_key = None
            self.reseed(swapped)
        return i

    def rehomed(self) -> "Shard":
        """A new Shard over the same parameters at their new dtype and device, with this
        one's state carried over (moved to the new device): training continues as with an
        optimizer built after the move."""
        new = Shard(self.home.rehomed(), self.spec, amsgrad=self.state.amsgrad, key=self.key)
        if self.device.type == "meta":  # materialised (model.to_empty): nothing to carry over
            return new
        with torch.no_grad():
            new.state.carry_over(self.state)
            new.reseed(new.home.carry_over(self.home, self.versions.written()))
        return new

    @torch.no_grad()
    def reseed(self, indices) -> None:
        """The user wrote parameters ``indices`` (their version moved, or their .data was
        replaced): seed this rank's part of their master again from them where they
        differ from it (``Master.reseed``), so the next step starts from what the user
        wrote (fp32 parameters are their own master). An element written with the value
        it had (DDP's broadcast, an EMA swapped back, the same weights loaded) keeps its
        master's extra precision."""
        if not indices:
            return
        wanted = set(indices)
        if self.has_master or self.offloaded:  # offloaded: the host mirrors follow
            layout = self.layout
            for part, (lo, hi, s0) in zip(self.param_parts, self.segments):
                ranges = [(i, a, b) for i, a, b in layout.ranges_in(lo, hi) if i in wanted]
                if ranges:
                    part = self.unwritten(part, s0)
                for i, a, b in ranges:
                    x = layout.offsets[i] + a - lo
                    self.state.master.reseed(s0 + x, s0 + x + b - a, part[x:x + b - a])
        self.versions.accept(wanted)

    @torch.no_grad()
    def published(self) -> None:
        """The master was just published into this rank's shard of the parameters (a
        checkpoint's load, whose model file holds the other ranks' shards as the gathers
        left them): hold there what our own gather would write (``Comm.gathered``)."""
        for part in self.param_parts:
            ours = self.home.comm.gathered(part)
            if ours is not part:
                part.copy_(ours)

    def unwritten(self, part: torch.Tensor, s0: int) -> torch.Tensor:
        """``part`` (this rank's parameters of one segment, its state at ``s0``) with
        what our own gather wrote there put back to the master's rounding, so that only
        the user's writes differ from it (``written_values``)."""
        master = self.state.master.export()
        if master is None:
            return part
        return written_values(part, master[s0:s0 + part.numel()].to(part.device), self.home.comm)

    def sync_grads(self):
        """Decide which parameters have a gradient at this step (``self.stepped``: None
        when all do): torch's rule, ``.grad`` not None (``zero_triton.comm.grads``)."""
        self.stepped = self.grad_buffer.sync(self.home.param_views)

    def zero_grads(self, set_to_none: bool = True):
        """``zero_grad``, as torch.optim.Optimizer's."""
        self.grad_buffer.zero(set_to_none)
        self.stepped = None
        self.averages_written()

    def averages_written(self) -> None:
        """The averaged shards were written in place (unscaled, zeroed): what offload
        copied of them as they landed is stale."""
        for side in self.sides:
            side.place.forget()

    # -- the step ------------------------------------------------------------------------
    def prepare(self, group, grad_scale, found_inf, clip_coef) -> dict:
        """Count this step and return its plan for ``update``/``update_bucket``: per
        side, the step's ``StepArgs`` and the runs of parameters that step (None: every
        piece whole)."""
        plan = []
        for n, side in enumerate(self.sides):
            args = self._args(side, group, grad_scale, found_inf, clip_coef)
            if n == 0:
                runs = side.state.count(self.stepped, args.found_inf)
            else:  # the second side counts as the first did (the same parameters)
                runs = side.state.follow(self.sides[0].state, self.stepped, plan[0][1])
            plan.append((args, runs))
        return {"sides": plan}

    def _args(self, side, group, grad_scale=None, found_inf=None, clip_coef=None) -> StepArgs:
        """The step's ``StepArgs`` for ``side``: ``group``'s hyperparameters, its lr and
        the step's scalars on the side's device (the host when offloaded, where the copy
        is the step's one wait on the device: a copy to the host that did not wait would
        be read early)."""
        beta1, beta2 = group["betas"]
        scalars = side.scalars(group["lr"], grad_scale, found_inf, clip_coef)
        return StepArgs(float(beta1), float(beta2), group["eps"], group["weight_decay"],
                        group["decoupled_weight_decay"], group["amsgrad"], group["maximize"],
                        *scalars, self.state.master.stochastic, self.home.seed if self.keyed else 0)

    def step_param(self, group, run, grad: torch.Tensor) -> None:
        """Gradient release (``zero_triton.optim.release``): step parameter ``run.index``
        alone, its elements [``run.a``, ``run.b``) held at ``run.at`` in the state, with
        ``grad`` (its elements in the buffer's order, 1-D), counted alone
        (``ShardState.count_one``): the bits the whole step gives it. One side (the state
        beside the parameters)."""
        side, step = self.sides[0], self.state.count_one(run.index)
        if grad.numel():
            side.step_run(run.at, grad, step, self._args(side, group))

    def update(self, plan: dict) -> None:
        """The fused kernel over this rank's whole shard (one process: every segment)."""
        self._step(range(len(self.segments)), plan)

    def update_bucket(self, k: int, plan: dict) -> None:
        """The fused kernel over this rank's shard of bucket ``k``."""
        self._step((k,), plan)

    def _step(self, ks, plan: dict) -> None:
        """Each side steps its pieces of segments ``ks`` (the offloaded side's gradients
        queued to the host before the device side's kernels, so that the two step at
        once), then the home is told they are done."""
        ks = [k for k in ks if self.segments[k][1] > self.segments[k][0]]
        held = [[j for k in ks for j in side.place.of_segment.get(k, ())] for side in self.sides]
        for side, js in zip(self.sides, held):
            side.place.fetch(js)  # offloaded: every piece's gradients on their way to the host
        for side, js, (args, runs) in zip(self.sides, held, plan["sides"]):
            side.step(js, args, runs)
        for k in ks:
            self.home.finished(k)

    def averaged_grads(self) -> list:
        """This rank's averaged shard of each bucket, in order (zeros where none was
        averaged since the last step; none for the engine's parameters)."""
        return [b.averaged() for b in self.buckets]

    def gather_bucket(self, k: int) -> None:
        """Start gathering every rank's updated shard of bucket ``k`` (the engine gathers
        its own)."""
        self.home.gather(k)

    def nbytes(self) -> dict:
        home = self.home.nbytes()
        state = self.state.nbytes()
        scratch = sum(side.scratch_bytes() for side in self.sides)
        # Offloaded: the state, the scratch, the parameters' mirror and the gradients'
        # staging of the offloaded side are host memory.
        host = sum(side.host_bytes() for side in self.sides)
        return {"params": home["params"], "grads": home["grads"], **state,
                "padding": home["padding"], "scratch": scratch, "host": host}


class Side:
    """One part of a shard's state (``ShardState``) over the pieces of the home's
    segments its ``place`` holds (``zero_triton.optim.offload``), and how it is stepped:
    its backend, launch, lr and scratch live where the state does. ``cut``: the state
    element of the whole shard where this part starts."""

    def __init__(self, shard: Shard, place, n: int, amsgrad: bool, cut: int = 0):
        self.shard, self.place, self.cut = shard, place, cut
        spec, home = shard.spec, shard.home
        rows = None
        if home.rows:  # each piece a whole local shard, stepped through its rows
            for p in place.pieces:
                lo, hi, _ = home.segments[p.k]
                if p.off or p.hi - p.lo != hi - lo:
                    raise AssertionError("a local shard stepped through its rows was split")
            rows = {p.s0: home.maps[p.k] for p in place.pieces}
        self.state = ShardState(place.parts(), [(p.lo, p.hi, p.s0) for p in place.pieces],
                                home.layout, master=shard.master_format, amsgrad=amsgrad,
                                moments=spec.moments, numel=n, rows=rows, mirror=place)
        if shard.dtype == torch.float64 or shard.device.type == "meta":
            # The kernels step float32 state: torch's ops step float64. Parameters on the
            # meta device are never stepped (step refuses them until they are materialised).
            self.backend = "torch"
        elif place.offloaded:
            self.backend = host_backend(spec.backend)
        else:
            self.backend = backends.resolve(spec.backend, shard.device)
        self.launch = home.launch(self.backend, self.state.moments.format, self.state.master.plain,
                                  spec.capture.buffers())
        self.lr = torch.zeros(1, dtype=self.state.dtype, device=self.state.device)
        self.scratch = torch.empty(n, dtype=self.state.dtype, device=self.state.device) \
            if self.backend == "torch" else None
        self.whole, self.whole_key = None, None  # each piece's operands (``_pieces``)

    def scalars(self, lr, grad_scale, found_inf, clip_coef) -> tuple:
        """The step's lr (into ``self.lr``), grad scale, inf flag and clip coefficient
        on this side's device."""
        if isinstance(lr, torch.Tensor):
            self.lr.copy_(lr)
        else:
            self.lr.fill_(lr)
        where = self.state.device
        early = where.type != "cpu"
        if found_inf is not None:
            found_inf = found_inf.to(where, torch.float32, non_blocking=early)
        if grad_scale is not None:
            grad_scale = grad_scale.to(where, torch.float32, non_blocking=early)
        if clip_coef is not None:
            clip_coef = clip_coef.to(where, non_blocking=early)
        return grad_scale, found_inf, clip_coef

    def step(self, js, args: StepArgs, runs) -> None:
        """Hand the launch the runs of pieces ``js`` that step: on the device one launch
        list for all; offloaded, piece by piece, each stepped once its gradients land and
        sent back before the next (for its all-gather; the engine's DTensors gather
        themselves: one list for all)."""
        place, home, keyed = self.place, self.shard.home, self.shard.keyed
        whole = self._pieces(args.amsgrad)
        for batch in ([[j] for j in js] if place.offloaded and home.gathers else [js]):
            launches = []
            for j in batch:
                piece = place.pieces[j]
                grad = place.grad(j)
                index = home.canonical(piece.k) + piece.off if keyed else 0
                if runs is None:
                    launches.append((whole[j]._replace(grad=grad), index, piece.k))
                    continue
                for start, end, i in runs[j]:
                    a, b = start - piece.lo, end - piece.lo
                    ops = self._operands(j, a, b, grad[a:b], self.state.step_of(i), args.amsgrad)
                    launches.append((ops, index + a if keyed else 0, piece.k))
            self.launch.run(launches, args)
            place.done(batch)

    def step_run(self, at: int, grad, step, args: StepArgs) -> None:
        """Step the state's elements [at, at + grad.numel()), which lie in one piece, with
        ``grad`` and the count ``step``."""
        j = next(j for j, (lo, hi, s0) in enumerate(self.state.segments) if s0 <= at < s0 + hi - lo)
        piece, a = self.place.pieces[j], at - self.state.segments[j][2]
        index = self.shard.home.canonical(piece.k) + piece.off + a if self.shard.keyed else 0
        ops = self._operands(j, a, a + grad.numel(), grad, step, args.amsgrad)
        self.launch.run([(ops, index, piece.k)], args)

    def _operands(self, j: int, a: int, b: int, grad, step, amsgrad: bool) -> Operands:
        """The operands of elements [a, b) of piece ``j``."""
        st, s0 = self.state, self.state.segments[j][2]
        param, param_lp, remainder = st.master.operands(s0 + a, s0 + b, st.param_parts[j][a:b])
        scratch = None if self.scratch is None else self.scratch[s0 + a:s0 + b]
        return Operands(param, grad, st.moments.operands(s0 + a, s0 + b, amsgrad), param_lp, step,
                        self.lr, remainder, scratch)

    def _pieces(self, amsgrad: bool) -> list:
        """Per piece, its whole operands but the gradient (None), made again only when a
        parameter's view or a state buffer is replaced (amsgrad switched on, a re-home, a
        swap by the engine, per-parameter step counts) or amsgrad changes."""
        st = self.state
        key = (st.master, st.moments, st.amsgrad, amsgrad, st.steps)
        if self.whole_key is None or any(a is not b for a, b in zip(key, self.whole_key)):
            self.whole = [self._operands(j, 0, hi - lo, None, st.step, amsgrad)
                          for j, (lo, hi, _) in enumerate(st.segments)]
            self.whole_key = key
        return self.whole

    def scratch_bytes(self) -> int:
        return 0 if self.scratch is None else self.scratch.numel() * self.scratch.element_size()

    def host_bytes(self) -> int:
        """Bytes this side keeps in host memory for an offloaded state: the state, its
        scratch, the parameters' mirror and the gradients' staging."""
        if not self.place.offloaded:
            return 0
        return sum(self.state.nbytes().values()) + self.scratch_bytes() + self.place.host_bytes()


def written_values(part: torch.Tensor, master: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The one rule of what a written parameter's master starts from: ``part`` (a
    parameter's elements as they are now) with every element that still holds what our
    own gather wrote from ``master`` (``Comm.gathered``: the master's rounding, quantized
    under compressed gathers) put back to the master's plain rounding, so that only the
    user's writes differ from the master (``Master.reseed``/``rebase`` keep the master's
    extra precision where they equal its rounding)."""
    rounded = master.to(part.dtype)
    ours = comm.gathered(rounded)
    return part if ours is rounded else torch.where(part == ours, rounded, part)

