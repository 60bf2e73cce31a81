#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

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
