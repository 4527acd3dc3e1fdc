// Baseline variant of the CPU Adam kernel: whatever the compiler targets by default
// (SSE2 on x86-64, NEON on aarch64). Always built; used when nothing better is found.
#define ZT_CPU_ISA isa_default
#include "adam_cpu_kernel.h"
