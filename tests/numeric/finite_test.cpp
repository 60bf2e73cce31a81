// all_finite / first_non_finite: every class of float, at the ends of a buffer and on both sides
// of a 16-float boundary.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "qflash/numeric/finite.hpp"

TEST_CASE("first_non_finite finds the first NaN or Inf and passes every finite value") {
  using L = std::numeric_limits<float>;
  float const finite[] = {0.0f, -0.0f, 1.0f, -3.5f, L::max(), -L::max(), L::min(), L::denorm_min(),
                          -L::denorm_min(), std::nextafter(L::max(), 0.0f)};
  float const bad[] = {L::infinity(), -L::infinity(), L::quiet_NaN(), -L::quiet_NaN(), L::signaling_NaN(),
                       std::bit_cast<float>(0x7f800001u), std::bit_cast<float>(0xffffffffu)};
  std::vector<float> x(67);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = finite[i % std::size(finite)];
  CHECK(qflash::all_finite(x));
  CHECK(qflash::first_non_finite(x) == x.size());
  CHECK(qflash::all_finite(std::span<float const>()));
  for (float b : bad)
    for (std::size_t at : {std::size_t{0}, std::size_t{15}, std::size_t{16}, std::size_t{66}}) {
      std::vector<float> y = x;
      y[at] = b;
      y.back() = b;
      CAPTURE(at);
      CHECK_FALSE(qflash::all_finite(y));
      CHECK(qflash::first_non_finite(y) == at);
    }
}
