// CPU launcher: reads the 1-element scalar tensors, computes the bias corrections in
// double once per call, picks the instruction-set variant and splits the range over
// threads with at::parallel_for. No allocation, no extra pass over memory.
#include "../adam.h"
#include "adam_cpu_args.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>
#include <stdexcept>

namespace zero_triton {
namespace {

using cpu::AdamRangeFn;

// Below ~64K elements the step takes a few microseconds; waking threads costs more.
constexpr int64_t kGrainSize = int64_t(1) << 16;

struct IsaChoice {
  const char* name;
  AdamRangeFn fn;
};

IsaChoice best_isa() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    return {"avx512", cpu::isa_avx512::adam_range};
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return {"avx2", cpu::isa_avx2::adam_range};
  }
#endif
  return {"default", cpu::isa_default::adam_range};
}

// Test hook only: -1 = automatic, otherwise an index into the variants below.
std::atomic<int> forced_isa{-1};

IsaChoice current_isa() {
  static const IsaChoice best = best_isa();
  switch (forced_isa.load(std::memory_order_relaxed)) {
    case 0: return {"default", cpu::isa_default::adam_range};
#if defined(__x86_64__) && defined(__GNUC__)
    case 1: return {"avx2", cpu::isa_avx2::adam_range};
    case 2: return {"avx512", cpu::isa_avx512::adam_range};
#endif
    default: return best;
  }
}

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return cpu::kFloat32;
    case at::kHalf: return cpu::kFloat16;
    case at::kBFloat16: return cpu::kBFloat16;
    default: return cpu::kNone;
  }
}

float scalar_of(const at::Tensor& t) { return *t.const_data_ptr<float>(); }

}  // namespace

std::string cpu_isa() { return current_isa().name; }

void set_cpu_isa(const std::string& isa) {
  int code = -1;
  if (isa == "default") code = 0;
#if defined(__x86_64__) && defined(__GNUC__)
  else if (isa == "avx2") code = 1;
  else if (isa == "avx512") code = 2;
#endif
  else if (!isa.empty())
    throw std::invalid_argument("unknown CPU variant '" + isa +
                                "'; use 'default', 'avx2', 'avx512' or '' for automatic");
  if (code == 1) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") ||
        !__builtin_cpu_supports("f16c"))
      throw std::invalid_argument("this CPU lacks AVX2/FMA/F16C");
  }
  if (code == 2) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512vl"))
      throw std::invalid_argument("this CPU lacks AVX512F/BW/VL");
  }
  forced_isa.store(code, std::memory_order_relaxed);
}

void adam_step_cpu(const AdamStep& s) {
  // Read on the host: for CPU tensors this is a load, not a device sync.
  if (s.found_inf && scalar_of(*s.found_inf) != 0.0f) return;
  const int64_t n = s.param.numel();
  if (n == 0) return;

  const double lr = scalar_of(s.lr);
  const double t = scalar_of(s.step);
  // Bias corrections in double: beta2^t for t in the millions loses most of its
  // digits in fp32 (1 - 0.999^t is computed from two nearly equal numbers early on).
  const double bias_correction1 = 1.0 - std::pow(s.beta1, t);
  const double bias_correction2 = 1.0 - std::pow(s.beta2, t);

  cpu::AdamCpuArgs a{};
  a.param = s.param.data_ptr<float>();
  a.grad = s.grad.const_data_ptr();
  a.exp_avg = s.exp_avg.data_ptr<float>();
  a.exp_avg_sq = s.exp_avg_sq.data_ptr<float>();
  a.max_exp_avg_sq = s.amsgrad ? s.max_exp_avg_sq->data_ptr<float>() : nullptr;
  a.param_lp = s.param_lp ? s.param_lp->data_ptr() : nullptr;
  a.grad_dtype = dtype_code(s.grad.scalar_type());
  a.param_lp_dtype = s.param_lp ? dtype_code(s.param_lp->scalar_type()) : cpu::kNone;
  a.amsgrad = s.amsgrad;
  a.l2_weight_decay = !s.adamw && s.weight_decay != 0.0;
  a.beta1 = float(s.beta1);
  a.beta2 = float(s.beta2);
  a.one_minus_beta1 = float(1.0 - s.beta1);
  a.one_minus_beta2 = float(1.0 - s.beta2);
  a.eps = float(s.eps);
  a.step_size = float(lr / bias_correction1);
  a.bias_correction2_sqrt = float(std::sqrt(bias_correction2));
  a.decay = (s.adamw && s.weight_decay != 0.0) ? float(1.0 - lr * s.weight_decay) : 1.0f;
  a.l2 = float(s.weight_decay);
  a.unscale = s.grad_scale.has_value();
  a.grad_scale = s.grad_scale ? scalar_of(*s.grad_scale) : 1.0f;
  const float clip = s.clip_coef ? scalar_of(*s.clip_coef) : 1.0f;
  a.grad_factor = s.maximize ? -clip : clip;

  const AdamRangeFn fn = current_isa().fn;
  at::parallel_for(0, n, kGrainSize, [&](int64_t begin, int64_t end) { fn(a, begin, end); });
}

}  // namespace zero_triton
