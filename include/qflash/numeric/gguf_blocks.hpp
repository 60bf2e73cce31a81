/// @file
/// GGUF (ggml) weight blocks Q8_0, Q4_K and Q6_K: byte-exact layouts and dequantization that
/// give the floats ggml's `dequantize_row_q8_0` / `_q4_K` / `_q6_K` give, so weights from a
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
/// Q6_K, 256 values (16 sub-blocks of 16), 210 bytes:
///   u8 ql[128], u8 qh[64], int8 scales[16], fp16 d  (d last);
///   x = (d * scales[i / 16]) * q  with 6-bit q = code - 32 (-32..31). Value i = 128h + 32k + l
///   (half h = 0..1, quarter k = 0..3, l = 0..31) keeps the low 4 bits of its code in
///   ql[64h + 32(k % 2) + l] (low nibble for k < 2, high for k >= 2) and the high 2 bits in
///   qh[32h + l] at bits 2k, 2k + 1.
/// Q8_K, 256 values, 292 bytes: fp32 d, int8 qs[256], int16 bsums[16] (sums of 16 codes);
///   ggml's activation block for dot products with Q4_K and Q6_K weights.
/// All multi-byte fields are little-endian, as GGUF files are on the hosts we run on.
/// Dequantization uses ggml's order of operations; like ggml's, the last bit of Q4_K can change
/// where the compiler contracts `a * q - m` into an FMA (nvcc does by default, g++ with -mfma).
/// Q8_0 and Q6_K have no add to contract, so they are the same everywhere.
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
inline constexpr int kQ6KBlockSize = 256;  ///< ggml QK_K
inline constexpr int kQ6KSubBlocks = 16;   ///< sub-blocks of 16 per Q6_K block

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

/// ggml block_q6_K.
struct BlockQ6K {
  std::uint8_t ql[kQ6KBlockSize / 2];  ///< low 4 bits of the codes
  std::uint8_t qh[kQ6KBlockSize / 4];  ///< high 2 bits of the codes
  std::int8_t scales[kQ6KSubBlocks];   ///< 8-bit sub-block scales
  Fp16 d;                              ///< scale of the sub-block scales
};
static_assert(sizeof(BlockQ6K) == 210 && alignof(BlockQ6K) == 2, "GGUF Q6_K block is 210 bytes");

/// ggml block_q8_K.
struct BlockQ8K {
  float d;
  std::int8_t qs[kQ4KBlockSize];
  std::int16_t bsums[kQ4KBlockSize / 16];  ///< bsums[g] = sum of qs[16g, 16g + 16)
};
static_assert(sizeof(BlockQ8K) == 292, "GGUF Q8_K block is 292 bytes");

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

