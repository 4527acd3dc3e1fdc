// Fused Adam/AdamW step on CUDA: plain-data arguments and the launcher declaration.
// Free of torch headers so that `nvcc -c adam_kernel.cu` compiles on its own.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace zero_triton {
namespace cuda {

enum DType : int { kNone = 0, kFloat32 = 1, kFloat16 = 2, kBFloat16 = 3 };

struct AdamCudaArgs {
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
  bool adamw;
  bool maximize;
  float beta1, beta2, eps, weight_decay;
  // Device scalars, read by the kernel (no host sync). Optional ones may be nullptr.
  const float* step;       // t, already incremented
  const float* lr;
  const float* grad_scale;
  const float* found_inf;
  const float* clip_coef;
};

// Launches one kernel on `stream`. `num_sms` sizes the grid (grid-stride loop).
// Returns the launch error, if any.
cudaError_t launch_adam_step(const AdamCudaArgs& args, int num_sms, cudaStream_t stream);

}  // namespace cuda
}  // namespace zero_triton
