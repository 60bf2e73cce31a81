/// @file
/// Scalar reference for kernels/gated_delta: the per-token recurrence of op.hpp, literally,
/// with the state and all sums in fp64 (rounded to fp32 only when stored). The truth in tests.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "qflash/kernels/gated_delta/op.hpp"

namespace qflash::kernels::ref {

inline void gated_delta(GatedDeltaArgs const& a) {
  std::int64_t const dk = a.d_k, dv = a.d_v;
  std::int64_t const qs = a.q_stride_or_default(), ks = a.k_stride_or_default(), vs = a.v_stride_or_default();
  std::vector<double> buf(static_cast<std::size_t>(dk * dv + 2 * dk + dv));
  double* const s = buf.data();  // [dk, dv]
  double* const q = s + dk * dv;  // [dk]
  double* const k = q + dk;       // [dk]
  double* const delta = k + dk;   // [dv]
  auto l2norm = [&](float const* x, double scale, double* y) {
    double ss = 0;
    for (std::int64_t i = 0; i < dk; ++i) ss += double{x[i]} * x[i];
    double const f = scale / std::sqrt(ss + a.l2norm_eps);
    for (std::int64_t i = 0; i < dk; ++i) y[i] = x[i] * f;
  };
  for (int h = 0; h < a.n_head_v; ++h) {
    int const kh = a.key_head(h);
    float* const state = a.state + h * dk * dv;
    for (std::int64_t i = 0; i < dk * dv; ++i) s[i] = state[i];
    for (std::int64_t t = 0; t < a.n_tokens; ++t) {
      l2norm(a.q + t * qs + kh * dk, 1.0 / std::sqrt(static_cast<double>(dk)), q);
      l2norm(a.k + t * ks + kh * dk, 1.0, k);
      float const* v = a.v + t * vs + h * dv;
      double const decay = std::exp(double{a.g[t * a.n_head_v + h]});
      double const beta = a.beta[t * a.n_head_v + h];
      for (std::int64_t i = 0; i < dk * dv; ++i) s[i] *= decay;
      for (std::int64_t c = 0; c < dv; ++c) {
        double u = 0;
        for (std::int64_t i = 0; i < dk; ++i) u += s[i * dv + c] * k[i];
        delta[c] = beta * (v[c] - u);
      }
      for (std::int64_t i = 0; i < dk; ++i)
        for (std::int64_t c = 0; c < dv; ++c) s[i * dv + c] += k[i] * delta[c];
      float* o = a.out + (t * a.n_head_v + h) * dv;
      for (std::int64_t c = 0; c < dv; ++c) {
        double acc = 0;
        for (std::int64_t i = 0; i < dk; ++i) acc += s[i * dv + c] * q[i];
        o[c] = static_cast<float>(acc);
      }
    }
    for (std::int64_t i = 0; i < dk * dv; ++i) state[i] = static_cast<float>(s[i]);
  }
}

}  // namespace qflash::kernels::ref
