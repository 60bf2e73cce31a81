/// @file
/// Seeded fp32 inputs that probe a narrow format's rounding where it goes wrong: exact ties
/// between neighbouring codes and one fp32 ulp either side, the overflow boundary, the
/// subnormal range and the underflow-to-zero boundary, specials (+-0, +-Inf, NaNs), and
/// uniformly random bit patterns. Built for speed (splitmix64), since the conversion tests
/// draw ten million of them under ASan.
#pragma once

#include <cstdint>
#include <limits>

#include "qflash/numeric/minifloat.hpp"

namespace qflash::test {

/// splitmix64: tiny, fast, and good enough to spread test inputs.
struct SplitMix64 {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  std::uint32_t next_u32() { return static_cast<std::uint32_t>(next() >> 32); }
  /// Uniform in [0, n).
  std::uint32_t below(std::uint32_t n) {
    return static_cast<std::uint32_t>((next() >> 32) * n >> 32);
  }
};

/// fp32 values chosen to probe one narrow format `f` (see the file comment).
class FloatCases {
 public:
  FloatCases(detail::MiniFloatFormat f, std::uint64_t seed) : f_(f), rng_{seed} {}

  float next() {
    std::uint32_t const sign = rng_.next_u32() & 0x80000000u;
    switch (rng_.below(8)) {
      case 0:  // any bit pattern: huge, tiny, NaN payloads
        return detail::float_of(rng_.next_u32());
      case 1:  // random value across the format's range and a little beyond
        return with_sign(sign, random_in_range());
      case 2:
      case 3:
      case 4:  // at, between and one ulp around neighbouring codes, including max -> overflow
        return with_sign(sign, near_tie());
      case 5:  // the subnormal / underflow region
        return with_sign(sign, near_tie_below(min_normal_code()));
      case 6:  // exactly at or one ulp around the overflow threshold and the largest value
        return with_sign(sign, overflow_boundary());
      default:
        return special();
    }
  }

 private:
  static float with_sign(std::uint32_t sign, float x) {
    return detail::float_of(detail::bits_of(x) | sign);
  }
  static float step(float x, int ulps) {  // x >= 0, moved by whole fp32 ulps
    return detail::float_of(
        static_cast<std::uint32_t>(static_cast<std::int64_t>(detail::bits_of(x)) + ulps));
  }
  std::uint32_t min_normal_code() const { return 1u << f_.man_bits; }
  /// Magnitude of finite code c.
  float value(std::uint32_t c) const { return detail::decode_minifloat(c, f_); }
  /// Distance from code c to the next magnitude; past the largest finite code, the step the
  /// format would take next (the overflow threshold is half of it above the largest value).
  float gap(std::uint32_t c) const {
    if (c < f_.max_finite) return value(c + 1) - value(c);
    return value(f_.max_finite) - value(f_.max_finite - 1);
  }
  float random_in_range() {
    int const lo_exp = 127 - f_.bias - f_.man_bits - 3;  // below the smallest subnormal
    int const hi_exp = 127 - f_.bias + (1 << (f_.total_bits - 1 - f_.man_bits)) + 1;
    std::uint32_t const lo = lo_exp > 0 ? static_cast<std::uint32_t>(lo_exp) : 0u;
    std::uint32_t const hi = hi_exp < 256 ? static_cast<std::uint32_t>(hi_exp) : 256u;
    std::uint32_t const e = lo + rng_.below(hi - lo);
    return detail::float_of(e << 23 | (rng_.next_u32() & 0x7FFFFFu));
  }
  /// Code c's value, the next one, or the midpoint (exact: the formats are much narrower than
  /// fp32), each also one fp32 ulp up or down.
  float around(std::uint32_t c) {
    float const lo = value(c);
    float const half = gap(c) * 0.5f;
    float const pick[3] = {lo, lo + half, lo + half + half};
    float const x = pick[rng_.below(3)];
    int const off = static_cast<int>(rng_.below(3)) - 1;
    if (x == 0.0f && off < 0) return x;
    return step(x, off);
  }
  float near_tie() { return around(rng_.below(f_.max_finite + 1)); }
  float near_tie_below(std::uint32_t limit) { return around(rng_.below(limit + 1)); }
  float overflow_boundary() {
    float const top = value(f_.max_finite);
    float const half = gap(f_.max_finite) * 0.5f;
    float const pick[4] = {top, top + half, top + half + half, (top + half) * 2.0f};
    return step(pick[rng_.below(4)], static_cast<int>(rng_.below(7)) - 3);
  }
  float special() {
    constexpr float kInf = std::numeric_limits<float>::infinity();
    float const s[] = {0.0f,
                       -0.0f,
                       kInf,
                       -kInf,
                       detail::float_of(0x7FC00000u),  // quiet NaN
                       detail::float_of(0xFFC00000u),  // negative quiet NaN
                       detail::float_of(0x7F800001u),  // signalling NaN
                       detail::float_of(0xFFFFFFFFu),
                       std::numeric_limits<float>::max(),
                       -std::numeric_limits<float>::max(),
                       std::numeric_limits<float>::min(),
                       std::numeric_limits<float>::denorm_min(),
                       -std::numeric_limits<float>::denorm_min(),
                       1.0f,
                       -1.0f};
    return s[rng_.below(sizeof(s) / sizeof(s[0]))];
  }

  detail::MiniFloatFormat f_;
  SplitMix64 rng_;
};

}  // namespace qflash::test
