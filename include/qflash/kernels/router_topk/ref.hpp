/// @file
/// Scalar reference for kernels/router_topk: fp64 softmax, a full stable sort, the policy's
/// count from the fp64 probabilities rounded to fp32.
#pragma once

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "qflash/kernels/router_topk/op.hpp"

namespace qflash::kernels::ref {

inline void router_topk(RouterTopkArgs const& a) {
  std::vector<double> p(static_cast<std::size_t>(a.n_expert));
  std::vector<int> order(static_cast<std::size_t>(a.n_expert));
  for (std::int64_t t = 0; t < a.n_tokens; ++t) {
    float const* l = a.logits + t * (a.logits_stride ? a.logits_stride : a.n_expert);
    if (a.shared_weights)
      a.shared_weights[t] = static_cast<float>(1.0 / (1.0 + std::exp(-static_cast<double>(l[a.n_expert]))));
    double const mx = *std::max_element(l, l + a.n_expert);
    double sum = 0;
    for (int e = 0; e < a.n_expert; ++e) sum += (p[static_cast<std::size_t>(e)] = std::exp(l[e] - mx));
    for (auto& x : p) x /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) {
      return p[static_cast<std::size_t>(x)] > p[static_cast<std::size_t>(y)];
    });
    std::vector<float> sorted(static_cast<std::size_t>(a.n_expert_used));
    for (int j = 0; j < a.n_expert_used; ++j)
      sorted[static_cast<std::size_t>(j)] = static_cast<float>(p[static_cast<std::size_t>(order[static_cast<std::size_t>(j)])]);
    int const used = (a.token_policies ? a.token_policies[t] : a.policy).count(sorted.data(), a.n_expert_used);
    double top = 0;
    for (int j = 0; j < used; ++j) top += p[static_cast<std::size_t>(order[static_cast<std::size_t>(j)])];
    for (int j = 0; j < a.n_expert_used; ++j) {
      int const e = order[static_cast<std::size_t>(j)];
      a.experts[t * a.n_expert_used + j] = j < used ? e : kNoExpert;
      double const w = j < used ? p[static_cast<std::size_t>(e)] : 0.0;
      a.weights[t * a.n_expert_used + j] = static_cast<float>(a.renormalize && j < used ? w / top : w);
    }
  }
}

}  // namespace qflash::kernels::ref
