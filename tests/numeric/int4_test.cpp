#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "qflash/numeric/int4.hpp"
#include "support/random.hpp"

using namespace qflash;

namespace {

/// The fp16 next to finite `h` toward +inf.
float fp16_next_up(Fp16 h) {
  if (h.bits == 0x8000) return std::ldexp(1.0f, -24);  // -0 -> the smallest subnormal
  Fp16 n = h;
  n.bits = static_cast<std::uint16_t>((h.bits & 0x8000) != 0 ? h.bits - 1 : h.bits + 1);
  return to_float(n);
}

/// Quantizes x[0..n) into one block and checks the documented parameters and error bound.
void check_group(float const* x, int n) {
  BlockInt4G128 b;
  std::memset(&b, 0xAB, sizeof b);  // garbage, to see that unused codes get cleared
  quantize_int4_g128(x, n, b);
  float y[kInt4GroupSize];
  dequantize_int4_g128(b, n, y);

  auto const [lo_it, hi_it] = std::minmax_element(x, x + n);
  double const lo = *lo_it;
  double const hi = *hi_it;
  double const min = to_float(b.min);
  double const scale = to_float(b.scale);
  CAPTURE(n);
  CAPTURE(lo);
  CAPTURE(hi);
  // min is the largest fp16 <= lo.
  CHECK(min <= lo);
  CHECK(fp16_next_up(b.min) > lo);
  // scale is the smallest fp16 >= (hi - min) / 15, up to fp32 rounding of that quotient.
  double const want = (hi - min) / 15.0;
  CHECK(scale >= want * (1 - 1e-6));
  if (scale > 0.0) {
    Fp16 below = b.scale;
    --below.bits;
    CHECK(to_float(below) < want * (1 + 1e-6));
  }
  // |x - y| <= scale / 2, plus fp32 rounding of x - min, the division, and the final add.
  double const slack = 8.0 * std::ldexp(1.0, -24) * (std::max(std::fabs(lo), std::fabs(hi)) +
                                                     (hi - lo) + std::fabs(min - lo));
  double const bound = 0.5 * scale + slack;
  int n_bad = 0;
  for (int i = 0; i < n; ++i) {
    double const err = std::fabs(static_cast<double>(y[i]) - x[i]);
    bool const ok = err <= bound && int4_g128_code(b, i) <= kInt4Max;
    if (!ok && ++n_bad <= 3) {
      CAPTURE(i);
      CAPTURE(x[i]);
      CAPTURE(y[i]);
      CHECK(err <= bound);
    }
  }
  CHECK(n_bad == 0);
  for (int i = n; i < kInt4GroupSize; ++i) {
    CAPTURE(i);
    CHECK(int4_g128_code(b, i) == 0);
  }
}

// Quantization is constexpr: x = {-1, 0.5, 2} gives min = -1, scale = the fp16 above 0.2
// (0.2000732, spacing 2^-13 there), codes round(0, 7.497, 14.995) = 0, 7, 15.
constexpr float kConstX[3] = {-1.0f, 0.5f, 2.0f};
constexpr BlockInt4G128 kConstBlock = [] {
  BlockInt4G128 b{};
  quantize_int4_g128(kConstX, 3, b);
  return b;
}();
static_assert(to_float(kConstBlock.min) == -1.0f);
static_assert(to_float(kConstBlock.scale) == 0.2000732421875f);
static_assert(int4_g128_code(kConstBlock, 0) == 0 && int4_g128_code(kConstBlock, 1) == 7 &&
              int4_g128_code(kConstBlock, 2) == 15 && int4_g128_code(kConstBlock, 3) == 0);

}  // namespace

