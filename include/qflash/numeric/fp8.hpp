/// @file
/// FP8 e4m3 (the "fn" variant: no Inf) and e5m2 as plain bytes with software conversions that
/// match CUDA's `__nv_cvt_float_to_fp8` and `__nv_cvt_fp8_to_halfraw` + `__half2float` bit for
/// bit (host implementations; tests/numeric/numeric_vs_cuda_test.cpp), so FP8 KV and weights
/// are encoded the same on CPU and GPU without including `cuda_fp8.h`.
///
/// What CUDA does, and so what this does, for fp32 -> fp8 (round to nearest even):
/// - NaN (either sign, any payload) -> 0x7F, a positive NaN, in both formats.
/// - kSatFinite: |x| past the largest finite value, and +-Inf, -> +-max finite
///   (e4m3 0x7E/0xFE = +-448, e5m2 0x7B/0xFB = +-57344).
/// - kNoSat: those -> e4m3 +-NaN (0x7F/0xFF), e5m2 +-Inf (0x7C/0xFC).
/// - "Past the largest" means rounding beyond it: e4m3 |x| > 464 (464 ties to even 448),
///   e5m2 |x| >= 61440 (ties to even 65536 = Inf).
/// - Subnormals round to nearest even; |x| <= half the smallest subnormal gives +-0 with the
///   sign kept (e4m3 smallest subnormal 2^-9, e5m2 2^-16).
/// fp8 -> fp32 is exact; NaN codes give 0x7FFFFFFF (sign dropped, as CUDA's host path does).
#pragma once

#include <cstdint>

#include "qflash/core/config.hpp"
#include "qflash/numeric/minifloat.hpp"

namespace qflash {

/// e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; max 448; NaN = 0x7F, 0xFF; no Inf.
struct Fp8E4m3 {
  std::uint8_t bits;
};

/// e5m2: 1 sign, 5 exponent (bias 15), 2 mantissa bits; max 57344; IEEE-style Inf and NaN.
struct Fp8E5m2 {
  std::uint8_t bits;
};

inline constexpr float kFp8E4m3Max = 448.0f;
inline constexpr float kFp8E5m2Max = 57344.0f;

/// What fp32 -> fp8 does with values beyond the largest finite fp8 (CUDA's __nv_saturation_t).
enum class Fp8Saturation : std::uint8_t {
  kSatFinite = 0,  ///< clamp to +-max finite, Inf included (`__NV_SATFINITE`; what PTX cvt does)
  kNoSat = 1,      ///< e4m3 -> NaN, e5m2 -> Inf (`__NV_NOSAT`)
};

namespace detail {
inline constexpr MiniFloatFormat kFp8E4m3Format{.man_bits = 3,
                                                .bias = 7,
                                                .total_bits = 8,
                                                .max_finite = 0x7E,
                                                .overflow = 0x7F,
                                                .nan = 0x7F,
                                                .has_inf = false};
inline constexpr MiniFloatFormat kFp8E5m2Format{.man_bits = 2,
                                                .bias = 15,
                                                .total_bits = 8,
                                                .max_finite = 0x7B,
                                                .overflow = 0x7C,
                                                .nan = 0x7F,
                                                .has_inf = true};
}  // namespace detail

/// fp32 -> e4m3, round to nearest even; see the file comment for NaN and overflow.
QFLASH_HD constexpr Fp8E4m3 to_fp8_e4m3(float x, Fp8Saturation s = Fp8Saturation::kSatFinite) {
  return {static_cast<std::uint8_t>(
      detail::encode_minifloat(x, detail::kFp8E4m3Format, s == Fp8Saturation::kSatFinite))};
}

/// fp32 -> e5m2, round to nearest even; see the file comment for NaN and overflow.
QFLASH_HD constexpr Fp8E5m2 to_fp8_e5m2(float x, Fp8Saturation s = Fp8Saturation::kSatFinite) {
  return {static_cast<std::uint8_t>(
      detail::encode_minifloat(x, detail::kFp8E5m2Format, s == Fp8Saturation::kSatFinite))};
}

namespace detail {

/// e4m3 -> fp32 without branches, equal to decode_minifloat bit for bit: the code's exponent
/// and mantissa go into an fp32's bits, the exponent raised by 127 - 7; a subnormal code
/// (exponent 0) takes exponent 1 and drops the implicit one by subtracting 2^-6, exactly. No
/// step makes or reads an fp32 subnormal, so flush-to-zero builds decode alike. The sign goes
/// on after; S.1111.111 is NaN. What the device decodes with (no per-value branches in a
/// GEMV's inner loop).
QFLASH_HD constexpr float decode_e4m3_branchless(std::uint8_t code) {
  std::uint32_t const mag = code & 0x7Fu;
  bool const subnormal = mag < 0x08u;
  float const v = float_of((mag << 20) + ((subnormal ? 121u : 120u) << 23)) - (subnormal ? 0x1p-6f : 0.0f);
  return mag == 0x7Fu ? float_of(kCanonicalNanBits) : float_of(bits_of(v) | (std::uint32_t{code} & 0x80u) << 24);
}

}  // namespace detail

/// e4m3 -> fp32, exact.
QFLASH_HD constexpr float to_float(Fp8E4m3 x) {
#ifdef __CUDA_ARCH__
  return detail::decode_e4m3_branchless(x.bits);
#else
  return detail::decode_minifloat(x.bits, detail::kFp8E4m3Format);
#endif
}

/// e5m2 -> fp32, exact.
QFLASH_HD constexpr float to_float(Fp8E5m2 x) {
  return detail::decode_minifloat(x.bits, detail::kFp8E5m2Format);
}

/// `x` rounded to the nearest e4m3 value (saturating), as fp32.
QFLASH_HD constexpr float round_to_fp8_e4m3(float x) { return to_float(to_fp8_e4m3(x)); }

/// `x` rounded to the nearest e5m2 value (saturating), as fp32.
QFLASH_HD constexpr float round_to_fp8_e5m2(float x) { return to_float(to_fp8_e5m2(x)); }

}  // namespace qflash
