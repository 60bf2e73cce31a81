#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__SSE2__)
#include <xmmintrin.h>
#endif

#include "numeric/float_cases.hpp"
#include "qflash/numeric/fp8.hpp"

using namespace qflash;
using detail::bits_of;
using detail::float_of;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

/// The value of an fp8 code from the format definition, in double.
double fp8_value(std::uint32_t code, int man_bits, int bias) {
  int const exp_bits = 7 - man_bits;
  double const sign = (code & 0x80u) != 0 ? -1.0 : 1.0;
  int const e = static_cast<int>((code >> man_bits) & ((1u << exp_bits) - 1u));
  double const m = static_cast<double>(code & ((1u << man_bits) - 1u)) / (1 << man_bits);
  if (e == 0) return sign * std::ldexp(m, 1 - bias);
  return sign * std::ldexp(1.0 + m, e - bias);
}

/// Brute-force reference for fp32 -> fp8: the nearest of all finite magnitudes (in double),
/// ties to the even code, with one extra "overflow" magnitude one step above the largest
/// finite value; landing on it, or beyond it, is overflow.
struct NearestReference {
  std::vector<double> mags;  // mags[c] = value of code c, c = 0..max_finite + 1
  std::uint32_t max_finite;
  std::uint32_t overflow_nosat;

  NearestReference(int man_bits, int bias, std::uint32_t max_finite_code,
                   std::uint32_t overflow_code)
      : max_finite(max_finite_code), overflow_nosat(overflow_code) {
    for (std::uint32_t c = 0; c <= max_finite; ++c) mags.push_back(fp8_value(c, man_bits, bias));
    mags.push_back(mags[max_finite] + (mags[max_finite] - mags[max_finite - 1]));
  }

  std::uint8_t encode(float x, bool saturate) const {
    if (std::isnan(x)) return 0x7F;
    std::uint8_t const sign = std::signbit(x) ? 0x80 : 0x00;
    double const a = std::fabs(static_cast<double>(x));
    std::uint32_t c = 0;
    if (a >= mags.back()) {
      c = max_finite + 1;
    } else {
      auto const it = std::upper_bound(mags.begin(), mags.end(), a);  // first magnitude > a
      std::uint32_t const hi = static_cast<std::uint32_t>(it - mags.begin());
      std::uint32_t const lo = hi - 1;
      double const dlo = a - mags[lo];
      double const dhi = mags[hi] - a;
      c = dlo < dhi ? lo : dhi < dlo ? hi : (lo % 2 == 0 ? lo : hi);
    }
    if (c > max_finite) c = saturate ? max_finite : overflow_nosat;
    return static_cast<std::uint8_t>(sign | c);
  }
};

}  // namespace

TEST_CASE("fp8 e4m3: all 256 codes decode to the e4m3fn values") {
  for (std::uint32_t c = 0; c < 256; ++c) {
    CAPTURE(c);
    float const y = to_float(Fp8E4m3{static_cast<std::uint8_t>(c)});
    if ((c & 0x7F) == 0x7F) {
      CHECK(bits_of(y) == detail::kCanonicalNanBits);
    } else {
      CHECK(y == static_cast<float>(fp8_value(c, 3, 7)));
      CHECK(std::signbit(y) == ((c & 0x80) != 0));
    }
  }
  CHECK(to_float(Fp8E4m3{0x7E}) == 448.0f);
  CHECK(to_float(Fp8E4m3{0xFE}) == -448.0f);
  CHECK(to_float(Fp8E4m3{0x38}) == 1.0f);
  CHECK(to_float(Fp8E4m3{0x08}) == std::ldexp(1.0f, -6));  // smallest normal
  CHECK(to_float(Fp8E4m3{0x01}) == std::ldexp(1.0f, -9));  // smallest subnormal
  CHECK(to_float(Fp8E4m3{0x78}) == 256.0f);                // exponent 15 is finite in fn
}

TEST_CASE("fp8 e4m3: the device's branch-free decode equals the host's for all 256 codes") {
  for (std::uint32_t c = 0; c < 256; ++c) {
    CAPTURE(c);
    auto const code = static_cast<std::uint8_t>(c);
    CHECK(bits_of(detail::decode_e4m3_branchless(code)) ==
          bits_of(detail::decode_minifloat(code, detail::kFp8E4m3Format)));
  }
  static_assert(detail::decode_e4m3_branchless(0x01) == 0x1p-9f);  // a subnormal, in a constant expression
}

