// The CPU kernels' entry points, one per instruction set: each adam_cpu_<isa>.cpp
// compiles adam_cpu_kernel.h once under its own target. Torch-free; the arguments and
// the step's scalars are the ones every backend shares (../adam_args.h).
#pragma once

#include <cstdint>

#include "../adam_args.h"

namespace zero_triton {
namespace cpu {

using AdamRangeFn = void (*)(const AdamArgs&, const StepScalars&, int64_t begin, int64_t end);

// One instantiation of adam_cpu_kernel.h per instruction set.
namespace isa_default { void adam_range(const AdamArgs&, const StepScalars&, int64_t, int64_t); }
#if defined(__x86_64__) && defined(__GNUC__)
namespace isa_avx2 { void adam_range(const AdamArgs&, const StepScalars&, int64_t, int64_t); }
namespace isa_avx512 { void adam_range(const AdamArgs&, const StepScalars&, int64_t, int64_t); }
#endif

}  // namespace cpu
}  // namespace zero_triton
