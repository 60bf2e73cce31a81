#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <optional>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include "qflash/kernels/token_candidates/cpu.hpp"
#include "qflash/runtime/sampler.hpp"

using namespace qflash;
using runtime::Sampler;
using runtime::SamplingParams;

namespace {
std::vector<float> const kLogits{1.0f, 3.0f, 2.5f, -1.0f, 2.9f};
}

TEST_CASE("greedy picks the argmax, lowest id on ties") {
  Sampler s(SamplingParams{});
  CHECK(s.sample(kLogits) == 1);
  std::vector<float> tie{0.5f, 2.0f, 2.0f};
  CHECK(s.sample(tie) == 1);
}

TEST_CASE("filters that leave one candidate behave like greedy at any temperature") {
  for (int seed = 0; seed < 20; ++seed) {
    SamplingParams p;
    p.temperature = 5.0f;
    p.seed = static_cast<std::uint64_t>(seed);
    p.top_k = 1;
    CHECK(Sampler(p).sample(kLogits) == 1);
    p.top_k = 0;
    p.top_p = 1e-6f;
    CHECK(Sampler(p).sample(kLogits) == 1);
    p.top_p = 1.0f;
    p.min_p = 1.0f;
    CHECK(Sampler(p).sample(kLogits) == 1);
  }
}

TEST_CASE("top-k limits the candidates; a seed reproduces the draws") {
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 3;  // ids 1, 4, 2
  p.seed = 42;
  Sampler a(p), b(p);
  for (int i = 0; i < 200; ++i) {
    auto const t = a.sample(kLogits);
    CHECK((t == 1 || t == 4 || t == 2));
    CHECK(b.sample(kLogits) == t);
  }
}

TEST_CASE("temperature 1 draws follow the softmax") {
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 1;
  Sampler s(p);
  std::array<int, 5> counts{};
  int const n = 20000;
  for (int i = 0; i < n; ++i) ++counts[static_cast<std::size_t>(s.sample(kLogits))];
  double z = 0;
  for (float l : kLogits) z += std::exp(l);
  for (std::size_t i = 0; i < kLogits.size(); ++i) {
    double const p_i = std::exp(kLogits[i]) / z;
    double const sd = std::sqrt(n * p_i * (1 - p_i));
    CHECK(std::fabs(counts[i] - n * p_i) <= 5 * sd + 1);  // 5 sigma
  }
}

TEST_CASE("repetition penalty discourages seen tokens once each") {
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  Sampler s(p);
  std::vector<std::int32_t> seen{1, 1, 1};
  CHECK(s.sample(kLogits, seen) == 4);  // 3.0 / 2 = 1.5 < 2.9
  std::vector<float> neg{-1.0f, -1.5f};
  std::vector<std::int32_t> first{0};
  CHECK(s.sample(neg, first) == 1);  // -1 * 2 = -2 < -1.5
}

TEST_CASE("parameters outside their ranges are refused, naming them") {
  SamplingParams p;
  p.top_p = 0.0f;
  CHECK_THROWS_WITH_AS(Sampler{p}, doctest::Contains("top_p"), Error);
  p = {};
  p.temperature = -1.0f;
  CHECK_THROWS_WITH_AS(Sampler{p}, doctest::Contains("temperature"), Error);
  p = {};
  p.min_p = 2.0f;
  CHECK_THROWS_WITH_AS(Sampler{p}, doctest::Contains("min_p"), Error);
  p = {};
  p.repetition_penalty = 0.0f;
  CHECK_THROWS_WITH_AS(Sampler{p}, doctest::Contains("repetition_penalty"), Error);
  p = {};
  p.top_k = -2;
  CHECK_THROWS_WITH_AS(Sampler{p}, doctest::Contains("top_k"), Error);
}

