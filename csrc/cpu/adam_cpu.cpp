// CPU launcher: fills the shared arguments (the 1-element scalar tensors are host
// memory here), computes the step's scalars in double once per call (../adam_args.h),
// picks the instruction-set variant and splits the range over threads with
// at::parallel_for. No allocation, no extra pass over memory.
#include "../adam.h"
#include "adam_cpu_args.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <stdexcept>

namespace zero_triton {
namespace {

using cpu::AdamRangeFn;

// Below ~64K elements the step takes a few microseconds; waking threads costs more.
constexpr int64_t kGrainSize = int64_t(1) << 16;
constexpr int64_t kQuantBlockElems = 256;  // quant.h's kQuantBlock
constexpr int64_t kQuant4BlockElems = 128;  // quant.h's kQuant4Block

struct IsaChoice {
  const char* name;
  AdamRangeFn fn;
  AdamRangeFn fn8;  // moments="int8", over blocks
  AdamRangeFn fn16;  // moments="bf16"
  AdamRangeFn fn4;  // moments="int4", over blocks
};

IsaChoice best_isa() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    return {"avx512", cpu::isa_avx512::adam_range, cpu::isa_avx512::adam8_range,
            cpu::isa_avx512::adam_bf16_range, cpu::isa_avx512::adam4_range};
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return {"avx2", cpu::isa_avx2::adam_range, cpu::isa_avx2::adam8_range,
            cpu::isa_avx2::adam_bf16_range, cpu::isa_avx2::adam4_range};
  }
#endif
  return {"default", cpu::isa_default::adam_range, cpu::isa_default::adam8_range,
            cpu::isa_default::adam_bf16_range, cpu::isa_default::adam4_range};
}

// Test hook only: -1 = automatic, otherwise an index into the variants below.
std::atomic<int> forced_isa{-1};

IsaChoice current_isa() {
  static const IsaChoice best = best_isa();
  switch (forced_isa.load(std::memory_order_relaxed)) {
    case 0: return {"default", cpu::isa_default::adam_range, cpu::isa_default::adam8_range,
            cpu::isa_default::adam_bf16_range, cpu::isa_default::adam4_range};
#if defined(__x86_64__) && defined(__GNUC__)
    case 1: return {"avx2", cpu::isa_avx2::adam_range, cpu::isa_avx2::adam8_range,
            cpu::isa_avx2::adam_bf16_range, cpu::isa_avx2::adam4_range};
    case 2: return {"avx512", cpu::isa_avx512::adam_range, cpu::isa_avx512::adam8_range,
            cpu::isa_avx512::adam_bf16_range, cpu::isa_avx512::adam4_range};
#endif
    default: return best;
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

  AdamArgs a = args_of(s);  // the scalars are host memory here
  a.found_inf = nullptr;    // read above
  const StepScalars scalars = step_scalars(a);  // once per call, in double

  if (a.exp_avg_bf16 != nullptr) {  // moments="bf16"
    const AdamRangeFn fn16 = current_isa().fn16;
    at::parallel_for(0, n, kGrainSize,
                     [&](int64_t begin, int64_t end) { fn16(a, scalars, begin, end); });
    return;
  }
  if (a.scales_bf16 != nullptr) {  // moments="int4": threads split the blocks
    const AdamRangeFn fn4 = current_isa().fn4;
    const int64_t blocks = (n + kQuant4BlockElems - 1) / kQuant4BlockElems;
    at::parallel_for(0, blocks, kGrainSize / kQuant4BlockElems,
                     [&](int64_t begin, int64_t end) { fn4(a, scalars, begin, end); });
    return;
  }
  if (a.scales != nullptr) {  // moments="int8": threads split the blocks
    const AdamRangeFn fn8 = current_isa().fn8;
    const int64_t blocks = (n + kQuantBlockElems - 1) / kQuantBlockElems;
    at::parallel_for(0, blocks, kGrainSize / kQuantBlockElems,
                     [&](int64_t begin, int64_t end) { fn8(a, scalars, begin, end); });
    return;
  }
  const AdamRangeFn fn = current_isa().fn;
  at::parallel_for(0, n, kGrainSize,
                   [&](int64_t begin, int64_t end) { fn(a, scalars, begin, end); });
}

}  // namespace zero_triton
