// Plain-data arguments of one CPU Adam step, shared by the torch-facing launcher
// (adam_cpu.cpp) and the per-ISA kernels (adam_cpu_<isa>.cpp). Torch-free.
#pragma once

#include <cstdint>

namespace zero_triton {
namespace cpu {

enum DType : int { kNone = 0, kFloat32 = 1, kFloat16 = 2, kBFloat16 = 3 };

struct AdamCpuArgs {
  float* param;           // fp32 master (or fp32 parameter), updated in place
  const void* grad;       // fp32 / fp16 / bf16, read only
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // nullptr unless amsgrad
  void* param_lp;         // fp16 / bf16 cast-back of param, or nullptr
  int grad_dtype;         // DType
  int param_lp_dtype;     // DType (kNone when param_lp is nullptr)
  bool amsgrad;
  bool l2_weight_decay;   // Adam's L2 (g += wd * p); AdamW's decay goes through `decay`
  bool unscale;           // divide by grad_scale (a GradScaler scale was given)
  float beta1, beta2;
  float one_minus_beta1, one_minus_beta2;  // rounded once from double
  float eps;
  float step_size;              // lr / (1 - beta1^t), computed in double
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t), computed in double
  float decay;                  // 1 - lr * wd for AdamW, exactly 1 otherwise
  float l2;                     // wd for Adam's L2 (only read when l2_weight_decay)
  float grad_scale;             // GradScaler scale (only read when unscale)
  float grad_factor;            // clip_coef (1 when absent), negated for maximize
};

using AdamRangeFn = void (*)(const AdamCpuArgs&, int64_t begin, int64_t end);

// One instantiation of adam_cpu_kernel.h per instruction set.
namespace isa_default { void adam_range(const AdamCpuArgs&, int64_t, int64_t); }
#if defined(__x86_64__) && defined(__GNUC__)
namespace isa_avx2 { void adam_range(const AdamCpuArgs&, int64_t, int64_t); }
namespace isa_avx512 { void adam_range(const AdamCpuArgs&, int64_t, int64_t); }
#endif

}  // namespace cpu
}  // namespace zero_triton
