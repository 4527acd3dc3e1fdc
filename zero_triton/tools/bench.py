"""Step benchmark: one optimizer step of zero_triton against torch and a memory limit.

``python -m zero_triton bench ...`` and ``python bench/step.py ...`` both call
``main(argv)``; ``--help`` lists the options.

What is timed, per case, side by side in one process:

* every zero_triton backend usable on the device (``FusedAdam(..., backend=b).step()``);
* ``torch.optim.Adam`` with ``foreach=False``, ``foreach=True`` and ``fused=True``;
* for bf16 parameters, the torch composite a careful user writes: bf16 grads cast into
  a preallocated fp32 buffer, torch's fused Adam on the fp32 master, master copied
  back into the bf16 parameters;
* DeepSpeedCPUAdam / apex FusedAdam when importable;
* the limit: a plain memory kernel with the step's exact access pattern (read p, g,
  m, v; write p, m, v -- for bf16 + master: read g2, master4, m4, v4; write master4,
  m4, v4, p2), and on CUDA a device-to-device copy as well.

Providers run interleaved: every round times each provider once, in an order rotated
round by round, so that drifting memory bandwidth hits all of them alike; we report
the median and p20/p80 over rounds. Bytes are counted at 28 B/param for every case
(an fp32 step reads p, g, m, v and writes p, m, v), so GB/s compare across providers
even when a provider moves more bytes (the composite moves 40 B/param).

Before timing, a correctness guard steps each provider twice from identical data and
compares parameters (or fp32 master) and both moments with torch ``fused=True`` (the
composite for bf16) and with ``zero_triton.tools.reference`` on a slice: a provider that
disagrees gets an error row instead of a time.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import gc
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zero_triton.tools import outputs
from zero_triton.tools.machine import cache_bytes, cpu_model, git_commit
from zero_triton.tools.units import SUFFIXES, format_count, parse_count, positive_number, whole_number

BYTES_PER_PARAM = 28
LR = 1e-2           # large enough that a missing update shows in the guard (see _guard)
BETAS = (0.9, 0.999)
EPS = 1e-8
GUARD_STEPS = 2     # step 2 exercises the bias correction, step 1 cancels it
GUARD_RTOL = 1e-4   # max|a - b| / max|b| over params (or master), exp_avg, exp_avg_sq
GUARD_LP_RTOL = 1e-2  # bf16 params: a master on a rounding boundary may flip one ulp
REF_SLICE = 1 << 16   # elements of tensor 0 checked against the float64 reference
INTERPRET_MAX_NUMEL = 1 << 20  # the Triton interpreter is ~1000x slower than compiled

ALL_CASES = ("fp32", "gpt2", "many", "bf16")
PROVIDER_IDS = ("zt-cpu", "zt-cuda", "zt-triton", "zt-torch", "torch-loop", "torch-foreach",
                "torch-fused", "torch-composite", "ds-cpuadam", "apex-fused", "limit", "copy")
LEGEND = {
    "zt-<b>": "zero_triton FusedAdam, backend=<b>",
    "torch-loop": "torch.optim.Adam(foreach=False)",
    "torch-foreach": "torch.optim.Adam(foreach=True)",
    "torch-fused": "torch.optim.Adam(fused=True)",
    "torch-composite": "bf16 grads -> fp32 buffer, Adam(fused=True) on fp32 master, copy -> bf16",
    "ds-cpuadam": "deepspeed.ops.adam.DeepSpeedCPUAdam",
    "apex-fused": "apex.optimizers.FusedAdam",
    "limit": "plain memory kernel, the step's access pattern",
    "copy": "device-to-device copy_ (GB/s of its own read+write bytes)",
}


# -- sizes and cases ------------------------------------------------------------------

def parse_size(text: str) -> int:
    """'16Mi' -> 16 * 2**20, '16M' -> 16 * 10**6: a positive integer with an optional
    suffix (``zero_triton.tools.units``). Anything else raises argparse.ArgumentTypeError."""
    return parse_count(text, "64Mi")


def _size_list(text: str) -> list[int]:
    return [parse_size(s) for s in text.split(",")]


def _many(text: str) -> tuple[int, int]:
    count, x, size = text.lower().partition("x")
    if not x:
        raise argparse.ArgumentTypeError(f"{text!r} is not COUNTxSIZE; pass e.g. 8192x4096")
    return parse_size(count), parse_size(size)


_positive_float = positive_number("number", "0.25")


def format_size(n: int) -> str:
    return format_count(n)


def gpt2_small_shapes(scale: float = 1.0) -> list[tuple[int, ...]]:
    """The 148 parameter shapes of GPT-2 small (124,439,808 params at scale 1).

    ``scale`` shrinks the element count about ``scale``-fold by multiplying the big
    dimensions (vocabulary, context, width) by sqrt(scale); the number of tensors and
    the layer structure stay."""
    r = math.sqrt(scale)
    vocab, ctx, d = (max(1, round(x * r)) for x in (50257, 1024, 768))
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(12):
        shapes += [(d,), (d,),                  # ln_1 weight, bias
                   (d, 3 * d), (3 * d,),        # attn.c_attn
                   (d, d), (d,),                # attn.c_proj
                   (d,), (d,),                  # ln_2
                   (d, 4 * d), (4 * d,),        # mlp.c_fc
                   (4 * d, d), (d,)]            # mlp.c_proj
    shapes += [(d,), (d,)]                      # ln_f
    return shapes


@dataclass
class Case:
    name: str
    shapes: list
    dtype: torch.dtype          # parameter and gradient dtype; bf16 keeps an fp32 master

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    @property
    def mixed(self) -> bool:
        return self.dtype != torch.float32

    @property
    def baseline(self) -> str:
        return "torch-composite" if self.mixed else "torch-fused"


def build_cases(args) -> list[Case]:
    cases = []
    for kind in args.cases:
        if kind == "fp32":
            cases += [Case(f"fp32 {format_size(n)}", [(n,)], torch.float32) for n in args.sizes]
        elif kind == "gpt2":
            shapes = gpt2_small_shapes(args.scale)
            inverse = 1 / args.scale
            label = ("gpt2-small" if args.scale == 1 else f"gpt2-small x1/{inverse:.0f}"
                     if abs(inverse - round(inverse)) < 1e-9 else f"gpt2-small x{args.scale:.3g}")
            cases.append(Case(label, shapes, torch.float32))
        elif kind == "many":
            count, size = args.many
            cases.append(Case(f"{count}x{size}", [(size,)] * count, torch.float32))
        elif kind == "bf16":
            cases += [Case(f"bf16+master {format_size(n)}", [(n,)], torch.bfloat16)
                      for n in args.bf16_sizes]
    return cases


# -- the limit kernels ----------------------------------------------------------------

_CPU_LIMIT_SRC = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>

// The step's memory traffic with as little arithmetic as keeps the values bounded
// (no inf, no denormals after thousands of calls): read p, g, m, v; write p, m, v.
void stream_fp32(at::Tensor p, at::Tensor g, at::Tensor m, at::Tensor v) {
  float* __restrict__ P = p.data_ptr<float>();
  const float* __restrict__ G = g.data_ptr<float>();
  float* __restrict__ M = m.data_ptr<float>();
  float* __restrict__ V = v.data_ptr<float>();
  at::parallel_for(0, p.numel(), 1 << 16, [&](int64_t b, int64_t e) {
    #pragma omp simd
    for (int64_t i = b; i < e; ++i) {
      const float gi = G[i];
      const float mi = 0.9f * M[i] + 0.1f * gi;
      V[i] = 0.999f * V[i] + 0.001f * gi * gi;
      M[i] = mi;
      P[i] = P[i] - 1e-3f * mi;
    }
  });
}

// bf16 + fp32 master: read g2, master4, m4, v4; write master4, m4, v4, p2. The
// pointers are parameters of a noinline function so that gcc keeps __restrict__
// (it drops it on lambda captures) and vectorises the mixed 2/4-byte loop.
__attribute__((noinline)) void bf16_range(uint16_t* __restrict__ P, const uint16_t* __restrict__ G,
                                          float* __restrict__ W, float* __restrict__ M,
                                          float* __restrict__ V, int64_t b, int64_t e) {
  for (int64_t i = b; i < e; ++i) {
    uint32_t gb = uint32_t(G[i]) << 16;
    float gi; std::memcpy(&gi, &gb, 4);
    const float mi = 0.9f * M[i] + 0.1f * gi;
    V[i] = 0.999f * V[i] + 0.001f * gi * gi;
    M[i] = mi;
    const float wi = W[i] - 1e-3f * mi;
    W[i] = wi;
    uint32_t wb; std::memcpy(&wb, &wi, 4);
    P[i] = uint16_t(wb >> 16);  // truncation: the limit needs the bytes, not RNE
  }
}

void stream_bf16(at::Tensor p, at::Tensor g, at::Tensor master, at::Tensor m, at::Tensor v) {
  uint16_t* P = reinterpret_cast<uint16_t*>(p.data_ptr<at::BFloat16>());
  const uint16_t* G = reinterpret_cast<const uint16_t*>(g.data_ptr<at::BFloat16>());
  float* W = master.data_ptr<float>();
  float* M = m.data_ptr<float>();
  float* V = v.data_ptr<float>();
  at::parallel_for(0, p.numel(), 1 << 16, [&](int64_t b, int64_t e) { bf16_range(P, G, W, M, V, b, e); });
}
"""


