// The update of one element of the fused Adam step, shared by the CPU loops and the
// CUDA kernel: every backend runs exactly these operations in this order.
//
// No include guard, on purpose: it is included once inside each instruction-set
// namespace of the CPU kernels (so that it is compiled, and inlined, under that
// namespace's `#pragma GCC target`) and once in the CUDA kernel. Include adam_args.h
// first.

#if defined(__CUDA_ARCH__)
#define ZT_ELEMENT __device__ __forceinline__
#else
#define ZT_ELEMENT inline
#endif

// max for amsgrad, and sqrt. They differ only for a NaN already in max_exp_avg_sq:
// fmaxf drops it on the GPU, the comparison keeps it on the CPU (as each always did).
ZT_ELEMENT float amsgrad_max(float old, float v) {
#if defined(__CUDA_ARCH__)
  return fmaxf(old, v);
#else
  return v > old ? v : old;
#endif
}

ZT_ELEMENT float element_sqrt(float x) {
#if defined(__CUDA_ARCH__)
  return sqrtf(x);
#else
  return __builtin_sqrtf(x);  // a vector instruction under -fno-math-errno
#endif
}

// L2 and AMSGRAD change which operations run (0 * p is NaN for p = inf, so L2 is not
// a multiply by zero); UNSCALE skips a divide that costs as much as the rest of the
// arithmetic. Everything else is a multiply by a factor that is exactly 1 (or -1)
// when the feature is off.
template <bool L2, bool AMSGRAD, bool UNSCALE>
ZT_ELEMENT void adam_element(const zero_triton::StepScalars& s, float g, float& p, float& m,
                             float& v, float& vmax) {
  if constexpr (UNSCALE) g = g / s.grad_scale;
  g = g * s.grad_factor;
  if constexpr (L2) g = g + s.l2 * p;
  p = p * s.decay;
  m = s.beta1 * m + s.one_minus_beta1 * g;
  v = s.beta2 * v + s.one_minus_beta2 * (g * g);
  float vhat = v;
  if constexpr (AMSGRAD) {
    vmax = amsgrad_max(vmax, v);
    vhat = vmax;
  }
  const float denom = element_sqrt(vhat) / s.bias_correction2_sqrt + s.eps;
  p = p - s.step_size * (m / denom);
}

#undef ZT_ELEMENT
