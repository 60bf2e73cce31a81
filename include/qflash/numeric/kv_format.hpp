/// @file
/// How the KV cache stores one token's K (or V) vector of one attention head, and what that
/// costs in bytes: the unit the paged cache, the per-head compression map and the memory
/// planner count in.
///
/// | format   | per value        | per token-head                                   |
/// |----------|------------------|--------------------------------------------------|
/// | f32      | 4 bytes          | - (exact: the reference the others are measured to) |
/// | bf16     | 2 bytes          | -                                                |
/// | fp8_e4m3 | 1 byte           | fp32 scale                                       |
/// | int8     | 1 byte           | fp16 scale + fp16 min per group of kKvGroup      |
/// | int6     | 3 bytes per 4    | fp16 scale + fp16 min per group of kKvGroup      |
///
/// int8 and int6 are asymmetric (x = min + scale * q), the last group of a head may be short.
///
/// Byte layout of one token-head vector of d values (little-endian throughout):
///   f32, bf16   the values;
///   fp8_e4m3    the fp32 scale (amax / 448), then d e4m3 codes of x / scale;
///   int8, int6  per group g its fp16 scale and fp16 min at byte 4g, then the groups' codes,
///               int8 one byte each, int6 packed as numeric/int6.hpp (a group in
///               int6_packed_bytes(n) bytes).
/// The stored min is rounded down and the scale up to fp16, and codes are computed with the
/// stored parameters, so every value comes back within scale/2 of itself (plus fp32
/// rounding); values beyond the fp16 range saturate there.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "qflash/core/config.hpp"
#include "qflash/core/error.hpp"
#include "qflash/numeric/bf16.hpp"
#include "qflash/numeric/fp16.hpp"
#include "qflash/numeric/fp8.hpp"
#include "qflash/numeric/int6.hpp"

