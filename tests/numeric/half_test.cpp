#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "numeric/float_cases.hpp"
#include "qflash/numeric/bf16.hpp"
#include "qflash/numeric/fp16.hpp"

using namespace qflash;
using detail::bits_of;
using detail::float_of;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

/// The value of an fp16 code from the IEEE definition, in double (NaN for NaN codes).
double fp16_value(std::uint32_t code) {
  double const sign = (code & 0x8000u) != 0 ? -1.0 : 1.0;
  int const e = static_cast<int>((code >> 10) & 0x1Fu);
  double const m = static_cast<double>(code & 0x3FFu) / 1024.0;
  if (e == 31) return m == 0.0 ? sign * std::numeric_limits<double>::infinity() : std::nan("");
  if (e == 0) return sign * std::ldexp(m, -14);
  return sign * std::ldexp(1.0 + m, e - 15);
}

/// Reference rounding fp32 -> bf16 (not NaN): of the two bf16 values around x (truncation
/// and the next code up in magnitude), the nearer in double, ties to the even code.
std::uint16_t bf16_reference(float x) {
  std::uint32_t const b = bits_of(x);
  std::uint32_t const lo = b >> 16;
  std::uint32_t const hi = lo + 1;
  double const dx = std::fabs(static_cast<double>(x));
  double const vlo = std::fabs(static_cast<double>(float_of(lo << 16)));
  // The code after the largest finite magnitude is Inf; its "value" is 2^128 for rounding.
  double const vhi = (hi & 0x7FFFu) == 0x7F80u ? std::ldexp(1.0, 128)
                                               : std::fabs(static_cast<double>(float_of(hi << 16)));
  double const dlo = dx - vlo;
  double const dhi = vhi - dx;
  return static_cast<std::uint16_t>(dlo < dhi ? lo : dhi < dlo ? hi : (lo % 2 == 0 ? lo : hi));
}

}  // namespace

TEST_CASE("bf16: all 65536 codes decode exactly and encode back to themselves") {
  for (std::uint32_t c = 0; c < 65536; ++c) {
    Bf16 const h{static_cast<std::uint16_t>(c)};
    float const y = to_float(h);
    CHECK(bits_of(y) == c << 16);  // widening keeps NaN payloads, as CUDA's host code does
    bool const is_nan = (c & 0x7F80u) == 0x7F80u && (c & 0x7Fu) != 0;
    // The generic decoder agrees (it canonicalises NaN), fp32-subnormal bf16 values included.
    CHECK(bits_of(detail::decode_minifloat(c, detail::kBf16Format)) ==
          (is_nan ? detail::kCanonicalNanBits : c << 16));
    std::uint16_t const back = to_bf16(y).bits;
    if (is_nan) {
      CHECK(back == 0x7FFF);
    } else if (back != c) {
      CAPTURE(c);
      CHECK(back == c);
    }
  }
}

TEST_CASE("bf16: round to nearest even, ties, overflow, NaN") {
  CHECK(to_bf16(1.0f).bits == 0x3F80);
  CHECK(to_bf16(float_of(0x3F808000u)).bits == 0x3F80);  // tie, even stays
  CHECK(to_bf16(float_of(0x3F818000u)).bits == 0x3F82);  // tie, odd rounds up
  CHECK(to_bf16(float_of(0x3F808001u)).bits == 0x3F81);
  CHECK(to_bf16(std::numeric_limits<float>::max()).bits == 0x7F80);  // rounds to Inf
  CHECK(to_bf16(float_of(0x7F7F7FFFu)).bits == 0x7F7F);
  CHECK(to_bf16(-kInf).bits == 0xFF80);
  CHECK(to_bf16(float_of(0xFFC00001u)).bits == 0x7FFF);
  CHECK(to_bf16(float_of(0x7F800001u)).bits == 0x7FFF);  // signalling NaN: stays NaN
  CHECK(to_bf16(-0.0f).bits == 0x8000);
  CHECK(to_bf16(std::numeric_limits<float>::denorm_min()).bits == 0x0000);
  CHECK(to_bf16(float_of(0x00008000u)).bits == 0x0000);  // subnormal tie to even 0
  CHECK(to_bf16(float_of(0x00018000u)).bits == 0x0002);
  CHECK(round_to_bf16(1.00390625f) == 1.0f);  // 1 + 2^-8 ties to 1
  static_assert(to_bf16(-2.0f).bits == 0xC000);
}