def _load_cpu_limit():
    """(module, description) of the compiled limit kernels, or (None, why not)."""
    try:
        from torch.utils.cpp_extension import load_inline
        mod = load_inline(
            name="zero_triton_bench_limit", cpp_sources=[_CPU_LIMIT_SRC],
            functions=["stream_fp32", "stream_bf16"],
            # -march=native is right here, unlike in anything shipped: this is compiled
            # on, and only ever run on, the machine being measured, and a limit built
            # for a lesser ISA than the step's run-time-dispatched kernel would not be
            # one (SSE2 packs the bf16 stores slowly enough to lose ~1/3 of bandwidth).
            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
            verbose=False)
        return mod, ("C++ loop, at::parallel_for over torch's threads, -O3 -march=native "
                     "-fopenmp (load_inline)")
    except Exception as exc:  # no compiler, no headers: say so and approximate
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


try:  # the limit kernel for CUDA runs; CPU runs never launch it
    import triton
    import triton.language as tl
except ImportError:  # triton is Linux-only
    triton = None

if triton is not None:
    @triton.jit
    def _stream_fp32_kernel(p_ptr, g_ptr, m_ptr, v_ptr, n, BLOCK: tl.constexpr):
        # fp32 step's traffic: read p, g, m, v; write p, m, v (28 B/param).
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask)
        m = 0.9 * tl.load(m_ptr + offs, mask=mask) + 0.1 * g
        v = 0.999 * tl.load(v_ptr + offs, mask=mask) + 0.001 * g * g
        p = tl.load(p_ptr + offs, mask=mask) - 1e-3 * m
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        tl.store(p_ptr + offs, p, mask=mask)

    @triton.jit
    def _stream_bf16_kernel(p_ptr, g_ptr, w_ptr, m_ptr, v_ptr, n, BLOCK: tl.constexpr):
        # bf16 + master traffic: read g2, w4, m4, v4; write w4, m4, v4, p2 (28 B/param).
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
        m = 0.9 * tl.load(m_ptr + offs, mask=mask) + 0.1 * g
        v = 0.999 * tl.load(v_ptr + offs, mask=mask) + 0.001 * g * g
        w = tl.load(w_ptr + offs, mask=mask) - 1e-3 * m
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        tl.store(w_ptr + offs, w, mask=mask)
        tl.store(p_ptr + offs, w.to(tl.bfloat16), mask=mask)