/// llama.cpp's quantizer of q8_0 activations on x86 (its AVX2 quantize_row_q8_0): like
/// quantize_q8_0 but with the inverse scale 127 / amax and codes rounded half to even.
/// @param x  [32] finite values
QFLASH_HD constexpr BlockQ8_0 quantize_q8_0_activations(float const* x) {
  float amax = 0.0f;
  for (int i = 0; i < kQ8_0BlockSize; ++i) {
    float const a = x[i] < 0.0f ? -x[i] : x[i];
    amax = a > amax ? a : amax;
  }
  BlockQ8_0 b{};
  b.d = to_fp16(amax / 127.0f);
  float const id = amax != 0.0f ? 127.0f / amax : 0.0f;
  for (int i = 0; i < kQ8_0BlockSize; ++i)
    b.qs[i] = static_cast<std::int8_t>(qflash::detail::round_half_even(x[i] * id));
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

// --- Q8_K -----------------------------------------------------------------------------------

/// ggml's quantize_row_q8_K_ref: the value of largest magnitude maps to -127, the scale
/// keeps its sign (d = max / -127), codes round half to even and clamp at 127.
/// @param x  [256] finite values
QFLASH_HD constexpr BlockQ8K quantize_q8_k(float const* x) {
  float amax = 0.0f;
  float max = 0.0f;
  for (int i = 0; i < kQ4KBlockSize; ++i) {
    float const a = x[i] < 0.0f ? -x[i] : x[i];
    if (a > amax) {
      amax = a;
      max = x[i];
    }
  }
  BlockQ8K b{};
  if (amax == 0.0f) return b;
  float const iscale = -127.0f / max;
  for (int i = 0; i < kQ4KBlockSize; ++i) {
    int const q = qflash::detail::round_half_even(iscale * x[i]);
    b.qs[i] = static_cast<std::int8_t>(q < 127 ? q : 127);
  }
  for (int g = 0; g < kQ4KBlockSize / 16; ++g) {
    int sum = 0;
    for (int l = 0; l < 16; ++l) sum += b.qs[16 * g + l];
    b.bsums[g] = static_cast<std::int16_t>(sum);
  }
  b.d = 1.0f / iscale;
  return b;
}

/// Quantizes `n` values (a multiple of 256) into n / 256 blocks.
QFLASH_HD constexpr void quantize_row_q8_k(float const* x, std::size_t n, BlockQ8K* blocks) {
  for (std::size_t i = 0; i < n / kQ4KBlockSize; ++i)
    blocks[i] = quantize_q8_k(x + i * kQ4KBlockSize);
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
  b.dmin = to_fp16_up(max_offset / 63.0f);
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

  b.d = to_fp16_up(max_s / 63.0f);
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

// --- Q6_K -----------------------------------------------------------------------------------

namespace detail {
/// Where value i (0..255) of a Q6_K block keeps its code: the low 4 bits at `ql_shift` of byte
/// ql[ql], the high 2 bits at `qh_shift` of byte qh[qh] (see the file comment).
struct Q6KPos {
  int ql;
  int ql_shift;
  int qh;
  int qh_shift;
};
QFLASH_HD constexpr Q6KPos q6_k_pos(int i) {
  int const h = i / 128;
  int const k = i % 128 / 32;
  int const l = i % 32;
  return {64 * h + 32 * (k % 2) + l, 4 * (k / 2), 32 * h + l, 2 * k};
}
}  // namespace detail

/// The signed 6-bit code (-32..31) of value i (0..255) of a block.
QFLASH_HD constexpr int q6_k_code(BlockQ6K const& b, int i) {
  detail::Q6KPos const p = detail::q6_k_pos(i);
  int const lo = (b.ql[p.ql] >> p.ql_shift) & 0xF;
  int const hi = (b.qh[p.qh] >> p.qh_shift) & 3;
  return (lo | hi << 4) - 32;
}

/// @param y  [256] dequantized values, in ggml's loop order and order of operations:
///           y = (d * sc) * q, each product rounded to fp32
QFLASH_HD constexpr void dequantize_q6_k(BlockQ6K const& b, float* y) {
  float const d = to_float(b.d);
  std::uint8_t const* ql = b.ql;
  std::uint8_t const* qh = b.qh;
  std::int8_t const* sc = b.scales;
  for (int n = 0; n < kQ6KBlockSize; n += 128) {
    for (int l = 0; l < 32; ++l) {
      int const is = l / 16;
      int const q1 = ((ql[l] & 0xF) | ((qh[l] >> 0 & 3) << 4)) - 32;
      int const q2 = ((ql[l + 32] & 0xF) | ((qh[l] >> 2 & 3) << 4)) - 32;
      int const q3 = ((ql[l] >> 4) | ((qh[l] >> 4 & 3) << 4)) - 32;
      int const q4 = ((ql[l + 32] >> 4) | ((qh[l] >> 6 & 3) << 4)) - 32;
      y[l] = d * static_cast<float>(sc[is + 0]) * static_cast<float>(q1);
      y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
      y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
      y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

/// A reference Q6_K quantizer (not ggml's, which searches each sub-block for a lower-error
/// scale; the format and dequantization are the same). Per sub-block j, with n_j and p_j the
/// largest magnitudes of its negative and positive values (0 if none):
///   s_j = max(n_j / 32, p_j / 31.5),  d = fp16 >= max_j s_j / 127,  sc_j = ceil(s_j / d)
///   e_j = d * sc_j,  q = clamp(round(x / e_j), -32, 31)
/// The codes -32..31 come within e_j / 2 of every value in [-32 e_j, 31.5 e_j], and s_j is the
/// smallest step whose range holds the sub-block. Rounding d and sc_j up keeps e_j >= s_j, so
/// each element is within e_j / 2 of x (plus fp32 rounding, a few ulp of max |x|), with
/// s_j <= e_j < s_j + d. Scales are never negative; an all-zero sub-block gets sc_j = 0.
/// @param x  [256] finite values with |x| < 2^27 (so d fits fp16)
QFLASH_HD constexpr BlockQ6K quantize_q6_k(float const* x) {
  float s[kQ6KSubBlocks] = {};
  float max_s = 0.0f;
  for (int j = 0; j < kQ6KSubBlocks; ++j) {
    float neg = 0.0f;
    float pos = 0.0f;
    for (int l = 0; l < 16; ++l) {
      float const v = x[16 * j + l];
      neg = -v > neg ? -v : neg;
      pos = v > pos ? v : pos;
    }
    float const s_neg = neg / 32.0f;
    float const s_pos = pos / 31.5f;
    s[j] = s_neg > s_pos ? s_neg : s_pos;
    max_s = s[j] > max_s ? s[j] : max_s;
  }

  BlockQ6K b{};
  b.d = to_fp16_up(max_s / 127.0f);
  float const d = to_float(b.d);
  for (int j = 0; j < kQ6KSubBlocks; ++j) {
    int const scj = d > 0.0f ? qflash::detail::ceil_nonnegative(s[j] / d) : 0;
    b.scales[j] = static_cast<std::int8_t>(scj < 127 ? scj : 127);
  }

  for (int i = 0; i < kQ6KBlockSize; ++i) {
    float const e = d * static_cast<float>(b.scales[i / 16]);
    int q = 0;
    if (e > 0.0f) {
      float v = x[i] / e;
      v = v < -32.0f ? -32.0f : (v > 31.0f ? 31.0f : v);
      q = qflash::detail::round_half_away(v);
    }
    int const code = q + 32;
    detail::Q6KPos const p = detail::q6_k_pos(i);
    b.ql[p.ql] = static_cast<std::uint8_t>(b.ql[p.ql] | (code & 0xF) << p.ql_shift);
    b.qh[p.qh] = static_cast<std::uint8_t>(b.qh[p.qh] | (code >> 4) << p.qh_shift);
  }
  return b;
}

/// Dequantizes `n` values (a multiple of 256) from n / 256 consecutive blocks.
/// @param blocks  [n / 256]
/// @param y       [n]
QFLASH_HD constexpr void dequantize_row_q6_k(BlockQ6K const* blocks, std::size_t n, float* y) {
  for (std::size_t i = 0; i < n / kQ6KBlockSize; ++i)
    dequantize_q6_k(blocks[i], y + i * kQ6KBlockSize);
}

/// Quantizes `n` values (a multiple of 256) into n / 256 blocks.
/// @param x       [n]
/// @param blocks  [n / 256]
QFLASH_HD constexpr void quantize_row_q6_k(float const* x, std::size_t n, BlockQ6K* blocks) {
  for (std::size_t i = 0; i < n / kQ6KBlockSize; ++i)
    blocks[i] = quantize_q6_k(x + i * kQ6KBlockSize);
}

}  // namespace qflash::gguf
