// master_weights="remainder": the fp32 master of a bf16 parameter as the parameter's 16
// bits and an int16 beside them; "remainder8": an int8, a 24-bit master. Exactly as
// zero_triton/kernels/remainder.py defines them (that file says why). Torch-free, compiled by the host compiler (csrc/cpu) and nvcc
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

// The 24-bit master of bf16 parameter bits `p` and its int8 remainder `r`: the int16
// remainder whose high byte it is (the low byte is zero).
ZT_REMAINDER float remainder8_join(uint16_t p, int8_t r) {
  return remainder_join(p, int16_t(int32_t(r) * 256));
}

// f rounded to 24 bits (to nearest, ties to even; a NaN as it is), then split as above:
// the int16 remainder's low byte is zero, and *r is its high byte (remainder_split's
// arithmetic on the rounded bits, written out: one NaN test for both).
ZT_REMAINDER uint16_t remainder8_split(float f, int8_t* r) {
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof(u));
  const bool nan = f != f;
  const uint32_t v = nan ? u : (u + 0x7Fu + ((u >> 8) & 1u)) & 0xFFFFFF00u;
  *r = int8_t(uint8_t(v >> 8));
  return uint16_t(nan ? ((u >> 16) | 0x40u) : (v + 0x8000u) >> 16);
}

#undef ZT_REMAINDER
