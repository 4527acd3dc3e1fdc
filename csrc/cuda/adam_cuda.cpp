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
namespace {

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kFloat32;
    case at::kHalf: return kFloat16;
    case at::kBFloat16: return kBFloat16;
    default: return kNone;
  }
}

const float* optional_ptr(const std::optional<at::Tensor>& t) {
  return t ? t->const_data_ptr<float>() : nullptr;
}

}  // namespace

void adam_step_cuda(const AdamStep& s) {
  const c10::cuda::CUDAGuard guard(s.param.device());
  AdamArgs a{};
  a.param = s.param.data_ptr<float>();
  a.grad = s.grad.const_data_ptr();
  a.exp_avg = s.exp_avg.data_ptr<float>();
  a.exp_avg_sq = s.exp_avg_sq.data_ptr<float>();
  a.max_exp_avg_sq = s.amsgrad ? s.max_exp_avg_sq->data_ptr<float>() : nullptr;
  a.param_lp = s.param_lp ? s.param_lp->data_ptr() : nullptr;
  a.numel = s.param.numel();
  a.grad_dtype = dtype_code(s.grad.scalar_type());
  a.param_lp_dtype = s.param_lp ? dtype_code(s.param_lp->scalar_type()) : kNone;
  a.amsgrad = s.amsgrad;
  a.adamw = s.adamw;
  a.maximize = s.maximize;
  // Rounded to float first, as the CUDA kernel always took them (the CPU kernels take
  // the doubles, as torch does); a change of numerics to be made where it can run.
  a.beta1 = double(float(s.beta1));
  a.beta2 = double(float(s.beta2));
  a.eps = double(float(s.eps));
  a.weight_decay = double(float(s.weight_decay));
  a.step = s.step.const_data_ptr<float>();
  a.lr = s.lr.const_data_ptr<float>();
  a.grad_scale = optional_ptr(s.grad_scale);
  a.found_inf = optional_ptr(s.found_inf);
  a.clip_coef = optional_ptr(s.clip_coef);
  int num_sms = 0;  // an attribute query, not a sync; 0 lets the launcher guess
  if (cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount,
                             s.param.device().index()) != cudaSuccess) {
    (void)cudaGetLastError();
    num_sms = 0;
  }
  const cudaError_t err =
      cuda::launch_adam_step(a, num_sms, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "zero_triton adam_step CUDA launch failed: ",
              cudaGetErrorString(err));
}

}  // namespace zero_triton
