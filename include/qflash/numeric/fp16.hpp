/// @file
/// IEEE 754 binary16 as a plain 16-bit value with software conversions, so host code, device
/// code and GGUF block scales share one rounding without including `cuda_fp16.h`.
///
/// Conversions match CUDA's `__float2half_rn` / `__half2float` host implementations bit for
/// bit (tests/numeric): round to nearest even including subnormals, overflow to Inf, every
/// NaN -> 0x7FFF, and fp16 NaN -> fp32 0x7FFFFFFF.
#pragma once

#include <cstdint>

#include "qflash/core/config.hpp"
#include "qflash/numeric/minifloat.hpp"

namespace qflash {

/// binary16: 1 sign, 5 exponent, 10 mantissa bits; max 65504, smallest subnormal 2^-24.
struct Fp16 {
  std::uint16_t bits;
};

inline constexpr float kFp16Max = 65504.0f;

namespace detail {
inline constexpr MiniFloatFormat kFp16Format{.man_bits = 10,
                                             .bias = 15,
                                             .total_bits = 16,
                                             .max_finite = 0x7BFF,
                                             .overflow = 0x7C00,
                                             .nan = 0x7FFF,
                                             .has_inf = true};
}  // namespace detail

/// fp32 -> fp16, round to nearest even.
QFLASH_HD constexpr Fp16 to_fp16(float x) {
  return {static_cast<std::uint16_t>(detail::encode_minifloat(x, detail::kFp16Format, false))};
}

namespace detail {

/// fp16 -> fp32 without branches, equal to decode_minifloat bit for bit: exponent and mantissa
/// placed in an fp32's bits and scaled by 2^(127 - 15) (exponent 0 lands in fp32's subnormals,
/// which the scaling renormalises), the sign after; exponent 31 is Inf or NaN. The device's
/// decode (GGUF block scales and f16 rows in GEMV inner loops); needs subnormals kept.
QFLASH_HD constexpr float decode_f16_scaled(std::uint16_t code) {
  std::uint32_t const mag = code & 0x7FFFu;
  std::uint32_t const sign = (std::uint32_t{code} & 0x8000u) << 16;
  float const v = float_of(mag << 13) * 0x1p112f;
  std::uint32_t const special = mag == 0x7C00u ? sign | 0x7F800000u : kCanonicalNanBits;
  return float_of(mag >= 0x7C00u ? special : bits_of(v) | sign);
}

}  // namespace detail

/// fp16 -> fp32, exact (NaN becomes the canonical 0x7FFFFFFF).
QFLASH_HD constexpr float to_float(Fp16 x) {
#ifdef __CUDA_ARCH__
  return detail::decode_f16_scaled(x.bits);
#else
  return detail::decode_minifloat(x.bits, detail::kFp16Format);
#endif
}

/// `x` rounded to the nearest fp16 value, as fp32.
QFLASH_HD constexpr float round_to_fp16(float x) { return to_float(to_fp16(x)); }

/// The smallest fp16 >= v, for finite 0 <= v <= the fp16 max: a stored scale that does not
/// shrink the range it must cover.
QFLASH_HD constexpr Fp16 to_fp16_up(float v) {
  Fp16 h = to_fp16(v);
  if (to_float(h) < v) ++h.bits;
  return h;
}

/// The largest fp16 <= v, for finite v with |v| <= the fp16 max: a stored minimum that stays
/// at or below the values it must cover.
QFLASH_HD constexpr Fp16 to_fp16_down(float v) {
  Fp16 h = to_fp16(v);
  // A step toward -inf: down in magnitude if positive, up if negative (-0 -> -2^-24).
  if (to_float(h) > v) h.bits = static_cast<std::uint16_t>((h.bits & 0x8000) != 0 ? h.bits + 1 : h.bits - 1);
  return h;
}

}  // namespace qflash