# -- providers --------------------------------------------------------------------------

@dataclass
class Provider:
    """One thing timed: ``fns[k]`` steps buffer set k (sets rotate to defeat caches).
    ``state(k)`` returns {"p": [...], "m": [...], "v": [...], "lp": [...]} tensors of
    set k for the guard (empty for the limit and the copy)."""
    id: str
    fns: list = field(default_factory=list)
    states: list = field(default_factory=list)
    bytes_per_call: int | None = None   # None: BYTES_PER_PARAM * numel
    note: str = ""

    def state(self, k):
        return self.states[k]() if self.states else None


def _torch_state(opt, params):
    return {"p": list(params), "m": [opt.state[p]["exp_avg"] for p in params],
            "v": [opt.state[p]["exp_avg_sq"] for p in params]}


def _params_with_grads(p0s, g0s):
    """Fresh copies of the parameters whose .grad is the shared, read-only gradient
    (FusedAdam copies it into its flat grad buffer; no step writes grads)."""
    params = [p.clone().requires_grad_() for p in p0s]
    for p, g in zip(params, g0s):
        p.grad = g
    return params


def _make_zt(backend, p0s, g0s, case):
    from zero_triton import FusedAdam
    params = _params_with_grads(p0s, g0s)
    opt = FusedAdam(params, lr=LR, betas=BETAS, eps=EPS, backend=backend)

    def state():
        if case.mixed:
            return {"p": [opt.state[p]["master_param"] for p in params],
                    "m": [opt.state[p]["exp_avg"] for p in params],
                    "v": [opt.state[p]["exp_avg_sq"] for p in params], "lp": params}
        return _torch_state(opt, params)
    return opt.step, state


def _make_torch(kind, p0s, g0s, case):
    params = _params_with_grads(p0s, g0s)
    flags = {"torch-loop": dict(foreach=False), "torch-foreach": dict(foreach=True),
             "torch-fused": dict(fused=True)}[kind]
    opt = torch.optim.Adam(params, lr=LR, betas=BETAS, eps=EPS, **flags)
    return opt.step, lambda: _torch_state(opt, params)


def _make_composite(p0s, g0s, case):
    """What a careful user writes for bf16 params with an fp32 master in plain torch:
    every buffer preallocated, one foreach copy in, torch's fused step, one out."""
    params = [p.clone() for p in p0s]
    grads = list(g0s)
    master = [p.float().requires_grad_() for p in params]
    for w in master:
        w.grad = torch.zeros_like(w)
    master_grads = [w.grad for w in master]
    opt = torch.optim.Adam(master, lr=LR, betas=BETAS, eps=EPS, fused=True)

    def step():
        torch._foreach_copy_(master_grads, grads)
        opt.step()
        torch._foreach_copy_(params, master)

    def state():
        return {**_torch_state(opt, master), "lp": params}
    return step, state


