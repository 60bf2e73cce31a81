/// @file
/// INT4 weights, asymmetric, one (scale, min) pair per group of 128 consecutive values of a
/// row: our own format for expert weights, shared by the CPU and CUDA linear kernels.
///
/// Block, 68 bytes: fp16 scale, fp16 min, u8 qs[64];  x = scale * q + min,  q = 0..15.
/// Value i (0..127) of the group is nibble i % 2 of byte qs[i / 2] (low nibble for even i).
/// A row of `cols` values takes ceil(cols / 128) blocks; the last may be short, its unused
/// codes zero.
///
/// Quantization of a group x[0..n), lo = min x, hi = max x:
///   min = the largest fp16 <= lo,  scale = the smallest fp16 >= (hi - min) / 15,
///   q = clamp(round((x - min) / scale), 0, 15)   (q = 0 when scale == 0)
/// Rounding min down and scale up keeps [lo, hi] inside [min, min + 15 * scale], so each
/// element comes back within scale / 2 (plus fp32 rounding, a few ulp of max |x| + hi - lo).
/// A constant group whose value is an fp16 is exact. scale * q is exact in fp32 (11 + 4
/// significant bits), so dequantization rounds once and is the same with or without FMA.
#pragma once

#include <cstddef>
#include <cstdint>

#include "qflash/core/config.hpp"
#include "qflash/numeric/fp16.hpp"
#include "qflash/numeric/minifloat.hpp"

namespace qflash {

inline constexpr int kInt4GroupSize = 128;  ///< values per block
inline constexpr int kInt4Max = 15;         ///< codes are 0..15

/// One group of up to 128 values of a row.
struct BlockInt4G128 {
  Fp16 scale;
  Fp16 min;
  std::uint8_t qs[kInt4GroupSize / 2];
};
static_assert(sizeof(BlockInt4G128) == 68 && alignof(BlockInt4G128) == 2,
              "INT4 group-128 block is 68 bytes");

/// Bytes of one row of `cols` values.
QFLASH_HD constexpr std::size_t int4_g128_row_bytes(std::size_t cols) {
  return (cols + kInt4GroupSize - 1) / kInt4GroupSize * sizeof(BlockInt4G128);
}

/// The code (0..15) of value i (0..127) of a block.
QFLASH_HD constexpr std::uint8_t int4_g128_code(BlockInt4G128 const& b, int i) {
  std::uint8_t const byte = b.qs[i / 2];
  return static_cast<std::uint8_t>(i % 2 == 0 ? byte & 0xF : byte >> 4);
}

/// Quantizes one group (see the file comment).
/// @param x  [n] finite values with |x| <= 65504 (the fp16 max), 1 <= n <= 128
/// @param b  the block; codes n..127 are zero
QFLASH_HD constexpr void quantize_int4_g128(float const* x, int n, BlockInt4G128& b) {
  float lo = x[0];
  float hi = x[0];
  for (int i = 1; i < n; ++i) {
    lo = x[i] < lo ? x[i] : lo;
    hi = x[i] > hi ? x[i] : hi;
  }
  b = {};
  b.min = to_fp16_down(lo);
  float const min = to_float(b.min);
  b.scale = to_fp16_up((hi - min) / kInt4Max);
  float const scale = to_float(b.scale);
  if (!(scale > 0.0f)) return;  // hi == min: every x is min, every code 0
  for (int i = 0; i < n; ++i) {
    float v = (x[i] - min) / scale;
    v = v > static_cast<float>(kInt4Max) ? static_cast<float>(kInt4Max) : v;
    int const q = v > 0.0f ? qflash::detail::round_half_away(v) : 0;
    b.qs[i / 2] = static_cast<std::uint8_t>(b.qs[i / 2] | q << (4 * (i % 2)));
  }
}

/// @param n  values to dequantize, 1 <= n <= 128
/// @param y  [n] values: scale * q + min
QFLASH_HD constexpr void dequantize_int4_g128(BlockInt4G128 const& b, int n, float* y) {
  float const scale = to_float(b.scale);
  float const min = to_float(b.min);
  for (int i = 0; i < n; ++i) y[i] = scale * static_cast<float>(int4_g128_code(b, i)) + min;
}

/// Quantizes a row of `cols` values (any count >= 1; the last group may be short).
/// @param x       [cols]
/// @param blocks  [ceil(cols / 128)]
QFLASH_HD constexpr void quantize_row_int4_g128(float const* x, std::size_t cols,
                                                BlockInt4G128* blocks) {
  for (std::size_t g = 0; g * kInt4GroupSize < cols; ++g) {
    std::size_t const left = cols - g * kInt4GroupSize;
    int const n = left < kInt4GroupSize ? static_cast<int>(left) : kInt4GroupSize;
    quantize_int4_g128(x + g * kInt4GroupSize, n, blocks[g]);
  }
}

/// Dequantizes a row of `cols` values.
/// @param blocks  [ceil(cols / 128)]
/// @param y       [cols]
QFLASH_HD constexpr void dequantize_row_int4_g128(BlockInt4G128 const* blocks, std::size_t cols,
                                                  float* y) {
  for (std::size_t g = 0; g * kInt4GroupSize < cols; ++g) {
    std::size_t const left = cols - g * kInt4GroupSize;
    int const n = left < kInt4GroupSize ? static_cast<int>(left) : kInt4GroupSize;
    dequantize_int4_g128(blocks[g], n, y + g * kInt4GroupSize);
  }
}

}  // namespace qflash
