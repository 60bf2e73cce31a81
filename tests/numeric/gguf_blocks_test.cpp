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

namespace {

/// Packs 256 codes (0..63, i.e. q + 32) as ggml's quantize_row_q6_K_ref does, independently of
/// the header's own packing.
void q6_k_pack_like_ggml(int const* codes, std::uint8_t* ql, std::uint8_t* qh) {
  for (int j = 0; j < 256; j += 128) {
    for (int l = 0; l < 32; ++l) {
      int const* L = codes + j;
      ql[l] = static_cast<std::uint8_t>((L[l] & 0xF) | (L[l + 64] & 0xF) << 4);
      ql[l + 32] = static_cast<std::uint8_t>((L[l + 32] & 0xF) | (L[l + 96] & 0xF) << 4);
      qh[l] = static_cast<std::uint8_t>(L[l] >> 4 | (L[l + 32] >> 4) << 2 |
                                        (L[l + 64] >> 4) << 4 | (L[l + 96] >> 4) << 6);
    }
    ql += 64;
    qh += 32;
  }
}

}  // namespace

TEST_CASE("q6_k: a hand-built block dequantizes to (d*sc)*q in ggml's value order") {
  // Offsets: ql 0..127, qh 128..191, scales 192..207, d 208..209. All other code bits are 0,
  // i.e. q = -32.
  std::uint8_t bytes[210] = {};
  bytes[208] = 0x00;  // d = 0.25 = fp16 0x3400, last
  bytes[209] = 0x34;
  std::int8_t const sc[16] = {2, -3, 5, 7, -1, 11, 13, 1, 127, -128, 4, 6, -5, 9, 10, 3};
  for (int j = 0; j < 16; ++j) bytes[192 + j] = static_cast<std::uint8_t>(sc[j]);
  // Half 0, l = 0: values 0, 32, 64, 96.
  bytes[0] = 0x5A;         // ql[0]:  value 0 low bits 0xA, value 64 low bits 0x5
  bytes[32] = 0xC3;        // ql[32]: value 32 low bits 0x3, value 96 low bits 0xC
  bytes[128 + 0] = 0xE4;   // qh[0] = 11 10 01 00: high bits 0, 1, 2, 3 for values 0, 32, 64, 96
  // Half 1, l = 17 (the second sub-block of each quarter): values 145, 177, 209, 241.
  bytes[64 + 17] = 0xF0;   // ql[81]:  value 145 low 0x0, value 209 low 0xF
  bytes[96 + 17] = 0x0F;   // ql[113]: value 177 low 0xF, value 241 low 0x0
  bytes[128 + 49] = 0x1B;  // qh[49] = 00 01 10 11: high bits 3, 2, 1, 0
  auto const b = from_bytes<BlockQ6K>(bytes);
  CHECK(to_float(b.d) == 0.25f);
  float y[256];
  dequantize_q6_k(b, y);

  //        code = low | high << 4;  q = code - 32;  y = 0.25 * sc[i / 16] * q
  CHECK(q6_k_code(b, 0) == -22);    // 10 | 0 << 4 = 10
  CHECK(y[0] == -11.0f);            // sc[0] = 2
  CHECK(q6_k_code(b, 32) == -13);   // 3 | 1 << 4 = 19
  CHECK(y[32] == -16.25f);          // sc[2] = 5
  CHECK(q6_k_code(b, 64) == 5);     // 5 | 2 << 4 = 37
  CHECK(y[64] == -1.25f);           // sc[4] = -1
  CHECK(q6_k_code(b, 96) == 28);    // 12 | 3 << 4 = 60
  CHECK(y[96] == 91.0f);            // sc[6] = 13
  CHECK(q6_k_code(b, 145) == 16);   // 0 | 3 << 4 = 48
  CHECK(y[145] == -512.0f);         // sc[9] = -128
  CHECK(q6_k_code(b, 177) == 15);   // 15 | 2 << 4 = 47
  CHECK(y[177] == 22.5f);           // sc[11] = 6
  CHECK(q6_k_code(b, 209) == -1);   // 15 | 1 << 4 = 31
  CHECK(y[209] == -2.25f);          // sc[13] = 9
  CHECK(q6_k_code(b, 241) == -32);  // 0 | 0 << 4 = 0
  CHECK(y[241] == -24.0f);          // sc[15] = 3
  for (int i : {1, 31, 33, 65, 97, 128, 144, 146, 178, 210, 242, 255}) {
    CAPTURE(i);
    CHECK(q6_k_code(b, i) == -32);
    CHECK(y[i] == 0.25f * sc[i / 16] * -32.0f);
  }
}

