"""What a step benchmark times: zero_triton's backends, torch's Adam (loop, foreach,
fused), the bf16 composite, DeepSpeed and apex when importable, and the limit: a plain
memory kernel with the step's access pattern."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zero_triton.state.moments import FIRST, SECOND
from zero_triton.state.shards import MASTER
from zero_triton.tools.bench.cases import BETAS, EPS, LR

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

// bench/lowbit_step.py's limits for 1- and 2-byte moments (its 28 B row is stream_fp32):
// read p, g (4 B each), m, v; write p, m, v. Counters that halve and count keep the values
// bounded with the least arithmetic. Moments as int8 + uint8: 16 B/param; as two uint16
// (bf16's bytes): 20 B/param.
template <typename TM, typename TV>
__attribute__((noinline)) void small_range(float* __restrict__ P, const float* __restrict__ G,
                                           TM* __restrict__ M, TV* __restrict__ V,
                                           int64_t b, int64_t e) {
  for (int64_t i = b; i < e; ++i) {
    const float g = G[i];
    M[i] = TM(M[i] / 2 + TM(g > 0.0f));
    V[i] = TV(V[i] / 2 + TV(g != 0.0f));
    P[i] = P[i] - 1e-3f * g;
  }
}

template <typename TM, typename TV>
void small_stream(at::Tensor p, at::Tensor g, TM* M, TV* V) {
  float* P = p.data_ptr<float>(); const float* G = g.data_ptr<float>();
  at::parallel_for(0, p.numel(), 1 << 16, [&](int64_t b, int64_t e) { small_range(P, G, M, V, b, e); });
}

void stream20(at::Tensor p, at::Tensor g, at::Tensor m, at::Tensor v) {
  small_stream(p, g, reinterpret_cast<uint16_t*>(m.data_ptr<at::BFloat16>()),
               reinterpret_cast<uint16_t*>(v.data_ptr<at::BFloat16>()));
}

void stream16(at::Tensor p, at::Tensor g, at::Tensor m, at::Tensor v) {
  small_stream(p, g, m.data_ptr<int8_t>(), v.data_ptr<uint8_t>());
}
"""


def load_cpu_limit():
    """(module, description) of the compiled limit kernels, or (None, why not)."""
    try:
        from torch.utils.cpp_extension import load_inline
        mod = load_inline(
            name="zero_triton_bench_limit", cpp_sources=[_CPU_LIMIT_SRC],
            functions=["stream_fp32", "stream_bf16", "stream20", "stream16"],
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
    return {"p": list(params), "m": [opt.state[p][FIRST] for p in params],
            "v": [opt.state[p][SECOND] for p in params]}


def _params_with_grads(p0s, g0s):
    """Fresh copies of the parameters whose .grad is the shared, read-only gradient
    (FusedAdam copies it into its flat grad buffer; no step writes grads)."""
    params = [p.clone().requires_grad_() for p in p0s]
    for p, g in zip(params, g0s):
        p.grad = g
    return params


def make_zt(backend, p0s, g0s, case):
    from zero_triton import FusedAdam
    params = _params_with_grads(p0s, g0s)
    opt = FusedAdam(params, lr=LR, betas=BETAS, eps=EPS, backend=backend)

    def state():
        if case.mixed:
            return {"p": [opt.state[p][MASTER] for p in params],
                    "m": [opt.state[p][FIRST] for p in params],
                    "v": [opt.state[p][SECOND] for p in params], "lp": params}
        return _torch_state(opt, params)
    return opt.step, state


def make_torch(kind, p0s, g0s, case):
    params = _params_with_grads(p0s, g0s)
    flags = {"torch-loop": dict(foreach=False), "torch-foreach": dict(foreach=True),
             "torch-fused": dict(fused=True)}[kind]
    opt = torch.optim.Adam(params, lr=LR, betas=BETAS, eps=EPS, **flags)
    return opt.step, lambda: _torch_state(opt, params)


def make_composite(p0s, g0s, case):
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


def make_deepspeed(p0s, g0s, case):
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    params = _params_with_grads(p0s, g0s)
    opt = DeepSpeedCPUAdam(params, lr=LR, betas=BETAS, eps=EPS, adamw_mode=False)
    return opt.step, lambda: _torch_state(opt, params)


def make_apex(p0s, g0s, case):
    from apex.optimizers import FusedAdam as ApexFusedAdam
    params = _params_with_grads(p0s, g0s)
    opt = ApexFusedAdam(params, lr=LR, betas=BETAS, eps=EPS, adam_w_mode=False)
    return opt.step, lambda: _torch_state(opt, params)


def make_limit(flat_p0, flat_g0, case, device, cpu_limit):
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
