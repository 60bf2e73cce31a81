/// @file
/// Scalar reference for kernels/attention: the cache decoded to fp32 first (gather_kv), then
/// fp64 scores and sums.
#pragma once

#include <cmath>
#include <vector>

#include "qflash/kernels/attention/op.hpp"
#include "qflash/kernels/kv_append/ref.hpp"

namespace qflash::kernels::ref {

inline void attention(AttentionArgs const& a) {
  int const group = a.n_head / a.n_head_kv;
  GatheredKv const kv = gather_kv(a.kv, a.n_ctx);
  std::vector<double> p(static_cast<std::size_t>(a.n_ctx));
  for (std::int64_t t = 0; t < a.n_tokens; ++t) {
    std::int64_t const pos = a.n_ctx - a.n_tokens + t;
    for (int h = 0; h < a.n_head; ++h) {
      float const* q = a.q + (t * a.n_head + h) * a.d_head;
      double mx = -INFINITY;
      for (std::int64_t s = 0; s <= pos; ++s) {
        float const* k = kv.k.data() + (s * a.n_head_kv + h / group) * a.d_head;
        double d = 0;
        for (int i = 0; i < a.d_head; ++i) d += static_cast<double>(q[i]) * k[i];
        p[static_cast<std::size_t>(s)] = d * a.scale;
        mx = std::max(mx, p[static_cast<std::size_t>(s)]);
      }
      double sum = 0;
      for (std::int64_t s = 0; s <= pos; ++s) sum += (p[static_cast<std::size_t>(s)] = std::exp(p[static_cast<std::size_t>(s)] - mx));
      float* o = a.out + (t * a.n_head + h) * a.d_head;
      for (int i = 0; i < a.d_head; ++i) {
        double acc = 0;
        for (std::int64_t s = 0; s <= pos; ++s)
          acc += p[static_cast<std::size_t>(s)] * kv.v[static_cast<std::size_t>((s * a.n_head_kv + h / group) * a.d_head + i)];
        o[i] = static_cast<float>(acc / sum);
      }
      if (a.gate) {
        float const* g = a.gate + t * a.gate_token_stride + h * a.gate_head_stride_or_default();
        for (int i = 0; i < a.d_head; ++i)
          o[i] = static_cast<float>(o[i] / (1.0 + std::exp(-static_cast<double>(g[i]))));
      }
    }
  }
}

}  // namespace qflash::kernels::ref