#if defined(__SSE2__)
TEST_CASE("fp8 e4m3: the branch-free decode is exact with subnormals flushed (FTZ and DAZ)") {
  std::vector<std::uint32_t> want(256);
  for (std::uint32_t c = 0; c < 256; ++c)
    want[c] = bits_of(detail::decode_minifloat(static_cast<std::uint8_t>(c), detail::kFp8E4m3Format));
  unsigned const csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8000u | 0x0040u);  // MXCSR's flush-to-zero and denormals-are-zero bits
  std::vector<std::uint32_t> got(256);
  for (std::uint32_t c = 0; c < 256; ++c) {
    volatile std::uint8_t const code = static_cast<std::uint8_t>(c);  // decoded at run time, under this mode
    got[c] = bits_of(detail::decode_e4m3_branchless(code));
  }
  volatile float const tiny = 0x1p-149f;
  bool const flushing = tiny * 1.0f == 0.0f;
  _mm_setcsr(csr);
  REQUIRE(flushing);  // the mode took
  for (std::uint32_t c = 0; c < 256; ++c) {
    CAPTURE(c);
    CHECK(got[c] == want[c]);
  }
}
#endif

TEST_CASE("fp8 e5m2: all 256 codes decode to the e5m2 values") {
  for (std::uint32_t c = 0; c < 256; ++c) {
    CAPTURE(c);
    float const y = to_float(Fp8E5m2{static_cast<std::uint8_t>(c)});
    std::uint32_t const mag = c & 0x7F;
    if (mag > 0x7C) {
      CHECK(bits_of(y) == detail::kCanonicalNanBits);
    } else if (mag == 0x7C) {
      CHECK(y == ((c & 0x80) != 0 ? -kInf : kInf));
    } else {
      CHECK(y == static_cast<float>(fp8_value(c, 2, 15)));
      CHECK(std::signbit(y) == ((c & 0x80) != 0));
    }
  }
  CHECK(to_float(Fp8E5m2{0x7B}) == 57344.0f);
  CHECK(to_float(Fp8E5m2{0x3C}) == 1.0f);
  CHECK(to_float(Fp8E5m2{0x04}) == std::ldexp(1.0f, -14));  // smallest normal
  CHECK(to_float(Fp8E5m2{0x01}) == std::ldexp(1.0f, -16));  // smallest subnormal
}

TEST_CASE("fp8: encode(decode(code)) == code for every non-NaN code, both saturation modes") {
  for (auto s : {Fp8Saturation::kSatFinite, Fp8Saturation::kNoSat}) {
    for (std::uint32_t c = 0; c < 256; ++c) {
      CAPTURE(c);
      auto const e4 = Fp8E4m3{static_cast<std::uint8_t>(c)};
      auto const e5 = Fp8E5m2{static_cast<std::uint8_t>(c)};
      // NaN codes all encode to the one NaN CUDA produces, 0x7F.
      CHECK(to_fp8_e4m3(to_float(e4), s).bits == ((c & 0x7F) == 0x7F ? 0x7F : c));
      std::uint32_t const e5_back = to_fp8_e5m2(to_float(e5), s).bits;
      if ((c & 0x7F) > 0x7C) {
        CHECK(e5_back == 0x7F);
      } else if ((c & 0x7F) == 0x7C) {  // Inf saturates to the largest finite value
        CHECK(e5_back == (s == Fp8Saturation::kSatFinite ? (c & 0x80) | 0x7B : c));
      } else {
        CHECK(e5_back == c);
      }
    }
  }
}