namespace {

/// The filters by their definition: every token ranked (logit, then lowest id), softmax at the
/// temperature over the top_k, the smallest ranked prefix reaching top_p, then min_p.
std::vector<std::pair<std::int32_t, double>> reference_distribution(std::vector<float> logits,
                                                                    std::vector<std::int32_t> const& history,
                                                                    SamplingParams const& p) {
  std::vector<bool> seen(logits.size());
  for (std::int32_t t : history)
    if (!seen[static_cast<std::size_t>(t)]) {
      seen[static_cast<std::size_t>(t)] = true;
      float& l = logits[static_cast<std::size_t>(t)];
      l = l < 0 ? l * p.repetition_penalty : l / p.repetition_penalty;
    }
  std::vector<std::int32_t> order(logits.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<std::int32_t>(i);
  std::sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
    float const la = logits[static_cast<std::size_t>(a)], lb = logits[static_cast<std::size_t>(b)];
    return la > lb || (la == lb && a < b);
  });
  if (p.top_k > 0 && static_cast<std::size_t>(p.top_k) < order.size()) order.resize(static_cast<std::size_t>(p.top_k));
  float const mx = logits[static_cast<std::size_t>(order[0])];
  std::vector<double> w;
  double sum = 0;
  for (std::int32_t t : order) sum += w.emplace_back(std::exp((logits[static_cast<std::size_t>(t)] - mx) / p.temperature));
  std::size_t cut = order.size();
  if (p.top_p < 1.0f) {
    double mass = 0;
    for (cut = 0; cut < order.size() && mass < p.top_p * sum;) mass += w[cut++];
  }
  while (cut > 1 && w[cut - 1] < p.min_p) --cut;
  double kept = 0;
  for (std::size_t i = 0; i < cut; ++i) kept += w[i];
  std::vector<std::pair<std::int32_t, double>> out;
  for (std::size_t i = 0; i < cut; ++i) out.emplace_back(order[i], w[i] / kept);
  return out;
}

}  // namespace

TEST_CASE("the filters over a whole vocabulary: the candidates and probabilities of their definition") {
  // top-p ranks only the exponents of the weights it needs; this checks it against a full
  // ranking, with ties, over 4096 and 50000 tokens, with each filter and their mixes.
  std::mt19937 rng(3);
  for (std::size_t n : {std::size_t{4096}, std::size_t{50000}})
    for (float spread : {3.0f, 0.05f}) {  // peaked; nearly flat (most of the vocabulary in top-p)
      std::normal_distribution<float> d(0.0f, spread);
      std::vector<float> logits(n);
      for (auto& l : logits) l = d(rng);
      for (std::size_t i = 0; i < n; i += 97) logits[i] = logits[i / 2];  // ties
      std::vector<std::int32_t> history;
      for (int i = 0; i < 50; ++i) history.push_back(static_cast<std::int32_t>(rng() % n));
      for (auto [temperature, top_k, top_p, min_p, penalty] :
           std::vector<std::tuple<float, int, float, float, float>>{{0.8f, 0, 0.95f, 0.0f, 1.1f},
                                                                    {1.0f, 0, 0.5f, 0.0f, 1.0f},
                                                                    {0.7f, 40, 0.9f, 0.0f, 1.0f},
                                                                    {1.3f, 0, 0.99f, 0.05f, 1.2f},
                                                                    {0.9f, 0, 1.0f, 0.1f, 1.0f},
                                                                    {1.0f, 0, 1.0f, 0.0f, 1.0f}}) {
        SamplingParams p;
        p.temperature = temperature, p.top_k = top_k, p.top_p = top_p, p.min_p = min_p, p.repetition_penalty = penalty;
        CAPTURE(n);
        CAPTURE(spread);
        CAPTURE(temperature);
        CAPTURE(top_k);
        CAPTURE(top_p);
        CAPTURE(min_p);
        auto got = Sampler(p).distribution(logits, history);
        auto want = reference_distribution(logits, history, p);
        bool const ranked = top_k > 0 || top_p < 1.0f;
        if (!ranked) {  // every candidate, in no particular order
          std::sort(got.begin(), got.end());
          std::sort(want.begin(), want.end());
        }
        REQUIRE(got.size() == want.size());
        double worst = 0;
        bool same_ids = true;
        for (std::size_t i = 0; i < got.size(); ++i) {
          same_ids = same_ids && got[i].first == want[i].first;
          worst = std::max(worst, std::fabs(got[i].second - want[i].second) / want[i].second);
        }
        CHECK(same_ids);
        CHECK(worst < 1e-6);  // float weights against double ones
      }
    }
}

TEST_CASE("distribution: none at temperature 0") {
  CHECK_THROWS_WITH_AS(Sampler(SamplingParams{}).distribution(kLogits), doctest::Contains("temperature 0"), Error);
}

// ---- sampling from a row's candidates (kernels/token_candidates) ----------------------------

