/// @file
/// Finding NaN and Inf in float data fast enough to check every step's logits.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>

namespace qflash {

/// True when v is NaN or Inf: its exponent bits are all ones.
constexpr bool non_finite_bits(float v) {
  constexpr std::uint32_t kExponent = 0x7f800000u;
  return (std::bit_cast<std::uint32_t>(v) & kExponent) == kExponent;
}

/// True when no value is NaN or Inf. An integer count over the bit patterns, so the loop
/// vectorises at -O3 (a float compare folded into a bool did not: 49 us for 64 Ki logits
/// against 6 us).
inline bool all_finite(std::span<float const> x) {
  std::uint32_t n = 0;
  for (float v : x) n += non_finite_bits(v) ? 1u : 0u;
  return n == 0;
}

/// Index of the first NaN or Inf, or x.size().
inline std::size_t first_non_finite(std::span<float const> x) {
  if (all_finite(x)) return x.size();
  std::size_t i = 0;
  while (!non_finite_bits(x[i])) ++i;
  return i;
}

}  // namespace qflash
