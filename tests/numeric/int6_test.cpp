#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/numeric/int6.hpp"
#include "support/random.hpp"

using namespace qflash;

namespace {

/// fp32 slack on top of scale/2: the subtraction, division and the dequantizing multiply-add
/// each round once, relative to at most max(|min|, |max|) + range.
double int6_slack(float lo, float hi) {
  double const mag =
      std::max(std::fabs(static_cast<double>(lo)), std::fabs(static_cast<double>(hi)));
  return 8.0 * std::ldexp(1.0, -24) * (mag + (static_cast<double>(hi) - lo));
}

/// Quantizes, packs, unpacks and dequantizes `x`; checks the scale/2 bound on every element.
void check_round_trip(std::vector<float> const& x) {
  std::size_t const n = x.size();
  std::vector<std::uint8_t> packed(int6_packed_bytes(n));
  Int6Params const p = int6_quantize_group(x.data(), n, packed.data());
  std::vector<float> y(n);
  int6_dequantize_group(packed.data(), n, p, y.data());

  auto const [lo_it, hi_it] = std::minmax_element(x.begin(), x.end());
  CHECK(p.min == *lo_it);
  CHECK(p.scale == (*hi_it - *lo_it) / 63.0f);
  double const bound = 0.5 * p.scale + int6_slack(*lo_it, *hi_it);
  int n_bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    double const err = std::fabs(static_cast<double>(y[i]) - x[i]);
    if (!(err <= bound) && ++n_bad <= 3) {
      CAPTURE(i);
      CAPTURE(x[i]);
      CAPTURE(y[i]);
      CHECK(err <= bound);
    }
  }
  CHECK(n_bad == 0);
  // Padding codes of a partial last group are zero.
  if (n % 4 != 0) {
    for (std::size_t i = n; i < (n + 3) / 4 * 4; ++i) CHECK(int6_get(packed.data(), i) == 0);
  }
}

}  // namespace

TEST_CASE("int6: packing layout is 4 codes per 3 little-endian bytes") {
  std::uint8_t const q[4] = {0x01, 0x02, 0x03, 0x3F};
  std::uint8_t out[3] = {};
  int6_pack(q, 4, out);
  // w = 1 | 2 << 6 | 3 << 12 | 63 << 18 = 0xFC3081
  CHECK(out[0] == 0x81);
  CHECK(out[1] == 0x30);
  CHECK(out[2] == 0xFC);
  CHECK(int6_packed_bytes(0) == 0);
  CHECK(int6_packed_bytes(1) == 3);
  CHECK(int6_packed_bytes(4) == 3);
  CHECK(int6_packed_bytes(5) == 6);
  CHECK(int6_packed_bytes(128) == 96);
}

TEST_CASE("int6: every code 0..63 round-trips in every position") {
  for (int pos = 0; pos < 4; ++pos) {
    for (int v = 0; v <= kInt6Max; ++v) {
      // The other three positions hold a distinct pattern, so a leak into them shows.
      std::uint8_t q[8];
      for (int k = 0; k < 8; ++k) q[k] = static_cast<std::uint8_t>((k * 23 + 5) & 0x3F);
      q[pos] = static_cast<std::uint8_t>(v);
      q[4 + pos] = static_cast<std::uint8_t>(63 - v);
      std::uint8_t packed[6] = {};
      int6_pack(q, 8, packed);
      std::uint8_t back[8] = {};
      int6_unpack(packed, 8, back);
      for (int k = 0; k < 8; ++k) {
        CAPTURE(pos);
        CAPTURE(v);
        CHECK(back[k] == q[k]);
        CHECK(int6_get(packed, static_cast<std::size_t>(k)) == q[k]);
      }
    }
  }
}

TEST_CASE("int6: span overloads pack odd lengths and check the buffer size") {
  std::vector<std::uint8_t> q(37);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = static_cast<std::uint8_t>((i * 7) % 64);
  std::vector<std::uint8_t> packed(int6_packed_bytes(q.size()));
  CHECK(packed.size() == 30);
  int6_pack(std::span<std::uint8_t const>(q), std::span<std::uint8_t>(packed));
  std::vector<std::uint8_t> back(q.size());
  int6_unpack(std::span<std::uint8_t const>(packed), std::span<std::uint8_t>(back));
  CHECK(back == q);
  std::vector<std::uint8_t> small(packed.size() - 1);
  CHECK_THROWS_AS(int6_pack(std::span<std::uint8_t const>(q), std::span<std::uint8_t>(small)),
                  Error);
  CHECK_THROWS_AS(int6_unpack(std::span<std::uint8_t const>(small), std::span<std::uint8_t>(back)),
                  Error);
}

TEST_CASE("int6: quantize/dequantize error is at most scale/2") {
  SUBCASE("random groups of many lengths and ranges") {
    std::mt19937_64 rng(0x1776);
    for (std::size_t n : {1u, 2u, 3u, 5u, 31u, 32u, 37u, 64u, 71u, 128u, 129u, 256u}) {
      for (int rep = 0; rep < 40; ++rep) {
        float const center = std::uniform_real_distribution<float>(-100.0f, 100.0f)(rng);
        float const width = std::ldexp(1.0f, std::uniform_int_distribution<int>(-20, 10)(rng));
        auto x = test::random_floats(n, rng(), center - width, center + width);
        CAPTURE(n);
        CAPTURE(rep);
        check_round_trip(x);
      }
    }
  }
  SUBCASE("constant groups are exact (scale 0)") {
    for (float c : {0.0f, -3.25f, 1e-30f, 7e20f}) {
      std::vector<float> const x(13, c);
      std::vector<std::uint8_t> packed(int6_packed_bytes(x.size()));
      Int6Params const p = int6_quantize_group(x.data(), x.size(), packed.data());
      CHECK(p.scale == 0.0f);
      std::vector<float> y(x.size());
      int6_dequantize_group(packed.data(), y.size(), p, y.data());
      CHECK(y == x);
    }
  }
  SUBCASE("group ends map to codes 0 and 63 exactly") {
    std::vector<float> const x = {-1.0f, 0.25f, 2.0f, 0.0f, 1.0f};
    std::vector<std::uint8_t> packed(int6_packed_bytes(x.size()));
    Int6Params const p = int6_quantize_group(x.data(), x.size(), packed.data());
    CHECK(int6_get(packed.data(), 0) == 0);
    CHECK(int6_get(packed.data(), 2) == 63);
    CHECK(int6_dequantize(0, p) == -1.0f);
    CHECK(int6_dequantize(63, p) == doctest::Approx(2.0f).epsilon(1e-6));
    check_round_trip(x);
  }
  SUBCASE("out-of-group values clamp") {
    Int6Params const p{1.0f, 0.0f};
    CHECK(int6_quantize(-5.0f, p) == 0);
    CHECK(int6_quantize(100.0f, p) == 63);
    CHECK(int6_quantize(2.5f, p) == 3);  // half away from zero
    CHECK(int6_quantize(2.49f, p) == 2);
  }
}

static_assert(int6_packed_bytes(6) == 6);
