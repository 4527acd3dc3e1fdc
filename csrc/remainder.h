// master_weights="remainder": the fp32 master of a bf16 parameter as the parameter's 16
// bits and an int16 beside them, exactly as zero_triton/kernels/remainder.py defines it
// (that file says why). Torch-free, compiled by the host compiler (csrc/cpu) and nvcc
// (csrc/cuda).
//
// No include guard, on purpose: included inside each instruction-set namespace of the CPU
// kernels and once in the CUDA kernel (as rounding.h is).

#if defined(__CUDA_ARCH__)
#define ZT_REMAINDER __host__ __device__ __forceinline__
#else
#define ZT_REMAINDER inline
#endif

// The master of bf16 parameter bits `p` and remainder `r`: the split below undone (a
// negative remainder means the parameter was rounded up: one comes back off).
ZT_REMAINDER float remainder_join(uint16_t p, int16_t r) {
  const uint32_t hi = uint16_t(p - (r < 0 ? 1u : 0u));
  const uint32_t u = (hi << 16) | uint16_t(r);
  float f;
  __builtin_memcpy(&f, &u, sizeof(f));
  return f;
}

// f's bf16 parameter (its high half, plus one when the low half is 0x8000 or more: to
// nearest, ties away from zero; a NaN quiet) and, in *r, its low half as an int16.
ZT_REMAINDER uint16_t remainder_split(float f, int16_t* r) {
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof(u));
  *r = int16_t(uint16_t(u & 0xFFFFu));
  const uint32_t up = (u + 0x8000u) >> 16;
  return uint16_t(f != f ? ((u >> 16) | 0x40u) : up);
}

#undef ZT_REMAINDER
