/// @file
/// Scalar reference for kernels/linear: each weight row decoded by the format's reference
/// dequantization, fp64 accumulation; the truth in tests.
#pragma once

#include <cstdint>
#include <vector>

#include "qflash/kernels/linear/op.hpp"

namespace qflash::kernels::ref {

inline void linear(LinearArgs const& a) {
  std::int64_t const xs = a.x_stride ? a.x_stride : a.w.cols;
  std::int64_t const ys = a.y_stride ? a.y_stride : a.w.rows;
  std::vector<float> row(static_cast<std::size_t>(a.w.cols));
  for (std::int64_t o = 0; o < a.w.rows; ++o) {
    dequantize_row(a.w, o, row.data());
    for (std::int64_t t = 0; t < a.n_tokens; ++t) {
      double acc = 0;
      for (std::int64_t i = 0; i < a.w.cols; ++i)
        acc += static_cast<double>(a.x[t * xs + i]) * row[static_cast<std::size_t>(i)];
      float& out = a.y[t * ys + o];
      out = static_cast<float>(acc) + (a.accumulate ? out : 0.0f);
    }
  }
}

}  // namespace qflash::kernels::ref