def _make_deepspeed(p0s, g0s, case):
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    params = _params_with_grads(p0s, g0s)
    opt = DeepSpeedCPUAdam(params, lr=LR, betas=BETAS, eps=EPS, adamw_mode=False)
    return opt.step, lambda: _torch_state(opt, params)


def _make_apex(p0s, g0s, case):
    from apex.optimizers import FusedAdam as ApexFusedAdam
    params = _params_with_grads(p0s, g0s)
    opt = ApexFusedAdam(params, lr=LR, betas=BETAS, eps=EPS, adam_w_mode=False)
    return opt.step, lambda: _torch_state(opt, params)


def _make_limit(flat_p0, flat_g0, case, device, cpu_limit):
    """A flat buffer of the case's size with the step's access pattern, and a note."""
    n = flat_p0.numel()
    f32 = dict(dtype=torch.float32, device=device)
    m, v = torch.zeros(n, **f32), torch.full((n,), 1e-4, **f32)
    if case.mixed:
        p, g, w = flat_p0.clone(), flat_g0, flat_p0.float()
    else:
        p, g, w = flat_p0.clone(), flat_g0, None
    if device.type == "cuda":
        if triton is None:
            raise RuntimeError("the CUDA limit kernel needs triton (pip install triton)")
        k32, k16 = _stream_fp32_kernel, _stream_bf16_kernel
        block, warps = 2048, 8   # a plain streaming configuration, not the step's tuning
        grid = (triton.cdiv(n, block),)
        if case.mixed:
            return (lambda: k16[grid](p, g, w, m, v, n, BLOCK=block, num_warps=warps)), "Triton kernel"
        return (lambda: k32[grid](p, g, m, v, n, BLOCK=block, num_warps=warps)), "Triton kernel"
    mod, how = cpu_limit
    if mod is not None:
        if case.mixed:
            return (lambda: mod.stream_bf16(p, g, w, m, v)), how
        return (lambda: mod.stream_fp32(p, g, m, v)), how
    # No compiler: torch ops. add_ re-reads g for each target, so this moves
    # 36 B/param (fp32) instead of 28 and understates the limit by up to ~1/4.
    if case.mixed:
        def approx():
            torch._foreach_add_([w, m, v], [g, g, g])
            p.copy_(w)
    else:
        def approx():
            torch._foreach_add_([p, m, v], [g, g, g])
    return approx, f"torch ops approximating it (no C++ compiler: {how})"


# -- timing -----------------------------------------------------------------------------

class Timer:
    def __init__(self, device):
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def measure(self, fns, calls, start_index=0):
        """Seconds per call of ``calls`` calls rotating over ``fns``."""
        if self.cuda:
            # CUDA events around the calls, as triton.testing.do_bench; buffer sets
            # rotate instead of do_bench's L2 flush, which would be timed with them.
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.sync()
            start.record()
            for i in range(calls):
                fns[(start_index + i) % len(fns)]()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / calls
        t0 = time.perf_counter()
        for i in range(calls):
            fns[(start_index + i) % len(fns)]()
        return (time.perf_counter() - t0) / calls


def _percentile(values, q):
    values = sorted(values)
    if len(values) == 1:
        return values[0]
    pos = (len(values) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


# -- the guard --------------------------------------------------------------------------

def _max_rel(a_list, b_list, chunk=1 << 24) -> float:
    """max|a - b| / max|b| over lists of tensors, in chunks (no full-size temporaries
    next to 1B-param buffers on a full GPU)."""
    num = den = 0.0
    for a, b in zip(a_list, b_list):
        a, b = a.detach().reshape(-1), b.detach().reshape(-1)
        for lo in range(0, b.numel(), chunk):
            bs = b[lo:lo + chunk].float()
            num = max(num, float((a[lo:lo + chunk].float() - bs).abs().max()))
            den = max(den, float(bs.abs().max()))
    return num / den if den > 0 else num


def _reference_slice(case, p0s, g0s):
    """zero_triton.tools.reference's float64 step on a slice of tensor 0, GUARD_STEPS times."""
    from zero_triton.tools.reference import torch_adam_step_
    k = min(REF_SLICE, p0s[0].numel())
    p = p0s[0].reshape(-1)[:k].float().cpu().clone()
    g = g0s[0].reshape(-1)[:k].cpu().clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t in range(1, GUARD_STEPS + 1):
        torch_adam_step_(p, g, m, v, None, t, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                         weight_decay=0.0, adamw=False, amsgrad=False, maximize=False)
    return k, {"p": [p], "m": [m], "v": [v]}


def _guard(case, providers, p0s, g0s):
    """Step every optimizer provider GUARD_STEPS times on set 0 (identical data) and
    compare with the baseline and the reference. Returns {id: (passed, max_rel, text)}."""
    results = {}
    stepped = [pr for pr in providers if pr.states]
    for pr in stepped:
        for _ in range(GUARD_STEPS):
            pr.fns[0]()
    base = next((pr for pr in stepped if pr.id == case.baseline), None)
    k, ref = _reference_slice(case, p0s, g0s)
    base_state = base.state(0) if base is not None else None
    for pr in stepped:
        s = pr.state(0)
        diffs = {}
        if base_state is not None and pr is not base:
            diffs["vs_" + case.baseline] = max(_max_rel(s[key], base_state[key]) for key in "pmv")
        diffs["vs_reference"] = max(
            _max_rel([s[key][0].reshape(-1)[:k].cpu()], ref[key]) for key in "pmv")
        worst = max(diffs.values())
        passed = worst < GUARD_RTOL
        if case.mixed and base_state is not None and pr is not base:
            lp = _max_rel(s["lp"], base_state["lp"])
            diffs["bf16_params_vs_" + case.baseline] = lp
            passed = passed and lp < GUARD_LP_RTOL
        text = ", ".join(f"{name} {value:.1e}" for name, value in diffs.items())
        results[pr.id] = (passed, worst, text)
    return results


# -- one case ---------------------------------------------------------------------------

def _split(flat, shapes):
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[offset:offset + n].view(shape))
        offset += n
    return out


