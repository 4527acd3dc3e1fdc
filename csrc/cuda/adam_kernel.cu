// Fused Adam/AdamW step on CUDA: one grid-stride kernel per call, 16-byte vector
// loads when every pointer allows it, 64-bit indices, scalars read from device memory.
// Free of torch headers: `nvcc -c` compiles this file alone (.ci/compile_cuda.sh).
#include "adam_kernel.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

namespace zero_triton {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 4;  // 4 fp32 = 16 bytes per load of param/m/v

// The update of one element (../adam_element.h), the same as the CPU kernels', and the
// int8 moment codes (../quant.h).
#include "../adam_element.h"
#include "../quant.h"
#include "../remainder.h"
#include "../rounding.h"

template <int DT>
__device__ __forceinline__ float to_float(uint16_t h);
template <>
__device__ __forceinline__ float to_float<kFloat16>(uint16_t h) {
  return __half2float(__ushort_as_half(h));
}
template <>
__device__ __forceinline__ float to_float<kBFloat16>(uint16_t h) {
  return __bfloat162float(__ushort_as_bfloat16(h));
}

// Round to nearest even, as torch's .to(float16/bfloat16) does.
template <int DT>
__device__ __forceinline__ uint16_t from_float(float f);
template <>
__device__ __forceinline__ uint16_t from_float<kFloat16>(float f) {
  return __half_as_ushort(__float2half_rn(f));
}
template <>
__device__ __forceinline__ uint16_t from_float<kBFloat16>(float f) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}

template <int GRAD_DT>
__device__ __forceinline__ float load_grad(const void* g, int64_t i) {
  if constexpr (GRAD_DT == kFloat32) {
    return static_cast<const float*>(g)[i];
  } else {
    return to_float<GRAD_DT>(static_cast<const uint16_t*>(g)[i]);
  }
}

// GRAD_DT, LP_DT, L2 and AMSGRAD are template parameters: they decide which memory is
// touched, so the dead branches vanish. VEC selects 16-byte accesses (the launcher
// checked alignment) or one element per iteration.
// PM (ParamMode, ../adam_args.h) other than kParamMaster: no master; the bf16 parameter
// (param_lp) is widened, or joined with its remainder (../remainder.h), stepped and
// written back by stochastic rounding (../rounding.h) or split again. Scalar path only.
template <int PM>
__device__ __forceinline__ float load_param(const AdamArgs& a, int64_t i) {
  const uint16_t* lp = static_cast<const uint16_t*>(a.param_lp);
  if constexpr (PM == kParamStochastic) return __uint_as_float(uint32_t(lp[i]) << 16);
  else if constexpr (PM == kParamRemainder)
    return remainder_join(lp[i], static_cast<const int16_t*>(a.param_remainder)[i]);
  else if constexpr (PM == kParamRemainder8)
    return remainder8_join(lp[i], static_cast<const int8_t*>(a.param_remainder)[i]);
  else return a.param[i];
}

template <int LP_DT, int PM>
__device__ __forceinline__ void store_param(const AdamArgs& a, int64_t i, float p,
                                            uint32_t key_p) {
  uint16_t* lp = static_cast<uint16_t*>(a.param_lp);
  if constexpr (PM == kParamStochastic) {
    lp[i] = bf16_stochastic(p, random_bits(key_p, uint64_t(a.index) + uint64_t(i)));
  } else if constexpr (PM == kParamRemainder) {
    lp[i] = remainder_split(p, &static_cast<int16_t*>(a.param_remainder)[i]);
  } else if constexpr (PM == kParamRemainder8) {
    lp[i] = remainder8_split(p, &static_cast<int8_t*>(a.param_remainder)[i]);
  } else {
    a.param[i] = p;
    if constexpr (LP_DT != kNone) lp[i] = from_float<LP_DT>(p);
  }
}

__device__ __forceinline__ uint32_t param_key(const AdamArgs& a) {
  return rounding_key(a.seed, uint32_t(*a.step), kParamStream);
}

