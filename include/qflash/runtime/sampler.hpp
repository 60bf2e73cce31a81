/// @file
/// Next-token sampling from logits: repetition penalty, then temperature, then top-k, top-p
/// and min-p filters, then a draw from the renormalised distribution. Temperature 0 is greedy
/// (argmax, lowest id on ties). Seeded, so a seed reproduces a generation.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "qflash/core/error.hpp"

namespace qflash::runtime {

struct SamplingParams {
  float temperature = 0.0f;         ///< 0: greedy
  int top_k = 0;                    ///< 0: off
  float top_p = 1.0f;               ///< 1: off
  float min_p = 0.0f;               ///< 0: off; keeps p >= min_p * p_max
  float repetition_penalty = 1.0f;  ///< 1: off; > 1 discourages tokens already seen
  std::uint64_t seed = 0;
};

/// Throws Error naming the parameter when a value is outside its range.
inline void validate(SamplingParams const& p) {
  QFLASH_CHECK(p.temperature >= 0 && std::isfinite(p.temperature), "temperature must be >= 0, got ", p.temperature);
  QFLASH_CHECK(p.top_k >= 0, "top_k must be >= 0, got ", p.top_k);
  QFLASH_CHECK(p.top_p > 0 && p.top_p <= 1, "top_p must be in (0, 1], got ", p.top_p);
  QFLASH_CHECK(p.min_p >= 0 && p.min_p <= 1, "min_p must be in [0, 1], got ", p.min_p);
  QFLASH_CHECK(p.repetition_penalty > 0 && std::isfinite(p.repetition_penalty),
               "repetition_penalty must be > 0, got ", p.repetition_penalty);
}

inline std::int32_t argmax(std::span<float const> logits) {
  return static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

class Sampler {
 public:
  explicit Sampler(SamplingParams const& p) : p_(p), rng_(p.seed) { validate(p); }

  [[nodiscard]] SamplingParams const& params() const { return p_; }

  /// Picks the next token; `history` holds the tokens the repetition penalty applies to.
  std::int32_t sample(std::span<float const> logits, std::span<std::int32_t const> history = {}) {
    scratch_.assign(logits.begin(), logits.end());
    if (p_.repetition_penalty != 1.0f) {
      seen_.assign(scratch_.size(), false);
      for (std::int32_t t : history) {
        if (t < 0 || static_cast<std::size_t>(t) >= scratch_.size() || seen_[static_cast<std::size_t>(t)]) continue;
        seen_[static_cast<std::size_t>(t)] = true;
        float& l = scratch_[static_cast<std::size_t>(t)];
        l = l < 0 ? l * p_.repetition_penalty : l / p_.repetition_penalty;
      }
    }
    if (p_.temperature == 0.0f) return argmax(scratch_);

    std::size_t const n = scratch_.size();
    order_.resize(n);
    std::iota(order_.begin(), order_.end(), 0);
    std::size_t keep = n;
    if (p_.top_k > 0 && static_cast<std::size_t>(p_.top_k) < n) keep = static_cast<std::size_t>(p_.top_k);
    auto by_logit = [&](std::int32_t a, std::int32_t b) {
      float const la = scratch_[static_cast<std::size_t>(a)], lb = scratch_[static_cast<std::size_t>(b)];
      return la > lb || (la == lb && a < b);
    };
    std::partial_sort(order_.begin(), order_.begin() + static_cast<std::ptrdiff_t>(keep), order_.end(), by_logit);

    // Softmax over the kept candidates at the given temperature.
    probs_.resize(keep);
    float const mx = scratch_[static_cast<std::size_t>(order_[0])];
    double sum = 0;
    for (std::size_t i = 0; i < keep; ++i)
      sum += probs_[i] = std::exp((scratch_[static_cast<std::size_t>(order_[i])] - mx) / p_.temperature);
    for (auto& q : probs_) q = static_cast<float>(q / sum);

    // top-p: the smallest prefix whose mass reaches top_p; min-p: drop p < min_p * p_max.
    std::size_t cut = keep;
    if (p_.top_p < 1.0f) {
      double mass = 0;
      for (std::size_t i = 0; i < keep; ++i) {
        mass += probs_[i];
        if (mass >= p_.top_p) {
          cut = i + 1;
          break;
        }
      }
    }
    if (p_.min_p > 0.0f)
      while (cut > 1 && probs_[cut - 1] < p_.min_p * probs_[0]) --cut;

    std::discrete_distribution<std::size_t> pick(probs_.begin(), probs_.begin() + static_cast<std::ptrdiff_t>(cut));
    return order_[pick(rng_)];
  }

 private:
  SamplingParams p_;
  std::mt19937_64 rng_;
  std::vector<float> scratch_;
  std::vector<std::int32_t> order_;
  std::vector<float> probs_;
  std::vector<bool> seen_;
};

}  // namespace qflash::runtime
