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
// The limit kernels: plain C++ over raw pointers, no torch headers, so the first run on a
// machine compiles them in about a second (with torch's headers it took a minute of a
// core). Each splits [0, n) into chunks of 2^16 over `threads` OpenMP threads, as
// at::parallel_for does over torch's.
#include <cstdint>
#include <cstring>

static const int64_t kChunk = int64_t(1) << 16;
static int64_t chunks(int64_t n) { return (n + kChunk - 1) / kChunk; }
static int64_t chunk_end(int64_t c, int64_t n) { return (c + 1) * kChunk < n ? (c + 1) * kChunk : n; }

// The step's memory traffic with as little arithmetic as keeps the values bounded
// (no inf, no denormals after thousands of calls): read p, g, m, v; write p, m, v.
__attribute__((noinline)) static void fp32_range(float* __restrict__ P, const float* __restrict__ G,
                                                 float* __restrict__ M, float* __restrict__ V,
                                                 int64_t b, int64_t e) {
  #pragma omp simd
  for (int64_t i = b; i < e; ++i) {
    const float gi = G[i];
    const float mi = 0.9f * M[i] + 0.1f * gi;
    V[i] = 0.999f * V[i] + 0.001f * gi * gi;
    M[i] = mi;
    P[i] = P[i] - 1e-3f * mi;
  }
}

// bf16 + fp32 master: read g2, master4, m4, v4; write master4, m4, v4, p2.
__attribute__((noinline)) static void bf16_range(uint16_t* __restrict__ P, const uint16_t* __restrict__ G,
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

// bench/lowbit_step.py's limits for 1- and 2-byte moments (its 28 B row is stream_fp32):
// read p, g (4 B each), m, v; write p, m, v. Counters that halve and count keep the values
// bounded with the least arithmetic. Moments as int8 + uint8: 16 B/param; as two uint16
// (bf16's bytes): 20 B/param.
template <typename TM, typename TV>
__attribute__((noinline)) static void small_range(float* __restrict__ P, const float* __restrict__ G,
                                                  TM* __restrict__ M, TV* __restrict__ V,
                                                  int64_t b, int64_t e) {
  for (int64_t i = b; i < e; ++i) {
    const float g = G[i];
    M[i] = TM(M[i] / 2 + TM(g > 0.0f));
    V[i] = TV(V[i] / 2 + TV(g != 0.0f));
    P[i] = P[i] - 1e-3f * g;
  }
}

extern "C" {
void stream_fp32(float* P, const float* G, float* M, float* V, int64_t n, int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t c = 0; c < chunks(n); ++c) fp32_range(P, G, M, V, c * kChunk, chunk_end(c, n));
}

void stream_bf16(uint16_t* P, const uint16_t* G, float* W, float* M, float* V, int64_t n, int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t c = 0; c < chunks(n); ++c) bf16_range(P, G, W, M, V, c * kChunk, chunk_end(c, n));
}

void stream20(float* P, const float* G, uint16_t* M, uint16_t* V, int64_t n, int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t c = 0; c < chunks(n); ++c) small_range(P, G, M, V, c * kChunk, chunk_end(c, n));
}

void stream16(float* P, const float* G, int8_t* M, uint8_t* V, int64_t n, int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t c = 0; c < chunks(n); ++c) small_range(P, G, M, V, c * kChunk, chunk_end(c, n));
}
}
"""
# -march=native is right here, unlike in anything shipped: this is compiled on, and only
# ever run on, the machine being measured, and a limit built for a lesser ISA than the
# step's run-time-dispatched kernel would not be one (SSE2 packs the bf16 stores slowly
# enough to lose ~1/3 of bandwidth).
_CPU_LIMIT_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_CPU_LIMIT_HOW = "C++ loop over OpenMP threads (torch's count), -O3 -march=native -fopenmp"


class CpuLimit:
    """The compiled limit kernels (``_CPU_LIMIT_SRC``), called with tensors."""

    def __init__(self, lib):
        import ctypes
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        for name, pointers in (("stream_fp32", 4), ("stream_bf16", 5), ("stream20", 4), ("stream16", 4)):
            getattr(lib, name).argtypes = [p] * pointers + [i64, i32]
            getattr(lib, name).restype = None
        self.lib = lib

    def _call(self, name: str, *tensors) -> None:
        getattr(self.lib, name)(*(t.data_ptr() for t in tensors), tensors[0].numel(),
                                torch.get_num_threads())

    def stream_fp32(self, p, g, m, v):
        self._call("stream_fp32", p, g, m, v)

    def stream_bf16(self, p, g, master, m, v):
        self._call("stream_bf16", p, g, master, m, v)

    def stream20(self, p, g, m, v):
        self._call("stream20", p, g, m, v)

    def stream16(self, p, g, m, v):
        self._call("stream16", p, g, m, v)


def load_cpu_limit():
    """(kernels, description) of the compiled limit kernels, or (None, why not). Compiled
    once per machine and compiler into the extension cache (a folder named by a hash of
    the source and flags; a new file is renamed into place, so concurrent first runs
    each compile and neither reads a half-written one), and loaded only where that
    folder and file are this user's alone, as the extension's are."""
    import ctypes
    import hashlib
    import os
    import subprocess
    import tempfile

    from zero_triton.native import cache
    try:
        cxx = cache.compiler_command()
        digest = hashlib.sha256("\0".join([_CPU_LIMIT_SRC, *_CPU_LIMIT_FLAGS, *cxx]).encode())
        folder = cache.cache_base() / f"zero_triton_bench_limit_{digest.hexdigest()[:16]}"
        so = folder / "limit.so"
        if not so.exists():
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
            os.close(fd)
            try:
                proc = subprocess.run([*cxx, *_CPU_LIMIT_FLAGS, "-x", "c++", "-", "-o", tmp],
                                      input=_CPU_LIMIT_SRC, capture_output=True, text=True,
                                      timeout=300)
                if proc.returncode != 0:
                    raise RuntimeError(f"{cxx[0]} failed: {cache.one_line(proc.stderr, 200)}")
                os.replace(tmp, so)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        for path in (folder, so):  # the extension cache's rule: loaded only if this user's alone
            why = cache.not_private(path)
            if why is not None:
                raise RuntimeError(f"{path} {why}: not loaded")
        return CpuLimit(ctypes.CDLL(str(so))), _CPU_LIMIT_HOW
    except Exception as exc:  # no compiler: say so and approximate
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


def deepspeed_without_shm() -> None:
    """DeepSpeed on CPUs with its collectives through torch.distributed (gloo) alone, not
    its shared-memory all-reduce op, which it compiles on first use in each new
    environment (about a minute of a core): the test suite's runs. Patched by module name:
    ``import deepspeed.comm.torch as m`` binds torch itself, which ``deepspeed.comm``
    holds under that name."""
    import importlib
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


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
