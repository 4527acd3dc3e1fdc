// Stochastic rounding to bfloat16 from a counter-based generator, exactly as
// zero_triton/kernels/rounding.py defines it (that file says why). Torch-free, compiled
// by the host compiler (csrc/cpu) and nvcc (csrc/cuda).
//
// No include guard, on purpose: included inside each instruction-set namespace of the CPU
// kernels and once in the CUDA kernel (as adam_element.h and quant.h are).

#if defined(__CUDA_ARCH__)
#define ZT_ROUND __host__ __device__ __forceinline__
#else
#define ZT_ROUND inline
#endif

constexpr uint32_t kGolden = 0x9E3779B1u, kMix1 = 0x85EBCA6Bu, kMix2 = 0xC2B2AE35u;
// exp_avg, exp_avg_sq, the parameter (master_weights="stochastic"), the 4-bit second
// moment's block scales
constexpr uint32_t kFirstStream = 1, kSecondStream = 2, kParamStream = 3, kScaleStream = 4;

// MurmurHash3's 32-bit finaliser.
ZT_ROUND uint32_t fmix32(uint32_t x) {
  x ^= x >> 16;
  x *= kMix1;
  x ^= x >> 13;
  x *= kMix2;
  x ^= x >> 16;
  return x;
}

// The per-run constant: the seed (the flat buffer's number), the step, the stream.
ZT_ROUND uint32_t rounding_key(uint32_t seed, uint32_t step, uint32_t stream) {
  return fmix32(fmix32(seed) ^ (step * kGolden) ^ (stream * kMix1));
}

// 32 random bits for element `index` of the canonical layout.
ZT_ROUND uint32_t random_bits(uint32_t key, uint64_t index) {
  return fmix32(uint32_t(index) ^ key ^ (uint32_t(index >> 32) * kMix2));
}

// f rounded to bfloat16 bits: up with probability the fraction dropped (the low 16 of
// `bits` added before the drop); NaN -> 0x7FC0, infinities stay.
ZT_ROUND uint16_t bf16_stochastic(float f, uint32_t bits) {
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof(u));
  const uint32_t rounded = (u + (bits & 0xFFFFu)) >> 16;
  const bool is_inf = (u & 0x7FFFFFFFu) == 0x7F800000u;
  const uint32_t out = is_inf ? (u >> 16) : rounded;
  return uint16_t(f != f ? 0x7FC0u : out);
}

#undef ZT_ROUND
