// What every backend of the fused Adam step shares: the plain-data arguments of one
// step, the step's scalars, and the dispatch from run-time options to the kernel's
// compile-time ones. Torch-free, and compiled by both the host compiler (the CPU
// kernels, csrc/cpu) and nvcc (the CUDA kernel, csrc/cuda: `nvcc -c` needs no torch).
// The per-element update is in adam_element.h.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define ZT_HOST_DEVICE __host__ __device__
#else
#define ZT_HOST_DEVICE
#endif

namespace zero_triton {

enum DType : int { kNone = 0, kFloat32 = 1, kFloat16 = 2, kBFloat16 = 3 };

struct AdamArgs {
  float* param;           // fp32 master (or fp32 parameter), updated in place
  const void* grad;       // fp32 / fp16 / bf16, read only
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // nullptr unless amsgrad
  void* param_lp;         // fp16 / bf16 cast-back of param, or nullptr
  int64_t numel;
  int grad_dtype;         // DType
  int param_lp_dtype;     // DType, kNone when param_lp is nullptr
  bool amsgrad;
  bool adamw;             // decoupled weight decay; otherwise Adam's L2 (g += wd * p)
  bool maximize;
  // The hyperparameters in double, as Python gives them. (The CUDA launcher rounds
  // them to float first, as the CUDA kernel always has; see cuda/adam_cuda.cpp.)
  double beta1, beta2, eps, weight_decay;
  // One-element float32 scalars: host memory for the CPU kernels, device memory for
  // the CUDA kernel (read there, so the host never waits). Optional ones may be null.
  const float* step;       // t, already incremented
  const float* lr;
  const float* grad_scale;  // g = g / grad_scale (GradScaler)
  const float* found_inf;   // nonzero: skip the step
  const float* clip_coef;   // g = g * clip_coef
  // moments="int8" (quant.h): exp_avg and exp_avg_sq above are nullptr, the codes and
  // the blocks' scales (float32 [blocks][2]: first, second) are here. nullptr otherwise.
  int8_t* exp_avg_codes;
  uint8_t* exp_avg_sq_codes;
  float* scales;
  // moments="int4" (quant.h, CPU only): the 4-bit codes two to a byte ([ceil(n/2)] each)
  // and the blocks' bfloat16 scales ([blocks of 128][2]). nullptr otherwise.
  uint8_t* exp_avg_nibbles;
  uint8_t* exp_avg_sq_nibbles;
  uint16_t* scales_bf16;
  // moments="bf16" (rounding.h): exp_avg / exp_avg_sq above are nullptr, these hold the
  // bfloat16 moments; `seed` and `index` (the canonical index of element 0) key the
  // stochastic rounding. nullptr otherwise.
  uint16_t* exp_avg_bf16;
  uint16_t* exp_avg_sq_bf16;
  uint32_t seed;
  int64_t index;
  // master_weights="stochastic": no fp32 master. `param` is nullptr, `param_lp` the
  // bfloat16 parameter itself, stepped and rounded back stochastically (rounding.h),
  // keyed by `seed` and `index` as above.
  bool stochastic_param;
  // master_weights="remainder": `param` is nullptr, `param_lp` the bfloat16 parameter and
  // this the low 16 bits of its fp32 master, int16 (remainder.h); "remainder8"
  // (`remainder8`): bits 8-15 of its 24-bit master, int8. nullptr otherwise.
  void* param_remainder;
  bool remainder8;
};

// How the parameter is stepped: an fp32 master (or fp32 parameter) and its optional
// fp16/bf16 copy, or the bf16 parameter itself, rounded back stochastically or split
// again with its remainder. Only bf16 instantiations of a kernel have the last two.
enum ParamMode : int {
  kParamMaster = 0, kParamStochastic = 1, kParamRemainder = 2, kParamRemainder8 = 3
};

ZT_HOST_DEVICE inline int param_mode(const AdamArgs& a) {
  return a.param_remainder ? (a.remainder8 ? kParamRemainder8 : kParamRemainder)
                           : a.stochastic_param ? kParamStochastic : kParamMaster;
}

// The scalars of one step, computed once from the arguments. The bias corrections are
// computed in double: 1 - beta2^t loses most of its digits in fp32.
struct StepScalars {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps;
  float step_size;              // lr / (1 - beta1^t)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
  float decay;                  // 1 - lr * wd for AdamW, exactly 1 otherwise
  float l2;                     // wd, read only by Adam's L2 variant
  float grad_scale;             // 1 without GradScaler
  float grad_factor;            // clip_coef (1 when absent), negated for maximize
};

ZT_HOST_DEVICE inline bool l2_weight_decay(const AdamArgs& a) {
  return !a.adamw && a.weight_decay != 0.0;
}

ZT_HOST_DEVICE inline StepScalars step_scalars(const AdamArgs& a) {
  StepScalars s;
  const double lr = *a.lr;
  const double t = *a.step;
  const double bias_correction1 = 1.0 - pow(a.beta1, t);
  const double bias_correction2 = 1.0 - pow(a.beta2, t);
  s.beta1 = float(a.beta1);
  s.beta2 = float(a.beta2);
  s.one_minus_beta1 = float(1.0 - a.beta1);
  s.one_minus_beta2 = float(1.0 - a.beta2);
  s.eps = float(a.eps);
  s.step_size = float(lr / bias_correction1);
  s.bias_correction2_sqrt = float(sqrt(bias_correction2));
  // x*1, x/1 and x*-1 are exact: disabled features cost a multiply, not a branch.
  s.decay = (a.adamw && a.weight_decay != 0.0) ? float(1.0 - lr * a.weight_decay) : 1.0f;
  s.l2 = float(a.weight_decay);
  s.grad_scale = a.grad_scale ? *a.grad_scale : 1.0f;
  const float clip = a.clip_coef ? *a.clip_coef : 1.0f;
  s.grad_factor = a.maximize ? -clip : clip;
  return s;
}

// dispatch<kAlwaysUnscale>(a, f) calls f.template run<GRAD_DT, LP_DT, L2, AMSGRAD,
// UNSCALE>() for the options of `a`: the template parameters decide which memory is
// touched and which operations run, so each kernel instantiation has no dead branches.
// Dividing by a grad_scale of 1 is exact: a backend that does not mind the divide
// passes kAlwaysUnscale = true and gets half the instantiations.
namespace dispatch_detail {

template <int G, int L, bool U, class F>
auto flags(const AdamArgs& a, F& f) -> decltype(f.template run<G, L, false, false, U>()) {
  if (l2_weight_decay(a)) {
    return a.amsgrad ? f.template run<G, L, true, true, U>() : f.template run<G, L, true, false, U>();
  }
  return a.amsgrad ? f.template run<G, L, false, true, U>() : f.template run<G, L, false, false, U>();
}

template <int G, int L, bool kAlwaysUnscale, class F>
auto unscale(const AdamArgs& a, F& f) -> decltype(f.template run<G, L, false, false, true>()) {
  if (kAlwaysUnscale || a.grad_scale != nullptr) return flags<G, L, true>(a, f);
  return flags<G, L, false>(a, f);
}

template <int G, bool kAlwaysUnscale, class F>
auto low_precision(const AdamArgs& a, F& f) -> decltype(f.template run<G, kNone, false, false, true>()) {
  switch (a.param_lp_dtype) {
    case kFloat16: return unscale<G, kFloat16, kAlwaysUnscale>(a, f);
    case kBFloat16: return unscale<G, kBFloat16, kAlwaysUnscale>(a, f);
    default: return unscale<G, kNone, kAlwaysUnscale>(a, f);
  }
}

}  // namespace dispatch_detail

template <bool kAlwaysUnscale, class F>
auto dispatch(const AdamArgs& a, F& f) -> decltype(f.template run<kFloat32, kNone, false, false, true>()) {
  switch (a.grad_dtype) {
    case kFloat16: return dispatch_detail::low_precision<kFloat16, kAlwaysUnscale>(a, f);
    case kBFloat16: return dispatch_detail::low_precision<kBFloat16, kAlwaysUnscale>(a, f);
    default: return dispatch_detail::low_precision<kFloat32, kAlwaysUnscale>(a, f);
  }
}

}  // namespace zero_triton
