// CUDA launcher: turns the checked AdamStep into plain pointers and launches the
// kernel of adam_kernel.cu on the current stream. No host sync: lr, step, grad_scale,
// found_inf and clip_coef stay on the device and the kernel reads them.
#include "../adam.h"
#include "adam_kernel.h"

// c10's stream and guard only: ATen/cuda/CUDAContext.h would pull in cuSPARSE/cuBLAS
// headers that a toolkit without those libraries lacks.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace zero_triton {

void adam_step_cuda(const AdamStep& s) {
  const c10::cuda::CUDAGuard guard(s.param.device());
  AdamArgs a = args_of(s);  // the scalars stay on the device: the kernel reads them
  // Rounded to float first, as the CUDA kernel always took them (the CPU kernels take
  // the doubles, as torch does); a change of numerics to be made where it can run.
  a.beta1 = double(float(s.beta1));
  a.beta2 = double(float(s.beta2));
  a.eps = double(float(s.eps));
  a.weight_decay = double(float(s.weight_decay));
  int num_sms = 0;  // an attribute query, not a sync; 0 lets the launcher guess
  if (cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount,
                             s.param.device().index()) != cudaSuccess) {
    (void)cudaGetLastError();
    num_sms = 0;
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const cudaError_t err = a.scales != nullptr         ? cuda::launch_adam8_step(a, num_sms, stream)
                          : a.exp_avg_bf16 != nullptr ? cuda::launch_adam_bf16_step(a, num_sms, stream)
                                                      : cuda::launch_adam_step(a, num_sms, stream);
  TORCH_CHECK(err == cudaSuccess, "zero_triton adam_step CUDA launch failed: ",
              cudaGetErrorString(err));
}

}  // namespace zero_triton
