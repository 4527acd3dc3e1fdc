// The CPU kernels' entry points, one per instruction set: each adam_cpu_<isa>.cpp
// compiles adam_cpu_kernel.h once under its own target. Torch-free; the arguments and
// the step's scalars are the ones every backend shares (../adam_args.h).
#pragma once

#include <cstdint>
#include <type_traits>

#include "../adam_args.h"

namespace zero_triton {
namespace cpu {

using AdamRangeFn = void (*)(const AdamArgs&, const StepScalars&, int64_t begin, int64_t end);

// One instantiation of adam_cpu_kernel.h per instruction set.
// adam8_range (moments="int8") takes a range of blocks of kQuantBlock elements,
// adam4_range (moments="int4") of kQuant4Block elements;
// adam_bf16_range (moments="bf16") a range of elements.
#define ZT_CPU_RANGES                                                          \
  void adam_range(const AdamArgs&, const StepScalars&, int64_t, int64_t);     \
  void adam8_range(const AdamArgs&, const StepScalars&, int64_t, int64_t);     \
  void adam4_range(const AdamArgs&, const StepScalars&, int64_t, int64_t);     \
  void adam_bf16_range(const AdamArgs&, const StepScalars&, int64_t, int64_t);
namespace isa_default { ZT_CPU_RANGES }
#if defined(__x86_64__) && defined(__GNUC__)
namespace isa_avx2 { ZT_CPU_RANGES }
namespace isa_avx512 { ZT_CPU_RANGES }
#endif
#undef ZT_CPU_RANGES

}  // namespace cpu
}  // namespace zero_triton
