/// @file
/// CPU kernels/router_topk: fp32 softmax and a partial selection per token, threaded over
/// tokens.
#pragma once

#include <algorithm>
#include <cmath>
#include <numeric>
#include <span>
#include <vector>

#include "qflash/core/parallel.hpp"
#include "qflash/kernels/router_topk/op.hpp"

namespace qflash::kernels::cpu {

/// The op for E experts, top-K (kDynamic: any): the spec fields its loops depend on.
template <int E, int K>
Status router_topk(RouterTopkArgs const& a) {
  int const n_expert = dim<E>(a.n_expert);
  int const k = a.n_expert_used == K ? K : a.n_expert_used;
  // Per-slot scratch owned by the calling thread (core/parallel.hpp), kept across calls.
  thread_local SlotScratch<float> probs;
  thread_local SlotScratch<int> orders;
  probs.prepare();
  orders.prepare();
  auto& probs_of = probs;
  auto& orders_of = orders;
  parallel_for(0, a.n_tokens, 4 * n_expert, [&](std::int64_t t) {
    std::span<float> const p(probs_of.get(static_cast<std::size_t>(n_expert)), static_cast<std::size_t>(n_expert));
    std::span<int> const order(orders_of.get(static_cast<std::size_t>(n_expert)), static_cast<std::size_t>(n_expert));
    float const* l = a.logits + t * (a.logits_stride ? a.logits_stride : n_expert);
    if (a.shared_weights) a.shared_weights[t] = 1.0f / (1.0f + std::exp(-l[n_expert]));
    float const mx = *std::max_element(l, l + n_expert);
    float sum = 0;
    for (int e = 0; e < n_expert; ++e) sum += (p[static_cast<std::size_t>(e)] = std::exp(l[e] - mx));
    float const inv = 1.0f / sum;
    for (auto& x : p) x *= inv;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int x, int y) {
      float const px = p[static_cast<std::size_t>(x)], py = p[static_cast<std::size_t>(y)];
      return px > py || (px == py && x < y);
    });
    float* w = a.weights + t * k;  // the sorted probabilities first, for the policy
    for (int j = 0; j < k; ++j) w[j] = p[static_cast<std::size_t>(order[static_cast<std::size_t>(j)])];
    int const used = (a.token_policies ? a.token_policies[t] : a.policy).count(w, k);
    float top = 0;
    for (int j = 0; j < used; ++j) top += w[j];
    float const scale = a.renormalize ? 1.0f / top : 1.0f;
    for (int j = 0; j < k; ++j) {
      a.experts[t * k + j] = j < used ? order[static_cast<std::size_t>(j)] : kNoExpert;
      w[j] = j < used ? w[j] * scale : 0.0f;
    }
  });
  return Status::kSuccess;
}

}  // namespace qflash::kernels::cpu

namespace qflash::kernels {

template <MoeSpec S>
Status launch_router_topk(arch::Cpu, RouterTopkArgs const& a, stream_t) {
  if (Status s = can_implement_router_topk<S>(a); s != Status::kSuccess) return s;
  return cpu::router_topk<S.n_expert, S.n_expert_used>(a);
}

}  // namespace qflash::kernels
