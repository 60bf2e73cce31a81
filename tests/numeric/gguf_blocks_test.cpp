#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "qflash/numeric/gguf_blocks.hpp"
#include "support/random.hpp"

using namespace qflash;
using namespace qflash::gguf;

namespace {

template <class Block, std::size_t N>
Block from_bytes(std::uint8_t const (&bytes)[N]) {
  static_assert(sizeof(Block) == N);
  Block b{};
  std::memcpy(&b, bytes, N);
  return b;
}

/// Sub-block j's effective scale d*sc_j and offset dmin*m_j, read back from a block.
struct SubBlock {
  float scale;
  float offset;
};
SubBlock q4_k_sub_block(BlockQ4K const& b, int j) {
  Q4KScaleMin const sm = q4_k_scale_min(b.scales, j);
  return {to_float(b.d) * sm.scale, to_float(b.dmin) * sm.min};
}

}  // namespace

TEST_CASE("q8_0: a hand-built block dequantizes to d * q") {
  // d = 0.5 (fp16 0x3800, little-endian), q[i] = i - 16, with the int8 extremes at both ends.
  std::uint8_t bytes[34] = {0x00, 0x38};
  std::int8_t q[32];
  for (int i = 0; i < 32; ++i) q[i] = static_cast<std::int8_t>(i - 16);
  q[0] = -128;
  q[31] = 127;
  for (int i = 0; i < 32; ++i) bytes[2 + i] = static_cast<std::uint8_t>(q[i]);
  auto const b = from_bytes<BlockQ8_0>(bytes);
  float y[32];
  dequantize_q8_0(b, y);
  for (int i = 0; i < 32; ++i) {
    CAPTURE(i);
    CHECK(y[i] == 0.5f * q[i]);
  }
  CHECK(y[0] == -64.0f);
  CHECK(y[1] == -7.5f);
  CHECK(y[31] == 63.5f);
}

TEST_CASE("q8_0: ggml's reference quantizer, and its error bound") {
  CHECK(qflash::detail::round_half_away(0.49999997f) == 0);  // where int(v + 0.5f) fails
  CHECK(qflash::detail::round_half_away(0.5f) == 1);
  CHECK(qflash::detail::round_half_away(-0.5f) == -1);
  CHECK(qflash::detail::round_half_away(-2.4f) == -2);

  SUBCASE("zeros give d = 0 and q = 0") {
    float const x[32] = {};
    BlockQ8_0 const b = quantize_q8_0(x);
    CHECK(b.d.bits == 0);
    for (auto q : b.qs) CHECK(q == 0);
  }
  SUBCASE("random rows") {
    std::mt19937_64 rng(0x0880);
    std::size_t const n = 32 * 61;
    for (float range : {1e-3f, 0.05f, 1.0f, 300.0f}) {
      auto const x = test::random_floats(n, rng(), -range, range);
      std::vector<BlockQ8_0> blocks(n / 32);
      quantize_row_q8_0(x.data(), n, blocks.data());
      std::vector<float> y(n);
      dequantize_row_q8_0(blocks.data(), n, y.data());
      int n_bad = 0;
      for (std::size_t k = 0; k < blocks.size(); ++k) {
        float const* xb = x.data() + 32 * k;
        float amax = 0.0f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
        float const d = amax / 127.0f;
        float const id = d != 0.0f ? 1.0f / d : 0.0f;
        CHECK(blocks[k].d.bits == to_fp16(d).bits);
        // One quantum, plus using the fp16-rounded d for up to 127 quanta.
        double const d16 = to_float(blocks[k].d);
        double const bound = 0.5 * d + 127.0 * std::fabs(d16 - d) + 1e-6 * amax;
        for (int i = 0; i < 32; ++i) {
          bool const q_ok = blocks[k].qs[i] == static_cast<std::int8_t>(std::roundf(xb[i] * id));
          bool const err_ok = std::fabs(static_cast<double>(y[32 * k + i]) - xb[i]) <= bound;
          if ((!q_ok || !err_ok) && ++n_bad <= 3) {
            CAPTURE(range);
            CAPTURE(k);
            CAPTURE(i);
            CHECK(q_ok);
            CHECK(err_ok);
          }
        }
      }
      CHECK(n_bad == 0);
    }
  }
}

