/// @file
/// Routing statistics and the quality/compute of routing policies, behind `qflash route-stats`.
/// Over a text in windows (as `perplexity` runs them), for the model's top-k and for each
/// policy given: per MoE layer the router entropy (nats, of the softmax over all experts) and
/// every expert's load (tokens routed to it); the histogram of experts per token; perplexity;
/// and the mean KL of each next-token distribution from top-k routing's.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/model/model.hpp"
#include "qflash/model/routing.hpp"
#include "qflash/runtime/perplexity.hpp"

namespace qflash::runtime {

struct RouteStats {
  model::Routing routing;
  int slots = 0;  ///< route slots per token
  std::vector<double> entropy_sum;                 ///< [layer] sum over tokens
  std::vector<std::int64_t> layer_tokens;          ///< [layer] tokens seen
  std::vector<std::vector<std::int64_t>> load;     ///< [layer][expert] tokens routed to it
  std::vector<std::int64_t> experts_per_token;     ///< [0..slots] token-layer pairs using that many
  std::int64_t token_layers = 0;                   ///< token-layer pairs seen
  double total_nll = 0, total_kl = 0;
  std::int64_t n_predicted = 0;

  [[nodiscard]] double perplexity() const { return std::exp(total_nll / static_cast<double>(n_predicted)); }
  [[nodiscard]] double mean_kl() const { return total_kl / static_cast<double>(n_predicted); }
  /// Mean router entropy of a layer (0 for a layer without MoE).
  [[nodiscard]] double mean_entropy(std::size_t layer) const {
    return layer_tokens[layer] ? entropy_sum[layer] / static_cast<double>(layer_tokens[layer]) : 0.0;
  }
  [[nodiscard]] double mean_experts() const {
    double s = 0;
    for (std::size_t c = 0; c < experts_per_token.size(); ++c) s += static_cast<double>(c * experts_per_token[c]);
    return s / static_cast<double>(token_layers);
  }

  void add(model::RouteRecord const& r) {
    if (load.size() <= r.layer) {
      load.resize(r.layer + 1, std::vector<std::int64_t>(static_cast<std::size_t>(r.n_expert), 0));
      entropy_sum.resize(r.layer + 1, 0.0);
      layer_tokens.resize(r.layer + 1, 0);
    }
    layer_tokens[r.layer] += r.n_tokens;
    experts_per_token.resize(static_cast<std::size_t>(r.n_expert_used) + 1, 0);
    for (std::int64_t t = 0; t < r.n_tokens; ++t) {
      entropy_sum[r.layer] += r.entropy(t);
      auto const used = r.used(t);
      for (std::int32_t e : used) ++load[r.layer][static_cast<std::size_t>(e)];
      ++experts_per_token[used.size()];
      ++token_layers;
    }
  }
};

/// Runs `ids` in windows of `context` under each of `policies` (the first should be top-k: the
/// KL of every policy is taken from the first's distributions) and returns one RouteStats per
/// policy. The model's routing is restored afterwards. `on_window(done, total)`: progress.
template <class Model>
std::vector<RouteStats> measure_routing(Model& model, std::span<std::int32_t const> ids, int context,
                                        std::span<model::Routing const> policies,
                                        std::function<void(std::size_t, std::size_t)> const& on_window = {}) {
  auto const& cfg = model.config();
  QFLASH_CHECK(!policies.empty(), "route-stats: no routing policy");
  QFLASH_CHECK(context >= 2 && context <= cfg.max_position_embeddings, "route-stats: the context must be in [2, ",
               cfg.max_position_embeddings, "] tokens, got ", context);
  QFLASH_CHECK(ids.size() >= 2, "route-stats: needs at least 2 tokens, got ", ids.size());
  for (auto const& p : policies) model::check_routing(p, cfg.n_expert, cfg.n_expert_used);
  std::vector<RouteStats> stats(policies.size());
  for (std::size_t i = 0; i < policies.size(); ++i) {
    stats[i].routing = policies[i];
    stats[i].slots = policies[i].slots(cfg.n_expert_used);
  }
  model::Routing const saved = model.routing();
  std::int64_t const vocab = cfg.vocab;
  std::vector<float> base, logits;
  std::size_t current = 0;
  auto observer = [&](model::RouteRecord const& r) { stats[current].add(r); };
  model.set_route_observer(observer);
  try {
    for (std::size_t begin = 0; begin < ids.size(); begin += static_cast<std::size_t>(context)) {
      std::size_t const len = std::min<std::size_t>(static_cast<std::size_t>(context), ids.size() - begin);
      if (len < 2) break;
      for (current = 0; current < policies.size(); ++current) {
        model.set_routing(policies[current]);
        auto state = model.new_sequence();
        model::SequenceChunk c{ids.subspan(begin, len), &state};
        std::vector<float>& out = current == 0 ? base : logits;
        model.forward(std::span(&c, 1), model::LogitsFor::kAllTokens, out);
        RouteStats& s = stats[current];
        for (std::size_t t = 0; t + 1 < len; ++t) {
          float const* l = out.data() + static_cast<std::int64_t>(t) * vocab;
          double const mx = *std::max_element(l, l + vocab);
          double sum = 0;
          for (std::int64_t v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(l[v]) - mx);
          s.total_nll += std::log(sum) + mx - l[ids[begin + t + 1]];
        }
        s.n_predicted += static_cast<std::int64_t>(len) - 1;
        if (current > 0) s.total_kl += sum_kl(base.data(), logits.data(), static_cast<std::int64_t>(len) - 1, vocab);
      }
      if (on_window) on_window(begin + len, ids.size());
    }
  } catch (...) {
    model.set_route_observer({});
    model.set_routing(saved);
    throw;
  }
  model.set_route_observer({});
  model.set_routing(saved);
  return stats;
}

}  // namespace qflash::runtime