namespace {

/// A row's candidates from the CPU op, as a model brings them back.
struct Candidates {
  std::vector<std::int32_t> ids;
  std::vector<float> values;
  kernels::CandidateStats stats;
  runtime::CandidateRow row(std::int64_t vocab) const { return {ids, values, stats, vocab}; }
};

Candidates candidates_of(std::vector<float> const& logits, std::vector<std::int32_t> const& excluded, int k,
                         float temperature) {
  Candidates c;
  c.ids.resize(static_cast<std::size_t>(k));
  c.values.resize(static_cast<std::size_t>(k));
  kernels::TokenCandidatesArgs a{};
  a.logits = logits.data();
  a.rows = 1;
  a.vocab = static_cast<int>(logits.size());
  a.k = k;
  a.temperature = &temperature;
  a.excluded = excluded.data();
  a.n_excluded = static_cast<int>(excluded.size());
  a.ids = c.ids.data();
  a.values = c.values.data();
  a.stats = &c.stats;
  REQUIRE(kernels::cpu::token_candidates(a) == Status::kSuccess);
  return c;
}

}  // namespace

TEST_CASE("sampling from candidates draws what the whole row draws, or leaves the generator untouched") {
  std::mt19937_64 rng(5);
  int decided = 0, total = 0, must = 0, penalised_nuclei = 0, decided_penalised_nuclei = 0;
  for (int trial = 0; trial < 1500; ++trial) {
    int const vocab = std::array{3, 40, 64, 65, 300, 2000}[trial % 6];
    // Peaked rows (a trained model's) and flat ones; values on a grid, so ties occur.
    bool const peaked = trial % 3 != 0;
    std::uniform_int_distribution<int> grid(-40, 40);
    std::vector<float> raw(static_cast<std::size_t>(vocab));
    for (auto& v : raw) v = static_cast<float>(grid(rng)) * (peaked ? 0.1f : 0.01f);
    if (peaked)
      for (int j = 0; j < 6; ++j) raw[rng() % static_cast<unsigned>(vocab)] = 8.0f + static_cast<float>(j % 3);
    std::vector<std::int32_t> excluded;
    for (std::int32_t id = 0; id < vocab; ++id)
      if (vocab > 3 && rng() % 9 == 0) excluded.push_back(id);
    SamplingParams p;
    p.temperature = std::array{0.0f, 0.3f, 0.7f, 1.0f, 2.0f}[rng() % 5];
    p.top_k = std::array{0, 0, 1, 5, 20, 64, 100}[rng() % 7];
    p.top_p = std::array{1.0f, 1.0f, 0.5f, 0.9f, 0.95f}[rng() % 5];
    p.min_p = std::array{0.0f, 0.0f, 0.05f, 0.3f}[rng() % 4];
    p.repetition_penalty = rng() % 3 == 0 ? 1.3f : 1.0f;
    p.seed = rng();
    // A history (the repetition penalty's) and generated tokens with counts (the engine's
    // frequency and presence penalties, which it takes off before the sampler).
    std::vector<std::int32_t> history;
    for (int j = 0; j < 30; ++j) history.push_back(static_cast<std::int32_t>(rng() % static_cast<unsigned>(vocab)));
    bool const engine_penalties = rng() % 3 == 0;
    std::vector<float> off(static_cast<std::size_t>(vocab), 0.0f);
    if (engine_penalties)
      for (int j = 10; j < 30; ++j) off[static_cast<std::size_t>(history[static_cast<std::size_t>(j)])] += 0.4f;
    CAPTURE(trial);
    CAPTURE(vocab);
    CAPTURE(p.temperature);
    CAPTURE(p.top_k);
    CAPTURE(p.top_p);
    CAPTURE(p.min_p);
    CAPTURE(p.repetition_penalty);
    CAPTURE(engine_penalties);

    std::vector<float> full = raw;
    for (std::int32_t id : excluded) full[static_cast<std::size_t>(id)] = -INFINITY;
    for (std::size_t i = 0; i < full.size(); ++i) full[i] -= off[i];
    Candidates const c = candidates_of(raw, excluded, 64, p.temperature);
    std::vector<float> lowered;
    std::size_t lowered_outside = 0;  // as the engine counts them: once per generated token
    if (engine_penalties) {
      for (std::int32_t id : c.ids) lowered.push_back(id >= 0 ? off[static_cast<std::size_t>(id)] : 0.0f);
      for (int j = 10; j < 30; ++j)
        lowered_outside += std::find(c.ids.begin(), c.ids.end(), history[static_cast<std::size_t>(j)]) == c.ids.end();
    }
    Sampler whole(p), from_candidates(p);
    bool const plain = p.repetition_penalty == 1.0f && !engine_penalties;
    for (int draw = 0; draw < 4; ++draw) {
      std::int32_t const want = whole.sample(full, history);
      std::optional<std::int32_t> const got =
          from_candidates.sample(c.row(vocab), history, {lowered, lowered_outside});
      ++total;
      bool const penalised_nucleus = !plain && p.temperature > 0.0f && p.top_k == 0 && p.top_p < 1.0f;
      penalised_nuclei += penalised_nucleus;
      if (got) {
        ++decided;
        decided_penalised_nuclei += penalised_nucleus;
        CHECK(*got == want);
      } else {
        CHECK(from_candidates.sample(full, history) == want);  // as the engine falls back
      }
      // What the candidates always decide: greedy, and a top-k within them, without penalties.
      if (plain && (p.temperature == 0.0f || (p.top_k > 0 && p.top_k <= 64))) {
        ++must;
        CHECK(got.has_value());
      }
    }
  }
  MESSAGE("decided from candidates: ", decided, " of ", total, " draws (", must, " had to be); top-p without top-k "
          "under penalties: ", decided_penalised_nuclei, " of ", penalised_nuclei);
  CHECK(decided > total / 2);
  CHECK(decided_penalised_nuclei > penalised_nuclei / 4);
}

