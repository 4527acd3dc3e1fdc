// AVX-512 variant of the CPU Adam kernel, chosen at run time when the CPU has
// AVX512F/BW/VL. 512-bit vectors are requested explicitly: gcc's generic tuning
// otherwise stays at 256 bits.
#if defined(__x86_64__) && defined(__GNUC__)
#include <cstdint>
// The shared arguments first, outside the target region: their inline functions are
// called by the launcher too and must not be compiled for this instruction set.
#include "adam_cpu_args.h"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c,prefer-vector-width=512")
#define ZT_CPU_ISA isa_avx512
#include "adam_cpu_kernel.h"
#pragma GCC pop_options
#endif
