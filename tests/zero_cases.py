"""What tests/test_zero.py's ranks run and how the parent checks it: the cases
(world size, dtype, shapes, options), the batch of jobs one spawned group runs per world
size (trajectories, clipping, GradScaler skips, a profiler trace, the memory report),
every rank's gradients rebuilt in the parent, the exact references and the comparisons
(bitwise, ulps, the bound of summing N floats)."""
from __future__ import annotations

import dataclasses
import io
import traceback

import pytest
import torch

from dist_utils import run_ranks
from zero_triton import FusedAdam, FusedAdamW, ZeroAdam, ZeroAdamW, ZeroGradScaler
from zero_triton.native import backends
from zero_triton.state.flat import ALIGN, FlatLayout
from zero_triton.reference import rne_cast


LR = 1e-2
STEPS = 10
UNEVEN = ((1,), (7,), (13, 5), (37,))   # 1 element, < one block, a matrix across shards, a prime
ONE = ((1,),)                            # fewer elements than ranks
RANK_TIMEOUT_S = 240                     # one spawned batch; a hang fails instead of waiting


# -- what the ranks run -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    """One ZeroAdam run.

    Against FusedAdam fed the same averaged gradient every rank's parameters, master,
    exp_avg and exp_avg_sq must be bitwise equal. Tolerances: ``mean_ulp``, how far the
    averaged gradient may sit from the exact mean rounded once (None: the classic bound
    for summing N values in the reduce dtype, see ``_mean_bound``); ``torch_tol``
    (rtol, atol) for master/m/v against torch.optim.Adam/AdamW in fp32."""

    name: str
    world_size: int
    dtype: torch.dtype
    backend: str = "torch"
    shapes: tuple = UNEVEN
    grads: str = "exact"        # "exact": k/256, |k| <= 16, the mean is exact; "randn"
    adamw: bool = False
    weight_decay: float = 0.0
    reduce_dtype: torch.dtype | None = None
    mean_ulp: int | None = 0
    torch_tol: tuple = (1e-5, 1e-6)
    norm_rtol: float = 1e-6     # clip_grad_norm_'s total norm vs torch's
    steps: int = STEPS
    # clipping: max_norm per step, cycled
    max_norms: tuple = ()
    # GradScaler skip: "scaler" (ZeroGradScaler), "torch_scaler" (plain torch.amp.GradScaler)
    # or "manual" (opt.grad_scale / found_inf)
    amp: str = ""
    inf_rank: int = 0
    inf_step: int = 0


def _init_params(shapes, dtype):
    gen = torch.Generator().manual_seed(1234)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def _rank_grads(case: Case, rank: int, step: int):
    gen = torch.Generator().manual_seed(step * 100 + rank)
    out = []
    for s in case.shapes:
        if case.grads == "exact":  # small multiples of 2^-8: sums and means by 2, 4 are exact
            g = torch.randint(-16, 17, s, generator=gen).float() * 2.0 ** -8
        else:
            g = torch.randn(s, generator=gen) * (10.0 if case.max_norms else 1.0)
        out.append(g.to(case.dtype))
    return out


def mean_grads(case: Case, step: int, dtype: torch.dtype):
    """The mean over ranks, computed in float64 and rounded once to ``dtype``."""
    per_rank = [_rank_grads(case, r, step) for r in range(case.world_size)]
    return [(sum(g[i].double() for g in per_rank) / case.world_size).to(dtype)
            for i in range(len(case.shapes))]


def _make_zero(case: Case, params):
    cls = ZeroAdamW if case.adamw else ZeroAdam
    return cls(params, lr=LR, weight_decay=case.weight_decay, backend=case.backend,
               reduce_dtype=case.reduce_dtype)


def _record_averages(opt) -> dict:
    """{bucket index: a copy of this rank's averaged shard of it}, taken as each step's
    kernel lets it go (the step keeps no averages between steps)."""
    seen = {}
    for b in opt._shards.groups[0][0].buckets:
        def release(b=b, release=b.release):
            seen[b.key[1]] = b.averaged().clone()
            release()
        b.release = release
    return seen


def _snapshot(opt, averages=None):
    flat = opt._shards.groups[0][0]
    out = {"params": [p.detach().clone() for p in flat.params],
           "flat_param": flat.flat_param.clone(),
           "master": flat.state.master.checkpointed().detach().clone(),
           **{k: v.clone() for k, v in flat.state.moments.export().items()},
           "step": float(flat.state.step)}
    if averages is not None:
        out["grad_shard"] = torch.cat([averages[k] for k in sorted(averages)])
    return out


def _describe_flat(opt):
    flat = opt._shards.groups[0][0]
    return {"padded_numel": flat.layout.padded_numel, "shard_numel": flat.layout.shard_numel,
            "segments": flat.segments,
            "sizes": {k: t.numel() for k, t in {"master": flat.state.master.checkpointed(), **flat.state.moments.export()}.items()
                      if k in ("master", "exp_avg", "exp_avg_sq")}}


def _job_trajectory(rank, world_size, case: Case):
    params = _init_params(case.shapes, case.dtype)
    opt = _make_zero(case, params)
    averages = _record_averages(opt)
    out = {**_describe_flat(opt), "steps": [], "norms": []}
    for t in range(1, case.steps + 1):
        opt.zero_grad()
        for p, g in zip(params, _rank_grads(case, rank, t)):
            p.grad = g.to(p.dtype).clone()
        if case.max_norms:
            max_norm = case.max_norms[(t - 1) % len(case.max_norms)]
            out["norms"].append(opt.clip_grad_norm_(max_norm))
        opt.step()
        out["steps"].append(_snapshot(opt, averages))
    return out


def _job_inf_step(rank, world_size, case: Case):
    """Steps with a GradScaler-style scale; at ``inf_step`` only ``inf_rank`` sees an inf."""
    params = _init_params(case.shapes, case.dtype)
    opt = _make_zero(case, params)
    scaler = None
    if case.amp == "scaler":
        scaler = ZeroGradScaler("cpu", process_group=None, init_scale=2.0 ** 8, growth_interval=1000)
    elif case.amp == "torch_scaler":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1000)
    out = []
    for t in range(1, case.steps + 1):
        opt.zero_grad()
        scale = 2.0 ** 8
        if scaler is not None:
            scaler.scale(torch.ones(()))  # as scaler.scale(loss).backward() would
            scale = scaler.get_scale()
        for p, g in zip(params, _rank_grads(case, rank, t)):
            p.grad = (g * scale).to(p.dtype)  # a power of two: scaling and unscaling are exact
        if rank == case.inf_rank and t == case.inf_step:
            params[-1].grad.view(-1)[3] = float("inf")
        before = _snapshot(opt)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            scale_after = scaler.get_scale()
        else:  # what torch.amp.GradScaler attaches, each rank looking at its own grads
            local_inf = any(not torch.isfinite(p.grad).all() for p in params)
            opt.grad_scale = torch.full((1,), scale)
            opt.found_inf = torch.full((1,), float(local_inf))
            opt.step()
            scale_after = scale
        out.append({"before": before, "after": _snapshot(opt), "scale": scale_after})
    return out


def _job_profile(rank, world_size, case: Case):
    params = _init_params(case.shapes, case.dtype)
    opt = _make_zero(case, params)
    for p, g in zip(params, _rank_grads(case, rank, 1)):
        p.grad = g.to(p.dtype).clone()
    opt.step()  # warm-up outside the trace
    for p, g in zip(params, _rank_grads(case, rank, 2)):
        p.grad = g.to(p.dtype).clone()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    return [(e.name, e.time_range.start) for e in prof.events() if e.name.startswith("zero_triton.")]


def _job_memory(rank, world_size, case: Case):
    params = _init_params(case.shapes, case.dtype)
    opt = _make_zero(case, params)
    built = opt.memory_report()
    for p, g in zip(params, _rank_grads(case, rank, 1)):
        p.grad = g.to(p.dtype).clone()
    opt.clip_grad_norm_(1.0)  # averages the gradients: the step's kernel reads them next
    averaged = opt.memory_report()
    opt.step()
    return {**_describe_flat(opt), "built": built, "averaged": averaged,
            "stepped": opt.memory_report(), "element_size": params[0].element_size()}


_JOBS = {"trajectory": _job_trajectory, "inf_step": _job_inf_step, "profile": _job_profile,
         "memory": _job_memory}


def _rank_batch(rank, world_size, jobs):
    """Run every (kind, case) job; a job that raises reports its traceback instead.

    Returns torch.save bytes: tensors sent through torch.multiprocessing's queue live in
    shared memory that the parent can no longer open once this process has exited."""
    results = {}
    for kind, case in jobs:
        try:
            results[(kind, case.name)] = _JOBS[kind](rank, world_size, case)
        except Exception:
            results[(kind, case.name)] = "error: " + traceback.format_exc()
    buf = io.BytesIO()
    torch.save(results, buf)
    return buf.getvalue()


# -- the cases --------------------------------------------------------------------------

F32, BF16 = torch.float32, torch.bfloat16
BOUND = None   # mean_ulp: no exact mean to hit (N = 3, or randn grads), the summation bound

TRAJECTORIES = [
    Case("ws1-f32", 1, F32),
    Case("ws1-bf16", 1, BF16),
    Case("ws2-f32", 2, F32),
    Case("ws2-bf16", 2, BF16),
    Case("ws2-f32-adamw", 2, F32, adamw=True, weight_decay=0.1),
    Case("ws2-f32-randn", 2, F32, grads="randn"),
    Case("ws3-f32", 3, F32),     # exact sums, one rounding of the division by 3
    Case("ws3-f32-randn", 3, F32, grads="randn", mean_ulp=BOUND),
    Case("ws3-bf16-randn", 3, BF16, grads="randn", mean_ulp=BOUND),
    Case("ws3-f32-l2", 3, F32, grads="randn", weight_decay=0.1, mean_ulp=BOUND),
    Case("ws4-f32", 4, F32),
    Case("ws4-bf16", 4, BF16),
    Case("ws4-f32-one-element", 4, F32, shapes=ONE),
    Case("ws4-bf16-one-element", 4, BF16, shapes=ONE),
    Case("ws3-bf16-one-element", 3, BF16, shapes=ONE, grads="randn", mean_ulp=BOUND),
    # Triton under the interpreter: ~1 ms per program instance, one instance per shard here.
    Case("ws2-f32-triton", 2, F32, backend="triton"),
    Case("ws3-bf16-triton", 3, BF16, backend="triton", grads="randn", mean_ulp=BOUND),
    Case("ws4-f32-cpu", 4, F32, backend="cpu"),
    Case("ws3-bf16-cpu", 3, BF16, backend="cpu", grads="randn", mean_ulp=BOUND),
    # bf16 parameters and gradients, averaged in fp32
    Case("ws2-bf16-reduce-f32", 2, BF16, grads="randn", reduce_dtype=F32),
    Case("ws3-bf16-reduce-f32", 3, BF16, grads="randn", reduce_dtype=F32, mean_ulp=BOUND),
]

CLIPS = [
    Case("ws2-clip", 2, F32, grads="randn", max_norms=(1.0, 1e4)),
    Case("ws3-clip", 3, F32, grads="randn", max_norms=(0.5, 1e4, 3.0), mean_ulp=BOUND),
    Case("ws4-clip-bf16", 4, BF16, grads="randn", max_norms=(1.0, 1e4), mean_ulp=BOUND),
]

INF_STEPS = [
    Case("ws4-scaler", 4, F32, amp="scaler", inf_rank=2, inf_step=3, steps=5),
    Case("ws4-manual", 4, F32, amp="manual", inf_rank=1, inf_step=2, steps=4),
    Case("ws2-scaler-bf16", 2, BF16, amp="scaler", inf_rank=1, inf_step=1, steps=3),
    # A plain torch.amp.GradScaler: the ranks agree on the skip and keep one scale.
    Case("ws2-torch-scaler", 2, F32, amp="torch_scaler", inf_rank=1, inf_step=1, steps=4),
    Case("ws4-torch-scaler", 4, F32, amp="torch_scaler", inf_rank=3, inf_step=2, steps=4),
]

PROFILES = [Case("ws2-profile", 2, F32)]

MEMORY = [Case(f"ws{n}-{name}-memory", n, dtype) for n in (1, 2, 3, 4)
          for name, dtype in (("f32", F32), ("bf16", BF16))]


def _unavailable(backend: str) -> str | None:
    try:
        return backends.why_not(backend, torch.device("cpu"))
    except Exception as exc:  # a broken native build is a reason to skip, said as such
        return f"{type(exc).__name__}: {exc}"


def skip_unavailable(case: Case):
    reason = _unavailable(case.backend)
    if reason is not None:
        pytest.skip(f"backend {case.backend!r} is unusable here: {reason}")


_BATCHES: dict = {}


def _batch(world_size: int) -> dict:
    """Every job of one world size, run in one spawned gloo group (cached per session)."""
    if world_size not in _BATCHES:
        jobs = [("trajectory", c) for c in TRAJECTORIES + CLIPS]
        jobs += [("inf_step", c) for c in INF_STEPS]
        jobs += [("profile", c) for c in PROFILES]
        jobs += [("memory", c) for c in MEMORY]
        jobs = [(k, c) for k, c in jobs
                if c.world_size == world_size and _unavailable(c.backend) is None]
        try:
            per_rank = [torch.load(io.BytesIO(b), weights_only=False)
                        for b in run_ranks(_rank_batch, world_size, jobs, timeout=RANK_TIMEOUT_S)]
            _BATCHES[world_size] = {key: [r[key] for r in per_rank] for key in per_rank[0]}
        except Exception as exc:  # remembered: the other tests of this size fail fast
            _BATCHES[world_size] = exc
    got = _BATCHES[world_size]
    if isinstance(got, Exception):
        raise got
    return got


def batch_results(kind: str, case: Case) -> list:
    per_rank = _batch(case.world_size)[(kind, case.name)]
    for rank, r in enumerate(per_rank):
        if isinstance(r, str) and r.startswith("error: "):
            pytest.fail(f"rank {rank} raised in {kind} job {case.name}:\n{r[7:]}")
    return per_rank


# -- comparisons ------------------------------------------------------------------------

def _ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """Float bits as integers in the floats' order (adjacent floats differ by 1)."""
    if x.dtype == torch.float32:
        bits, sign = x.view(torch.int32).long(), 0x7FFFFFFF
    elif x.dtype == torch.bfloat16:
        bits, sign = x.view(torch.int16).long(), 0x7FFF
    else:
        raise TypeError(f"no ulp distance for {x.dtype}")
    return torch.where(bits < 0, -(bits & sign), bits)


def _first(mask: torch.Tensor, *tensors) -> str:
    idx = int(mask.reshape(-1).nonzero()[0])
    vals = ", ".join(f"{float(t.reshape(-1)[idx])!r}" for t in tensors)
    return f"{int(mask.sum())} of {mask.numel()} elements; first at flat index {idx}: {vals}"


def assert_ulps(actual, expected, max_ulp: int, where: str):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, \
        f"{where}: {actual.dtype}{tuple(actual.shape)} vs {expected.dtype}{tuple(expected.shape)}"
    ulps = (_ordered_bits(actual) - _ordered_bits(expected)).abs()
    bad = ulps > max_ulp
    if bad.any():
        idx = int(bad.reshape(-1).nonzero()[0])
        pytest.fail(f"{where}: more than {max_ulp} ulp apart at {_first(bad, actual, expected)} "
                    f"(actual, expected; {int(ulps.reshape(-1)[idx])} ulp)")


def assert_close(actual, expected, rtol: float, atol: float, where: str):
    actual, expected = actual.double(), expected.double()
    bad = (actual - expected).abs() > atol + rtol * expected.abs()
    if bad.any():
        pytest.fail(f"{where}: off by more than rtol={rtol}, atol={atol} at "
                    f"{_first(bad, actual, expected)} (actual, expected)")


def _padding_mask(layout: FlatLayout) -> torch.Tensor:
    mask = torch.ones(layout.padded_numel, dtype=torch.bool)
    for o, s in zip(layout.offsets, layout.shapes):
        mask[o:o + _numel(s)] = False
    return mask


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def as_flat(tensors, layout: FlatLayout, dtype) -> torch.Tensor:
    """``tensors`` laid out as ``layout`` says, zeros in the padding."""
    out = torch.zeros(layout.padded_numel, dtype=dtype)
    for view, t in zip(layout.views(out), tensors):
        view.copy_(t.detach())
    return out


def _padded(t: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.zeros(n, dtype=t.dtype)
    out[:t.numel()] = t.detach()
    return out


class References:
    """FusedAdam (same backend) and torch.optim.Adam/AdamW, fed one averaged gradient."""

    def __init__(self, case: Case):
        self.case = case
        # With reduce_dtype=fp32 the average is fp32: FusedAdam on fp32 parameters starting
        # from the bf16 values is what the bf16 master must follow.
        self.grad_dtype = case.reduce_dtype or case.dtype
        self.fused_params = [p.detach().to(self.grad_dtype).requires_grad_()
                             for p in _init_params(case.shapes, case.dtype)]
        cls = FusedAdamW if case.adamw else FusedAdam
        self.fused = cls(self.fused_params, lr=LR, weight_decay=case.weight_decay,
                         backend=case.backend)
        self.torch_params = [p.detach().float().requires_grad_()
                             for p in _init_params(case.shapes, case.dtype)]
        tcls = torch.optim.AdamW if case.adamw else torch.optim.Adam
        self.torch = tcls(self.torch_params, lr=LR, weight_decay=case.weight_decay)
        self.layout = FlatLayout.build(case.shapes, case.world_size)

    def gathered_average(self, results: list, t: int) -> list:
        """The averaged gradient ZeroAdam computed at step t: the ranks' shards joined."""
        flat = torch.cat([r["steps"][t - 1]["grad_shard"] for r in results])
        return [v.clone() for v in self.layout.views(flat)]

    def step(self, average: list, max_norm: float | None = None):
        """One step of both on ``average`` (per parameter); returns torch's total norm."""
        self.fused.zero_grad()
        for p, g in zip(self.fused_params, average):
            p.grad = g.to(p.dtype).clone()
        if max_norm is not None:
            self.fused.clip_grad_norm_(max_norm)
        self.fused.step()
        for p, g in zip(self.torch_params, average):
            p.grad = g.float()
        total = None
        if max_norm is not None:
            total = torch.nn.utils.clip_grad_norm_(self.torch_params, max_norm)
        self.torch.step()
        return total

    def fused_state(self, key: str) -> torch.Tensor:
        """FusedAdam's flat master/m/v padded to the ZeRO layout's length."""
        state = self.fused._shards.groups[0][0].state
        t = state.master.checkpointed() if key == "master" else state.moments.export()[key]
        return _padded(t, self.layout.padded_numel)

    def torch_state(self, key: str) -> torch.Tensor:
        if key == "master":
            return as_flat(self.torch_params, self.layout, torch.float32)
        return as_flat([self.torch.state[p][key] for p in self.torch_params], self.layout, torch.float32)


_UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}


def _mean_bound(per_rank: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """How far a float average of ``per_rank`` (N x n, float64) may sit from the exact
    mean: N-1 rounded additions in ``dtype`` in any order, |error| <= (N-1) u sum|g|
    (Higham, Accuracy and Stability, 4.2), divided by N, plus one rounding of the
    quotient (or of a multiplication by 1/N and of 1/N itself: 2u)."""
    n = per_rank.shape[0]
    u = _UNIT_ROUNDOFF[dtype]
    exact = per_rank.mean(0)
    return (n - 1) * u * per_rank.abs().sum(0) / n + 2 * u * exact.abs()


def check_average(case: Case, ref: References, average: list, t: int):
    """ZeroAdam's averaged gradient against the exact mean of the ranks' gradients."""
    dtype = ref.grad_dtype
    per_rank = [_rank_grads(case, r, t) for r in range(case.world_size)]
    for i, got in enumerate(average):
        where = f"step {t}: averaged gradient of parameter {i} {tuple(got.shape)}"
        assert got.dtype == dtype, f"{where} is {got.dtype}, expected {dtype}"
        stacked = torch.stack([g[i].double().reshape(-1) for g in per_rank])
        exact = stacked.mean(0)
        got = got.reshape(-1)
        if case.mean_ulp is not None:
            assert_ulps(got, exact.to(dtype), case.mean_ulp, f"{where} vs the exact mean")
        else:
            bound = _mean_bound(stacked, dtype)
            bad = (got.double() - exact).abs() > bound
            if bad.any():
                pytest.fail(f"{where}: further from the exact mean than {case.world_size} summands "
                            f"in {dtype} allow at {_first(bad, got, exact, bound)} (got, exact, bound)")


def check_layout(case: Case, results: list):
    layout = FlatLayout.build(case.shapes, case.world_size)
    assert layout.padded_numel % (case.world_size * ALIGN) == 0
    for rank, r in enumerate(results):
        assert (r["padded_numel"], r["shard_numel"]) == (layout.padded_numel, layout.shard_numel), \
            f"rank {rank}: layout {r['padded_numel']}/{r['shard_numel']}, expected " \
            f"{layout.padded_numel}/{layout.shard_numel}"
        assert r["segments"] == layout.shard_segments(rank), f"rank {rank}: shard {r['segments']}"
        for key, n in r["sizes"].items():
            assert n == layout.shard_numel, \
                f"rank {rank}: {key} has {n} elements, the shard {layout.shard_numel}"
    return layout


def check_step(case: Case, ref: References, results: list, t: int):
    """Every rank after step t against FusedAdam (bitwise) and torch.optim (torch_tol)."""
    layout, pad = ref.layout, _padding_mask(ref.layout)
    full = {}
    for rank, r in enumerate(results):
        snap = r["steps"][t - 1]
        (lo, hi, _), = r["segments"]
        where = f"rank {rank}, step {t}"
        assert snap["step"] == t, f"{where}: step counter {snap['step']}"
        # The whole model on every rank, equal to FusedAdam's (rounded, with reduce_dtype).
        for i, (p, q) in enumerate(zip(snap["params"], ref.fused_params)):
            expected = q.detach() if q.dtype == case.dtype else rne_cast(q.detach(), case.dtype)
            assert_ulps(p, expected, 0, f"{where}: parameter {i} {tuple(p.shape)} vs FusedAdam")
        for key in ("master", "exp_avg", "exp_avg_sq"):
            mine = snap[key]
            assert_ulps(mine, ref.fused_state(key)[lo:hi], 0, f"{where}: {key} shard vs FusedAdam")
            leaked = pad[lo:hi] & (mine != 0)
            assert not leaked.any(), f"{where}: {key} is non-zero in the padding: {_first(leaked, mine)}"
            full.setdefault(key, []).append(mine)
        leaked = pad & (snap["flat_param"] != 0)
        assert not leaked.any(), \
            f"{where}: flat parameter padding is non-zero: {_first(leaked, snap['flat_param'])}"
        if snap["master"].dtype != case.dtype:  # the parameter is the master rounded to nearest even
            assert_ulps(snap["flat_param"][lo:hi], rne_cast(snap["master"], case.dtype), 0,
                        f"{where}: parameter shard vs its master rounded to nearest even")
    # The state of all ranks together against torch.optim.
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert_close(torch.cat(full[key]), ref.torch_state(key), *case.torch_tol,
                     f"step {t}: {key} (all shards) vs torch.optim.{type(ref.torch).__name__}")
