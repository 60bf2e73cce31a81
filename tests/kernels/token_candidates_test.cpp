// kernels/token_candidates on the CPU against a brute-force reference: every id ranked by a
// stable sort, and the sums over the row in id order (the sampler's and the engine's, so
// equal to the bit), and the log-normaliser against long double.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "qflash/kernels/token_candidates/cpu.hpp"
#include "qflash/spec/presets.hpp"

using namespace qflash;
using namespace qflash::kernels;

namespace {

constexpr auto kSpec = spec::generic;

struct Case {
  std::int64_t rows;
  int vocab, k;
  std::int64_t ld;
  std::vector<float> logits, temperature;
  std::vector<std::int32_t> excluded;
};

struct Out {
  std::vector<std::int32_t> ids;
  std::vector<float> values;
  std::vector<CandidateStats> stats;
};

Out run(Case const& c) {
  Out o;
  o.ids.assign(static_cast<std::size_t>(c.rows * c.k), -7);
  o.values.assign(o.ids.size(), 7.0f);
  o.stats.resize(static_cast<std::size_t>(c.rows));
  TokenCandidatesArgs a{};
  a.logits = c.logits.data();
  a.rows = c.rows;
  a.ld = c.ld;
  a.vocab = c.vocab;
  a.k = c.k;
  a.temperature = c.temperature.empty() ? nullptr : c.temperature.data();
  a.excluded = c.excluded.data();
  a.n_excluded = static_cast<int>(c.excluded.size());
  a.ids = o.ids.data();
  a.values = o.values.data();
  a.stats = o.stats.data();
  REQUIRE(launch_token_candidates<kSpec>(arch::Cpu{}, a) == Status::kSuccess);
  return o;
}

/// Logits with ties (values on a coarse grid) and, with `spread`, a few far above the rest.
Case make_case(std::uint64_t seed, std::int64_t rows, int vocab, int k, int pad, int n_excluded, bool temps) {
  std::mt19937_64 rng(seed);
  Case c{rows, vocab, k, pad ? vocab + pad : 0, {}, {}, {}};
  std::int64_t const ld = vocab + pad;
  c.logits.resize(static_cast<std::size_t>(rows * ld));
  std::uniform_int_distribution<int> grid(-40, 40);
  for (auto& v : c.logits) v = static_cast<float>(grid(rng)) * 0.25f;
  for (std::int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < 5; ++j)
      c.logits[static_cast<std::size_t>(r * ld + static_cast<std::int64_t>(rng() % static_cast<unsigned>(vocab)))] =
          20.0f + static_cast<float>(j);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(vocab));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  c.excluded.assign(ids.begin(), ids.begin() + std::min(n_excluded, vocab));
  std::sort(c.excluded.begin(), c.excluded.end());
  if (temps)
    for (std::int64_t r = 0; r < rows; ++r) c.temperature.push_back(r % 3 == 0 ? 0.0f : 0.3f + 0.4f * static_cast<float>(r));
  return c;
}

void check_against_reference(Case const& c, Out const& o) {
  std::int64_t const ld = c.ld ? c.ld : c.vocab;
  for (std::int64_t r = 0; r < c.rows; ++r) {
    CAPTURE(r);
    std::vector<float> l(c.logits.begin() + r * ld, c.logits.begin() + r * ld + c.vocab);
    for (std::int32_t id : c.excluded) l[static_cast<std::size_t>(id)] = -INFINITY;
    std::vector<std::int32_t> order(static_cast<std::size_t>(c.vocab));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
      return l[static_cast<std::size_t>(a)] > l[static_cast<std::size_t>(b)];
    });
    for (int j = 0; j < c.k; ++j) {
      auto const at = static_cast<std::size_t>(r * c.k + j);
      if (j < c.vocab) {
        CHECK(o.ids[at] == order[static_cast<std::size_t>(j)]);
        CHECK(o.values[at] == l[static_cast<std::size_t>(order[static_cast<std::size_t>(j)])]);
      } else {
        CHECK(o.ids[at] == -1);
        CHECK(o.values[at] == -INFINITY);
      }
    }
    CandidateStats const& st = o.stats[static_cast<std::size_t>(r)];
    float const mx = *std::max_element(l.begin(), l.end());
    CHECK(st.max == mx);
    CHECK(st.non_finite == 0);
    if (mx == -INFINITY) {
      CHECK(st.log_norm == -INFINITY);
      CHECK(st.mass == 0.0);
      continue;
    }
    float const t = c.temperature.empty() || c.temperature[static_cast<std::size_t>(r)] <= 0
                        ? 1.0f
                        : c.temperature[static_cast<std::size_t>(r)];
    double norm = 0, mass = 0;
    long double exact = 0;
    for (float v : l) {
      norm += std::exp(static_cast<double>(v - mx));
      mass += std::exp((v - mx) / t);
      exact += std::exp(static_cast<long double>(v) - static_cast<long double>(mx));
    }
    CHECK(st.log_norm == mx + static_cast<float>(std::log(norm)));
    CHECK(st.mass == mass);
    CHECK(static_cast<long double>(st.log_norm) ==
          doctest::Approx(static_cast<double>(mx + std::log(exact))).epsilon(1e-6));
  }
}

}  // namespace

