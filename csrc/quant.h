// The 8-bit moment codes of moments="int8": block-scaled minifloats, exactly as
// zero_triton/kernels/quant.py defines them (that file says why these maps). Torch-free,
// compiled by the host compiler (csrc/cpu) and nvcc (csrc/cuda).
//
// A code's magnitude is an E<e>M<MAN> minifloat of r = |x| * (1 / block scale) in (0, 1]:
// exponent field e (value 2^(e - BIAS)), MAN mantissa bits, code 0 = zero. exp_avg keeps a
// sign (int8, E4M3: BIAS 15, MAN 3); exp_avg_sq is unsigned (uint8, E4M4: BIAS 15, MAN 4)
// and a positive value never takes code 0. Round to nearest, ties away from zero: add half of
// the last kept bit to the float's bits, then drop the rest (a carry moves the exponent).
//
// No include guard, on purpose: included inside each instruction-set namespace of the CPU
// kernels (compiled under that namespace's target) and once in the CUDA kernel.

#if defined(__CUDA_ARCH__)
#define ZT_QUANT __device__ __forceinline__
#else
#define ZT_QUANT inline
#endif

constexpr int kQuantBlock = 256;  // state elements per scale
constexpr int kFirstBias = 15;    // exp_avg: E4M3
constexpr int kFirstMan = 3;
constexpr int kSecondBias = 15;   // exp_avg_sq: E4M4
constexpr int kSecondMan = 4;

// The code of r >= 0 (r a rounding above 1 and NaN take the code of 1.0), `added` added
// to r's bits before the bits below the code's are dropped: half of the last kept bit
// (round to nearest, encode_magnitude) or random bits below it (stochastic rounding).
template <int BIAS, int MAN>
ZT_QUANT uint32_t encode_magnitude_adding(float r, int32_t added) {
  int32_t bits;
  __builtin_memcpy(&bits, &r, sizeof(bits));
  bits += added;
  const int32_t e = (bits >> 23) - 127 + BIAS;
  int32_t code = (e << MAN) | ((bits >> (23 - MAN)) & ((1 << MAN) - 1));
  code = e < 0 ? 0 : code;
  code = code < (BIAS << MAN) ? code : (BIAS << MAN);
  return uint32_t(code);
}

template <int BIAS, int MAN>
ZT_QUANT uint32_t encode_magnitude(float r) {
  return encode_magnitude_adding<BIAS, MAN>(r, int32_t(1) << (22 - MAN));
}

// r' of a code's magnitude (0 for code 0).
template <int BIAS, int MAN>
ZT_QUANT float decode_magnitude(uint32_t code) {
  const uint32_t bits = (((code >> MAN) - BIAS + 127) << 23) |
                        ((code & ((1u << MAN) - 1)) << (23 - MAN));
  float r;
  __builtin_memcpy(&r, &bits, sizeof(r));
  return code == 0 ? 0.0f : r;
}

ZT_QUANT float decode_first(int8_t code, float scale) {
  const int32_t c = code;
  const float x = decode_magnitude<kFirstBias, kFirstMan>(uint32_t(c < 0 ? -c : c)) * scale;
  return c < 0 ? -x : x;
}

ZT_QUANT float decode_second(uint8_t code, float scale) {
  return decode_magnitude<kSecondBias, kSecondMan>(code) * scale;
}

// 1 / scale, or 0 for a block whose largest magnitude is 0 (or NaN).
ZT_QUANT float inverse_scale(float scale) { return scale > 0.0f ? 1.0f / scale : 0.0f; }

ZT_QUANT int8_t encode_first(float x, float inv_scale) {
  const int32_t code = int32_t(encode_magnitude<kFirstBias, kFirstMan>(__builtin_fabsf(x) * inv_scale));
  return int8_t(x < 0.0f ? -code : code);
}

ZT_QUANT uint8_t encode_second(float x, float inv_scale) {
  const float r = __builtin_fabsf(x) * inv_scale;
  const uint32_t code = encode_magnitude<kSecondBias, kSecondMan>(r);
  const uint32_t smallest = r > 0.0f ? 1u : 0u;  // a positive value never takes code 0
  return uint8_t(code == 0 ? smallest : code);
}

// moments="int4" (zero_triton/kernels/quant4.py): the same minifloats with 4 bits, two
// codes to a byte (element 2k the low nibble), blocks of 128 with bfloat16 scales.
// exp_avg: a sign and E3M0 (BIAS 7, no mantissa), the nibble its 4-bit two's complement;
// exp_avg_sq: E3M1 (BIAS 7, MAN 1), a positive value never code 0; in a step it is rounded
// stochastically (encode_second4_stochastic) under a scale rounded so too.
constexpr int kQuant4Block = 128;
constexpr int kFirst4Bias = 7;
constexpr int kFirst4Man = 0;
constexpr int kSecond4Bias = 7;
constexpr int kSecond4Man = 1;

ZT_QUANT float decode_first4(uint32_t nibble, float scale) {
  const int32_t c = int32_t(nibble << 28) >> 28;  // sign-extended
  const float x = decode_magnitude<kFirst4Bias, kFirst4Man>(uint32_t(c < 0 ? -c : c)) * scale;
  return c < 0 ? -x : x;
}

ZT_QUANT float decode_second4(uint32_t nibble, float scale) {
  return decode_magnitude<kSecond4Bias, kSecond4Man>(nibble) * scale;
}

ZT_QUANT uint32_t encode_first4(float x, float inv_scale) {
  const int32_t code = int32_t(encode_magnitude<kFirst4Bias, kFirst4Man>(__builtin_fabsf(x) * inv_scale));
  return uint32_t(x < 0.0f ? -code : code) & 0xFu;
}

ZT_QUANT uint32_t encode_second4(float x, float inv_scale) {
  const float r = __builtin_fabsf(x) * inv_scale;
  const uint32_t code = encode_magnitude<kSecond4Bias, kSecond4Man>(r);
  return code == 0 ? (r > 0.0f ? 1u : 0u) : code;
}

// exp_avg_sq's code in a step (quant4.encode_stochastic): r = |x| / scale (0 where the
// scale is not positive) rounded up with the probability of the fraction past the code
// below (`bits`' low bits added before the drop); a positive value never code 0; the
// block's largest (`top`) the top code.
ZT_QUANT uint32_t encode_second4_stochastic(float x, float scale, bool top, uint32_t bits) {
  const float r = scale > 0.0f ? __builtin_fabsf(x) / (scale > 0.0f ? scale : 1.0f) : 0.0f;
  const int32_t added = int32_t(bits & ((1u << (23 - kSecond4Man)) - 1u));
  const uint32_t code = encode_magnitude_adding<kSecond4Bias, kSecond4Man>(r, added);
  const uint32_t kept = code == 0 ? (r > 0.0f ? 1u : 0u) : code;
  return top ? uint32_t(kSecond4Bias << kSecond4Man) : kept;
}

// |x|'s bits: for the block's largest magnitude as an integer max (NaN the largest).
ZT_QUANT uint32_t magnitude_bits(float x) {
  uint32_t u;
  __builtin_memcpy(&u, &x, sizeof(u));
  return u & UINT32_C(0x7FFFFFFF);
}

#undef ZT_QUANT
