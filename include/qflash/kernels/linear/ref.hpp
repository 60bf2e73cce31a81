/// @file
/// Scalar reference for kernels/linear: fp64 accumulation, the truth in tests.
#pragma once

#include <cstdint>
#include <cstring>

#include "qflash/kernels/common/bf16_bits.hpp"
#include "qflash/kernels/linear/op.hpp"

namespace qflash::kernels::ref {

/// One weight element as float, whatever the view's dtype.
inline float weight_at(WeightView const& w, std::int64_t r, std::int64_t c) {
  std::size_t const i = static_cast<std::size_t>(r * w.cols + c);
  if (w.dtype == DType::kBF16) {
    bf16_bits bits;
    std::memcpy(&bits, static_cast<std::byte const*>(w.data) + 2 * i, 2);
    return bf16_to_float(bits);
  }
  return static_cast<float const*>(w.data)[i];
}

inline void linear(LinearArgs const& a) {
  std::int64_t const xs = a.x_stride ? a.x_stride : a.w.cols;
  std::int64_t const ys = a.y_stride ? a.y_stride : a.w.rows;
  for (std::int64_t t = 0; t < a.n_tokens; ++t)
    for (std::int64_t o = 0; o < a.w.rows; ++o) {
      double acc = 0;
      for (std::int64_t i = 0; i < a.w.cols; ++i)
        acc += static_cast<double>(a.x[t * xs + i]) * weight_at(a.w, o, i);
      float& out = a.y[t * ys + o];
      out = static_cast<float>(acc) + (a.accumulate ? out : 0.0f);
    }
}

}  // namespace qflash::kernels::ref