TEST_CASE("sampling from candidates: negative penalties or a repetition penalty below 1 read the whole row") {
  std::vector<float> logits(200);
  for (std::size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>(i % 17) * 0.5f;
  Candidates const c = candidates_of(logits, {}, 64, 1.0f);
  std::vector<std::int32_t> const history{5, 6};
  SamplingParams p;
  p.repetition_penalty = 0.8f;
  CHECK_FALSE(Sampler(p).sample(c.row(200), history).has_value());
  CHECK(Sampler(p).sample(c.row(200)).has_value());  // no history: nothing to raise
  p.repetition_penalty = 1.0f;
  std::vector<float> raised(64, 0.0f);
  raised[3] = -1.0f;
  CHECK_FALSE(Sampler(p).sample(c.row(200), history, {raised, 0}).has_value());
}

TEST_CASE("sampling from candidates: top-p under penalties on tokens outside them decides only when it can") {
  // 64 candidates 3.0, 2.98, ...; 1936 tokens outside at 1.7 hold most of the mass, so the nucleus
  // of top_p 0.05 ends among the candidates, where the penalties outside place it.
  int const vocab = 2000;
  std::vector<float> raw(vocab, 1.7f);
  for (int i = 0; i < 64; ++i) raw[static_cast<std::size_t>(i)] = 3.0f - 0.02f * static_cast<float>(i);
  Candidates const c = candidates_of(raw, {}, 64, 1.0f);
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_p = 0.05f;
  p.seed = 3;
  for (int n_outside : {3, 1500}) {
    CAPTURE(n_outside);
    std::vector<std::int32_t> history;  // tokens outside the candidates, and one candidate
    for (int j = 0; j < n_outside; ++j) history.push_back(100 + j);
    history.push_back(10);
    SUBCASE("the repetition penalty") {
      p.repetition_penalty = 1.3f;
      Sampler whole(p), from_candidates(p);
      int decided = 0;
      for (int draw = 0; draw < 200; ++draw) {
        std::int32_t const want = whole.sample(raw, history);
        std::optional<std::int32_t> const got = from_candidates.sample(c.row(vocab), history);
        if (got) {
          ++decided;
          CHECK(*got == want);
        } else {
          CHECK(from_candidates.sample(raw, history) == want);
        }
      }
      CHECK(decided == (n_outside == 3 ? 200 : 0));  // 1500 leave the mass too uncertain
    }
    SUBCASE("a caller's own penalties (the engine's frequency penalty)") {
      std::vector<float> full = raw, lowered(64, 0.0f);
      for (std::int32_t id : history) full[static_cast<std::size_t>(id)] -= 0.4f;
      lowered[10] = 0.4f;
      Sampler whole(p), from_candidates(p);
      int decided = 0;
      for (int draw = 0; draw < 200; ++draw) {
        std::int32_t const want = whole.sample(full);
        std::optional<std::int32_t> const got =
            from_candidates.sample(c.row(vocab), {}, {lowered, static_cast<std::size_t>(n_outside)});
        if (got) {
          ++decided;
          CHECK(*got == want);
        } else {
          CHECK(from_candidates.sample(full) == want);
        }
      }
      CHECK(decided == (n_outside == 3 ? 200 : 0));
    }
  }
}
