/// @file
/// GGUF (ggml) weight blocks Q8_0 and Q4_K: byte-exact layouts and dequantization that give
/// the floats ggml's `dequantize_row_q8_0` / `dequantize_row_q4_K` give, so weights from a
/// `.gguf` file can be used in place on CPU and GPU; plus quantizers for making test data and
/// for converting weights.
///
/// Q8_0, 32 values, 34 bytes: fp16 d, int8 qs[32];  x[i] = d * qs[i].
/// Q4_K, 256 values (8 sub-blocks of 32), 144 bytes:
///   fp16 d, fp16 dmin, u8 scales[12], u8 qs[128];
///   x = (d * sc[j]) * q - (dmin * m[j])  for sub-block j, with 6-bit sc[j], m[j] (0..63)
///   packed in `scales` as in ggml's get_scale_min_k4 (see q4_k_scale_min), and 4-bit q:
///   for pair p = 0..3 (values 64p..64p+63), byte qs[32p + l] holds value 64p + l in its low
///   nibble (sub-block 2p) and value 64p + 32 + l in its high nibble (sub-block 2p + 1).
/// All multi-byte fields are little-endian, as GGUF files are on the hosts we run on.
/// Dequantization uses ggml's order of operations; like ggml's, its last bit can change where
/// the compiler contracts `a * q - m` into an FMA (nvcc does by default, g++ with -mfma).
#pragma once

#include <cstddef>
#include <cstdint>

#include "qflash/core/config.hpp"
#include "qflash/numeric/fp16.hpp"
#include "qflash/numeric/minifloat.hpp"

