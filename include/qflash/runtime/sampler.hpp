/// @file
/// Next-token sampling from logits: repetition penalty, then temperature, then top-k, top-p
/// and min-p filters, then a draw from the renormalised distribution. Temperature 0 is greedy
/// (argmax, lowest id on ties). Seeded, so a seed reproduces a generation.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <utility>
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
    if (p_.temperature == 0.0f) return argmax(penalised(logits, history));
    std::size_t const cut = filter(logits, history);
    weights_.resize(cut);
    for (std::size_t i = 0; i < cut; ++i) weights_[i] = candidates_[i].weight;
    std::discrete_distribution<std::size_t> pick(weights_.begin(), weights_.end());
    return candidates_[pick(rng_)].id;
  }

  /// What sample() draws from at a temperature above 0: each candidate token left after the
  /// filters and its probability; ranked best first where top-k or top-p ranked them.
  std::vector<std::pair<std::int32_t, double>> distribution(std::span<float const> logits,
                                                            std::span<std::int32_t const> history = {}) {
    QFLASH_CHECK(p_.temperature > 0.0f, "distribution: temperature 0 is greedy, with no distribution");
    std::size_t const cut = filter(logits, history);
    double sum = 0;
    for (std::size_t i = 0; i < cut; ++i) sum += candidates_[i].weight;
    std::vector<std::pair<std::int32_t, double>> out(cut);
    for (std::size_t i = 0; i < cut; ++i) out[i] = {candidates_[i].id, candidates_[i].weight / sum};
    return out;
  }

 private:
  struct Candidate {
    float logit;
    std::int32_t id;
    float weight;
  };

  /// The logits after the repetition penalty (in scratch_).
  std::span<float const> penalised(std::span<float const> logits, std::span<std::int32_t const> history) {
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
    return scratch_;
  }

  /// candidates_[0, returned) are the tokens left after the penalty, top-k, top-p and min-p,
  /// with their softmax weights at the temperature (unnormalised).
  std::size_t filter(std::span<float const> logits, std::span<std::int32_t const> history) {
    penalised(logits, history);
    // Candidates: the top_k best, ranked; else every token, ranked only as far as top-p needs.
    std::size_t const n = scratch_.size();
    QFLASH_CHECK(n > 0, "sampling from no logits");
    candidates_.resize(n);
    for (std::size_t i = 0; i < n; ++i) candidates_[i] = {scratch_[i], static_cast<std::int32_t>(i), 0.0f};
    auto const ranks_higher = [](Candidate const& a, Candidate const& b) {
      return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
    };
    auto const at = [&](std::size_t i) { return candidates_.begin() + static_cast<std::ptrdiff_t>(i); };
    std::size_t keep = n, ranked = 0;  // candidates_[0, ranked) are the best, in order
    if (p_.top_k > 0 && static_cast<std::size_t>(p_.top_k) < n) {
      keep = ranked = static_cast<std::size_t>(p_.top_k);
      std::nth_element(at(0), at(keep), at(n), ranks_higher);
      std::sort(at(0), at(keep), ranks_higher);
    }

    // Softmax weights at the given temperature (the best candidate's is 1), their sum, and
    // the mass of each binary exponent of the weights.
    float mx = candidates_[0].logit;
    for (std::size_t i = 1; i < keep; ++i) mx = std::max(mx, candidates_[i].logit);
    double sum = 0;
    std::array<double, 256> exponent_mass{};
    for (std::size_t i = 0; i < keep; ++i) {
      float const w = candidates_[i].weight = std::exp((candidates_[i].logit - mx) / p_.temperature);
      sum += w;
      exponent_mass[exponent_of(w)] += w;
    }

    // top-p: the smallest ranked prefix whose mass reaches top_p. Unranked, it lies within the
    // weights of the exponents from the highest down to the one where their mass reaches
    // top_p: only those are ranked first (a trained model's are a few dozen tokens, not the
    // vocabulary), then the rest if rounding left the mass short.
    std::size_t cut = keep;
    if (p_.top_p < 1.0f) {
      double const target = static_cast<double>(p_.top_p) * sum;
      if (ranked < keep) {
        int lowest = 255;
        for (double mass = exponent_mass[255]; mass < target && lowest > 0;) mass += exponent_mass[--lowest];
        ranked = static_cast<std::size_t>(std::partition(at(0), at(keep), [&](Candidate const& c) {
                                            return exponent_of(c.weight) >= lowest;
                                          }) - at(0));
        std::sort(at(0), at(ranked), ranks_higher);
      }
      double mass = 0;
      std::size_t i = 0;
      while (i < ranked && mass < target) mass += candidates_[i++].weight;
      if (mass < target && ranked < keep) {
        std::sort(at(ranked), at(keep), ranks_higher);
        while (i < keep && mass < target) mass += candidates_[i++].weight;
      }
      cut = i;
    }
    // min-p: drop p < min_p * p_max (the best candidate's weight is 1, so never itself).
    if (p_.min_p > 0.0f)
      cut = static_cast<std::size_t>(std::stable_partition(at(0), at(cut), [&](Candidate const& c) {
                                       return c.weight >= p_.min_p;
                                     }) - at(0));

    return cut;
  }

  /// The biased binary exponent of a weight in [0, 1] (0 for 0 and subnormals).
  static int exponent_of(float w) { return static_cast<int>(std::bit_cast<std::uint32_t>(w) >> 23); }

  SamplingParams p_;
  std::mt19937_64 rng_;
  std::vector<float> scratch_;
  std::vector<Candidate> candidates_;
  std::vector<float> weights_;
  std::vector<bool> seen_;
};

}  // namespace qflash::runtime
