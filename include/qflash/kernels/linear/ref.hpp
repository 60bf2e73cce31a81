/// @file
/// Scalar reference for kernels/linear: each weight row decoded by the format's reference
/// dequantization, the activations rounded as the op rounds them, fp64 accumulation; the
/// truth in tests.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "qflash/kernels/linear/op.hpp"
#include "qflash/numeric/gguf_blocks.hpp"

namespace qflash::kernels::ref {

/// Rounds n activations in place to what a projection by format f multiplies: unchanged, or
/// for q8_0 and int4 (blocks of 32; int4's last one may be short) / q4_k and q6_k (q8_k
/// blocks of 256) the dequantized 8-bit blocks.
inline void round_activations(WeightFormat f, float* x, std::int64_t n) {
  if (f == WeightFormat::kQ8_0 || f == WeightFormat::kInt4) {
    for (std::int64_t b = 0; b < n; b += gguf::kQ8_0BlockSize) {
      if (f == WeightFormat::kQ8_0 && b + gguf::kQ8_0BlockSize > n) break;
      float block[gguf::kQ8_0BlockSize] = {};
      std::int64_t const len = std::min<std::int64_t>(gguf::kQ8_0BlockSize, n - b);
      std::copy_n(x + b, len, block);
      gguf::dequantize_q8_0(gguf::quantize_q8_0_activations(block), block);
      std::copy_n(block, len, x + b);
    }
  } else if (f == WeightFormat::kQ4K || f == WeightFormat::kQ6K) {
    for (std::int64_t b = 0; b + gguf::kQ4KBlockSize <= n; b += gguf::kQ4KBlockSize) {
      gguf::BlockQ8K const q = gguf::quantize_q8_k(x + b);
      for (int i = 0; i < gguf::kQ4KBlockSize; ++i) x[b + i] = q.d * static_cast<float>(q.qs[i]);
    }
  }
}

inline void linear(LinearArgs const& a) {
  std::int64_t const xs = a.x_stride ? a.x_stride : a.w.cols;
  std::int64_t const ys = a.y_stride ? a.y_stride : a.w.rows;
  std::vector<float> x(static_cast<std::size_t>(a.n_tokens * a.w.cols));
  for (std::int64_t t = 0; t < a.n_tokens; ++t) {
    std::copy_n(a.x + t * xs, a.w.cols, x.data() + t * a.w.cols);
    round_activations(a.w.format, x.data() + t * a.w.cols, a.w.cols);
  }
  std::vector<float> row(static_cast<std::size_t>(a.w.cols));
  for (std::int64_t o = 0; o < a.w.rows; ++o) {
    dequantize_row(a.w, o, row.data());
    for (std::int64_t t = 0; t < a.n_tokens; ++t) {
      double acc = 0;
      for (std::int64_t i = 0; i < a.w.cols; ++i)
        acc += static_cast<double>(x[static_cast<std::size_t>(t * a.w.cols + i)]) * row[static_cast<std::size_t>(i)];
      float& out = a.y[t * ys + o];
      out = static_cast<float>(acc) + (a.accumulate ? out : 0.0f);
    }
  }
}

}  // namespace qflash::kernels::ref