TEST_CASE("q4_k: 6-bit scales and mins unpack as get_scale_min_k4") {
  // sc = {1, 2, 3, 63, 10, 33, 47, 60}, m = {0, 5, 63, 1, 17, 32, 48, 2}, packed by hand:
  //   bytes 0-3:  sc[j] | (sc[j+4] >> 4) << 6     = 01 82 83 FF
  //   bytes 4-7:  m[j]  | (m[j+4]  >> 4) << 6     = 40 85 FF 01
  //   bytes 8-11: (sc[j+4] & 15) | (m[j+4] & 15) << 4 = 1A 01 0F 2C
  std::uint8_t const packed[12] = {0x01, 0x82, 0x83, 0xFF, 0x40, 0x85,
                                   0xFF, 0x01, 0x1A, 0x01, 0x0F, 0x2C};
  std::uint8_t const sc[8] = {1, 2, 3, 63, 10, 33, 47, 60};
  std::uint8_t const m[8] = {0, 5, 63, 1, 17, 32, 48, 2};
  for (int j = 0; j < 8; ++j) {
    CAPTURE(j);
    Q4KScaleMin const sm = q4_k_scale_min(packed, j);
    CHECK(sm.scale == sc[j]);
    CHECK(sm.min == m[j]);
  }
  std::uint8_t repacked[12] = {};
  q4_k_pack_scale_min(sc, m, repacked);
  for (int k = 0; k < 12; ++k) CHECK(repacked[k] == packed[k]);

  // Every (scale, min) pair in every slot survives pack -> unpack.
  for (int j = 0; j < 8; ++j) {
    for (int v = 0; v < 64; ++v) {
      std::uint8_t s2[8] = {};
      std::uint8_t m2[8] = {};
      s2[j] = static_cast<std::uint8_t>(v);
      m2[j] = static_cast<std::uint8_t>(63 - v);
      std::uint8_t bytes[12] = {};
      q4_k_pack_scale_min(s2, m2, bytes);
      for (int k = 0; k < 8; ++k) {
        Q4KScaleMin const sm = q4_k_scale_min(bytes, k);
        CHECK(sm.scale == s2[k]);
        CHECK(sm.min == m2[k]);
      }
    }
  }
}

TEST_CASE("q4_k: a hand-built block dequantizes to (d*sc)*q - dmin*m in ggml's value order") {
  std::uint8_t bytes[144] = {};
  bytes[0] = 0x00;  // d = 0.25 = fp16 0x3400
  bytes[1] = 0x34;
  bytes[2] = 0x00;  // dmin = 0.125 = fp16 0x3000
  bytes[3] = 0x30;
  std::uint8_t const scales[12] = {0x01, 0x82, 0x83, 0xFF, 0x40, 0x85,
                                   0xFF, 0x01, 0x1A, 0x01, 0x0F, 0x2C};
  std::memcpy(bytes + 4, scales, 12);
  int const sc[8] = {1, 2, 3, 63, 10, 33, 47, 60};
  int const m[8] = {0, 5, 63, 1, 17, 32, 48, 2};
  auto code = [](int i) { return (i * 7 + i / 32) % 16; };
  // qs[32p + l]: low nibble = value 64p + l, high nibble = value 64p + 32 + l.
  for (int p = 0; p < 4; ++p) {
    for (int l = 0; l < 32; ++l) {
      bytes[16 + 32 * p + l] =
          static_cast<std::uint8_t>(code(64 * p + l) | code(64 * p + 32 + l) << 4);
    }
  }
  auto const b = from_bytes<BlockQ4K>(bytes);
  float y[256];
  dequantize_q4_k(b, y);
  for (int i = 0; i < 256; ++i) {
    CAPTURE(i);
    int const j = i / 32;
    CHECK(q4_k_code(b, i) == code(i));
    // All terms are small dyadic numbers: exact in fp32 whatever the order or FMA use.
    CHECK(y[i] == 0.25f * sc[j] * code(i) - 0.125f * m[j]);
  }
  // A few worked by hand; code(i) = (7i + i/32) % 16.
  CHECK(y[0] == 0.0f);                        // code 0, sc 1, m 0
  CHECK(y[33] == 0.25f * 2 * 8 - 0.625f);     // code (231 + 1) % 16 = 8, sc 2, m 5
  CHECK(y[255] == 0.25f * 60 * 0 - 0.25f);    // code (1785 + 7) % 16 = 0, sc 60, m 2
  CHECK(y[100] == 0.25f * 63 * 15 - 0.125f);  // code (700 + 3) % 16 = 15, sc 63, m 1
}