TEST_CASE("bf16: random floats equal the nearest-even reference") {
  test::FloatCases cases(detail::kBf16Format, 0xBF16);
  int n_bad = 0;
  for (int i = 0; i < 1'000'000; ++i) {
    float const x = cases.next();
    std::uint16_t const want = std::isnan(x) ? 0x7FFF : bf16_reference(x);
    if (to_bf16(x).bits != want && ++n_bad <= 5) {
      CAPTURE(bits_of(x));
      CHECK(to_bf16(x).bits == want);
    }
  }
  CHECK(n_bad == 0);
}

TEST_CASE("fp16: all 65536 codes decode exactly and encode back to themselves") {
  for (std::uint32_t c = 0; c < 65536; ++c) {
    Fp16 const h{static_cast<std::uint16_t>(c)};
    float const y = to_float(h);
    double const want = fp16_value(c);
    bool const is_nan = std::isnan(want);
    if (is_nan) {
      CHECK(bits_of(y) == detail::kCanonicalNanBits);
      CHECK(to_fp16(y).bits == 0x7FFF);
      continue;
    }
    if (static_cast<double>(y) != want || std::signbit(y) != ((c & 0x8000u) != 0) ||
        to_fp16(y).bits != c) {
      CAPTURE(c);
      CHECK(static_cast<double>(y) == want);
      CHECK(std::signbit(y) == ((c & 0x8000u) != 0));
      CHECK(to_fp16(y).bits == c);
    }
  }
}

TEST_CASE("fp16: the device's branch-free decode equals the host's for all 65536 codes") {
  int mismatches = 0;
  for (std::uint32_t c = 0; c < 65536; ++c) {
    auto const code = static_cast<std::uint16_t>(c);
    std::uint32_t const got = bits_of(detail::decode_f16_scaled(code));
    std::uint32_t const want = bits_of(detail::decode_minifloat(code, detail::kFp16Format));
    if (got != want && mismatches++ < 5) MESSAGE("code ", c, ": ", got, " != ", want);
  }
  CHECK(mismatches == 0);
  static_assert(detail::decode_f16_scaled(0x0001) == 0x1p-24f);  // the smallest subnormal
  static_assert(detail::decode_f16_scaled(0xFC00) == -HUGE_VALF);
}

TEST_CASE("fp16: round to nearest even, subnormals, overflow, NaN") {
  CHECK(to_fp16(1.0f).bits == 0x3C00);
  CHECK(to_fp16(65504.0f).bits == 0x7BFF);
  CHECK(to_fp16(65519.996f).bits == 0x7BFF);
  CHECK(to_fp16(65520.0f).bits == 0x7C00);  // tie between max (odd) and Inf: Inf
  CHECK(to_fp16(-1e30f).bits == 0xFC00);
  CHECK(to_fp16(-kInf).bits == 0xFC00);
  CHECK(to_fp16(float_of(0xFF800001u)).bits == 0x7FFF);
  CHECK(to_fp16(std::ldexp(1.0f, -24)).bits == 0x0001);  // smallest subnormal
  CHECK(to_fp16(std::ldexp(1.0f, -25)).bits == 0x0000);  // half of it: tie to even 0
  CHECK(to_fp16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)).bits == 0x0001);
  CHECK(to_fp16(-std::ldexp(3.0f, -25)).bits == 0x8002);    // 1.5 ulp ties to 2
  CHECK(to_fp16(std::ldexp(1023.5f, -24)).bits == 0x0400);  // rounds up into the normals
  CHECK(to_fp16(-0.0f).bits == 0x8000);
  CHECK(to_fp16(1.0f + std::ldexp(1.0f, -11)).bits == 0x3C00);  // tie, even
  CHECK(to_fp16(1.0f + std::ldexp(3.0f, -11)).bits == 0x3C02);  // tie, odd rounds up
  CHECK(round_to_fp16(0.1f) == 0.0999755859375f);
  static_assert(to_fp16(2.0f).bits == 0x4000);
  static_assert(to_float(Fp16{0x7BFF}) == kFp16Max);
}

#if defined(__FLT16_MAX__)
TEST_CASE("fp16: random floats equal the compiler's _Float16 conversion") {
  test::FloatCases cases(detail::kFp16Format, 0xF16);
  int n_bad = 0;
  for (int i = 0; i < 1'000'000; ++i) {
    float const x = cases.next();
    if (std::isnan(x)) continue;  // _Float16 keeps NaN payloads; ours is canonical (checked above)
    auto const h = static_cast<_Float16>(x);
    std::uint16_t want = 0;
    static_assert(sizeof(h) == sizeof(want));
    __builtin_memcpy(&want, &h, sizeof(want));
    if (to_fp16(x).bits != want && ++n_bad <= 5) {
      CAPTURE(bits_of(x));
      CHECK(to_fp16(x).bits == want);
    }
  }
  CHECK(n_bad == 0);
}
#endif
