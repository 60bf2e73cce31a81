/// @file
/// Scalar reference for kernels/qk_norm_rope: fp64 norm, then the fp64 RoPE reference; the
/// second set of heads, if any, as a call of its own.
#pragma once

#include <cmath>
#include <vector>

#include "qflash/kernels/qk_norm_rope/op.hpp"
#include "qflash/kernels/rope/ref.hpp"

namespace qflash::kernels::ref {

inline void qk_norm_rope(QkNormRopeArgs const& a) {
  std::int64_t const hs = a.head_stride_or_default(), ts = a.token_stride_or_default();
  std::vector<float> out(static_cast<std::size_t>(a.n_tokens * a.n_head * a.d_head));
  for (std::int64_t t = 0; t < a.n_tokens; ++t)
    for (int h = 0; h < a.n_head; ++h) {
      float const* x = a.x + t * ts + h * hs;
      double ss = 0;
      for (int i = 0; i < a.d_head; ++i) ss += static_cast<double>(x[i]) * x[i];
      double const inv = 1.0 / std::sqrt(ss / a.d_head + a.eps);
      float* y = out.data() + (t * a.n_head + h) * a.d_head;
      for (int i = 0; i < a.d_head; ++i) {
        double const w = a.weight_kind == NormWeight::kZeroCentered ? 1.0 + a.weight[i] : a.weight[i];
        y[i] = static_cast<float>(x[i] * inv * w);
      }
    }
  if (a.rotary_dim > 0) {
    RopeArgs r{};
    r.x = out.data();
    r.positions = a.positions;
    r.n_tokens = a.n_tokens;
    r.n_head = a.n_head;
    r.d_head = a.d_head;
    r.rotary_dim = a.rotary_dim;
    r.theta = a.theta;
    rope(r);
  }
  std::copy(out.begin(), out.end(), a.y);
  if (a.keys.x) qk_norm_rope(a.keys_call());
}

}  // namespace qflash::kernels::ref
