/// @file
/// Scalar reference for kernels/rope: angles and rotation in fp64.
#pragma once

#include <cmath>

#include "qflash/kernels/rope/op.hpp"

namespace qflash::kernels::ref {

inline void rope(RopeArgs const& a) {
  int const half = a.rotary_dim / 2;
  for (std::int64_t t = 0; t < a.n_tokens; ++t)
    for (int h = 0; h < a.n_head; ++h) {
      float* v = a.x + (t * a.n_head + h) * a.d_head;
      for (int j = 0; j < half; ++j) {
        double const ang = static_cast<double>(a.positions[t]) *
                           std::pow(static_cast<double>(a.theta), -2.0 * j / a.rotary_dim);
        double const c = std::cos(ang), s = std::sin(ang);
        double const x0 = v[j], x1 = v[j + half];
        v[j] = static_cast<float>(x0 * c - x1 * s);
        v[j + half] = static_cast<float>(x1 * c + x0 * s);
      }
    }
}

}  // namespace qflash::kernels::ref