TEST_CASE("int4_g128: layout, sizes, and a hand-built block") {
  CHECK(sizeof(BlockInt4G128) == 68);
  CHECK(int4_g128_row_bytes(0) == 0);
  CHECK(int4_g128_row_bytes(1) == 68);
  CHECK(int4_g128_row_bytes(128) == 68);
  CHECK(int4_g128_row_bytes(129) == 136);
  CHECK(int4_g128_row_bytes(7168) == 56 * 68);

  // scale = 0.5 (fp16 0x3800), min = -2 (fp16 0xC000), little-endian, then the codes.
  std::uint8_t bytes[68] = {0x00, 0x38, 0x00, 0xC0};
  bytes[4] = 0x21;   // value 0: code 1 (low nibble), value 1: code 2 (high nibble)
  bytes[5] = 0xF0;   // value 2: code 0, value 3: code 15
  bytes[67] = 0x7E;  // value 126: code 14, value 127: code 7
  BlockInt4G128 b;
  std::memcpy(&b, bytes, sizeof b);
  float y[128];
  dequantize_int4_g128(b, 128, y);
  CHECK(y[0] == -1.5f);
  CHECK(y[1] == -1.0f);
  CHECK(y[2] == -2.0f);
  CHECK(y[3] == 5.5f);
  CHECK(y[4] == -2.0f);
  CHECK(y[126] == 5.0f);
  CHECK(y[127] == 1.5f);
  CHECK(int4_g128_code(b, 3) == 15);
  CHECK(int4_g128_code(b, 126) == 14);

  // Every code in both nibbles, with the other nibble holding a different code.
  for (int i = 0; i < 2; ++i) {
    for (int q = 0; q < 16; ++q) {
      BlockInt4G128 c{};
      c.scale = to_fp16(0.25f);
      c.min = to_fp16(1.0f);
      c.qs[0] = static_cast<std::uint8_t>(i == 0 ? q | (15 - q) << 4 : (15 - q) | q << 4);
      float z[2];
      dequantize_int4_g128(c, 2, z);
      CHECK(int4_g128_code(c, i) == q);
      CHECK(z[i] == 0.25f * q + 1.0f);
      CHECK(z[1 - i] == 0.25f * (15 - q) + 1.0f);
    }
  }
}

TEST_CASE("int4_g128: quantize -> dequantize stays within scale / 2") {
  std::mt19937_64 rng(0x4128);
  for (auto [lo, hi] : {std::pair{-1.0f, 1.0f}, std::pair{0.5f, 2.0f}, std::pair{-3.0f, -0.01f},
                        std::pair{-1e-3f, 2e-3f}, std::pair{-6e4f, 6e4f},
                        std::pair{-1e-6f, 1e-6f}}) {
    for (int n : {1, 2, 7, 64, 127, 128}) {
      for (int rep = 0; rep < 8; ++rep) {
        auto const x = test::random_floats(static_cast<std::size_t>(n), rng(), lo, hi);
        CAPTURE(lo);
        CAPTURE(rep);
        check_group(x.data(), n);
      }
    }
  }
}

TEST_CASE("int4_g128: constant groups and single values") {
  SUBCASE("a constant that is an fp16 is exact, with scale 0 and codes 0") {
    for (float c : {0.0f, -0.75f, 3.0f, 1000.5f, -65504.0f}) {
      std::vector<float> const x(128, c);
      BlockInt4G128 b;
      quantize_int4_g128(x.data(), 128, b);
      CAPTURE(c);
      CHECK(b.scale.bits == 0);
      CHECK(to_float(b.min) == c);
      float y[128];
      dequantize_int4_g128(b, 128, y);
      for (int i = 0; i < 128; ++i) CHECK(y[i] == c);
      check_group(x.data(), 128);
    }
  }
  SUBCASE("a constant that is not an fp16 comes back within scale / 2") {
    for (float c : {0.1f, -0.1f, 3.14159f, 1e-7f}) {
      std::vector<float> const x(128, c);
      CAPTURE(c);
      check_group(x.data(), 128);
      check_group(x.data(), 1);
    }
  }
  SUBCASE("n = 1") {
    auto const x = test::random_floats(64, 0x4001, -10.0f, 10.0f);
    for (float v : x) check_group(&v, 1);
  }
}

TEST_CASE("int4_g128: rows with a short last group") {
  std::mt19937_64 rng(0x4129);
  for (std::size_t cols : {1u, 7u, 127u, 128u, 129u, 300u, 512u}) {
    auto const x = test::random_floats(cols, rng(), -2.0f, 1.0f);
    std::vector<BlockInt4G128> blocks(int4_g128_row_bytes(cols) / sizeof(BlockInt4G128));
    quantize_row_int4_g128(x.data(), cols, blocks.data());
    std::vector<float> y(cols);
    dequantize_row_int4_g128(blocks.data(), cols, y.data());
    CAPTURE(cols);
    for (std::size_t g = 0; g < blocks.size(); ++g) {
      std::size_t const c0 = g * kInt4GroupSize;
      int const n = static_cast<int>(std::min<std::size_t>(kInt4GroupSize, cols - c0));
      check_group(x.data() + c0, n);
      BlockInt4G128 one;
      quantize_int4_g128(x.data() + c0, n, one);
      CHECK(std::memcmp(&one, &blocks[g], sizeof one) == 0);
      float yg[kInt4GroupSize];
      dequantize_int4_g128(one, n, yg);
      CHECK(std::equal(yg, yg + n, y.begin() + static_cast<std::ptrdiff_t>(c0)));
    }
  }
}