TEST_CASE("token_candidates: the k best by value then id, and the row's sums") {
  struct Shape {
    std::int64_t rows;
    int vocab, k, pad, excluded;
    bool temps;
  };
  for (Shape const s : {Shape{1, 1, 1, 0, 0, false}, Shape{3, 5, 8, 0, 0, true}, Shape{4, 300, 64, 3, 17, true},
                        Shape{2, 5000, 64, 0, 4999, false}, Shape{2, 9000, 256, 5, 100, true},
                        Shape{5, 4096, 1, 0, 0, true}, Shape{1, 70, 20, 0, 70, false}}) {
    CAPTURE(s.rows);
    CAPTURE(s.vocab);
    CAPTURE(s.k);
    CAPTURE(s.excluded);
    Case const c = make_case(static_cast<std::uint64_t>(s.vocab * 31 + s.k), s.rows, s.vocab, s.k, s.pad, s.excluded,
                             s.temps);
    check_against_reference(c, run(c));
  }
}

TEST_CASE("token_candidates: -0 ties +0 (lower id first); non-finite logits are counted") {
  Case c{2, 6, 3, 0, {0.0f, -0.0f, 0.0f, -1.0f, -0.0f, -2.0f, 1.0f, NAN, INFINITY, -INFINITY, 0.0f, 2.0f}, {}, {}};
  Out const o = run(c);
  CHECK(o.ids[0] == 0);
  CHECK(o.ids[1] == 1);
  CHECK(o.ids[2] == 2);
  CHECK(o.stats[0].non_finite == 0);
  CHECK(o.stats[1].non_finite == 3);
}

TEST_CASE("token_candidates: arguments the op cannot run are refused") {
  std::vector<float> l(8, 0.0f);
  std::vector<std::int32_t> ids(8);
  std::vector<float> values(8);
  std::vector<CandidateStats> stats(1);
  auto args = [&] {
    TokenCandidatesArgs a{};
    a.logits = l.data();
    a.rows = 1;
    a.vocab = 8;
    a.k = 4;
    a.ids = ids.data();
    a.values = values.data();
    a.stats = stats.data();
    return a;
  };
  CHECK(launch_token_candidates<kSpec>(arch::Cpu{}, args()) == Status::kSuccess);
  auto refused = [&](auto&& change) {
    TokenCandidatesArgs a = args();
    change(a);
    return launch_token_candidates<kSpec>(arch::Cpu{}, a) == Status::kErrorInvalidProblem;
  };
  CHECK(refused([](TokenCandidatesArgs& a) { a.k = 0; }));
  CHECK(refused([](TokenCandidatesArgs& a) { a.k = kMaxTokenCandidates + 1; }));
  CHECK(refused([](TokenCandidatesArgs& a) { a.ld = 7; }));
  CHECK(refused([](TokenCandidatesArgs& a) { a.stats = nullptr; }));
  std::vector<std::int32_t> const unsorted{3, 1}, repeated{2, 2}, outside{8};
  CHECK(refused([&](TokenCandidatesArgs& a) { a.excluded = unsorted.data(), a.n_excluded = 2; }));
  CHECK(refused([&](TokenCandidatesArgs& a) { a.excluded = repeated.data(), a.n_excluded = 2; }));
  CHECK(refused([&](TokenCandidatesArgs& a) { a.excluded = outside.data(), a.n_excluded = 1; }));
}