template <int GRAD_DT, int LP_DT, bool L2, bool AMSGRAD, bool VEC, int PM = kParamMaster>
__global__ void __launch_bounds__(kThreads)
    adam_step_kernel(const AdamArgs a) {
  // Skip the whole step on overflow; read on the device so the host never waits.
  if (a.found_inf && *a.found_inf != 0.f) return;
  // Every thread computes the step's scalars from the device pointers (../adam_args.h).
  const StepScalars s = step_scalars(a);
  // 64-bit: shards of more than 2^31 elements are normal for ZeRO.
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t scalar_begin = 0;

  if constexpr (VEC) {
    const int64_t nvec = a.numel / kVec;
    // Two 16-byte packs per thread per iteration, every load issued before any math:
    // twice the bytes in flight per thread, which is what keeps HBM busy.
    constexpr int kUnroll = 2;
    for (int64_t base = tid; base < nvec; base += kUnroll * stride) {
      float4 p4[kUnroll], m4[kUnroll], v4[kUnroll], x4[kUnroll];
      float g[kUnroll][kVec];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j = base + u * stride;
        if (j >= nvec) break;
        p4[u] = reinterpret_cast<const float4*>(a.param)[j];
        m4[u] = reinterpret_cast<const float4*>(a.exp_avg)[j];
        v4[u] = reinterpret_cast<const float4*>(a.exp_avg_sq)[j];
        x4[u] = make_float4(0.f, 0.f, 0.f, 0.f);
        if constexpr (AMSGRAD) x4[u] = reinterpret_cast<const float4*>(a.max_exp_avg_sq)[j];
        if constexpr (GRAD_DT == kFloat32) {
          const float4 g4 = reinterpret_cast<const float4*>(a.grad)[j];
          g[u][0] = g4.x; g[u][1] = g4.y; g[u][2] = g4.z; g[u][3] = g4.w;
        } else {
          const uint2 raw = reinterpret_cast<const uint2*>(a.grad)[j];  // 4 x 16-bit
          g[u][0] = to_float<GRAD_DT>(uint16_t(raw.x & 0xFFFFu));
          g[u][1] = to_float<GRAD_DT>(uint16_t(raw.x >> 16));
          g[u][2] = to_float<GRAD_DT>(uint16_t(raw.y & 0xFFFFu));
          g[u][3] = to_float<GRAD_DT>(uint16_t(raw.y >> 16));
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j = base + u * stride;
        if (j >= nvec) break;
        adam_element<L2, AMSGRAD, true>(s, g[u][0], p4[u].x, m4[u].x, v4[u].x, x4[u].x);
        adam_element<L2, AMSGRAD, true>(s, g[u][1], p4[u].y, m4[u].y, v4[u].y, x4[u].y);
        adam_element<L2, AMSGRAD, true>(s, g[u][2], p4[u].z, m4[u].z, v4[u].z, x4[u].z);
        adam_element<L2, AMSGRAD, true>(s, g[u][3], p4[u].w, m4[u].w, v4[u].w, x4[u].w);
        reinterpret_cast<float4*>(a.param)[j] = p4[u];
        reinterpret_cast<float4*>(a.exp_avg)[j] = m4[u];
        reinterpret_cast<float4*>(a.exp_avg_sq)[j] = v4[u];
        if constexpr (AMSGRAD) reinterpret_cast<float4*>(a.max_exp_avg_sq)[j] = x4[u];
        if constexpr (LP_DT != kNone) {
          uint2 out;
          out.x = uint32_t(from_float<LP_DT>(p4[u].x)) | (uint32_t(from_float<LP_DT>(p4[u].y)) << 16);
          out.y = uint32_t(from_float<LP_DT>(p4[u].z)) | (uint32_t(from_float<LP_DT>(p4[u].w)) << 16);
          reinterpret_cast<uint2*>(a.param_lp)[j] = out;
        }
      }
    }
    scalar_begin = nvec * kVec;  // the tail, fewer than kVec elements
  }

  uint32_t key_p = 0;
  if constexpr (PM == kParamStochastic) key_p = param_key(a);
  for (int64_t i = scalar_begin + tid; i < a.numel; i += stride) {
    float p = load_param<PM>(a, i), m = a.exp_avg[i], v = a.exp_avg_sq[i];
    float x = 0.f;
    if constexpr (AMSGRAD) x = a.max_exp_avg_sq[i];
    adam_element<L2, AMSGRAD, true>(s, load_grad<GRAD_DT>(a.grad, i), p, m, v, x);
    a.exp_avg[i] = m;
    a.exp_avg_sq[i] = v;
    if constexpr (AMSGRAD) a.max_exp_avg_sq[i] = x;
    store_param<LP_DT, PM>(a, i, p, key_p);
  }
}

// Calls f(std::integral_constant<int, ParamMode>) for the step's parameter mode: only
// bf16 instantiations get the stochastic and remainder variants.
template <int LP_DT, class F>
cudaError_t with_param_mode(const AdamArgs& a, F&& f) {
  if constexpr (LP_DT == kBFloat16) {
    switch (param_mode(a)) {
      case kParamStochastic: return f(std::integral_constant<int, kParamStochastic>{});
      case kParamRemainder: return f(std::integral_constant<int, kParamRemainder>{});
      case kParamRemainder8: return f(std::integral_constant<int, kParamRemainder8>{});
      default: break;
    }
  }
  return f(std::integral_constant<int, kParamMaster>{});
}