namespace qflash {

enum class KvFormat : std::uint8_t { kF32, kBf16, kFp8E4m3, kInt8, kInt6 };

inline constexpr std::array<std::pair<KvFormat, std::string_view>, 5> kKvFormats{{
    {KvFormat::kF32, "f32"},
    {KvFormat::kBf16, "bf16"},
    {KvFormat::kFp8E4m3, "fp8_e4m3"},
    {KvFormat::kInt8, "int8"},
    {KvFormat::kInt6, "int6"},
}};

/// Values that share one (scale, min) in int8 and int6.
inline constexpr int kKvGroup = 64;

constexpr std::string_view to_string(KvFormat f) {
  for (auto const& [k, name] : kKvFormats)
    if (k == f) return name;
  return "unknown";
}

/// "f32" (or "fp32"), "bf16", "fp8_e4m3" (or "fp8"), "int8", "int6"; throws Error listing
/// them otherwise.
inline KvFormat parse_kv_format(std::string_view name) {
  if (name == "fp8") return KvFormat::kFp8E4m3;
  if (name == "fp32") return KvFormat::kF32;
  std::string choices;
  for (auto const& [k, n] : kKvFormats) {
    if (n == name) return k;
    choices += (choices.empty() ? "" : ", ") + std::string(n);
  }
  QFLASH_FAIL("unknown KV format '", name, "' (expected one of: ", choices, ")");
}

/// Bytes of one token-head vector of d_head values in format f, scales included.
QFLASH_HD constexpr std::int64_t kv_head_bytes(KvFormat f, std::int64_t d_head) {
  std::int64_t const groups = (d_head + kKvGroup - 1) / kKvGroup;
  switch (f) {
    case KvFormat::kF32: return 4 * d_head;
    case KvFormat::kBf16: return 2 * d_head;
    case KvFormat::kFp8E4m3: return d_head + 4;
    case KvFormat::kInt8: return d_head + 4 * groups;
    case KvFormat::kInt6: {
      // each group packs on its own, so a short group pads to whole 3-byte words
      std::int64_t bytes = 4 * groups;
      for (std::int64_t g = 0; g < groups; ++g)
        bytes += static_cast<std::int64_t>(int6_packed_bytes(static_cast<std::size_t>(
            g + 1 < groups ? kKvGroup : d_head - g * kKvGroup)));
      return bytes;
    }
  }
  return 0;
}

namespace detail {

QFLASH_HD constexpr void put_u16(std::uint8_t* p, std::uint16_t v) {
  p[0] = static_cast<std::uint8_t>(v);
  p[1] = static_cast<std::uint8_t>(v >> 8);
}
QFLASH_HD constexpr std::uint16_t get_u16(std::uint8_t const* p) {
  return static_cast<std::uint16_t>(p[0] | p[1] << 8);
}
QFLASH_HD constexpr void put_f32(std::uint8_t* p, float x) {
  std::uint32_t const b = detail::bits_of(x);
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::uint8_t>(b >> (8 * i));
}
QFLASH_HD constexpr float get_f32(std::uint8_t const* p) {
  return detail::float_of(static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8 |
                          static_cast<std::uint32_t>(p[2]) << 16 | static_cast<std::uint32_t>(p[3]) << 24);
}

/// The stored (scale, min) of an asymmetric group whose values span [lo, hi], with `levels`
/// steps: min rounded down, scale up, both clamped to the fp16 range.
QFLASH_HD constexpr Int6Params kv_range_params(float lo, float hi, int levels) {
  lo = lo < -kFp16Max ? -kFp16Max : (lo > kFp16Max ? kFp16Max : lo);
  float const min = to_float(to_fp16_down(lo));
  float range = (hi - min) / static_cast<float>(levels);
  range = range > kFp16Max ? kFp16Max : (range > 0.0f ? range : 0.0f);
  return {to_float(to_fp16_up(range)), min};
}

/// ... of the n values at x.
QFLASH_HD constexpr Int6Params kv_group_params(float const* x, int n, int levels) {
  float lo = x[0], hi = x[0];
  for (int i = 1; i < n; ++i) {
    lo = x[i] < lo ? x[i] : lo;
    hi = x[i] > hi ? x[i] : hi;
  }
  return kv_range_params(lo, hi, levels);
}

}  // namespace detail

/// Byte offset of group g's codes inside an int8/int6 token-head vector of d values.
QFLASH_HD constexpr std::int64_t kv_group_codes_offset(KvFormat f, std::int64_t d, std::int64_t g) {
  std::int64_t const groups = (d + kKvGroup - 1) / kKvGroup;
  return 4 * groups + g * (f == KvFormat::kInt8 ? kKvGroup : static_cast<std::int64_t>(int6_packed_bytes(kKvGroup)));
}

/// Stores x[0, d) (finite) in format f at out[0, kv_head_bytes(f, d)).
QFLASH_HD constexpr void kv_encode(KvFormat f, float const* x, int d, std::uint8_t* out) {
  switch (f) {
    case KvFormat::kF32:
      for (int i = 0; i < d; ++i) detail::put_f32(out + 4 * i, x[i]);
      return;
    case KvFormat::kBf16:
      for (int i = 0; i < d; ++i) detail::put_u16(out + 2 * i, to_bf16(x[i]).bits);
      return;
    case KvFormat::kFp8E4m3: {
      float amax = 0.0f;
      for (int i = 0; i < d; ++i) {
        float const a = x[i] < 0.0f ? -x[i] : x[i];
        amax = a > amax ? a : amax;
      }
      float const scale = amax / kFp8E4m3Max;
      detail::put_f32(out, scale);
      for (int i = 0; i < d; ++i) out[4 + i] = scale > 0.0f ? to_fp8_e4m3(x[i] / scale).bits : 0;
      return;
    }
    case KvFormat::kInt8:
    case KvFormat::kInt6: {
      int const levels = f == KvFormat::kInt8 ? 255 : kInt6Max;
      for (int g = 0; g * kKvGroup < d; ++g) {
        int const n = d - g * kKvGroup < kKvGroup ? d - g * kKvGroup : kKvGroup;
        float const* xg = x + g * kKvGroup;
        Int6Params const p = detail::kv_group_params(xg, n, levels);
        detail::put_u16(out + 4 * g, to_fp16(p.scale).bits);
        detail::put_u16(out + 4 * g + 2, to_fp16(p.min).bits);
        std::uint8_t* codes = out + kv_group_codes_offset(f, d, g);
        if (f == KvFormat::kInt8) {
          for (int i = 0; i < n; ++i) codes[i] = asym_quantize(xg[i], p, levels);
        } else {
          for (int i0 = 0; i0 < n; i0 += kInt6PerGroup) {
            std::uint8_t q[kInt6PerGroup] = {0, 0, 0, 0};
            for (int k = 0; k < kInt6PerGroup && i0 + k < n; ++k) q[k] = asym_quantize(xg[i0 + k], p, levels);
            int6_pack(q, kInt6PerGroup, codes + i0 / kInt6PerGroup * kInt6GroupBytes);
          }
        }
      }
      return;
    }
  }
}

/// The scale group g of a stored vector was quantized with (fp8_e4m3: the vector's one
/// scale): the unit of its error bound. 0 for f32 and bf16.
QFLASH_HD constexpr float kv_stored_scale(KvFormat f, std::uint8_t const* in, int g) {
  if (f == KvFormat::kFp8E4m3) return detail::get_f32(in);
  if (f == KvFormat::kInt8 || f == KvFormat::kInt6) return to_float(Fp16{detail::get_u16(in + 4 * g)});
  return 0.0f;
}

/// Reads the d values stored by kv_encode.
QFLASH_HD constexpr void kv_decode(KvFormat f, std::uint8_t const* in, int d, float* y) {
  switch (f) {
    case KvFormat::kF32:
      for (int i = 0; i < d; ++i) y[i] = detail::get_f32(in + 4 * i);
      return;
    case KvFormat::kBf16:
      for (int i = 0; i < d; ++i) y[i] = to_float(Bf16{detail::get_u16(in + 2 * i)});
      return;
    case KvFormat::kFp8E4m3: {
      float const scale = detail::get_f32(in);
      for (int i = 0; i < d; ++i) y[i] = to_float(Fp8E4m3{in[4 + i]}) * scale;
      return;
    }
    case KvFormat::kInt8:
    case KvFormat::kInt6:
      for (int g = 0; g * kKvGroup < d; ++g) {
        int const n = d - g * kKvGroup < kKvGroup ? d - g * kKvGroup : kKvGroup;
        Int6Params const p{to_float(Fp16{detail::get_u16(in + 4 * g)}), to_float(Fp16{detail::get_u16(in + 4 * g + 2)})};
        std::uint8_t const* codes = in + kv_group_codes_offset(f, d, g);
        for (int i = 0; i < n; ++i)
          y[g * kKvGroup + i] = p.min + p.scale * static_cast<float>(f == KvFormat::kInt8 ? codes[i] : int6_get(codes, static_cast<std::size_t>(i)));
      }
      return;
  }
}

}  // namespace qflash
