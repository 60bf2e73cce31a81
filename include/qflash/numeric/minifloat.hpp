/// @file
/// Bit-level rounding shared by bf16, fp16 and fp8: one float -> small-float encoder and one
/// decoder, parameterised by the format, so every format rounds by the same tested code.
///
/// Everything here is integer arithmetic on the float's bits: it is `constexpr`, behaves the
/// same on host and device, and does not depend on the FPU's rounding mode or on `-ffast-math`.
#pragma once

#include <cstdint>

#include "qflash/core/config.hpp"

namespace qflash::detail {

QFLASH_HD constexpr std::uint32_t bits_of(float x) { return __builtin_bit_cast(std::uint32_t, x); }
QFLASH_HD constexpr float float_of(std::uint32_t bits) { return __builtin_bit_cast(float, bits); }

/// The quiet NaN that CUDA's host conversions return: positive, all mantissa bits set.
inline constexpr std::uint32_t kCanonicalNanBits = 0x7FFFFFFFu;

/// A binary floating-point format narrower than fp32, described by its bit fields and by
/// what it does with NaN and out-of-range values. Codes are right-aligned in a uint32.
struct MiniFloatFormat {
  int man_bits;              ///< explicit mantissa bits
  int bias;                  ///< exponent bias
  int total_bits;            ///< sign + exponent + mantissa
  std::uint32_t max_finite;  ///< largest finite magnitude code
  std::uint32_t overflow;    ///< magnitude code for values rounding past max_finite
  std::uint32_t nan;         ///< code of the NaN the encoder returns (sign bit included)
  bool has_inf;              ///< the all-ones exponent with zero mantissa is infinity
};

/// Rounds the magnitude `a` (fp32 bits without sign; finite or infinity) to the nearest
/// code of format `f`, ties to even, as if the format's exponent range were unbounded above.
/// Codes are contiguous in magnitude, so a carry out of the mantissa bumps the exponent and
/// a subnormal that rounds up to the smallest normal encodes correctly.
QFLASH_HD constexpr std::uint32_t round_magnitude(std::uint32_t a, MiniFloatFormat f) {
  int const float_exp = static_cast<int>(a >> 23);
  int const min_normal_exp = 127 - f.bias + 1;  // fp32 biased exponent of the smallest normal
  std::uint32_t mant = 0;
  int shift = 23 - f.man_bits;
  if (float_exp >= min_normal_exp) {
    mant = a - (static_cast<std::uint32_t>(127 - f.bias) << 23);  // re-bias the exponent field
  } else {
    // Subnormal in the target: shift the significand right by the exponent deficit.
    mant = (a & 0x7FFFFFu) | (float_exp != 0 ? 0x800000u : 0u);
    shift += min_normal_exp - (float_exp != 0 ? float_exp : 1);
    if (shift > 24) return 0;  // below half the smallest subnormal (mant < 2^24)
  }
  std::uint32_t q = mant >> shift;
  std::uint32_t const rem = mant & ((1u << shift) - 1u);
  std::uint32_t const half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u) != 0)) ++q;
  return q;
}

/// fp32 -> format `f`, round to nearest even. NaN gives `f.nan`; magnitudes that round past
/// the largest finite value give `f.max_finite` when `saturate`, else `f.overflow`; the sign
/// is kept on everything but NaN, including zeros and underflow.
QFLASH_HD constexpr std::uint32_t encode_minifloat(float x, MiniFloatFormat f, bool saturate) {
  std::uint32_t const bits = bits_of(x);
  std::uint32_t const a = bits & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return f.nan;
  std::uint32_t q = round_magnitude(a, f);
  if (q > f.max_finite) q = saturate ? f.max_finite : f.overflow;
  return ((bits >> 31) << (f.total_bits - 1)) | q;
}

/// Format `f` -> fp32, exact for every non-NaN code; NaN codes give kCanonicalNanBits (as
/// CUDA's host `__half2float` and `__nv_cvt_fp8_to_halfraw` do: sign and payload dropped).
/// Formats with `has_inf` use the IEEE all-ones exponent for Inf/NaN; the others (e4m3fn)
/// have a single NaN magnitude, `f.nan`, and use the all-ones exponent for normals.
QFLASH_HD constexpr float decode_minifloat(std::uint32_t code, MiniFloatFormat f) {
  std::uint32_t const sign = (code >> (f.total_bits - 1)) << 31;
  std::uint32_t const mag = code & ((1u << (f.total_bits - 1)) - 1u);
  std::uint32_t const exp = mag >> f.man_bits;
  std::uint32_t const man = mag & ((1u << f.man_bits) - 1u);
  std::uint32_t const exp_all_ones = (1u << (f.total_bits - 1 - f.man_bits)) - 1u;
  if (f.has_inf && exp == exp_all_ones) {
    return float_of(man == 0 ? (sign | 0x7F800000u) : kCanonicalNanBits);
  }
  if (!f.has_inf && mag == (f.nan & ~(1u << (f.total_bits - 1)))) {
    return float_of(kCanonicalNanBits);  // e4m3fn: only S.1111.111 is NaN
  }
  if (exp == 0) {
    if (man == 0) return float_of(sign);
    // Subnormal: normalise so the leading one becomes the implicit bit of an fp32 normal,
    // unless the value is an fp32 subnormal too (bf16), which only needs aligning.
    int lead = f.man_bits - 1;
    while ((man >> lead) == 0) --lead;
    int const e = 127 - f.bias - f.man_bits + 1 + lead;
    if (e <= 0) return float_of(sign | man << (150 - f.bias - f.man_bits));
    std::uint32_t const m = (man ^ (1u << lead)) << (23 - lead);
    return float_of(sign | (static_cast<std::uint32_t>(e) << 23) | m);
  }
  return float_of(sign | ((exp + 127 - static_cast<std::uint32_t>(f.bias)) << 23) |
                  (man << (23 - f.man_bits)));
}

/// Round half away from zero, like `roundf`, for |v| < 2^31. `v - trunc(v)` is exact, so
/// unlike `int(v + 0.5f)` this does not round 0.49999997f up.
QFLASH_HD constexpr int round_half_away(float v) {
  int i = static_cast<int>(v);
  float const frac = v - static_cast<float>(i);
  if (frac >= 0.5f) ++i;
  if (frac <= -0.5f) --i;
  return i;
}

/// Round half to even, for |v| < 2^22 (ggml's nearest_int): adding 1.5 * 2^23 leaves the
/// rounded integer in the low mantissa bits.
QFLASH_HD constexpr int round_half_even(float v) {
#ifdef __CUDA_ARCH__
  // An unfusable add: nvcc would fuse `a * b` before it into one FMA and round the exact
  // product, not the float one the host rounds (-99.5 from a product then gave -99, not -100).
  float const shifted = __fadd_rn(v, 12582912.0f);
#else
  float const shifted = v + 12582912.0f;
#endif
  return static_cast<int>(bits_of(shifted) & 0x007fffffu) - 0x00400000;
}

/// Smallest integer >= v, for 0 <= v < 2^31.
QFLASH_HD constexpr int ceil_nonnegative(float v) {
  int const i = static_cast<int>(v);
  return static_cast<float>(i) < v ? i + 1 : i;
}

}  // namespace qflash::detail
