/// @file
/// Weight storage formats as data: each weight matrix carries its own format (per tensor, so
/// a mix such as q4_k_m is just a choice per tensor), its block layout, and a row decoder that
/// host and device kernels share. Rows are independent: row r of a [rows, cols] matrix is
/// `row_bytes(format, cols)` bytes at `data + r * row_bytes`, except fp8's block scales.
///
/// | format   | values/block | bytes/block | layout                                                  |
/// |----------|--------------|-------------|---------------------------------------------------------|
/// | f32      | 1            | 4           | IEEE binary32                                           |
/// | bf16     | 1            | 2           | upper half of binary32                                  |
/// | f16      | 1            | 2           | IEEE binary16                                           |
/// | fp8_e4m3 | 1            | 1           | e4m3 bytes x fp32 scale per 128x128 tile (Qwen FP8)     |
/// | q8_0     | 32           | 34          | GGUF block_q8_0 (cols must be a multiple of 32)         |
/// | q4_k     | 256          | 144         | GGUF block_q4_K (cols must be a multiple of 256)        |
/// | q6_k     | 256          | 210         | GGUF block_q6_K (cols must be a multiple of 256)        |
/// | int4     | 128          | 68          | BlockInt4G128: asymmetric group of 128; short last group |
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "qflash/core/config.hpp"
#include "qflash/numeric/bf16.hpp"
#include "qflash/numeric/fp16.hpp"
#include "qflash/numeric/fp8.hpp"
#include "qflash/numeric/fp8_block.hpp"
#include "qflash/numeric/gguf_blocks.hpp"
#include "qflash/numeric/int4.hpp"

namespace qflash {

/// Storage format of a weight matrix. In a MoeSpec, kAny means "every format" (the kernels
/// dispatch on each tensor's format); a specific format compiles that format's path only.
enum class WeightFormat : int {
  kAny = -1,
  kF32 = 0,
  kBf16 = 1,
  kFp8E4m3 = 2,  ///< e4m3 with fp32 scales per 128x128 tile
  kQ8_0 = 3,
  kQ4K = 4,
  kF16 = 5,
  kQ6K = 6,
  kInt4 = 7,  ///< asymmetric int4, groups of 128 along a row
};

inline constexpr WeightFormat kAllWeightFormats[] = {
    WeightFormat::kF32,  WeightFormat::kBf16, WeightFormat::kF16,  WeightFormat::kFp8E4m3,
    WeightFormat::kQ8_0, WeightFormat::kQ4K,  WeightFormat::kQ6K, WeightFormat::kInt4};

constexpr std::string_view to_string(WeightFormat w) {
  switch (w) {
    case WeightFormat::kAny: return "any";
    case WeightFormat::kF32: return "f32";
    case WeightFormat::kBf16: return "bf16";
    case WeightFormat::kF16: return "f16";
    case WeightFormat::kFp8E4m3: return "fp8_e4m3";
    case WeightFormat::kQ8_0: return "q8_0";
    case WeightFormat::kQ4K: return "q4_k";
    case WeightFormat::kQ6K: return "q6_k";
    case WeightFormat::kInt4: return "int4";
  }
  return "unknown";
}

/// Values per block along a row (1 for element formats).
QFLASH_HD constexpr int block_values(WeightFormat f) {
  switch (f) {
    case WeightFormat::kQ8_0: return gguf::kQ8_0BlockSize;
    case WeightFormat::kQ4K:
    case WeightFormat::kQ6K: return gguf::kQ4KBlockSize;
    case WeightFormat::kInt4: return kInt4GroupSize;
    default: return 1;
  }
}

/// Bytes per block (per element for element formats; 0 for kAny).
QFLASH_HD constexpr int block_bytes(WeightFormat f) {
  switch (f) {
    case WeightFormat::kF32: return 4;
    case WeightFormat::kBf16:
    case WeightFormat::kF16: return 2;
    case WeightFormat::kFp8E4m3: return 1;
    case WeightFormat::kQ8_0: return sizeof(gguf::BlockQ8_0);
    case WeightFormat::kQ4K: return sizeof(gguf::BlockQ4K);
    case WeightFormat::kQ6K: return sizeof(gguf::BlockQ6K);
    case WeightFormat::kInt4: return sizeof(BlockInt4G128);
    case WeightFormat::kAny: return 0;
  }
  return 0;
}

/// True when rows of `cols` values can be stored in `f`: GGUF blocks need whole blocks (as
/// ggml does); int4 allows a short last group.
QFLASH_HD constexpr bool row_fits(WeightFormat f, std::int64_t cols) {
  if (f == WeightFormat::kAny || cols <= 0) return false;
  if (f == WeightFormat::kQ8_0 || f == WeightFormat::kQ4K || f == WeightFormat::kQ6K)
    return cols % block_values(f) == 0;
  return true;
}

/// Bytes of one row of `cols` values (a row that fits).
QFLASH_HD constexpr std::int64_t row_bytes(WeightFormat f, std::int64_t cols) {
  std::int64_t const bv = block_values(f);
  return (cols + bv - 1) / bv * block_bytes(f);
}

/// Rows (or columns) of fp8's scale grid for `n` rows (columns).
QFLASH_HD constexpr std::int64_t fp8_scale_blocks(std::int64_t n) {
  return (n + kFp8BlockSize - 1) / kFp8BlockSize;
}

/// A weight matrix [rows = out features, cols = in features], row-major, not owned.
struct WeightView {
  WeightFormat format = WeightFormat::kF32;
  void const* data = nullptr;  // [rows, row_bytes(format, cols)] bytes
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  /// kFp8E4m3 only: the whole tensor's scale grid [ceil(R / 128), ceil(cols / 128)], and the
  /// tensor row that row 0 of this view is (a view may be a slice of a stacked tensor).
  float const* scales = nullptr;
  std::int64_t scale_row0 = 0;

