// Fused Adam/AdamW step over a range of a flat fp32 shard: the ISA-independent body.
//
// Torch-free on purpose: each adam_cpu_<isa>.cpp includes this file once under a
// `#pragma GCC target(...)`, so one plain loop is compiled for several instruction
// sets and picked at run time (no -march=native in anything built ahead of time).
// The loop is written so that gcc auto-vectorises it: no branches that depend on
// data, bit-exact conversions written as integer/float arithmetic, __restrict__
// pointers, and `-fno-math-errno` (from the build flags) so sqrt is a vector
// instruction. `-ffp-contract=off` keeps every ISA variant bit-identical.
//
// Include guard is deliberately absent: the file is included once per ISA
// namespace (ZT_CPU_ISA).
#ifndef ZT_CPU_ISA
#error "define ZT_CPU_ISA (the namespace of this instruction-set variant) first"
#endif

#include "adam_cpu_args.h"

namespace zero_triton {
namespace cpu {
namespace ZT_CPU_ISA {
namespace {

#include "../adam_element.h"
#include "../quant.h"
#include "../remainder.h"
#include "../rounding.h"

inline uint32_t bits_of(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof(u));
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, sizeof(f));
  return f;
}

// bf16 is the top half of an fp32: widening is a shift.
inline float bf16_to_float(uint16_t h) { return float_of(uint32_t(h) << 16); }

// Round to nearest even, NaN -> canonical quiet NaN 0x7FC0: exactly what
// c10::BFloat16(float) and torch's .to(torch.bfloat16) do on the CPU.
inline uint16_t float_to_bf16(float f) {
  const uint32_t u = bits_of(f);
  const uint32_t rounded = (u + UINT32_C(0x7FFF) + ((u >> 16) & 1u)) >> 16;
  return f != f ? uint16_t(0x7FC0) : uint16_t(rounded);
}

// IEEE half <-> float without F16C, branch-free (M. Dukhan's FP16 library, which
// c10::Half also uses), so the same code vectorises on every ISA and rounds to
// nearest even, with subnormals, infinities and NaN handled.
inline float half_to_float(uint16_t h) {
  const uint32_t w = uint32_t(h) << 16;
  const uint32_t sign = w & UINT32_C(0x80000000);
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = UINT32_C(0xE0) << 23;
  const float exp_scale = 0x1.0p-112f;
  const float normalized = float_of((two_w >> 4) + exp_offset) * exp_scale;
  const uint32_t magic_mask = UINT32_C(126) << 23;
  const float magic_bias = 0.5f;
  const float denormalized = float_of((two_w >> 17) | magic_mask) - magic_bias;
  const uint32_t denormalized_cutoff = UINT32_C(1) << 27;
  const uint32_t result =
      sign | (two_w < denormalized_cutoff ? bits_of(denormalized) : bits_of(normalized));
  return float_of(result);
}

inline uint16_t float_to_half(float f) {
  const float scale_to_inf = 0x1.0p+112f;
  const float scale_to_zero = 0x1.0p-110f;
  const uint32_t w = bits_of(f);
  const float abs_f = float_of(w & UINT32_C(0x7FFFFFFF));
  float base = (abs_f * scale_to_inf) * scale_to_zero;
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & UINT32_C(0x80000000);
  uint32_t bias = shl1_w & UINT32_C(0xFF000000);
  bias = bias < UINT32_C(0x71000000) ? UINT32_C(0x71000000) : bias;
  base = float_of((bias >> 1) + UINT32_C(0x07800000)) + base;
  const uint32_t b = bits_of(base);
  const uint32_t exp_bits = (b >> 13) & UINT32_C(0x00007C00);
  const uint32_t mantissa_bits = b & UINT32_C(0x00000FFF);
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return uint16_t((sign >> 16) | (shl1_w > UINT32_C(0xFF000000) ? UINT32_C(0x7E00) : nonsign));
}

template <int DT>
inline float load_grad(const void* __restrict__ base, int64_t i) {
  if constexpr (DT == kFloat32) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (DT == kFloat16) {
    return half_to_float(static_cast<const uint16_t*>(base)[i]);
  } else {
    return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
}

// The parameter in float32: the fp32 master, or (PM, ParamMode) the bf16 parameter
// itself, widened or joined with its remainder.
template <int LP_DT, int PM>
inline float load_param(const float* __restrict__ p, const uint16_t* __restrict__ lp,
                        const void* __restrict__ rem, int64_t i) {
  if constexpr (PM == kParamStochastic) return bf16_to_float(lp[i]);
  else if constexpr (PM == kParamRemainder)
    return remainder_join(lp[i], static_cast<const int16_t*>(rem)[i]);
  else if constexpr (PM == kParamRemainder8)
    return remainder8_join(lp[i], static_cast<const int8_t*>(rem)[i]);
  else return p[i];
}

// The stepped parameter back: the fp32 master (and its fp16/bf16 copy), or the bf16
// parameter alone, rounded stochastically or split with its remainder.
template <int LP_DT, int PM>
inline void store_param(float* __restrict__ p, uint16_t* __restrict__ lp,
                        void* __restrict__ rem, int64_t i, float pi, uint32_t key_p,
                        uint64_t index) {
  if constexpr (PM == kParamStochastic) {
    lp[i] = bf16_stochastic(pi, random_bits(key_p, index + uint64_t(i)));
  } else if constexpr (PM == kParamRemainder) {
    lp[i] = remainder_split(pi, &static_cast<int16_t*>(rem)[i]);
  } else if constexpr (PM == kParamRemainder8) {
    lp[i] = remainder8_split(pi, &static_cast<int8_t*>(rem)[i]);
  } else {
    p[i] = pi;
    if constexpr (LP_DT == kFloat16) lp[i] = float_to_half(pi);
    if constexpr (LP_DT == kBFloat16) lp[i] = float_to_bf16(pi);
  }
}

// Calls f(std::integral_constant<int, ParamMode>) for the step's parameter mode: only
// bf16 instantiations get the stochastic and remainder variants.
template <int LP_DT, class F>
inline void with_param_mode(const AdamArgs& a, F&& f) {
  if constexpr (LP_DT == kBFloat16) {
    switch (param_mode(a)) {
      case kParamStochastic: return f(std::integral_constant<int, kParamStochastic>{});
      case kParamRemainder: return f(std::integral_constant<int, kParamRemainder>{});
      case kParamRemainder8: return f(std::integral_constant<int, kParamRemainder8>{});
      default: break;
    }
  }
  f(std::integral_constant<int, kParamMaster>{});
}

inline uint32_t param_key(const AdamArgs& a) {
  return a.stochastic_param ? rounding_key(a.seed, uint32_t(*a.step), kParamStream) : 0u;
}

// The pointers are parameters of a non-inlined function marked __restrict__ (gcc
// drops restrict on locals and after inlining), so the loop is vectorised without
// runtime alias checks; the launcher refuses overlapping tensors, which makes the
// promise true. The scalars are copied into a local: nothing can alias it.
// PM (ParamMode) other than kParamMaster: no fp32 master; the bf16 parameter `lp` is
// widened (or joined with its remainder `rem`), stepped and written back by stochastic
// rounding keyed by (seed, step, the parameter's stream, canonical index) (../rounding.h)
// or split again (../remainder.h); `p` is unused.
template <int GRAD_DT, int LP_DT, bool L2, bool AMSGRAD, bool UNSCALE, int PM>
__attribute__((noinline)) void adam_loop(const StepScalars& scalars, float* __restrict__ p,
                                         const void* __restrict__ g, float* __restrict__ m,
                                         float* __restrict__ v, float* __restrict__ vmax,
                                         uint16_t* __restrict__ lp, void* __restrict__ rem,
                                         uint32_t key_p, uint64_t index, int64_t begin,
                                         int64_t end) {
  const StepScalars s = scalars;
  // 64-bit index: shards of more than 2^31 elements are normal for ZeRO.
  for (int64_t i = begin; i < end; ++i) {
    float pi = load_param<LP_DT, PM>(p, lp, rem, i), mi = m[i], vi = v[i];
    float xi = 0.0f;
    if constexpr (AMSGRAD) xi = vmax[i];
    adam_element<L2, AMSGRAD, UNSCALE>(s, load_grad<GRAD_DT>(g, i), pi, mi, vi, xi);
    m[i] = mi;
    v[i] = vi;
    if constexpr (AMSGRAD) vmax[i] = xi;
    store_param<LP_DT, PM>(p, lp, rem, i, pi, key_p, index);
  }
}

// dispatch()'s callback: one loop instantiation per combination of options.
struct Loop {
  const AdamArgs& a;
  const StepScalars& s;
  int64_t begin, end;

  template <int GRAD_DT, int LP_DT, bool L2, bool AMSGRAD, bool UNSCALE>
  void run() {
    with_param_mode<LP_DT>(a, [&](auto mode) {
      adam_loop<GRAD_DT, LP_DT, L2, AMSGRAD, UNSCALE, decltype(mode)::value>(
          s, a.param, a.grad, a.exp_avg, a.exp_avg_sq, a.max_exp_avg_sq,
          static_cast<uint16_t*>(a.param_lp), a.param_remainder, param_key(a),
          uint64_t(a.index), begin, end);
    });
  }
};

// moments="int8": blocks [block_begin, block_end) of kQuantBlock elements (the last may
// be short: numel). Per block, one pass decodes the moments, steps every element as
// adam_loop does (adam_element) and keeps the new moments and their largest
// magnitudes; a second pass over the block (in L1) encodes them with the new scales.
template <int GRAD_DT, int LP_DT, bool L2, bool UNSCALE, int PM>
__attribute__((noinline)) void adam8_loop(const StepScalars& scalars, float* __restrict__ p,
                                          const void* __restrict__ g,
                                          int8_t* __restrict__ mq, uint8_t* __restrict__ vq,
                                          float* __restrict__ scales, uint16_t* __restrict__ lp,
                                          void* __restrict__ rem, uint32_t key_p, uint64_t index, int64_t block_begin,
                                          int64_t block_end, int64_t numel) {
  const StepScalars s = scalars;
  float mb[kQuantBlock], vb[kQuantBlock];
  for (int64_t blk = block_begin; blk < block_end; ++blk) {
    const int64_t lo = blk * kQuantBlock;
    const int64_t len = numel - lo < kQuantBlock ? numel - lo : kQuantBlock;
    const float m_scale = scales[2 * blk], v_scale = scales[2 * blk + 1];
    uint32_t m_max = 0, v_max = 0;
    for (int64_t j = 0; j < len; ++j) {
      const int64_t i = lo + j;
      float pi = load_param<LP_DT, PM>(p, lp, rem, i);
      float mi = decode_first(mq[i], m_scale);
      float vi = decode_second(vq[i], v_scale);
      float unused = 0.0f;
      adam_element<L2, false, UNSCALE>(s, load_grad<GRAD_DT>(g, i), pi, mi, vi, unused);
      store_param<LP_DT, PM>(p, lp, rem, i, pi, key_p, index);
      mb[j] = mi;
      vb[j] = vi;
      const uint32_t am = magnitude_bits(mi), av = magnitude_bits(vi);
      m_max = am > m_max ? am : m_max;
      v_max = av > v_max ? av : v_max;
    }
    const float m_new = float_of(m_max), v_new = float_of(v_max);
    const float m_inv = inverse_scale(m_new), v_inv = inverse_scale(v_new);
    for (int64_t j = 0; j < len; ++j) {
      mq[lo + j] = encode_first(mb[j], m_inv);
      vq[lo + j] = encode_second(vb[j], v_inv);
    }
    scales[2 * blk] = m_new;
    scales[2 * blk + 1] = v_new;
  }
}

// moments="int4": adam8_loop over blocks of kQuant4Block elements whose codes are two to
// a byte and whose scales are bfloat16 (each block's largest magnitude rounded to nearest
// even; an element above its rounded scale takes the largest code). A block of an odd
// length leaves its last byte's high nibble (a padding element's) zero.
template <int GRAD_DT, int LP_DT, bool L2, bool UNSCALE, int PM>
__attribute__((noinline)) void adam4_loop(const StepScalars& scalars, float* __restrict__ p,
                                          const void* __restrict__ g,
                                          uint8_t* __restrict__ mq, uint8_t* __restrict__ vq,
                                          uint16_t* __restrict__ scales, uint16_t* __restrict__ lp,
                                          void* __restrict__ rem, uint32_t key_p,
                                          uint32_t key_v, uint32_t key_s, uint64_t index,
                                          int64_t block_begin, int64_t block_end, int64_t numel) {
  const StepScalars s = scalars;
  // Passes over one block in L1, each a loop the compiler vectorises: unpack and decode
  // the bytes, step the elements (as adam8_loop), encode, pack. exp_avg_sq and its scale
  // are rounded stochastically, keyed by (seed, step, stream, canonical index): key_v
  // each element's, key_s each block's first element's.
  float mb[kQuant4Block], vb[kQuant4Block];
  uint8_t cm[kQuant4Block], cv[kQuant4Block];
  uint32_t rb[kQuant4Block];
  for (int64_t blk = block_begin; blk < block_end; ++blk) {
    const int64_t lo = blk * kQuant4Block;
    const int64_t len = numel - lo < kQuant4Block ? numel - lo : kQuant4Block;
    const int64_t bytes = (len + 1) / 2;
    const float m_scale = bf16_to_float(scales[2 * blk]);
    const float v_scale = bf16_to_float(scales[2 * blk + 1]);
    const uint8_t* __restrict__ mbytes = mq + lo / 2;
    const uint8_t* __restrict__ vbytes = vq + lo / 2;
    for (int64_t k = 0; k < bytes; ++k) {
      mb[2 * k] = decode_first4(uint32_t(mbytes[k]) & 0xFu, m_scale);
      mb[2 * k + 1] = decode_first4(uint32_t(mbytes[k]) >> 4, m_scale);
      vb[2 * k] = decode_second4(uint32_t(vbytes[k]) & 0xFu, v_scale);
      vb[2 * k + 1] = decode_second4(uint32_t(vbytes[k]) >> 4, v_scale);
    }
    uint32_t m_max = 0, v_max = 0;
    for (int64_t j = 0; j < len; ++j) {
      const int64_t i = lo + j;
      float pi = load_param<LP_DT, PM>(p, lp, rem, i);
      float mi = mb[j], vi = vb[j], unused = 0.0f;
      adam_element<L2, false, UNSCALE>(s, load_grad<GRAD_DT>(g, i), pi, mi, vi, unused);
      store_param<LP_DT, PM>(p, lp, rem, i, pi, key_p, index);
      mb[j] = mi;
      vb[j] = vi;
      const uint32_t am = magnitude_bits(mi), av = magnitude_bits(vi);
      m_max = am > m_max ? am : m_max;
      v_max = av > v_max ? av : v_max;
    }
    const uint16_t m_new = float_to_bf16(float_of(m_max));
    const uint16_t v_new = bf16_stochastic(float_of(v_max), random_bits(key_s, index + uint64_t(lo)));
    const float m_inv = inverse_scale(bf16_to_float(m_new)), v_scale_new = bf16_to_float(v_new);
    const uint64_t first = index + uint64_t(lo);
    for (int64_t j = 0; j < len; ++j) rb[j] = random_bits(key_v, first + uint64_t(j));
    for (int64_t j = 0; j < len; ++j) cm[j] = uint8_t(encode_first4(mb[j], m_inv));
    for (int64_t j = 0; j < len; ++j) {
      const uint32_t av = magnitude_bits(vb[j]);
      cv[j] = uint8_t(encode_second4_stochastic(vb[j], v_scale_new, av == v_max && av != 0, rb[j]));
    }
    if (len & 1) {  // the padding element after an odd run: zero
      cm[len] = 0;
      cv[len] = 0;
    }
    uint8_t* __restrict__ mout = mq + lo / 2;
    uint8_t* __restrict__ vout = vq + lo / 2;
    for (int64_t k = 0; k < bytes; ++k) {
      mout[k] = uint8_t(cm[2 * k] | (cm[2 * k + 1] << 4));
      vout[k] = uint8_t(cv[2 * k] | (cv[2 * k + 1] << 4));
    }
    scales[2 * blk] = m_new;
    scales[2 * blk + 1] = v_new;
  }
}

// moments="bf16": adam_loop over bfloat16 moments, written back by stochastic rounding
// keyed by (seed, step, stream, canonical index).
template <int GRAD_DT, int LP_DT, bool L2, bool UNSCALE, int PM>
__attribute__((noinline)) void adam_bf16_loop(const StepScalars& scalars, float* __restrict__ p,
                                              const void* __restrict__ g,
                                              uint16_t* __restrict__ m, uint16_t* __restrict__ v,
                                              uint16_t* __restrict__ lp,
                                              void* __restrict__ rem, uint32_t key_m,
                                              uint32_t key_v, uint32_t key_p, uint64_t index,
                                              int64_t begin, int64_t end) {
  const StepScalars s = scalars;
  for (int64_t i = begin; i < end; ++i) {
    float pi = load_param<LP_DT, PM>(p, lp, rem, i), unused = 0.0f;
    float mi = bf16_to_float(m[i]), vi = bf16_to_float(v[i]);
    adam_element<L2, false, UNSCALE>(s, load_grad<GRAD_DT>(g, i), pi, mi, vi, unused);
    m[i] = bf16_stochastic(mi, random_bits(key_m, index + uint64_t(i)));
    v[i] = bf16_stochastic(vi, random_bits(key_v, index + uint64_t(i)));
    store_param<LP_DT, PM>(p, lp, rem, i, pi, key_p, index);
  }
}

struct LoopBf16 {
  const AdamArgs& a;
  const StepScalars& s;
  int64_t begin, end;

  template <int GRAD_DT, int LP_DT, bool L2, bool AMSGRAD, bool UNSCALE>
  void run() {  // AMSGRAD: refused for bf16 moments before any launch
    const uint32_t step = uint32_t(*a.step);
    with_param_mode<LP_DT>(a, [&](auto mode) {
      adam_bf16_loop<GRAD_DT, LP_DT, L2, UNSCALE, decltype(mode)::value>(
          s, a.param, a.grad, a.exp_avg_bf16, a.exp_avg_sq_bf16,
          static_cast<uint16_t*>(a.param_lp), a.param_remainder, rounding_key(a.seed, step, kFirstStream),
          rounding_key(a.seed, step, kSecondStream), param_key(a), uint64_t(a.index), begin,
          end);
    });
  }
};

struct Loop8 {
  const AdamArgs& a;
  const StepScalars& s;
  int64_t block_begin, block_end;

  template <int GRAD_DT, int LP_DT, bool L2, bool AMSGRAD, bool UNSCALE>
  void run() {  // AMSGRAD: refused for int8 before any launch
    with_param_mode<LP_DT>(a, [&](auto mode) {
      adam8_loop<GRAD_DT, LP_DT, L2, UNSCALE, decltype(mode)::value>(
          s, a.param, a.grad, a.exp_avg_codes, a.exp_avg_sq_codes, a.scales,
          static_cast<uint16_t*>(a.param_lp), a.param_remainder, param_key(a), uint64_t(a.index), block_begin,
          block_end, a.numel);
    });
  }
};

struct Loop4 {
  const AdamArgs& a;
  const StepScalars& s;
  int64_t block_begin, block_end;

  template <int GRAD_DT, int LP_DT, bool L2, bool AMSGRAD, bool UNSCALE>
  void run() {  // AMSGRAD: refused for int4 before any launch
    const uint32_t step = uint32_t(*a.step);
    with_param_mode<LP_DT>(a, [&](auto mode) {
      adam4_loop<GRAD_DT, LP_DT, L2, UNSCALE, decltype(mode)::value>(
          s, a.param, a.grad, a.exp_avg_nibbles, a.exp_avg_sq_nibbles, a.scales_bf16,
          static_cast<uint16_t*>(a.param_lp), a.param_remainder, param_key(a),
          rounding_key(a.seed, step, kSecondStream), rounding_key(a.seed, step, kScaleStream),
          uint64_t(a.index), block_begin, block_end, a.numel);
    });
  }
};

}  // namespace

void adam_range(const AdamArgs& a, const StepScalars& s, int64_t begin, int64_t end) {
  Loop loop{a, s, begin, end};
  dispatch</*kAlwaysUnscale=*/false>(a, loop);
}

void adam8_range(const AdamArgs& a, const StepScalars& s, int64_t block_begin,
                 int64_t block_end) {
  Loop8 loop{a, s, block_begin, block_end};
  dispatch</*kAlwaysUnscale=*/false>(a, loop);
}

void adam4_range(const AdamArgs& a, const StepScalars& s, int64_t block_begin,
                 int64_t block_end) {
  Loop4 loop{a, s, block_begin, block_end};
  dispatch</*kAlwaysUnscale=*/false>(a, loop);
}

void adam_bf16_range(const AdamArgs& a, const StepScalars& s, int64_t begin, int64_t end) {
  LoopBf16 loop{a, s, begin, end};
  dispatch</*kAlwaysUnscale=*/false>(a, loop);
}

}  // namespace ZT_CPU_ISA
}  // namespace cpu
}  // namespace zero_triton
