/// @file
/// Scalar bf16 <-> fp32 on raw bits, for host kernels and references. Kept apart from
/// `numeric/bf16.hpp` for one reason: a NaN keeps its sign and payload here, as the kernels'
/// SIMD conversions (cpu_simd.hpp) do, where numeric's `to_bf16` returns CUDA's 0x7FFF.
/// Non-NaN results are identical.
#pragma once

#include <bit>
#include <cstdint>

namespace qflash::kernels {

/// bf16 as it lies in memory: the upper 16 bits of a binary32.
using bf16_bits = std::uint16_t;

/// Exact: every bf16 is a binary32.
constexpr float bf16_to_float(bf16_bits b) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

/// Round to nearest, ties to even. NaN stays NaN (sign and top payload bits kept, quiet bit
/// set, so a NaN whose payload lies only in the dropped bits does not turn into infinity);
/// overflow rounds to infinity; subnormals round like any other value (no flush to zero).
constexpr bf16_bits float_to_bf16(float f) {
  std::uint32_t const u = std::bit_cast<std::uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16_bits>((u >> 16) | 0x0040u);
  std::uint32_t const lsb = (u >> 16) & 1u;
  return static_cast<bf16_bits>((u + 0x7fffu + lsb) >> 16);
}

}  // namespace qflash::kernels
