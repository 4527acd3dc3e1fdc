// Fused Adam/AdamW step on CUDA: the launcher declaration. The arguments are the ones
// every backend shares (../adam_args.h). Free of torch headers so that
// `nvcc -c adam_kernel.cu` compiles on its own.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "../adam_args.h"

namespace zero_triton {
namespace cuda {

// Launches one kernel on `stream`. `num_sms` sizes the grid (grid-stride loop).
// Returns the launch error, if any. The scalars of `args` are device pointers.
cudaError_t launch_adam_step(const AdamArgs& args, int num_sms, cudaStream_t stream);
// moments="int8" (../quant.h): the codes and scales of `args` instead of fp32 moments.
cudaError_t launch_adam8_step(const AdamArgs& args, int num_sms, cudaStream_t stream);
// moments="bf16" (../rounding.h): the bfloat16 moments of `args` and their rounding's keys.
cudaError_t launch_adam_bf16_step(const AdamArgs& args, int num_sms, cudaStream_t stream);

}  // namespace cuda
}  // namespace zero_triton