def _zt_backends(device, case, say):
    from zero_triton.native import backends
    names = ("triton", "cuda", "torch") if device.type == "cuda" else ("cpu", "torch", "triton")
    usable = []
    for name in names:
        try:
            reason = backends.why_not(name, device)
        except Exception as exc:  # a half-installed extension is a reason, not a crash
            reason = f"{type(exc).__name__}: {exc}"
        if reason is None and name == "triton" and device.type == "cpu" and case.numel > INTERPRET_MAX_NUMEL:
            reason = (f"TRITON_INTERPRET=1 runs Triton in the interpreter, ~1000x slower than "
                      f"compiled; not timed above {format_size(INTERPRET_MAX_NUMEL)} params")
        if reason is None:
            usable.append(name)
        else:
            say(f"  skipped zt-{name}: {reason}")
    return usable


def _provider_plan(case, device, args, say):
    """Provider ids to build for this case, in table order, with skip reasons said."""
    plan = [f"zt-{b}" for b in _zt_backends(device, case, say)]
    if case.mixed:
        plan.append("torch-composite")
    else:
        plan += ["torch-loop", "torch-foreach", "torch-fused"]
    if device.type == "cpu" and not case.mixed:
        if importlib.util.find_spec("deepspeed") is None:
            say("  skipped ds-cpuadam: deepspeed is not installed (pip install deepspeed)")
        else:
            plan.append("ds-cpuadam")
    elif device.type == "cpu":
        say("  skipped ds-cpuadam: no bf16-params + fp32-master mode wired up here")
    if device.type == "cuda" and not case.mixed:
        if importlib.util.find_spec("apex") is None:
            say("  skipped apex-fused: apex is not installed (github.com/NVIDIA/apex)")
        else:
            plan.append("apex-fused")
    elif device.type == "cuda":
        say("  skipped apex-fused: its master-weights mode is not wired up here")
    else:
        say("  skipped apex-fused: apex FusedAdam steps CUDA tensors only")
    plan.append("limit")
    if device.type == "cuda":
        plan.append("copy")
    if args.providers:
        dropped = [p for p in plan if p not in args.providers and p != case.baseline and p != "limit"]
        for p in dropped:
            say(f"  skipped {p}: not in --providers")
        plan = [p for p in plan if p not in dropped]
    return plan


def _fit_memory(case, plan, device, sets, say):
    """Drop the slow multi-pass providers first when all would not fit in memory."""
    n = case.numel
    lp = 2 if case.mixed else 4
    # Bytes per param each provider holds (grads are shared except zero_triton's flat
    # buffer), with the temporaries torch's multi-pass steps allocate.
    need = {"zt-torch": 20, "torch-loop": 16, "torch-foreach": 20, "torch-fused": 12,
            "torch-composite": 18, "limit": 14, "copy": 0}
    per_set = sum(need.get(p, 16) for p in plan) * n + 2 * lp * n  # + shared p0, g0
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for victim in ("torch-loop", "zt-torch", "torch-foreach"):
        if per_set * sets <= 0.85 * free:
            break
        if victim in plan:
            plan.remove(victim)
            per_set -= need[victim] * n
            say(f"  skipped {victim}: all providers need ~{per_set * sets / 1e9:.0f}+ GB, "
                f"{free / 1e9:.0f} GB free")
    return plan