TEST_CASE("q4_k: quantize -> dequantize stays within half a sub-block step") {
  std::mt19937_64 rng(0x4444);
  auto check_block = [](float const* x, BlockQ4K const& b) {
    float y[256];
    dequantize_q4_k(b, y);
    float const d = to_float(b.d);
    float const dmin = to_float(b.dmin);
    int n_bad = 0;
    for (int j = 0; j < 8; ++j) {
      SubBlock const s = q4_k_sub_block(b, j);
      float lo = 0.0f;
      float hi = x[32 * j];
      for (int l = 0; l < 32; ++l) {
        lo = std::min(lo, x[32 * j + l]);
        hi = std::max(hi, x[32 * j + l]);
      }
      // The step is no coarser than the range (plus the 6-bit rounding of min and scale) needs.
      double const mag = std::max(std::fabs(lo), std::fabs(hi)) + s.offset;
      CHECK(s.scale <= (hi - lo + dmin) / 15.0 + d + 1e-6 * mag);
      double const bound = 0.5 * s.scale + 4e-7 * mag;
      for (int l = 0; l < 32; ++l) {
        int const i = 32 * j + l;
        double const err = std::fabs(static_cast<double>(y[i]) - x[i]);
        if (!(err <= bound) && ++n_bad <= 3) {
          CAPTURE(i);
          CAPTURE(x[i]);
          CAPTURE(y[i]);
          CHECK(err <= bound);
        }
      }
    }
    CHECK(n_bad == 0);
  };

  SUBCASE("random blocks, symmetric, positive-only and negative-only") {
    for (auto [lo, hi] : {std::pair{-1.0f, 1.0f}, std::pair{0.5f, 2.0f}, std::pair{-3.0f, -0.01f},
                          std::pair{-0.02f, 0.07f}, std::pair{-200.0f, 50.0f}}) {
      std::size_t const n = 256 * 9;
      auto const x = test::random_floats(n, rng(), lo, hi);
      std::vector<BlockQ4K> blocks(n / 256);
      quantize_row_q4_k(x.data(), n, blocks.data());
      std::vector<float> y(n);
      dequantize_row_q4_k(blocks.data(), n, y.data());
      for (std::size_t k = 0; k < blocks.size(); ++k) {
        CAPTURE(lo);
        CAPTURE(k);
        check_block(x.data() + 256 * k, blocks[k]);
        float yk[256];
        dequantize_q4_k(blocks[k], yk);
        CHECK(std::equal(yk, yk + 256, y.begin() + static_cast<std::ptrdiff_t>(256 * k)));
      }
    }
  }
  SUBCASE("sub-blocks of very different magnitude") {
    std::vector<float> x(256);
    for (int j = 0; j < 8; ++j) {
      auto const part = test::random_floats(32, rng(), -std::ldexp(1.0f, -j), std::ldexp(1.0f, -j));
      std::copy(part.begin(), part.end(), x.begin() + 32 * j);
    }
    check_block(x.data(), quantize_q4_k(x.data()));
  }
  SUBCASE("all-zero and constant blocks") {
    std::vector<float> const zeros(256, 0.0f);
    BlockQ4K const z = quantize_q4_k(zeros.data());
    float y[256];
    dequantize_q4_k(z, y);
    for (float v : y) CHECK(v == 0.0f);
    std::vector<float> const c(256, -0.75f);
    check_block(c.data(), quantize_q4_k(c.data()));
  }
}
