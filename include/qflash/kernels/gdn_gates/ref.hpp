/// @file
/// Scalar reference for kernels/gdn_gates, in fp64.
#pragma once

#include <cmath>

#include "qflash/kernels/gdn_gates/op.hpp"

namespace qflash::kernels::ref {

inline void gdn_gates(GdnGatesArgs const& a) {
  for (std::int64_t t = 0; t < a.n_tokens; ++t)
    for (int h = 0; h < a.n_head_v; ++h) {
      std::int64_t const i = t * a.n_head_v + h;
      a.beta[i] = static_cast<float>(1.0 / (1.0 + std::exp(-static_cast<double>(a.beta[i]))));
      double const x = static_cast<double>(a.g[i]) + a.dt_bias[h];
      double const softplus = x > 20.0 ? x : std::log1p(std::exp(x));
      a.g[i] = static_cast<float>(a.neg_a[h] * softplus);
    }
}

}  // namespace qflash::kernels::ref
