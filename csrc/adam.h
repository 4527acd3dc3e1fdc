// zero_triton._C: one fused Adam/AdamW step, stateless, in place, one launch per call.
// The Python-facing entry point (adam.cpp) checks every argument once, then hands the
// same AdamStep to the CPU or the CUDA launcher.
#pragma once

#include <ATen/ATen.h>

#include "adam_args.h"

#include <optional>
#include <string>

namespace zero_triton {

struct AdamStep {
  at::Tensor param;       // float32 [n], fp32 master or parameter, updated
  at::Tensor grad;        // float32 / float16 / bfloat16 [n], read only
  at::Tensor exp_avg;     // float32 [n], updated
  at::Tensor exp_avg_sq;  // float32 [n], updated
  std::optional<at::Tensor> max_exp_avg_sq;  // float32 [n] iff amsgrad, updated
  std::optional<at::Tensor> param_lp;        // float16 / bfloat16 [n], written
  at::Tensor step;        // float32 [1], step number t (already incremented)
  at::Tensor lr;          // float32 [1]
  std::optional<at::Tensor> grad_scale;  // float32 [1]: g = g / grad_scale
  std::optional<at::Tensor> found_inf;   // float32 [1]: nonzero -> skip the step
  std::optional<at::Tensor> clip_coef;   // float32 [1]: g = g * clip_coef
  // moments="int8" (quant.h): exp_avg / exp_avg_sq undefined, these defined instead:
  // int8 [n], uint8 [n], float32 [ceil(n / 256), 2].
  std::optional<at::Tensor> exp_avg_codes, exp_avg_sq_codes, scales;
  // moments="int4": uint8 [ceil(n / 2)] each, bfloat16 [ceil(n / 128), 2].
  std::optional<at::Tensor> exp_avg_nibbles, exp_avg_sq_nibbles, scales_bf16;
  // moments="bf16" (rounding.h): bfloat16 [n] each, and the keys of their rounding.
  std::optional<at::Tensor> exp_avg_bf16, exp_avg_sq_bf16;
  int64_t seed = 0, index = 0;
  // master_weights="stochastic": `param` is the bfloat16 parameter itself (no master),
  // `param_lp` absent; rounded back stochastically, keyed by seed and index.
  bool stochastic_param = false;
  // master_weights="remainder": `param` is the bfloat16 parameter, this int16 [n] the low
  // 16 bits of its fp32 master (remainder.h); both updated. `param_lp` absent.
  std::optional<at::Tensor> param_remainder;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  bool adamw = false, amsgrad = false, maximize = false;
};

// The shared, torch-free arguments (adam_args.h) of a checked step: pointers, dtypes,
// options, hyperparameters, and pointers to the 1-element scalars (host or device
// memory, wherever the tensors are). adam.cpp; both launchers start from it.
AdamArgs args_of(const AdamStep& s);

// CPU launcher (cpu/adam_cpu.cpp). Inputs already checked.
void adam_step_cpu(const AdamStep& s);
// Name of the instruction-set variant the CPU launcher uses ("avx512", "avx2",
// "default"), and a test hook that forces one ("" restores automatic choice).
std::string cpu_isa();
void set_cpu_isa(const std::string& isa);

#ifdef ZERO_TRITON_WITH_CUDA
// CUDA launcher (cuda/adam_cuda.cpp). Inputs already checked.
void adam_step_cuda(const AdamStep& s);
#endif

}  // namespace zero_triton