bool aligned(const void* p, uintptr_t bytes) {
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

template <int GRAD_DT, int LP_DT, bool L2, bool AMSGRAD>
cudaError_t launch_typed(const AdamArgs& a, int num_sms, cudaStream_t stream) {
  if (param_mode(a) != kParamMaster) {  // the bf16 parameter itself: the scalar path
    const int64_t max_blocks = int64_t(num_sms > 0 ? num_sms : 132) * 8;
    int64_t blocks = (a.numel + kThreads - 1) / kThreads;
    if (blocks > max_blocks) blocks = max_blocks;
    return with_param_mode<LP_DT>(a, [&](auto mode) {
      adam_step_kernel<GRAD_DT, LP_DT, L2, AMSGRAD, false, decltype(mode)::value>
          <<<unsigned(blocks), kThreads, 0, stream>>>(a);
      return cudaGetLastError();
    });
  }
  const int grad_bytes = GRAD_DT == kFloat32 ? 4 : 2;
  // Vector path: fp32 arrays 16-byte aligned, 16-bit arrays 8-byte aligned.
  const bool vec = aligned(a.param, 16) && aligned(a.exp_avg, 16) &&
                   aligned(a.exp_avg_sq, 16) && aligned(a.max_exp_avg_sq, 16) &&
                   aligned(a.grad, grad_bytes * kVec) && aligned(a.param_lp, 2 * kVec);
  const int64_t work = vec ? a.numel / kVec + kVec : a.numel;
  // Enough resident blocks to saturate memory; the grid-stride loop covers the rest.
  const int64_t max_blocks = int64_t(num_sms > 0 ? num_sms : 132) * 8;
  int64_t blocks = (work + kThreads - 1) / kThreads;
  if (blocks > max_blocks) blocks = max_blocks;
  if (blocks < 1) blocks = 1;
  if (vec) {
    adam_step_kernel<GRAD_DT, LP_DT, L2, AMSGRAD, true>
        <<<unsigned(blocks), kThreads, 0, stream>>>(a);
  } else {
    adam_step_kernel<GRAD_DT, LP_DT, L2, AMSGRAD, false>
        <<<unsigned(blocks), kThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

// dispatch()'s callback. The kernel always divides by grad_scale (1 without a
// GradScaler: exact), so UNSCALE is always true here and the instantiations halve.
struct Launch {
  const AdamArgs& a;
  int num_sms;
  cudaStream_t stream;

  template <int GRAD_DT, int LP_DT, bool L2, bool AMSGRAD, bool UNSCALE>
  cudaError_t run() {
    return launch_typed<GRAD_DT, LP_DT, L2, AMSGRAD>(a, num_sms, stream);
  }
};

// moments="int8": one thread per element, one thread block per block of kQuantBlock
// elements at a time (grid-stride over the blocks). Each thread decodes its element's
// codes, steps it (adam_element), and the block takes its new largest magnitudes as the
// scales (warp shuffles, then one shared word per warp) before every thread encodes.
template <int GRAD_DT, int LP_DT, bool L2, int PM>
__global__ void __launch_bounds__(kQuantBlock) adam8_step_kernel(const AdamArgs a) {
  if (a.found_inf && *a.found_inf != 0.f) return;
  const StepScalars s = step_scalars(a);
  uint32_t key_p = 0;
  if constexpr (PM == kParamStochastic) key_p = param_key(a);
  constexpr int kWarps = kQuantBlock / 32;
  __shared__ uint32_t warp_max[2][kWarps];
  const int64_t n_blocks = (a.numel + kQuantBlock - 1) / kQuantBlock;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t blk = blockIdx.x; blk < n_blocks; blk += gridDim.x) {
    const int64_t i = blk * kQuantBlock + threadIdx.x;
    const bool mine = i < a.numel;
    float m = 0.f, v = 0.f;
    if (mine) {
      float p = load_param<PM>(a, i), unused = 0.f;
      m = decode_first(a.exp_avg_codes[i], a.scales[2 * blk]);
      v = decode_second(a.exp_avg_sq_codes[i], a.scales[2 * blk + 1]);
      adam_element<L2, false, true>(s, load_grad<GRAD_DT>(a.grad, i), p, m, v, unused);
      store_param<LP_DT, PM>(a, i, p, key_p);
    }
    uint32_t m_max = magnitude_bits(m), v_max = magnitude_bits(v);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      m_max = max(m_max, __shfl_xor_sync(0xFFFFFFFFu, m_max, offset));
      v_max = max(v_max, __shfl_xor_sync(0xFFFFFFFFu, v_max, offset));
    }
    if (lane == 0) {
      warp_max[0][warp] = m_max;
      warp_max[1][warp] = v_max;
    }
    __syncthreads();  // every thread read the old scales before thread 0 writes them
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      m_max = max(m_max, warp_max[0][w]);
      v_max = max(v_max, warp_max[1][w]);
    }
    __syncthreads();  // before the next block's maxima overwrite warp_max
    const float m_scale = __uint_as_float(m_max), v_scale = __uint_as_float(v_max);
    if (mine) {
      a.exp_avg_codes[i] = encode_first(m, inverse_scale(m_scale));
      a.exp_avg_sq_codes[i] = encode_second(v, inverse_scale(v_scale));
    }
    if (threadIdx.x == 0) {
      a.scales[2 * blk] = m_scale;
      a.scales[2 * blk + 1] = v_scale;
    }
  }
}