TEST_CASE("q6_k: every code in every position decodes as ggml packs it") {
  std::int8_t const sc[16] = {1, -2, 3, -4, 5, -6, 7, -8, 9, -10, 11, -12, 13, 127, -128, 64};
  for (int shift = 0; shift < 64; shift += 13) {
    int codes[256];
    for (int i = 0; i < 256; ++i) codes[i] = (i * 5 + i / 64 + shift) % 64;
    BlockQ6K b{};
    q6_k_pack_like_ggml(codes, b.ql, b.qh);
    std::memcpy(b.scales, sc, 16);
    b.d = to_fp16(0.5f);
    float y[256];
    dequantize_q6_k(b, y);
    bool seen[64] = {};
    int n_bad = 0;
    for (int i = 0; i < 256; ++i) {
      seen[codes[i]] = true;
      // Small dyadic terms: exact in fp32.
      bool const ok = q6_k_code(b, i) == codes[i] - 32 &&
                      y[i] == 0.5f * sc[i / 16] * static_cast<float>(codes[i] - 32);
      if (!ok && ++n_bad <= 3) {
        CAPTURE(shift);
        CAPTURE(i);
        CHECK(q6_k_code(b, i) == codes[i] - 32);
        CHECK(y[i] == 0.5f * sc[i / 16] * static_cast<float>(codes[i] - 32));
      }
    }
    CHECK(n_bad == 0);
    CHECK(std::all_of(std::begin(seen), std::end(seen), [](bool s) { return s; }));
  }
}