TEST_CASE("fp8: specials, saturation and the overflow threshold") {
  constexpr auto kNoSat = Fp8Saturation::kNoSat;
  float const nan = std::numeric_limits<float>::quiet_NaN();
  // NaN of either sign -> positive NaN 0x7F.
  CHECK(to_fp8_e4m3(nan).bits == 0x7F);
  CHECK(to_fp8_e4m3(-nan).bits == 0x7F);
  CHECK(to_fp8_e5m2(-nan).bits == 0x7F);
  CHECK(to_fp8_e5m2(nan, kNoSat).bits == 0x7F);
  // Inf: max finite when saturating, else NaN (e4m3) / Inf (e5m2), sign kept.
  CHECK(to_fp8_e4m3(kInf).bits == 0x7E);
  CHECK(to_fp8_e4m3(-kInf).bits == 0xFE);
  CHECK(to_fp8_e4m3(-kInf, kNoSat).bits == 0xFF);
  CHECK(to_fp8_e5m2(kInf).bits == 0x7B);
  CHECK(to_fp8_e5m2(-kInf, kNoSat).bits == 0xFC);
  // e4m3: 464 is the tie between 448 (even) and the would-be 480: stays 448.
  CHECK(to_fp8_e4m3(464.0f, kNoSat).bits == 0x7E);
  CHECK(to_fp8_e4m3(std::nextafter(464.0f, kInf), kNoSat).bits == 0x7F);
  CHECK(to_fp8_e4m3(std::nextafter(464.0f, kInf)).bits == 0x7E);
  // e5m2: 61440 ties between 57344 (odd code 0x7B) and 65536 (Inf, even): overflows.
  CHECK(to_fp8_e5m2(61440.0f, kNoSat).bits == 0x7C);
  CHECK(to_fp8_e5m2(std::nextafter(61440.0f, 0.0f), kNoSat).bits == 0x7B);
  CHECK(to_fp8_e5m2(61440.0f).bits == 0x7B);
  // Zeros and underflow keep the sign; half the smallest subnormal ties to zero.
  CHECK(to_fp8_e4m3(0.0f).bits == 0x00);
  CHECK(to_fp8_e4m3(-0.0f).bits == 0x80);
  CHECK(to_fp8_e4m3(-1e-30f).bits == 0x80);
  CHECK(to_fp8_e4m3(std::ldexp(1.0f, -10)).bits == 0x00);
  CHECK(to_fp8_e4m3(std::nextafter(std::ldexp(1.0f, -10), 1.0f)).bits == 0x01);
  CHECK(to_fp8_e5m2(std::ldexp(1.0f, -17)).bits == 0x00);
  CHECK(to_fp8_e5m2(-std::ldexp(3.0f, -17)).bits == 0x82);  // 1.5 ulp ties to even 2 ulp
  // A subnormal that rounds up into the smallest normal.
  CHECK(to_fp8_e4m3(std::ldexp(15.0f, -10)).bits == 0x08);
  // round_to_* is the value the code holds.
  CHECK(round_to_fp8_e4m3(1000.0f) == 448.0f);
  CHECK(round_to_fp8_e5m2(0.3f) == 0.3125f);
}

// Usable in constant expressions (tables, static_asserts).
static_assert(to_fp8_e4m3(1.0f).bits == 0x38);
static_assert(to_fp8_e5m2(-2.0f).bits == 0xC0);
static_assert(to_float(Fp8E4m3{0x7E}) == kFp8E4m3Max);
static_assert(to_float(Fp8E5m2{0x7B}) == kFp8E5m2Max);

TEST_CASE("fp8: rounding equals a brute-force nearest-even reference") {
  NearestReference const e4m3(3, 7, 0x7E, 0x7F);
  NearestReference const e5m2(2, 15, 0x7B, 0x7C);
  test::FloatCases cases_e4m3(detail::kFp8E4m3Format, 0xF8E4);
  test::FloatCases cases_e5m2(detail::kFp8E5m2Format, 0xF8E5);
  int n_bad = 0;
  for (int i = 0; i < 200'000; ++i) {
    for (float const x : {cases_e4m3.next(), cases_e5m2.next()}) {
      for (bool const sat : {true, false}) {
        auto const s = sat ? Fp8Saturation::kSatFinite : Fp8Saturation::kNoSat;
        std::uint8_t const got4 = to_fp8_e4m3(x, s).bits;
        std::uint8_t const got5 = to_fp8_e5m2(x, s).bits;
        std::uint8_t const want4 = e4m3.encode(x, sat);
        std::uint8_t const want5 = e5m2.encode(x, sat);
        if ((got4 != want4 || got5 != want5) && ++n_bad <= 5) {
          CAPTURE(bits_of(x));
          CAPTURE(sat);
          CHECK(got4 == want4);
          CHECK(got5 == want5);
        }
      }
    }
  }
  CHECK(n_bad == 0);
}
