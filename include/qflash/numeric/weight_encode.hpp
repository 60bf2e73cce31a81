/// @file
/// Encoding fp32 matrices into a WeightFormat: what quantize-at-load and tests use. Host
/// only. The GGUF blocks use the quantizers of numeric/gguf_blocks.hpp (q8_0 bit-exact with
/// ggml's reference quantizer; q4_k/q6_k simple reference quantizers in ggml's block layout).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/numeric/weight_format.hpp"

namespace qflash {

/// One fp32 row of n values in format f (not fp8, whose scales span 128 rows).
/// @param out  row_bytes(f, n) bytes
inline void encode_row(WeightFormat f, float const* x, std::int64_t n, std::byte* out) {
  std::size_t const un = static_cast<std::size_t>(n);
  QFLASH_CHECK(row_fits(f, n), "a row of ", n, " values does not fit format ", to_string(f));
  switch (f) {
    case WeightFormat::kF32: std::memcpy(out, x, un * 4); return;
    case WeightFormat::kBf16:
    case WeightFormat::kF16:
      for (std::size_t i = 0; i < un; ++i) {
        std::uint16_t const h = f == WeightFormat::kBf16 ? to_bf16(x[i]).bits : to_fp16(x[i]).bits;
        std::memcpy(out + 2 * i, &h, 2);
      }
      return;
    case WeightFormat::kQ8_0: gguf::quantize_row_q8_0(x, un, reinterpret_cast<gguf::BlockQ8_0*>(out)); return;
    case WeightFormat::kQ4K: gguf::quantize_row_q4_k(x, un, reinterpret_cast<gguf::BlockQ4K*>(out)); return;
    case WeightFormat::kQ6K: gguf::quantize_row_q6_k(x, un, reinterpret_cast<gguf::BlockQ6K*>(out)); return;
    case WeightFormat::kInt4: quantize_row_int4_g128(x, un, reinterpret_cast<BlockInt4G128*>(out)); return;
    default: QFLASH_CHECK(false, "encode_row: no row encoding for ", to_string(f));
  }
}

/// A matrix that owns its bytes (and fp8 scale grid); `view` points into them.
struct OwnedMatrix {
  std::vector<std::byte> bytes;
  std::vector<float> scales;
  WeightView view;

  OwnedMatrix() = default;
  OwnedMatrix(OwnedMatrix const&) = delete;
  OwnedMatrix(OwnedMatrix&&) = default;  // vectors keep their buffers: view stays valid
};

/// x [rows, cols] encoded in format f.
inline OwnedMatrix encode_matrix(WeightFormat f, float const* x, std::int64_t rows, std::int64_t cols) {
  OwnedMatrix m;
  m.view = WeightView{f, nullptr, rows, cols};
  m.bytes.resize(static_cast<std::size_t>(m.view.bytes()));
  m.view.data = m.bytes.data();
  if (f == WeightFormat::kFp8E4m3) {
    m.scales.resize(static_cast<std::size_t>(fp8_scale_blocks(rows) * fp8_scale_blocks(cols)));
    quantize_fp8_block(x, static_cast<std::size_t>(rows), static_cast<std::size_t>(cols),
                       reinterpret_cast<std::uint8_t*>(m.bytes.data()), m.scales.data());
    m.view.scales = m.scales.data();
  } else {
    for (std::int64_t r = 0; r < rows; ++r) encode_row(f, x + r * cols, cols, m.bytes.data() + r * m.view.row_bytes());
  }
  return m;
}

}  // namespace qflash
