/// @file
/// An expert_ffn problem for kernel tests: seeded expert matrices it owns (or a MatrixCache
/// does), the tokens, their routes, and the ExpertFfnArgs that point at them. Tests fill
/// `routes` / `route_weights` (and `shared_weights` with a shared expert) in their own pattern.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <tuple>
#include <vector>

#include "qflash/kernels/expert_ffn/op.hpp"
#include "qflash/numeric/weight_encode.hpp"
#include "support/random.hpp"

namespace qflash::test {

/// A [rows, cols] matrix of values in [-0.5, 0.5) from `seed`, in format f.
inline OwnedMatrix seeded_matrix(WeightFormat f, std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  auto const w = random_floats(static_cast<std::size_t>(rows * cols), seed, -0.5f, 0.5f);
  return encode_matrix(f, w.data(), rows, cols);
}

/// Seeded matrices kept for the cases of a test that draw the same ones again: drawing and
/// encoding a model-sized matrix takes longer than many a kernel run on the CUDA emulator.
class MatrixCache {
 public:
  OwnedMatrix const& get(WeightFormat f, std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
    Key const key{f, rows, cols, seed};
    auto it = matrices_.find(key);
    if (it == matrices_.end()) it = matrices_.emplace(key, seeded_matrix(f, rows, cols, seed)).first;
    return it->second;
  }

 private:
  using Key = std::tuple<WeightFormat, std::int64_t, std::int64_t, std::uint64_t>;
  std::map<Key, OwnedMatrix> matrices_;  // a map: entries stay where they are as it grows
};

struct ExpertCase {
  std::deque<OwnedMatrix> store;  // a deque: the views stay valid as it grows
  MatrixCache* cache = nullptr;   // where matrix() finds and keeps its matrices, if set
  std::vector<kernels::ExpertWeights> experts;
  std::optional<kernels::ExpertWeights> shared;
  std::vector<float> x;  // [n_tokens, d_model]
  std::vector<std::int32_t> routes;
  std::vector<float> route_weights, shared_weights;
  std::int64_t n_tokens = 0;
  int n_expert_used = 0;

  /// seeded_matrix(f, rows, cols, seed), owned here or by the cache.
  WeightView matrix(WeightFormat f, std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
    if (cache) return cache->get(f, rows, cols, seed).view;
    return store.emplace_back(seeded_matrix(f, rows, cols, seed)).view;
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
