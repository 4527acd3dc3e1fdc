// Fused Adam/AdamW step on CUDA: one grid-stride kernel per call, 16-byte vector
// loads when every pointer allows it, 64-bit indices, scalars read from device memory.
// Free of torch headers: `nvcc -c` compiles this file alone (.ci/compile_cuda.sh).
#include "adam_kernel.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace zero_triton {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 4;  // 4 fp32 = 16 bytes per load of param/m/v

// Scalars for one step, computed by every thread from the device pointers. The bias
// corrections are computed in double: 1 - beta2^t loses most of its digits in fp32.
struct StepScalars {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps;
  float step_size, bias_correction2_sqrt, decay, l2, grad_scale, grad_factor;
};

__device__ __forceinline__ StepScalars step_scalars(const AdamCudaArgs& a) {
  StepScalars s;
  const double lr = *a.lr;
  const double t = *a.step;
  const double bc1 = 1.0 - pow(double(a.beta1), t);
  const double bc2 = 1.0 - pow(double(a.beta2), t);
  s.beta1 = a.beta1;
  s.beta2 = a.beta2;
  s.one_minus_beta1 = float(1.0 - double(a.beta1));
  s.one_minus_beta2 = float(1.0 - double(a.beta2));
  s.eps = a.eps;
  s.step_size = float(lr / bc1);
  s.bias_correction2_sqrt = float(sqrt(bc2));
  // x*1, x/1 and x*-1 are exact: disabled features cost a multiply, not a branch.
  s.decay = (a.adamw && a.weight_decay != 0.f) ? float(1.0 - lr * double(a.weight_decay)) : 1.f;
  s.l2 = a.weight_decay;
  s.grad_scale = a.grad_scale ? *a.grad_scale : 1.f;
  const float clip = a.clip_coef ? *a.clip_coef : 1.f;
  s.grad_factor = a.maximize ? -clip : clip;
  return s;
}

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

// The update of one element, shared by the vector and the scalar path.
template <bool L2, bool AMSGRAD>
__device__ __forceinline__ void adam_element(const StepScalars& s, float g, float& p, float& m,
                                             float& v, float& vmax) {
  g = (g / s.grad_scale) * s.grad_factor;
  if constexpr (L2) g = g + s.l2 * p;
  p = p * s.decay;
  m = s.beta1 * m + s.one_minus_beta1 * g;
  v = s.beta2 * v + s.one_minus_beta2 * (g * g);
  float vhat = v;
  if constexpr (AMSGRAD) {
    vmax = fmaxf(vmax, v);
    vhat = vmax;
  }
  const float denom = sqrtf(vhat) / s.bias_correction2_sqrt + s.eps;
  p = p - s.step_size * (m / denom);
}

// GRAD_DT, LP_DT, L2 and AMSGRAD are template parameters: they decide which memory is
// touched, so the dead branches vanish. VEC selects 16-byte accesses (the launcher
// checked alignment) or one element per iteration.
template <int GRAD_DT, int LP_DT, bool L2, bool AMSGRAD, bool VEC>
__global__ void __launch_bounds__(kThreads)
    adam_step_kernel(const AdamCudaArgs a) {
  // Skip the whole step on overflow; read on the device so the host never waits.
  if (a.found_inf && *a.found_inf != 0.f) return;
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
        adam_element<L2, AMSGRAD>(s, g[u][0], p4[u].x, m4[u].x, v4[u].x, x4[u].x);
        adam_element<L2, AMSGRAD>(s, g[u][1], p4[u].y, m4[u].y, v4[u].y, x4[u].y);
        adam_element<L2, AMSGRAD>(s, g[u][2], p4[u].z, m4[u].z, v4[u].z, x4[u].z);
        adam_element<L2, AMSGRAD>(s, g[u][3], p4[u].w, m4[u].w, v4[u].w, x4[u].w);
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

  for (int64_t i = scalar_begin + tid; i < a.numel; i += stride) {
    float p = a.param[i], m = a.exp_avg[i], v = a.exp_avg_sq[i];
    float x = 0.f;
    if constexpr (AMSGRAD) x = a.max_exp_avg_sq[i];
    adam_element<L2, AMSGRAD>(s, load_grad<GRAD_DT>(a.grad, i), p, m, v, x);
    a.param[i] = p;
    a.exp_avg[i] = m;
    a.exp_avg_sq[i] = v;
    if constexpr (AMSGRAD) a.max_exp_avg_sq[i] = x;
    if constexpr (LP_DT != kNone) static_cast<uint16_t*>(a.param_lp)[i] = from_float<LP_DT>(p);
  }
}

bool aligned(const void* p, uintptr_t bytes) {
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

template <int GRAD_DT, int LP_DT, bool L2, bool AMSGRAD>
cudaError_t launch_typed(const AdamCudaArgs& a, int num_sms, cudaStream_t stream) {
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

template <int GRAD_DT, int LP_DT>
cudaError_t launch_flags(const AdamCudaArgs& a, int num_sms, cudaStream_t stream) {
  const bool l2 = !a.adamw && a.weight_decay != 0.f;
  if (l2) {
    return a.amsgrad ? launch_typed<GRAD_DT, LP_DT, true, true>(a, num_sms, stream)
                     : launch_typed<GRAD_DT, LP_DT, true, false>(a, num_sms, stream);
  }
  return a.amsgrad ? launch_typed<GRAD_DT, LP_DT, false, true>(a, num_sms, stream)
                   : launch_typed<GRAD_DT, LP_DT, false, false>(a, num_sms, stream);
}

template <int GRAD_DT>
cudaError_t launch_lp(const AdamCudaArgs& a, int num_sms, cudaStream_t stream) {
  switch (a.param_lp_dtype) {
    case kFloat16: return launch_flags<GRAD_DT, kFloat16>(a, num_sms, stream);
    case kBFloat16: return launch_flags<GRAD_DT, kBFloat16>(a, num_sms, stream);
    default: return launch_flags<GRAD_DT, kNone>(a, num_sms, stream);
  }
}

}  // namespace

cudaError_t launch_adam_step(const AdamCudaArgs& a, int num_sms, cudaStream_t stream) {
  if (a.numel == 0) return cudaSuccess;
  switch (a.grad_dtype) {
    case kFloat16: return launch_lp<kFloat16>(a, num_sms, stream);
    case kBFloat16: return launch_lp<kBFloat16>(a, num_sms, stream);
    default: return launch_lp<kFloat32>(a, num_sms, stream);
  }
}

}  // namespace cuda
}  // namespace zero_triton