TEST_CASE("q6_k: quantize -> dequantize stays within half a sub-block step") {
  std::mt19937_64 rng(0x6666);
  // The quantizer's step before rounding: max(n_j / 32, p_j / 31.5) (see quantize_q6_k).
  auto step = [](float const* xj) {
    double neg = 0.0;
    double pos = 0.0;
    for (int l = 0; l < 16; ++l) {
      neg = std::max(neg, -static_cast<double>(xj[l]));
      pos = std::max(pos, static_cast<double>(xj[l]));
    }
    return std::max(neg / 32.0, pos / 31.5);
  };
  // Checks the documented step and error bounds; marks the codes used in `seen`.
  auto check_block = [&](float const* x, BlockQ6K const& b, bool* seen) {
    float y[256];
    dequantize_q6_k(b, y);
    double const d = to_float(b.d);
    double max_s = 0.0;
    for (int j = 0; j < 16; ++j) max_s = std::max(max_s, step(x + 16 * j));
    // d is max_s / 127 rounded up to fp16: at most one fp16 ulp above, which is 2^-10
    // relative for normals and 2^-24 absolute for subnormals (below 2^-14).
    CHECK(d >= max_s / 127.0 * (1 - 1e-6));
    CHECK(d <= max_s / 127.0 * (1.0 + std::ldexp(1.0, -10)) + std::ldexp(1.0, -24));
    int n_bad = 0;
    for (int j = 0; j < 16; ++j) {
      double const s = step(x + 16 * j);
      double const e = d * b.scales[j];
      double amax = 0.0;
      for (int l = 0; l < 16; ++l) amax = std::max(amax, std::fabs(double{x[16 * j + l]}));
      CAPTURE(j);
      CHECK(b.scales[j] >= 0);
      CHECK(e >= s * (1 - 1e-6));
      CHECK(e <= s + d);
      double const bound = 0.5 * e + 4e-6 * amax;
      for (int l = 0; l < 16; ++l) {
        int const i = 16 * j + l;
        seen[q6_k_code(b, i) + 32] = true;
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

  bool seen[64] = {};
  SUBCASE("random blocks of several ranges, and all 64 codes used") {
    for (auto [lo, hi] : {std::pair{-1.0f, 1.0f}, std::pair{0.5f, 2.0f}, std::pair{-3.0f, -0.01f},
                          std::pair{-1e-3f, 2e-3f}, std::pair{-5e4f, 1e4f}}) {
      std::size_t const n = 256 * 9;
      auto const x = test::random_floats(n, rng(), lo, hi);
      std::vector<BlockQ6K> blocks(n / 256);
      quantize_row_q6_k(x.data(), n, blocks.data());
      std::vector<float> y(n);
      dequantize_row_q6_k(blocks.data(), n, y.data());
      for (std::size_t k = 0; k < blocks.size(); ++k) {
        CAPTURE(lo);
        CAPTURE(k);
        check_block(x.data() + 256 * k, blocks[k], seen);
        float yk[256];
        dequantize_q6_k(blocks[k], yk);
        CHECK(std::equal(yk, yk + 256, y.begin() + static_cast<std::ptrdiff_t>(256 * k)));
      }
    }
    // Both ends too, from the largest sub-blocks (sc_j near 127, so e_j is within 1% of s_j):
    // a dominant negative end maps to about -32, a dominant positive end to about 31.5 -> 31.
    CHECK(std::all_of(std::begin(seen), std::end(seen), [](bool s) { return s; }));
  }
  SUBCASE("a zero block") {
    float const x[256] = {};
    BlockQ6K const b = quantize_q6_k(x);
    CHECK(b.d.bits == 0);
    float y[256];
    dequantize_q6_k(b, y);
    for (int i = 0; i < 256; ++i) {
      CAPTURE(i);
      CHECK(y[i] == 0.0f);
      CHECK(q6_k_code(b, i) == 0);
    }
  }
  SUBCASE("one large outlier, in either sign, with zero and small sub-blocks") {
    for (float outlier : {1000.0f, -1000.0f, 3.0f}) {
      for (int pos : {0, 77, 255}) {
        auto x = test::random_floats(256, rng(), -0.01f, 0.01f);
        std::fill(x.begin() + 96, x.begin() + 112, 0.0f);  // sub-block 6 all zero
        x[static_cast<std::size_t>(pos)] = outlier;
        BlockQ6K const b = quantize_q6_k(x.data());
        CAPTURE(outlier);
        CAPTURE(pos);
        CHECK(b.scales[pos / 16] == 127);
        CHECK(b.scales[6] == 0);
        check_block(x.data(), b, seen);
        float y[256];
        dequantize_q6_k(b, y);
        CHECK(q6_k_code(b, pos) == (outlier < 0 ? -32 : 31));
        // Within half a step of about |outlier| / 31.5.
        CHECK(std::fabs(y[pos] - outlier) <= std::fabs(outlier) / 63.0f * 1.01f);
      }
    }
  }
}

TEST_CASE("activation blocks: llama.cpp's q8_0 (x86) and q8_K quantizers") {
  CHECK(qflash::detail::round_half_even(0.5f) == 0);
  CHECK(qflash::detail::round_half_even(1.5f) == 2);
  CHECK(qflash::detail::round_half_even(-2.5f) == -2);
  CHECK(qflash::detail::round_half_even(-2.6f) == -3);
  std::mt19937_64 rng(0x08c8);
  for (float range : {1e-3f, 1.0f, 300.0f}) {
    CAPTURE(range);
    auto const x = test::random_floats(256, rng(), -range, range);
    SUBCASE("q8_0: codes round(x * 127 / amax) half to even, d = fp16(amax / 127)") {
      for (int k = 0; k < 8; ++k) {
        float const* xb = x.data() + 32 * k;
        float amax = 0.0f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
        BlockQ8_0 const b = quantize_q8_0_activations(xb);
        CHECK(b.d.bits == to_fp16(amax / 127.0f).bits);
        for (int i = 0; i < 32; ++i) CHECK(b.qs[i] == static_cast<std::int8_t>(std::nearbyint(xb[i] * (127.0f / amax))));
      }
    }
    SUBCASE("q8_K: the largest magnitude maps to -127, |x - d q| <= |d| / 2, bsums are sums of 16") {
      BlockQ8K const b = quantize_q8_k(x.data());
      auto const top = std::max_element(x.begin(), x.end(), [](float a, float c) { return std::fabs(a) < std::fabs(c); });
      CHECK(b.qs[top - x.begin()] == -127);
      CHECK((b.d < 0) == (*top > 0));
      for (int i = 0; i < 256; ++i) CHECK(std::fabs(b.d * b.qs[i] - x[static_cast<std::size_t>(i)]) <= std::fabs(b.d) * (0.5 + 1e-5));
      for (int g = 0; g < 16; ++g) {
        int sum = 0;
        for (int l = 0; l < 16; ++l) sum += b.qs[16 * g + l];
        CHECK(b.bsums[g] == sum);
      }
    }
  }
  float const zeros[256] = {};
  BlockQ8K const z = quantize_q8_k(zeros);
  CHECK(z.d == 0.0f);
  CHECK(z.bsums[0] == 0);
}
