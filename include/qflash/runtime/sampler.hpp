/// @file
/// Next-token sampling from logits: repetition penalty, then temperature, then top-k, top-p
/// and min-p filters, then a draw from the renormalised distribution. Temperature 0 is greedy
/// (argmax, lowest id on ties). Seeded, so a seed reproduces a generation.
///
/// A sampler also decides from a row's best tokens alone (kernels/token_candidates), where
/// they cover its choice: then it draws exactly what it would from the whole row, with the
/// same use of its generator.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/kernels/token_candidates/op.hpp"

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

/// The best tokens of a logits row that generation brings back from the model to sample
/// from (kernels/token_candidates): covers top-k up to 64, the engine's top_logprobs, and the
/// nucleus of a trained model's usual top-p; a draw they do not decide reads the row in full.
inline constexpr int kSamplingCandidates = 64;

/// A logits row of `vocab` tokens as kernels/token_candidates gives it: its best tokens, best
/// first (higher logit, then lower id), and its sums at the sampler's temperature.
struct CandidateRow {
  std::span<std::int32_t const> ids;
  std::span<float const> logits;
  kernels::CandidateStats stats;
  std::int64_t vocab = 0;
};

/// What a caller took off a row's logits before sampling (penalties of its own, each >= 0).
struct Lowered {
  std::span<float const> candidates;  ///< off each candidate's logit; empty: the caller lowers none
  std::size_t outside = 0;            ///< how many tokens that are not candidates it lowered (at most)
};

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

  /// Whether sample(CandidateRow) can ever decide with these parameters: not where every token
  /// stays in the draw (no top-k, top-p or min-p), or a penalty may raise a logit.
  [[nodiscard]] bool may_decide_from_candidates() const {
    if (p_.repetition_penalty < 1.0f) return false;
    return p_.temperature == 0.0f || p_.top_k > 0 || p_.top_p < 1.0f || p_.min_p > 0.0f;
  }

  /// sample(row's logits, history) from the row's candidates alone, when they decide it; else
  /// nullopt, with the generator untouched. `caller` holds what the caller already took off the
  /// logits; one that lowers any token passes it, its candidates' part even all zeros. The
  /// choice is decided when every token it depends on is a candidate (the draw's tokens, and
  /// every token ranked above them) and, for top-p without top-k, the row's penalised mass is
  /// known closely enough to place the nucleus' end.
  std::optional<std::int32_t> sample(CandidateRow const& row, std::span<std::int32_t const> history = {},
                                     Lowered const& caller = {}) {
    std::span<float const> const lowered = caller.candidates;
    std::size_t const n_cand = std::min(row.ids.size(), static_cast<std::size_t>(row.vocab));
    bool const outside = static_cast<std::size_t>(row.vocab) > n_cand;  // tokens that are not candidates
    if (n_cand == 0) return std::nullopt;
    // No token outside has a logit above `bound`, penalised or not: penalties only lower.
    float const bound = outside ? row.logits[n_cand - 1] : -INFINITY;
    bool const repeat = p_.repetition_penalty != 1.0f && !history.empty();
    if (repeat && p_.repetition_penalty < 1.0f) return std::nullopt;
    bool const penalised = repeat || !lowered.empty();
    candidates_.resize(n_cand);
    for (std::size_t i = 0; i < n_cand; ++i) {
      float l = row.logits[i];
      if (!lowered.empty()) {
        if (!(lowered[i] >= 0.0f)) return std::nullopt;
        l -= lowered[i];
      }
      candidates_[i] = {l, row.ids[i], 0.0f};
    }
    if (repeat) {  // once per candidate in the history, as penalised() does
      order_.resize(n_cand);
      for (std::size_t i = 0; i < n_cand; ++i) order_[i] = i;
      auto const id_of = [&](std::size_t i) { return candidates_[i].id; };
      std::sort(order_.begin(), order_.end(), [&](std::size_t a, std::size_t b) { return id_of(a) < id_of(b); });
      changed_.assign(n_cand, false);  // here: seen in the history
      for (std::int32_t t : history) {
        auto const at = std::lower_bound(order_.begin(), order_.end(), t,
                                         [&](std::size_t i, std::int32_t id) { return id_of(i) < id; });
        if (at == order_.end() || id_of(*at) != t || changed_[*at]) continue;
        changed_[*at] = true;
        float& l = candidates_[*at].logit;
        l = l < 0 ? l * p_.repetition_penalty : l / p_.repetition_penalty;
      }
    }
    changed_.resize(n_cand);
    for (std::size_t i = 0; i < n_cand; ++i) changed_[i] = candidates_[i].logit != row.logits[i];
    // Top-p under penalties (without top-k, it needs the row's mass): what they take off the
    // row's mass (at the temperature, relative to the row's max), exactly for the candidates,
    // and at most the weight of `bound` for each penalised token outside them.
    double taken = 0, taken_outside = 0;
    if (penalised && p_.temperature > 0.0f && p_.top_p < 1.0f) {
      double const t = p_.temperature, m = row.stats.max;
      for (std::size_t i = 0; i < n_cand; ++i)
        if (changed_[i])
          taken += std::exp((static_cast<double>(row.logits[i]) - m) / t) -
                   std::exp((static_cast<double>(candidates_[i].logit) - m) / t);
      std::size_t const n_outside = caller.outside + (repeat ? history_outside(row.ids.first(n_cand), history) : 0);
      if (outside) taken_outside = static_cast<double>(n_outside) * std::exp((static_cast<double>(bound) - m) / t);
    }
    if (penalised) {
      order_.resize(n_cand);
      for (std::size_t i = 0; i < n_cand; ++i) order_[i] = i;
      std::sort(order_.begin(), order_.end(),
                [&](std::size_t a, std::size_t b) { return ranks_higher(candidates_[a], candidates_[b]); });
      ranked_.resize(n_cand);
      ranked_changed_.resize(n_cand);
      for (std::size_t i = 0; i < n_cand; ++i) {
        ranked_[i] = candidates_[order_[i]];
        ranked_changed_[i] = changed_[order_[i]];
      }
      candidates_.swap(ranked_);
      changed_.swap(ranked_changed_);
    }
    // Whether candidate i ranks above every token outside: one left at `bound` does, since the
    // candidates hold the lower ids of those at it.
    auto const above_outside = [&](std::size_t i) {
      return !outside || candidates_[i].logit > bound || (candidates_[i].logit == bound && !changed_[i]);
    };
    if (p_.temperature == 0.0f) {
      if (!above_outside(0)) return std::nullopt;
      return candidates_[0].id;
    }

    auto const n = static_cast<std::size_t>(row.vocab);
    bool const top_k = p_.top_k > 0 && static_cast<std::size_t>(p_.top_k) < n;
    std::size_t const keep = top_k ? static_cast<std::size_t>(p_.top_k) : n;
    if (top_k && (keep > n_cand || !above_outside(keep - 1))) return std::nullopt;
    if (!above_outside(0) && candidates_[0].logit < bound) return std::nullopt;  // the max is outside
    float const mx = candidates_[0].logit;
    for (auto& c : candidates_) c.weight = std::exp((c.logit - mx) / p_.temperature);

    // top-p over the ranked tokens, as filter() walks them.
    std::size_t cut = keep;
    if (p_.top_p < 1.0f) {
      // The whole row's sum of weights (relative to mx), which sets the nucleus' end: within
      // [sum_lo, sum_hi] where penalties leave it uncertain.
      double sum_lo = 0, sum_hi = 0;
      if (top_k) {
        for (std::size_t i = 0; i < keep; ++i) sum_hi += candidates_[i].weight;
        sum_lo = sum_hi;
      } else if (!penalised) {
        sum_lo = sum_hi = row.stats.mass;
      } else {
        // Rescaled from the row's max to mx; widened for the float rounding of the weights'
        // arguments (l - max) / t, which moves a weight by up to |its argument| * 2^-24 and so
        // a row's sum by under 1e-6 of its mass (the mass-weighted mean argument stays below
        // ln(vocab)); subtracting what the penalties took does not shrink it.
        double const scale = std::exp((static_cast<double>(row.stats.max) - mx) / p_.temperature);
        double const slack = 4e-6 * row.stats.mass;
        sum_hi = (row.stats.mass - taken + slack) * scale;
        sum_lo = (row.stats.mass - taken - taken_outside - slack) * scale;
      }
      double const target_lo = static_cast<double>(p_.top_p) * sum_lo, target_hi = static_cast<double>(p_.top_p) * sum_hi;
      // The end for the highest target; the same for every target down to target_lo when the
      // mass before the last token stays below it.
      double mass = 0, before = 0;
      std::size_t i = 0;
      for (; i < keep && mass < target_hi; ++i) {
        if (i >= n_cand || !above_outside(i)) return std::nullopt;
        before = mass;
        mass += candidates_[i].weight;
      }
      if (i > 0 && !(before < target_lo)) return std::nullopt;
      cut = i;
    }
    // The drawn tokens, in filter()'s order: ranked where top-k or top-p ranked them, else by id.
    if (!top_k && p_.top_p >= 1.0f) {
      if (outside) {
        // Every token left must be a candidate: min-p has to drop all at `bound` and below.
        if (p_.min_p <= 0.0f || !(std::exp((bound - mx) / p_.temperature) < p_.min_p)) return std::nullopt;
      }
      cut = n_cand;
      std::sort(candidates_.begin(), candidates_.begin() + static_cast<std::ptrdiff_t>(cut),
                [](Candidate const& a, Candidate const& b) { return a.id < b.id; });
    }
    weights_.clear();
    picked_.clear();
    for (std::size_t i = 0; i < cut; ++i)
      if (p_.min_p <= 0.0f || candidates_[i].weight >= p_.min_p) {
        weights_.push_back(candidates_[i].weight);
        picked_.push_back(candidates_[i].id);
      }
    std::discrete_distribution<std::size_t> pick(weights_.begin(), weights_.end());
    return picked_[pick(rng_)];
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
  static bool ranks_higher(Candidate const& a, Candidate const& b) {
    return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
  }

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

  /// How many distinct tokens of `history` are not among `ids` (ids outside the vocabulary
  /// count too: an upper bound serves).
  std::size_t history_outside(std::span<std::int32_t const> ids, std::span<std::int32_t const> history) {
    sorted_ids_.assign(ids.begin(), ids.end());
    std::sort(sorted_ids_.begin(), sorted_ids_.end());
    outside_.clear();
    for (std::int32_t t : history)
      if (!std::binary_search(sorted_ids_.begin(), sorted_ids_.end(), t)) outside_.push_back(t);
    std::sort(outside_.begin(), outside_.end());
    return static_cast<std::size_t>(std::unique(outside_.begin(), outside_.end()) - outside_.begin());
  }

  /// The biased binary exponent of a weight in [0, 1] (0 for 0 and subnormals).
  static int exponent_of(float w) { return static_cast<int>(std::bit_cast<std::uint32_t>(w) >> 23); }

  SamplingParams p_;
  std::mt19937_64 rng_;
  std::vector<float> scratch_;
  std::vector<Candidate> candidates_;
  std::vector<float> weights_;
  std::vector<bool> seen_;
  // sample(CandidateRow): which candidates a penalty changed, and the reordering.
  std::vector<bool> changed_, ranked_changed_;
  std::vector<std::size_t> order_;
  std::vector<Candidate> ranked_;
  std::vector<std::int32_t> picked_, sorted_ids_, outside_;
};

}  // namespace qflash::runtime
