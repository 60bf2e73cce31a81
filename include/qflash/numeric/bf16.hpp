/// @file
/// bfloat16 as a plain 16-bit value with software conversions, so host code, device code and
/// file loaders share one rounding without including `cuda_bf16.h`.
///
/// Conversions match CUDA's `__float2bfloat16_rn` / `__bfloat162float` bit for bit (checked
/// against its host implementation in tests/numeric): round to nearest even, overflow to Inf,
/// every NaN -> 0x7FFF; widening keeps the NaN payload.
#pragma once

#include <cstdint>

#include "qflash/core/config.hpp"
#include "qflash/numeric/minifloat.hpp"

namespace qflash {

/// bfloat16: 1 sign, 8 exponent, 7 mantissa bits; the upper half of an fp32.
struct Bf16 {
  std::uint16_t bits;
};

namespace detail {
inline constexpr MiniFloatFormat kBf16Format{.man_bits = 7,
                                             .bias = 127,
                                             .total_bits = 16,
                                             .max_finite = 0x7F7F,
                                             .overflow = 0x7F80,
                                             .nan = 0x7FFF,
                                             .has_inf = true};
}  // namespace detail

/// fp32 -> bf16, round to nearest even.
QFLASH_HD constexpr Bf16 to_bf16(float x) {
  return {static_cast<std::uint16_t>(detail::encode_minifloat(x, detail::kBf16Format, false))};
}

/// bf16 -> fp32, exact.
QFLASH_HD constexpr float to_float(Bf16 x) {
  return detail::float_of(static_cast<std::uint32_t>(x.bits) << 16);
}

/// `x` rounded to the nearest bf16 value, as fp32: what storing to bf16 and loading back gives.
QFLASH_HD constexpr float round_to_bf16(float x) { return to_float(to_bf16(x)); }

}  // namespace qflash
