/// @file
/// An expert_ffn problem for kernel tests: seeded expert matrices it owns, the tokens, their
/// routes, and the ExpertFfnArgs that point at them. Tests fill `routes` / `route_weights`
/// (and `shared_weights` with a shared expert) in their own pattern.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <vector>

#include "qflash/kernels/expert_ffn/op.hpp"
#include "qflash/numeric/weight_encode.hpp"
#include "support/random.hpp"

namespace qflash::test {

struct ExpertCase {
  std::deque<OwnedMatrix> store;  // a deque: the views stay valid as it grows
  std::vector<kernels::ExpertWeights> experts;
  std::optional<kernels::ExpertWeights> shared;
  std::vector<float> x;  // [n_tokens, d_model]
  std::vector<std::int32_t> routes;
  std::vector<float> route_weights, shared_weights;
  std::int64_t n_tokens = 0;
  int n_expert_used = 0;

  /// A [rows, cols] matrix of values in [-0.5, 0.5) from `seed`, in format f.
  WeightView matrix(WeightFormat f, std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
    auto const w = random_floats(static_cast<std::size_t>(rows * cols), seed, -0.5f, 0.5f);
    return store.emplace_back(encode_matrix(f, w.data(), rows, cols)).view;
  }

  /// Gate and up [d_ff, d_model] in `gate_up`, down [d_model, d_ff] in `down`, from seeds seed..seed + 2.
  kernels::ExpertWeights expert(WeightFormat gate_up, WeightFormat down, std::int64_t d_model, std::int64_t d_ff,
                                std::uint64_t seed) {
    return {matrix(gate_up, d_ff, d_model, seed), matrix(gate_up, d_ff, d_model, seed + 1),
            matrix(down, d_model, d_ff, seed + 2)};
  }

  /// n routed experts, expert e from seeds seed + 3e...
  void add_experts(int n, WeightFormat gate_up, WeightFormat down, std::int64_t d_model, std::int64_t d_ff,
                   std::uint64_t seed) {
    for (int e = 0; e < n; ++e)
      experts.push_back(expert(gate_up, down, d_model, d_ff, seed + 3 * static_cast<std::uint64_t>(e)));
  }

  /// n tokens of d_model values in [-1, 1) from `seed`, each routed to up to k experts.
  void set_tokens(std::int64_t n, std::int64_t d_model, int k, std::uint64_t seed) {
    n_tokens = n;
    n_expert_used = k;
    x = random_floats(static_cast<std::size_t>(n * d_model), seed);
  }

  /// The arguments, accumulating into `out`.
  [[nodiscard]] kernels::ExpertFfnArgs args(float* out) const {
    kernels::ExpertFfnArgs a{};
    a.experts = experts;
    a.x = x.data();
    a.routes = routes.data();
    a.route_weights = route_weights.data();
    a.n_tokens = n_tokens;
    a.n_expert_used = n_expert_used;
    a.out = out;
    if (shared) {
      a.shared = &*shared;
      a.shared_weights = shared_weights.data();
    }
    return a;
  }
};

}  // namespace qflash::test
