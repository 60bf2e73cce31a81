/// @file
/// CPU kernels/attention: one (token, head) pair per work item, fp32 scores, max-subtracted
/// softmax, and a weighted sum of value rows that the compiler vectorises over d_head.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "qflash/core/parallel.hpp"
#include "qflash/kernels/attention/op.hpp"

namespace qflash::kernels::cpu {

/// The op for head width D (kDynamic: any): the one spec field its loops depend on.
template <int D>
Status attention(AttentionArgs const& a) {
  int const d = dim<D>(a.d_head);
  std::int64_t const gate_hs = a.gate_head_stride ? a.gate_head_stride : d;
  int const group = a.n_head / a.n_head_kv;
  std::int64_t const n_items = a.n_tokens * a.n_head;
  parallel_for(0, n_items, 2 * a.n_ctx * d, [&](std::int64_t item) {
    thread_local std::vector<float> p;
    std::int64_t const t = item / a.n_head;
    int const h = static_cast<int>(item % a.n_head);
    int const kv = h / group;
    std::int64_t const n_keys = a.n_ctx - a.n_tokens + t + 1;
    p.resize(static_cast<std::size_t>(n_keys));
    float const* q = a.q + item * d;
    float mx = -INFINITY;
    for (std::int64_t s = 0; s < n_keys; ++s) {
      float const* k = a.k + (s * a.n_head_kv + kv) * d;
      float dot = 0;
      for (int i = 0; i < d; ++i) dot += q[i] * k[i];
      p[static_cast<std::size_t>(s)] = dot * a.scale;
      mx = std::max(mx, p[static_cast<std::size_t>(s)]);
    }
    float sum = 0;
    for (auto& x : p) sum += (x = std::exp(x - mx));
    float const inv = 1.0f / sum;
    float* o = a.out + item * d;
    std::fill(o, o + d, 0.0f);
    for (std::int64_t s = 0; s < n_keys; ++s) {
      float const w = p[static_cast<std::size_t>(s)] * inv;
      float const* v = a.v + (s * a.n_head_kv + kv) * d;
      for (int i = 0; i < d; ++i) o[i] += w * v[i];
    }
    if (a.gate) {
      float const* g = a.gate + t * a.gate_token_stride + h * gate_hs;
      for (int i = 0; i < d; ++i) o[i] *= 1.0f / (1.0f + std::exp(-g[i]));
    }
  });
  return Status::kSuccess;
}

}  // namespace qflash::kernels::cpu

namespace qflash::kernels {

template <MoeSpec S>
Status launch_attention(arch::Cpu, AttentionArgs const& a, stream_t) {
  if (Status s = can_implement_attention<S>(a); s != Status::kSuccess) return s;
  return cpu::attention<S.d_head>(a);
}

}  // namespace qflash::kernels
