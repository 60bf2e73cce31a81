/// @file
/// FP8 e4m3 weights with one fp32 scale per 128 x 128 tile: the layout of the FP8 checkpoints
/// DeepSeek and Qwen publish, so those weights can be used as stored.
///
/// A weight [rows, cols] is stored as e4m3 bytes, row-major, next to `weight_scale_inv`, fp32
/// [ceil(rows / 128), ceil(cols / 128)], row-major (edge tiles may be partial), and
///   w[r][c] = to_float(q[r][c]) * scale_inv[r / 128][c / 128].
/// Despite its name, scale_inv multiplies: it is the quantizer's scale amax / 448.
///
/// Quantization, per tile: scale = amax / 448 (1 for an all-zero tile), q = e4m3(w / scale),
/// saturating. For |w| / scale >= 2^-6 (e4m3's normal range) an element comes back within
/// 2^-4 of |w| relative (half an e4m3 ulp, plus fp32 rounding); below that, within 2^-10 *
/// scale absolute (half the smallest e4m3 subnormal).
#pragma once

#include <cstddef>
#include <cstdint>

#include "qflash/core/config.hpp"
#include "qflash/numeric/fp8.hpp"

namespace qflash {

inline constexpr int kFp8BlockSize = 128;  ///< tile side of the scale grid

/// Shape of the scale grid of a [rows, cols] weight.
struct Fp8BlockScaleDims {
  std::size_t rows;
  std::size_t cols;
};

/// [ceil(rows / 128), ceil(cols / 128)]
QFLASH_HD constexpr Fp8BlockScaleDims fp8_block_scale_dims(std::size_t rows, std::size_t cols) {
  return {(rows + kFp8BlockSize - 1) / kFp8BlockSize, (cols + kFp8BlockSize - 1) / kFp8BlockSize};
}

/// Quantizes a weight tile by tile (see the file comment).
/// @param w          [rows, cols] finite values
/// @param q          [rows, cols] e4m3 bytes
/// @param scale_inv  fp8_block_scale_dims(rows, cols), fp32
QFLASH_HD constexpr void quantize_fp8_block(float const* w, std::size_t rows, std::size_t cols,
                                            std::uint8_t* q, float* scale_inv) {
  Fp8BlockScaleDims const grid = fp8_block_scale_dims(rows, cols);
  std::size_t const bs = kFp8BlockSize;
  for (std::size_t tr = 0; tr < grid.rows; ++tr) {
    std::size_t const r0 = tr * bs;
    std::size_t const r1 = r0 + bs < rows ? r0 + bs : rows;
    for (std::size_t tc = 0; tc < grid.cols; ++tc) {
      std::size_t const c0 = tc * bs;
      std::size_t const c1 = c0 + bs < cols ? c0 + bs : cols;
      float amax = 0.0f;
      for (std::size_t r = r0; r < r1; ++r) {
        for (std::size_t c = c0; c < c1; ++c) {
          float const v = w[r * cols + c];
          float const a = v < 0.0f ? -v : v;
          amax = a > amax ? a : amax;
        }
      }
      float scale = amax / kFp8E4m3Max;
      if (!(scale > 0.0f)) scale = 1.0f;  // all zeros (or amax / 448 underflows)
      scale_inv[tr * grid.cols + tc] = scale;
      for (std::size_t r = r0; r < r1; ++r) {
        for (std::size_t c = c0; c < c1; ++c) {
          q[r * cols + c] = to_fp8_e4m3(w[r * cols + c] / scale, Fp8Saturation::kSatFinite).bits;
        }
      }
    }
  }
}

/// Dequantizes one weight row.
/// @param q_row          [cols] e4m3 bytes of row r
/// @param scale_inv_row  [ceil(cols / 128)] row r / 128 of the scale grid
/// @param y              [cols]
QFLASH_HD constexpr void dequantize_fp8_row(std::uint8_t const* q_row, float const* scale_inv_row,
                                            std::size_t cols, float* y) {
  for (std::size_t c = 0; c < cols; ++c) {
    y[c] = to_float(Fp8E4m3{q_row[c]}) * scale_inv_row[c / kFp8BlockSize];
  }
}

}  // namespace qflash
