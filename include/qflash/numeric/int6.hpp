/// @file
/// INT6 asymmetric quantization and its 4-values-in-3-bytes packing: the storage of INT6 KV
/// heads (ARCHITECTURE.md, L1 per-head precision), shared by the CPU and CUDA KV codecs.
///
/// Quantization (min/max form) of a group x[0..n):
///   scale = (max(x) - min(x)) / 63,   q = clamp(round((x - min) / scale), 0, 63),
///   x'    = min + scale * q,
/// with round = half away from zero and q = 0 when scale == 0 (a constant group is exact).
/// Each element comes back within scale/2 (plus fp32 rounding of the subtraction, division
/// and product, a few ulp of max(|min|, |max|)). Inputs must be finite with max - min
/// finite. To store (scale, min) at a lower precision, round them first (min down, scale up,
/// so no value is clamped) and quantize with the rounded values: the bound then holds for
/// the stored parameters.
///
/// Packing: values q0..q3 form the 24-bit word  w = q0 | q1 << 6 | q2 << 12 | q3 << 18,
/// stored little-endian as bytes w & 0xFF, (w >> 8) & 0xFF, w >> 16. Value i lives in bytes
/// 3*(i/4).. of the packed buffer at bit 6*(i%4). A tail of n % 4 values is padded with zero
/// codes to a whole 3-byte group, so n values take int6_packed_bytes(n) = 3 * ceil(n/4) bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "qflash/core/config.hpp"
#include "qflash/core/error.hpp"
#include "qflash/numeric/minifloat.hpp"

namespace qflash {

inline constexpr int kInt6Max = 63;        ///< codes are 0..63
inline constexpr int kInt6PerGroup = 4;    ///< values per packed group
inline constexpr int kInt6GroupBytes = 3;  ///< bytes per packed group

/// Bytes that hold `n` packed INT6 codes.
QFLASH_HD constexpr std::size_t int6_packed_bytes(std::size_t n) {
  return (n + kInt6PerGroup - 1) / kInt6PerGroup * kInt6GroupBytes;
}

/// Packs `n` codes (each 0..63; higher bits are dropped).
/// @param q    [n] codes
/// @param out  [int6_packed_bytes(n)] packed bytes
QFLASH_HD constexpr void int6_pack(std::uint8_t const* q, std::size_t n, std::uint8_t* out) {
  for (std::size_t g = 0; g * kInt6PerGroup < n; ++g) {
    std::uint32_t w = 0;
    for (std::size_t k = 0; k < kInt6PerGroup && g * kInt6PerGroup + k < n; ++k) {
      w |= static_cast<std::uint32_t>(q[g * kInt6PerGroup + k] & 0x3Fu) << (6 * k);
    }
    out[g * 3 + 0] = static_cast<std::uint8_t>(w);
    out[g * 3 + 1] = static_cast<std::uint8_t>(w >> 8);
    out[g * 3 + 2] = static_cast<std::uint8_t>(w >> 16);
  }
}

/// The code at index `i` of a packed buffer.
QFLASH_HD constexpr std::uint8_t int6_get(std::uint8_t const* packed, std::size_t i) {
  std::uint8_t const* b = packed + i / kInt6PerGroup * kInt6GroupBytes;
  std::uint32_t const w =
      b[0] | static_cast<std::uint32_t>(b[1]) << 8 | static_cast<std::uint32_t>(b[2]) << 16;
  return static_cast<std::uint8_t>((w >> (6 * (i % kInt6PerGroup))) & 0x3Fu);
}

/// Unpacks `n` codes.
/// @param packed  [int6_packed_bytes(n)] packed bytes
/// @param q       [n] codes 0..63
QFLASH_HD constexpr void int6_unpack(std::uint8_t const* packed, std::size_t n, std::uint8_t* q) {
  for (std::size_t i = 0; i < n; ++i) q[i] = int6_get(packed, i);
}

/// Host overloads on spans; they check that `out` is large enough.
inline void int6_pack(std::span<std::uint8_t const> q, std::span<std::uint8_t> out) {
  QFLASH_CHECK(out.size() >= int6_packed_bytes(q.size()), "int6_pack: ", q.size(), " codes need ",
               int6_packed_bytes(q.size()), " bytes, got ", out.size());
  int6_pack(q.data(), q.size(), out.data());
}
inline void int6_unpack(std::span<std::uint8_t const> packed, std::span<std::uint8_t> q) {
  QFLASH_CHECK(packed.size() >= int6_packed_bytes(q.size()), "int6_unpack: ", q.size(),
               " codes need ", int6_packed_bytes(q.size()), " bytes, got ", packed.size());
  int6_unpack(packed.data(), q.size(), q.data());
}

/// The parameters of one quantized group: x' = min + scale * q.
struct Int6Params {
  float scale;
  float min;
};

/// scale = (max - min) / 63 and min of `x`; {0, 0} for an empty group.
/// @param x  [n] finite values
QFLASH_HD constexpr Int6Params int6_params(float const* x, std::size_t n) {
  if (n == 0) return {0.0f, 0.0f};
  float lo = x[0];
  float hi = x[0];
  for (std::size_t i = 1; i < n; ++i) {
    lo = x[i] < lo ? x[i] : lo;
    hi = x[i] > hi ? x[i] : hi;
  }
  return {(hi - lo) / kInt6Max, lo};
}

/// One value -> its code in [0, levels] under `p` (levels <= 255): the asymmetric rounding
/// every such format shares.
QFLASH_HD constexpr std::uint8_t asym_quantize(float x, Int6Params p, int levels) {
  if (!(p.scale > 0.0f)) return 0;
  float const v = (x - p.min) / p.scale;
  if (!(v > 0.0f)) return 0;  // also NaN
  if (v >= static_cast<float>(levels)) return static_cast<std::uint8_t>(levels);
  return static_cast<std::uint8_t>(detail::round_half_away(v));
}

/// One value -> its code under `p`.
QFLASH_HD constexpr std::uint8_t int6_quantize(float x, Int6Params p) { return asym_quantize(x, p, kInt6Max); }

/// One code -> its value under `p`.
QFLASH_HD constexpr float int6_dequantize(std::uint8_t q, Int6Params p) {
  return p.min + p.scale * static_cast<float>(q);
}

/// Quantizes and packs a group; returns the parameters used.
/// @param x       [n] finite values
/// @param packed  [int6_packed_bytes(n)] packed codes
QFLASH_HD constexpr Int6Params int6_quantize_group(float const* x, std::size_t n,
                                                   std::uint8_t* packed) {
  Int6Params const p = int6_params(x, n);
  for (std::size_t g = 0; g * kInt6PerGroup < n; ++g) {
    std::uint8_t q[kInt6PerGroup] = {0, 0, 0, 0};
    std::size_t const base = g * kInt6PerGroup;
    std::size_t const m = n - base < kInt6PerGroup ? n - base : kInt6PerGroup;
    for (std::size_t k = 0; k < m; ++k) q[k] = int6_quantize(x[base + k], p);
    int6_pack(q, kInt6PerGroup, packed + g * kInt6GroupBytes);
  }
  return p;
}

/// Unpacks and dequantizes a group.
/// @param packed  [int6_packed_bytes(n)] packed codes
/// @param y       [n] values
QFLASH_HD constexpr void int6_dequantize_group(std::uint8_t const* packed, std::size_t n,
                                               Int6Params p, float* y) {
  for (std::size_t i = 0; i < n; ++i) y[i] = int6_dequantize(int6_get(packed, i), p);
}

}  // namespace qflash
