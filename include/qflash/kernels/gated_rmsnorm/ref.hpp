/// @file
/// Scalar reference for kernels/gated_rmsnorm: the formula in op.hpp in fp64, the truth in tests.
#pragma once

#include <cmath>
#include <cstdint>

#include "qflash/kernels/gated_rmsnorm/op.hpp"

namespace qflash::kernels::ref {

inline void gated_rmsnorm(GatedRmsNormArgs const& a) {
  std::int64_t const n = a.n_cols;
  for (std::int64_t r = 0; r < a.n_rows; ++r) {
    float const* x = a.x + r * n;
    float const* z = a.z + r * n;
    double ss = 0;
    for (std::int64_t c = 0; c < n; ++c) ss += double{x[c]} * x[c];
    double const inv = 1.0 / std::sqrt(ss / static_cast<double>(n) + a.eps);
    for (std::int64_t c = 0; c < n; ++c) {
      double const zc = z[c];
      double const silu = zc / (1.0 + std::exp(-zc));
      a.y[r * n + c] = static_cast<float>(double{a.weight[c]} * (x[c] * inv) * silu);
    }
  }
}

}  // namespace qflash::kernels::ref