def run_case(case, device, args, cpu_limit, say):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    n = case.numel
    state_bytes = n * (16 if not case.mixed else 14)
    cache = cache_bytes(device)
    sets = 1 if state_bytes >= 2 * cache else min(args.max_sets, math.ceil(2 * cache / state_bytes))
    say(f"\n== {case.name}: {len(case.shapes)} tensor(s), {n:,} params, "
        f"{BYTES_PER_PARAM * n / 1e9:.3f} GB per step at {BYTES_PER_PARAM} B/param"
        + (f", {sets} buffer sets rotated (working set vs {cache >> 20} MiB cache)" if sets > 1 else ""))
    plan = _fit_memory(case, _provider_plan(case, device, args, say), device, sets, say)

    gen = torch.Generator(device=device)
    providers = {pid: Provider(pid) for pid in plan}
    errors = {}
    p0s_guard = g0s_guard = None
    for k in range(sets):
        gen.manual_seed(1234 + k)
        flat_p0 = torch.randn(n, generator=gen, device=device).to(case.dtype)
        flat_g0 = torch.randn(n, generator=gen, device=device).to(case.dtype)
        p0s, g0s = _split(flat_p0, case.shapes), _split(flat_g0, case.shapes)
        if k == 0:  # the reference checks a slice of tensor 0
            p0s_guard = [p0s[0].reshape(-1)[:REF_SLICE].clone()]
            g0s_guard = [g0s[0].reshape(-1)[:REF_SLICE].clone()]
        for pid, pr in providers.items():
            if pid in errors:
                continue
            try:
                if pid.startswith("zt-"):
                    step, state = _make_zt(pid[3:], p0s, g0s, case)
                elif pid in ("torch-loop", "torch-foreach", "torch-fused"):
                    step, state = _make_torch(pid, p0s, g0s, case)
                elif pid == "torch-composite":
                    step, state = _make_composite(p0s, g0s, case)
                elif pid == "ds-cpuadam":
                    step, state = _make_deepspeed(p0s, g0s, case)
                elif pid == "apex-fused":
                    step, state = _make_apex(p0s, g0s, case)
                elif pid == "limit":
                    step, pr.note = _make_limit(flat_p0, flat_g0, case, device, cpu_limit)
                    state = None
                elif pid == "copy":
                    nbytes = min(BYTES_PER_PARAM // 2 * n, 2 << 30)
                    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
                    dst = torch.empty_like(src)
                    step, state = (lambda d=dst, s=src: d.copy_(s)), None
                    pr.bytes_per_call = 2 * nbytes
                pr.fns.append(step)
                if state is not None:
                    pr.states.append(state)
            except Exception as exc:
                errors[pid] = f"setup failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        del flat_p0, flat_g0, p0s, g0s

    live = [pr for pid, pr in providers.items() if pid not in errors]
    guard = {}
    try:
        guard = _guard(case, live, p0s_guard, g0s_guard)
    except Exception as exc:
        for pr in live:
            if pr.states:
                errors[pr.id] = f"guard crashed: {type(exc).__name__}: {exc}"
    for pid, (passed, worst, text) in guard.items():
        if not passed:
            errors[pid] = f"GUARD FAILED ({text}): not timed"
    timed = [pr for pr in live if pr.id not in errors]

    timer = Timer(device)
    calls = {}
    target = args.min_time
    for pr in timed:
        try:
            for fn in pr.fns:          # warm every set (torch allocates state on step 1)
                fn()
            timer.sync()
            t = timer.measure(pr.fns, len(pr.fns))
            calls[pr.id] = max(len(pr.fns), math.ceil(target / max(t, 1e-9) / len(pr.fns)) * len(pr.fns))
        except Exception as exc:
            errors[pr.id] = f"warm-up failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    timed = [pr for pr in timed if pr.id not in errors]

    samples = {pr.id: [] for pr in timed}
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(args.repeats):
            order = timed[r % len(timed):] + timed[:r % len(timed)] if timed else []
            for pr in order:
                samples[pr.id].append(timer.measure(pr.fns, calls[pr.id], start_index=r))
    finally:
        if gc_was_enabled:
            gc.enable()

    rows = []
    medians = {pid: statistics.median(v) for pid, v in samples.items() if v}
    base_ms = medians.get(case.baseline)
    limit_ms = medians.get("limit")
    copy_gbps = None
    if "copy" in medians:
        copy_gbps = providers["copy"].bytes_per_call / medians["copy"] / 1e9
    for pid, pr in providers.items():
        row = {"case": case.name, "provider": pid, "dtype": str(case.dtype).replace("torch.", ""),
               "numel": n, "n_tensors": len(case.shapes), "sets": sets,
               "bytes_per_step": pr.bytes_per_call or BYTES_PER_PARAM * n,
               "median_ms": None, "p20_ms": None, "p80_ms": None, "gbps": None,
               "x_baseline": None, "baseline": case.baseline, "pct_limit": None, "pct_copy": None,
               "guard": None, "guard_max_rel": None, "calls_per_sample": calls.get(pid),
               "status": "ok", "note": pr.note}
        if pid in guard:
            row["guard"] = "pass" if guard[pid][0] else "FAIL"
            row["guard_max_rel"] = guard[pid][1]
        if pid in errors:
            row["status"] = "error"
            row["note"] = errors[pid]
        elif pid in medians:
            med = medians[pid]
            row["median_ms"] = med * 1e3
            row["p20_ms"] = _percentile(samples[pid], 0.2) * 1e3
            row["p80_ms"] = _percentile(samples[pid], 0.8) * 1e3
            row["gbps"] = row["bytes_per_step"] / med / 1e9
            if pid != "copy":
                if base_ms is not None:
                    row["x_baseline"] = base_ms / med
                if limit_ms is not None:
                    row["pct_limit"] = 100 * limit_ms / med
                if copy_gbps:
                    row["pct_copy"] = 100 * row["gbps"] / copy_gbps
        rows.append(row)
    del providers, live, timed
    return rows


# -- output -----------------------------------------------------------------------------

COLUMNS = ["case", "provider", "dtype", "numel", "n_tensors", "sets", "bytes_per_step",
           "median_ms", "p20_ms", "p80_ms", "gbps", "x_baseline", "baseline", "pct_limit",
           "pct_copy", "guard", "guard_max_rel", "calls_per_sample", "status", "note"]


def format_table(rows, cuda: bool) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)
    head = (f"{'case':<22} {'provider':<16} {'median ms':>10} {'p20':>9} {'p80':>9} {'GB/s':>7} "
            f"{'x base':>7} {'% limit':>8}" + (f" {'% copy':>7}" if cuda else "") + "  guard")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['case']:<22} {r['provider']:<16} ERROR: {r['note']}")
            continue
        lines.append(
            f"{r['case']:<22} {r['provider']:<16} {f(r['median_ms'], '10.3f')} {f(r['p20_ms'], '9.3f')} "
            f"{f(r['p80_ms'], '9.3f')} {f(r['gbps'], '7.1f')} {f(r['x_baseline'], '7.2f')} "
            f"{f(r['pct_limit'], '7.1f')}%" + (f" {f(r['pct_copy'], '6.1f')}%" if cuda else "")
            + f"  {r['guard'] or ''}")
    return "\n".join(lines)