  [[nodiscard]] QFLASH_HD std::int64_t row_bytes() const { return qflash::row_bytes(format, cols); }
  [[nodiscard]] QFLASH_HD std::byte const* row(std::int64_t r) const {
    return static_cast<std::byte const*>(data) + r * row_bytes();
  }
  /// kFp8E4m3: the scales of row r, one per 128 columns.
  [[nodiscard]] QFLASH_HD float const* scale_row(std::int64_t r) const {
    return scales + (scale_row0 + r) / kFp8BlockSize * fp8_scale_blocks(cols);
  }
  /// Rows [begin, begin + n) as their own view.
  [[nodiscard]] QFLASH_HD WeightView slice_rows(std::int64_t begin, std::int64_t n) const {
    WeightView v = *this;
    v.data = row(begin);
    v.rows = n;
    v.scale_row0 = scale_row0 + begin;
    return v;
  }
  /// Bytes of the matrix (not counting fp8 scales, which a slice shares with its tensor).
  [[nodiscard]] QFLASH_HD std::int64_t bytes() const { return rows * row_bytes(); }
};

/// Decodes row r of `w` into y[0, cols): the floats the format's reference dequantization
/// gives (ggml's for the GGUF blocks).
QFLASH_HD inline void dequantize_row(WeightView const& w, std::int64_t r, float* y) {
  std::byte const* src = w.row(r);
  std::int64_t const n = w.cols;
  switch (w.format) {
    case WeightFormat::kF32:
      for (std::int64_t i = 0; i < n; ++i) {
        float v;
        std::memcpy(&v, src + 4 * i, 4);
        y[i] = v;
      }
      return;
    case WeightFormat::kBf16:
    case WeightFormat::kF16:
      for (std::int64_t i = 0; i < n; ++i) {
        std::uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        y[i] = w.format == WeightFormat::kBf16 ? to_float(Bf16{h}) : to_float(Fp16{h});
      }
      return;
    case WeightFormat::kFp8E4m3:
      dequantize_fp8_row(reinterpret_cast<std::uint8_t const*>(src), w.scale_row(r), n, y);
      return;
    case WeightFormat::kQ8_0:
      gguf::dequantize_row_q8_0(reinterpret_cast<gguf::BlockQ8_0 const*>(src), static_cast<std::size_t>(n), y);
      return;
    case WeightFormat::kQ4K:
      gguf::dequantize_row_q4_k(reinterpret_cast<gguf::BlockQ4K const*>(src), static_cast<std::size_t>(n), y);
      return;
    case WeightFormat::kQ6K:
      gguf::dequantize_row_q6_k(reinterpret_cast<gguf::BlockQ6K const*>(src), static_cast<std::size_t>(n), y);
      return;
    case WeightFormat::kInt4:
      dequantize_row_int4_g128(reinterpret_cast<BlockInt4G128 const*>(src), static_cast<std::size_t>(n), y);
      return;
    case WeightFormat::kAny: return;
  }
}

}  // namespace qflash