// moments="bf16": grid-stride over the elements; the moments widened, stepped by
// adam_element and written back by stochastic rounding (../rounding.h).
template <int GRAD_DT, int LP_DT, bool L2, int PM>
__global__ void __launch_bounds__(kThreads) adam_bf16_step_kernel(const AdamArgs a) {
  if (a.found_inf && *a.found_inf != 0.f) return;
  const StepScalars s = step_scalars(a);
  const uint32_t step = uint32_t(*a.step);
  const uint32_t key_m = rounding_key(a.seed, step, kFirstStream);
  const uint32_t key_v = rounding_key(a.seed, step, kSecondStream);
  const uint32_t key_p = PM == kParamStochastic ? rounding_key(a.seed, step, kParamStream) : 0u;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < a.numel; i += stride) {
    float p = load_param<PM>(a, i), unused = 0.f;
    float m = __uint_as_float(uint32_t(a.exp_avg_bf16[i]) << 16);
    float v = __uint_as_float(uint32_t(a.exp_avg_sq_bf16[i]) << 16);
    adam_element<L2, false, true>(s, load_grad<GRAD_DT>(a.grad, i), p, m, v, unused);
    const uint64_t index = uint64_t(a.index) + uint64_t(i);
    a.exp_avg_bf16[i] = bf16_stochastic(m, random_bits(key_m, index));
    a.exp_avg_sq_bf16[i] = bf16_stochastic(v, random_bits(key_v, index));
    store_param<LP_DT, PM>(a, i, p, key_p);
  }
}

struct LaunchBf16 {
  const AdamArgs& a;
  int num_sms;
  cudaStream_t stream;

  template <int GRAD_DT, int LP_DT, bool L2, bool AMSGRAD, bool UNSCALE>
  cudaError_t run() {  // AMSGRAD: refused for bf16 moments before any launch
    const int64_t max_blocks = int64_t(num_sms > 0 ? num_sms : 132) * 8;
    int64_t blocks = (a.numel + kThreads - 1) / kThreads;
    if (blocks > max_blocks) blocks = max_blocks;
    return with_param_mode<LP_DT>(a, [&](auto mode) {
      adam_bf16_step_kernel<GRAD_DT, LP_DT, L2, decltype(mode)::value>
          <<<unsigned(blocks), kThreads, 0, stream>>>(a);
      return cudaGetLastError();
    });
  }
};

struct Launch8 {
  const AdamArgs& a;
  int num_sms;
  cudaStream_t stream;

  template <int GRAD_DT, int LP_DT, bool L2, bool AMSGRAD, bool UNSCALE>
  cudaError_t run() {  // AMSGRAD: refused for int8 before any launch
    const int64_t n_blocks = (a.numel + kQuantBlock - 1) / kQuantBlock;
    const int64_t max_blocks = int64_t(num_sms > 0 ? num_sms : 132) * 8;
    const int64_t grid = n_blocks < max_blocks ? n_blocks : max_blocks;
    return with_param_mode<LP_DT>(a, [&](auto mode) {
      adam8_step_kernel<GRAD_DT, LP_DT, L2, decltype(mode)::value>
          <<<unsigned(grid), kQuantBlock, 0, stream>>>(a);
      return cudaGetLastError();
    });
  }
};

}  // namespace

cudaError_t launch_adam8_step(const AdamArgs& a, int num_sms, cudaStream_t stream) {
  if (a.numel == 0) return cudaSuccess;
  Launch8 launch{a, num_sms, stream};
  return dispatch</*kAlwaysUnscale=*/true>(a, launch);
}

cudaError_t launch_adam_bf16_step(const AdamArgs& a, int num_sms, cudaStream_t stream) {
  if (a.numel == 0) return cudaSuccess;
  LaunchBf16 launch{a, num_sms, stream};
  return dispatch</*kAlwaysUnscale=*/true>(a, launch);
}

cudaError_t launch_adam_step(const AdamArgs& a, int num_sms, cudaStream_t stream) {
  if (a.numel == 0) return cudaSuccess;
  Launch launch{a, num_sms, stream};
  return dispatch</*kAlwaysUnscale=*/true>(a, launch);
}

}  // namespace cuda
}  // namespace zero_triton