namespace qflash::gguf {

inline constexpr int kQ8_0BlockSize = 32;  ///< ggml QK8_0
inline constexpr int kQ4KBlockSize = 256;  ///< ggml QK_K
inline constexpr int kQ4KSubBlocks = 8;    ///< sub-blocks of 32 per Q4_K block
inline constexpr int kQ4KScaleBytes = 12;  ///< ggml K_SCALE_SIZE

/// ggml block_q8_0.
struct BlockQ8_0 {
  Fp16 d;
  std::int8_t qs[kQ8_0BlockSize];
};
static_assert(sizeof(BlockQ8_0) == 34 && alignof(BlockQ8_0) == 2, "GGUF Q8_0 block is 34 bytes");

/// ggml block_q4_K.
struct BlockQ4K {
  Fp16 d;     ///< scale of the 6-bit sub-block scales
  Fp16 dmin;  ///< scale of the 6-bit sub-block mins
  std::uint8_t scales[kQ4KScaleBytes];
  std::uint8_t qs[kQ4KBlockSize / 2];
};
static_assert(sizeof(BlockQ4K) == 144 && alignof(BlockQ4K) == 2, "GGUF Q4_K block is 144 bytes");

// --- Q8_0 -----------------------------------------------------------------------------------

/// @param y  [32] dequantized values
QFLASH_HD constexpr void dequantize_q8_0(BlockQ8_0 const& b, float* y) {
  float const d = to_float(b.d);
  for (int i = 0; i < kQ8_0BlockSize; ++i) y[i] = static_cast<float>(b.qs[i]) * d;
}

/// ggml's reference quantizer (quantize_row_q8_0_ref): d = amax / 127, q = roundf(x / d)
/// computed as x * (1 / d), d stored as fp16. Bit-exact with ggml for finite inputs.
/// @param x  [32] finite values
QFLASH_HD constexpr BlockQ8_0 quantize_q8_0(float const* x) {
  float amax = 0.0f;
  for (int i = 0; i < kQ8_0BlockSize; ++i) {
    float const a = x[i] < 0.0f ? -x[i] : x[i];
    amax = a > amax ? a : amax;
  }
  float const d = amax / 127.0f;
  float const id = d != 0.0f ? 1.0f / d : 0.0f;
  BlockQ8_0 b{};
  b.d = to_fp16(d);
  for (int i = 0; i < kQ8_0BlockSize; ++i) {
    b.qs[i] = static_cast<std::int8_t>(qflash::detail::round_half_away(x[i] * id));
  }
  return b;
}

/// Dequantizes `n` values (a multiple of 32) from n / 32 consecutive blocks.
/// @param blocks  [n / 32]
/// @param y       [n]
QFLASH_HD constexpr void dequantize_row_q8_0(BlockQ8_0 const* blocks, std::size_t n, float* y) {
  for (std::size_t i = 0; i < n / kQ8_0BlockSize; ++i)
    dequantize_q8_0(blocks[i], y + i * kQ8_0BlockSize);
}

/// Quantizes `n` values (a multiple of 32) into n / 32 blocks.
/// @param x       [n]
/// @param blocks  [n / 32]
QFLASH_HD constexpr void quantize_row_q8_0(float const* x, std::size_t n, BlockQ8_0* blocks) {
  for (std::size_t i = 0; i < n / kQ8_0BlockSize; ++i)
    blocks[i] = quantize_q8_0(x + i * kQ8_0BlockSize);
}

// --- Q4_K -----------------------------------------------------------------------------------

/// The 6-bit scale and min of one Q4_K sub-block.
struct Q4KScaleMin {
  std::uint8_t scale;
  std::uint8_t min;
};

/// Sub-block j's (0..7) 6-bit scale and min from the 12 packed bytes, as ggml's
/// get_scale_min_k4 reads them: for j < 4, the low 6 bits of bytes j (scale) and j + 4 (min);
/// for j >= 4, the low / high nibble of byte j + 4 (scale / min) give the low 4 bits, and the
/// top 2 bits of bytes j - 4 (scale) and j (min) give the high 2 bits.
QFLASH_HD constexpr Q4KScaleMin q4_k_scale_min(std::uint8_t const* scales, int j) {
  if (j < 4) {
    return {static_cast<std::uint8_t>(scales[j] & 63),
            static_cast<std::uint8_t>(scales[j + 4] & 63)};
  }
  return {static_cast<std::uint8_t>((scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4)),
          static_cast<std::uint8_t>((scales[j + 4] >> 4) | ((scales[j] >> 6) << 4))};
}

/// The inverse of q4_k_scale_min: packs 8 scales and 8 mins (each 0..63) into 12 bytes.
/// @param sc      [8] scales
/// @param m       [8] mins
/// @param scales  [12] packed bytes
QFLASH_HD constexpr void q4_k_pack_scale_min(std::uint8_t const* sc, std::uint8_t const* m,
                                             std::uint8_t* scales) {
  for (int j = 0; j < 4; ++j) {
    scales[j] = static_cast<std::uint8_t>((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
    scales[j + 4] = static_cast<std::uint8_t>((m[j] & 63) | ((m[j + 4] >> 4) << 6));
    scales[j + 8] = static_cast<std::uint8_t>((sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4));
  }
}

/// The 4-bit code of value i (0..255) of a block.
QFLASH_HD constexpr std::uint8_t q4_k_code(BlockQ4K const& b, int i) {
  std::uint8_t const byte = b.qs[i / 64 * 32 + i % 32];
  return static_cast<std::uint8_t>(i % 64 < 32 ? byte & 0xF : byte >> 4);
}

/// @param y  [256] dequantized values, in ggml's order of operations:
///           y = (d * sc) * q - (dmin * m), each product rounded to fp32
QFLASH_HD constexpr void dequantize_q4_k(BlockQ4K const& b, float* y) {
  float const d = to_float(b.d);
  float const dmin = to_float(b.dmin);
  for (int j = 0; j < kQ4KSubBlocks; ++j) {
    Q4KScaleMin const sm = q4_k_scale_min(b.scales, j);
    float const dj = d * static_cast<float>(sm.scale);
    float const mj = dmin * static_cast<float>(sm.min);
    for (int l = 0; l < 32; ++l) {
      int const i = 32 * j + l;
      y[i] = dj * static_cast<float>(q4_k_code(b, i)) - mj;
    }
  }
}

namespace detail {
/// The smallest fp16 >= v, for finite v >= 0 below the fp16 max: a stored scale that does
/// not shrink the range it must cover.
QFLASH_HD constexpr Fp16 fp16_round_up(float v) {
  Fp16 h = to_fp16(v);
  if (to_float(h) < v) ++h.bits;
  return h;
}
}  // namespace detail

/// A reference Q4_K quantizer (not ggml's iterative make_qkx2_quants, which searches for a
/// lower-error scale; the format and dequantization are the same). Per sub-block j, with
/// lo = min(0, min x), hi = max x:
///   dmin = fp16 >= max_j(-lo_j) / 63,  m_j = ceil(-lo_j / dmin)        (offset at or below lo)
///   s_j = (hi_j + dmin*m_j) / 15,  d = fp16 >= max_j s_j / 63,  sc_j = ceil(s_j / d)
///   q = clamp(round((x + dmin*m_j) / (d*sc_j)), 0, 15)
/// Rounding the scales up keeps every x inside the representable range, so each element is
/// within (d*sc_j)/2 of x (plus fp32 rounding), and d*sc_j < s_j + d.
/// @param x  [256] finite values with |x| well below the fp16 max
QFLASH_HD constexpr BlockQ4K quantize_q4_k(float const* x) {
  float offset[kQ4KSubBlocks] = {};  // -lo_j >= 0
  float top[kQ4KSubBlocks] = {};     // hi_j
  float max_offset = 0.0f;
  for (int j = 0; j < kQ4KSubBlocks; ++j) {
    float lo = 0.0f;
    float hi = x[32 * j];
    for (int l = 0; l < 32; ++l) {
      float const v = x[32 * j + l];
      lo = v < lo ? v : lo;
      hi = v > hi ? v : hi;
    }
    offset[j] = -lo;
    top[j] = hi;
    max_offset = offset[j] > max_offset ? offset[j] : max_offset;
  }

  BlockQ4K b{};
  b.dmin = detail::fp16_round_up(max_offset / 63.0f);
  float const dmin = to_float(b.dmin);
  std::uint8_t m[kQ4KSubBlocks] = {};
  float m_eff[kQ4KSubBlocks] = {};
  float s[kQ4KSubBlocks] = {};
  float max_s = 0.0f;
  for (int j = 0; j < kQ4KSubBlocks; ++j) {
    int const mj = dmin > 0.0f ? qflash::detail::ceil_nonnegative(offset[j] / dmin) : 0;
    m[j] = static_cast<std::uint8_t>(mj < 63 ? mj : 63);
    m_eff[j] = dmin * static_cast<float>(m[j]);
    float const range = top[j] + m_eff[j];
    s[j] = range > 0.0f ? range / 15.0f : 0.0f;
    max_s = s[j] > max_s ? s[j] : max_s;
  }

  b.d = detail::fp16_round_up(max_s / 63.0f);
  float const d = to_float(b.d);
  std::uint8_t sc[kQ4KSubBlocks] = {};
  for (int j = 0; j < kQ4KSubBlocks; ++j) {
    int const scj = d > 0.0f ? qflash::detail::ceil_nonnegative(s[j] / d) : 0;
    sc[j] = static_cast<std::uint8_t>(scj < 63 ? scj : 63);
  }
  q4_k_pack_scale_min(sc, m, b.scales);

  for (int j = 0; j < kQ4KSubBlocks; ++j) {
    float const dj = d * static_cast<float>(sc[j]);
    for (int l = 0; l < 32; ++l) {
      int const i = 32 * j + l;
      int q = 0;
      if (dj > 0.0f) {
        float const v = (x[i] + m_eff[j]) / dj;
        q = v > 0.0f ? qflash::detail::round_half_away(v < 15.0f ? v : 15.0f) : 0;
      }
      std::uint8_t& byte = b.qs[i / 64 * 32 + i % 32];
      byte = static_cast<std::uint8_t>(i % 64 < 32 ? (byte & 0xF0) | q : (byte & 0x0F) | (q << 4));
    }
  }
  return b;
}

/// Dequantizes `n` values (a multiple of 256) from n / 256 consecutive blocks.
/// @param blocks  [n / 256]
/// @param y       [n]
QFLASH_HD constexpr void dequantize_row_q4_k(BlockQ4K const* blocks, std::size_t n, float* y) {
  for (std::size_t i = 0; i < n / kQ4KBlockSize; ++i)
    dequantize_q4_k(blocks[i], y + i * kQ4KBlockSize);
}

/// Quantizes `n` values (a multiple of 256) into n / 256 blocks.
/// @param x       [n]
/// @param blocks  [n / 256]
QFLASH_HD constexpr void quantize_row_q4_k(float const* x, std::size_t n, BlockQ4K* blocks) {
  for (std::size_t i = 0; i < n / kQ4KBlockSize; ++i)
    blocks[i] = quantize_q4_k(x + i * kQ4KBlockSize);
}

}  // namespace qflash::gguf