def metadata(device, args, notes) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    commit, dirty = git_commit()
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model(),
        "cpu_model": cpu_model(), "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
        "python": platform.python_version(), "git_commit": commit, "git_dirty": dirty,
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
        "bytes_per_param": BYTES_PER_PARAM, "repeats": args.repeats, "lr": LR,
        "guard": {"steps": GUARD_STEPS, "rtol": GUARD_RTOL, "bf16_params_rtol": GUARD_LP_RTOL},
        "argv": args.argv, "notes": notes, "legend": LEGEND,
    }
    return meta


def write_outputs(rows, meta, out: Path, device, say) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"step_{device.type}"
    paths = {"csv": out / f"{stem}.csv", "json": out / f"{stem}.json", "png": out / f"{stem}.png"}
    with outputs.replacing(paths["csv"], "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    with outputs.replacing(paths["json"], "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("PNG skipped: matplotlib is not installed (pip install 'zero_triton[bench]')")
        paths.pop("png")
        return paths
    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, axes = plt.subplots(len(cases), 1, figsize=(9, 2.6 * len(cases)), squeeze=False)
    for ax, case in zip(axes[:, 0], cases):
        ok = [r for r in rows if r["case"] == case and r["gbps"] is not None and r["provider"] != "copy"]
        names = [r["provider"] for r in ok]
        colors = ["tab:green" if n.startswith("zt-") else "tab:gray" if n == "limit" else "tab:blue"
                  for n in names]
        ax.barh(names, [r["gbps"] for r in ok], color=colors)
        for r in rows:
            if r["case"] == case and r["provider"] == "copy" and r["gbps"]:
                ax.axvline(r["gbps"], color="tab:red", linestyle="--", label="d2d copy")
                ax.legend(loc="lower right", fontsize=7)
        ax.invert_yaxis()
        ax.set_title(case, fontsize=9)
        ax.tick_params(labelsize=7)
    axes[-1, 0].set_xlabel(f"GB/s at {BYTES_PER_PARAM} B/param (median)")
    fig.suptitle(f"optimizer step, {meta['device']}, torch {meta['torch']}", fontsize=9)
    fig.tight_layout()
    with outputs.replacing(paths["png"], "wb") as fh:
        fig.savefig(fh, dpi=110, format="png")
    plt.close(fig)
    return paths


# -- entry point ------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m zero_triton bench",
        description="Time one optimizer step (zero_triton, torch, a memory-kernel limit), "
                    "interleaved in one process; medians, p20/p80, GB/s at 28 B/param.")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--cases", default=",".join(ALL_CASES),
                    help=f"comma list of {','.join(ALL_CASES)} (default: all)")
    ap.add_argument("--sizes", type=_size_list, default=None,
                    help="params per flat buffer for the fp32 and bf16 cases, e.g. "
                         f"64Mi,256Mi,1Gi ({SUFFIXES}; default: fp32 16Mi,64Mi and bf16 64Mi)")
    ap.add_argument("--scale", type=_positive_float, default=None,
                    help="GPT-2 small element count scale (default 0.25 on cpu, 1 on cuda)")
    ap.add_argument("--many", type=_many, default="8192x4096",
                    help="COUNTxSIZE for the many-tensors case")
    ap.add_argument("--providers", default=None,
                    help=f"comma list to keep (the case baseline and the limit always stay): "
                         f"{','.join(PROVIDER_IDS)}")
    ap.add_argument("--repeats", type=whole_number(1, "15"), default=None,
                    help="interleaved rounds (default 15 on cpu, 50 on cuda)")
    ap.add_argument("--min-time", type=positive_number("number of seconds", "0.02"), default=None,
                    help="seconds per sample: steps are repeated to last this long "
                         "(default 0.02 on cpu, 0.005 on cuda)")
    ap.add_argument("--out", default=os.path.join("bench", "results"),
                    help="folder for step_<device>.csv/.json/.png (default bench/results)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny smoke run: every case at ~16-32K params, 3 rounds")
    return ap


