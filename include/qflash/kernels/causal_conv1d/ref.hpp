/// @file
/// Scalar reference for kernels/causal_conv1d: the formula in op.hpp, fp64 sums, the truth
/// in tests.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "qflash/kernels/causal_conv1d/op.hpp"

namespace qflash::kernels::ref {

inline void causal_conv1d(CausalConv1dArgs const& a) {
  int const k = a.d_conv;
  std::int64_t const n_ch = a.n_channels;
  // in(s) for s in [-(K-1), n_tokens): the state, then this call's inputs.
  auto input = [&](std::int64_t s, std::int64_t c) -> double {
    return s < 0 ? a.state[c * (k - 1) + (k - 1) + s] : a.x[s * n_ch + c];
  };
  for (std::int64_t t = 0; t < a.n_tokens; ++t)
    for (std::int64_t c = 0; c < n_ch; ++c) {
      double acc = 0;
      for (int j = 0; j < k; ++j) acc += double{a.weight[c * k + j]} * input(t - (k - 1) + j, c);
      a.y[t * n_ch + c] = static_cast<float>(a.apply_silu ? acc / (1.0 + std::exp(-acc)) : acc);
    }
  // New state: the last K-1 entries of [state, x].
  std::vector<float> next(static_cast<std::size_t>(n_ch * (k - 1)));
  for (std::int64_t c = 0; c < n_ch; ++c)
    for (int i = 0; i < k - 1; ++i)
      next[static_cast<std::size_t>(c * (k - 1) + i)] =
          static_cast<float>(input(a.n_tokens - (k - 1) + i, c));
  for (std::size_t i = 0; i < next.size(); ++i) a.state[i] = next[i];
}

}  // namespace qflash::kernels::ref
