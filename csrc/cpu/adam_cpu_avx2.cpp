// AVX2 variant of the CPU Adam kernel, chosen at run time when the CPU has AVX2, FMA
// and F16C. Compiled with a target pragma instead of -mavx2 so the rest of the
// extension (and anything built ahead of time) keeps the portable baseline.
#if defined(__x86_64__) && defined(__GNUC__)
#include <cstdint>
// The shared arguments first, outside the target region: their inline functions are
// called by the launcher too and must not be compiled for this instruction set.
#include "adam_cpu_args.h"
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define ZT_CPU_ISA isa_avx2
#include "adam_cpu_kernel.h"
#pragma GCC pop_options
#endif