def parse_args(argv):
    ap = _parser()
    args = ap.parse_args([str(a) for a in argv])
    args.argv = [str(a) for a in argv]
    cuda = args.device == "cuda"
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in args.cases if c not in ALL_CASES]
    if bad:
        ap.error(f"unknown case(s) {bad}; choose from {','.join(ALL_CASES)}")
    if args.providers:
        args.providers = [p.strip() for p in args.providers.split(",") if p.strip()]
        bad = [p for p in args.providers if p not in PROVIDER_IDS]
        if bad:
            ap.error(f"unknown provider(s) {bad}; choose from {','.join(PROVIDER_IDS)}")
    if args.quick:
        sizes = [16 << 10]
        args.sizes, args.bf16_sizes = sizes, sizes
        args.scale = args.scale or 1 / 4096
        args.many = (32, 512)
        args.repeats = args.repeats or 3
        args.min_time = args.min_time if args.min_time is not None else 0.0
        args.max_sets = 2  # exercises the rotation without timing caches honestly
    else:
        if args.sizes:
            args.bf16_sizes = args.sizes
        else:
            args.sizes, args.bf16_sizes = [16 << 20, 64 << 20], [64 << 20]
        args.scale = args.scale or (1.0 if cuda else 0.25)
        args.repeats = args.repeats or (50 if cuda else 15)
        if args.min_time is None:
            args.min_time = 0.005 if cuda else 0.02
        args.max_sets = 8
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    return args


def main(argv=None) -> int:
    """Run the benchmark; 0 when every provider passed its guard and ran, else 1."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch.cuda.is_available() is False here", file=sys.stderr)
        return 2
    notes = []

    def say(text):
        print(text, flush=True)
        if text.strip().startswith(("skipped", "PNG", "limit")):
            notes.append(text.strip())

    say(f"zero_triton step benchmark on {device.type}: "
        + (torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model())
        + f", torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeats} rounds")
    cpu_limit = (None, "")
    if device.type == "cpu":
        cpu_limit = _load_cpu_limit()
        say(f"limit kernel: {cpu_limit[1]}" if cpu_limit[0] is not None else
            f"limit kernel: torch ops approximating the access pattern (no C++ compiler: {cpu_limit[1]})")
    else:
        say("limit kernel: Triton kernel with the step's access pattern; plus d2d copy_")
    rows = []
    for case in build_cases(args):
        try:
            rows += run_case(case, device, args, cpu_limit, say)
        except Exception as exc:  # one case (an OOM at 1B, say) must not lose the others
            say(f"  case {case.name} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            rows.append({**{c: None for c in COLUMNS}, "case": case.name, "provider": "-",
                         "status": "error", "note": f"{type(exc).__name__}: {exc}"[:300]})
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print()
    print(format_table(rows, device.type == "cuda"))
    print("x base: baseline median / provider median (baseline: torch-fused; torch-composite "
          "for bf16+master). % limit: limit median / provider median.")
    for key, text in LEGEND.items():
        print(f"  {key:<16} {text}")
    meta = metadata(device, args, notes)
    paths = write_outputs(rows, meta, Path(args.out), device, say)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        print(f"{len(failed)} provider(s) failed: " + "; ".join(f"{r['case']}/{r['provider']}" for r in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    from zero_triton.tools.console import run
    sys.exit(run(main))
