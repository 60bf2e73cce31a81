#include <doctest/doctest.h>

#include <array>
#include <cmath>
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
