/// @file
/// Vector exp and the activations built on it (SiLU, sigmoid) for AVX2 kernels, and the
/// scalar forms they replace. exp: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-7
/// Taylor polynomial (truncation < 6e-9 relative), times 2^n built in the exponent bits:
/// within 2 ulp of std::exp over [-87.3, 88.3]; below -87.3 (where results turn subnormal)
/// it gives 0, above 88.37 +inf (true overflow is at 88.72), NaN stays NaN.
#pragma once

#include <cmath>
#include <cstdint>

#include "qflash/kernels/common/cpu_simd.hpp"

namespace qflash::kernels {

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

}  // namespace qflash::kernels

#if QFLASH_HAS_X86_SIMD
QFLASH_SIMD_BEGIN
namespace qflash::kernels::simd {

QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m256 avx2_exp(__m256 x) {
  __m256 const lo = _mm256_set1_ps(-87.3365478515625f);  // ~ln(FLT_MIN)
  __m256 const hi = _mm256_set1_ps(88.3762626647949f);   // largest x with n <= 127
  __m256 const xc = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  __m256 const n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2 in two steps (ln2's high part has few bits, so n * hi is exact).
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  __m256i const e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
  y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
  return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

/// x / (1 + e^-x); +-inf give +inf and -0.
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m256 avx2_silu(__m256 x) {
  __m256 const one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(x, _mm256_add_ps(one, avx2_exp(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m256 avx2_sigmoid(__m256 x) {
  __m256 const one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, avx2_exp(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

}  // namespace qflash::kernels::simd
QFLASH_SIMD_END
#endif  // QFLASH_HAS_X86_SIMD
