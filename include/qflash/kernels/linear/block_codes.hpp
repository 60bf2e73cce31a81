/// @file
/// Block-format weights (q8_0, q4_k, q6_k, int4) as the CUDA kernels read them: as integer
/// codes, four to a 32-bit word (int8 each), and per span of columns an affine map, value =
/// scale * code + offset, whose products are the format's dequantized values. With the
/// activations rounded to 8-bit codes as the CPU rounds them (rounding.cuh), a span's products
/// are an integer dot product of codes, scaled: the GEMV takes it with dp4a, the tensor-core
/// path with mma.sync (mma_blocks.hpp). Host-device code: tests check it on the host.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "qflash/core/config.hpp"
#include "qflash/numeric/fp16.hpp"
#include "qflash/numeric/gguf_blocks.hpp"
#include "qflash/numeric/int4.hpp"
#include "qflash/numeric/weight_format.hpp"

namespace qflash::kernels::linear_cuda {

/// Columns that share an activation scale: a q8_0 block, an eighth of a q8_k block.
inline constexpr int kGroup = 32;

/// Whether the code kernels read format f.
QFLASH_HD constexpr bool reads_codes(WeightFormat f) {
  return f == WeightFormat::kQ8_0 || f == WeightFormat::kQ4K || f == WeightFormat::kQ6K || f == WeightFormat::kInt4;
}

/// A row of `cols` values as whole groups of codes (int4's last block may end mid-group: its
/// codes past the row are zeros, as are the activations').
QFLASH_HD constexpr std::int64_t padded_cols(std::int64_t cols) { return (cols + kGroup - 1) / kGroup * kGroup; }

namespace detail {
/// A 16-bit load from a block's bytes at an even offset (blocks are 2-byte aligned).
QFLASH_HD inline std::uint16_t load_u16(std::byte const* p) {
#ifdef __CUDA_ARCH__
  return *reinterpret_cast<std::uint16_t const*>(p);
#else
  std::uint16_t v = 0;
  std::memcpy(&v, p, sizeof v);
  return v;
#endif
}
/// Four bytes at an even offset.
QFLASH_HD inline std::uint32_t load_u32(std::byte const* p) {
  return load_u16(p) | std::uint32_t{load_u16(p + 2)} << 16;
}
QFLASH_HD inline float fp16_at(std::byte const* p) { return to_float(Fp16{load_u16(p)}); }
}  // namespace detail

/// Code v (0-3) of a word.
QFLASH_HD constexpr int code_of(std::uint32_t word, int v) { return static_cast<std::int8_t>(word >> (8 * v)); }

/// c + the sum of the four int8 products of words a and b (dp4a on the device).
QFLASH_HD inline int dot4(std::uint32_t a, std::uint32_t b, int c) {
#ifdef __CUDA_ARCH__
  return __dp4a(static_cast<int>(a), static_cast<int>(b), c);
#else
  for (int v = 0; v < 4; ++v) c += code_of(a, v) * code_of(b, v);
  return c;
#endif
}

/// A span's weights: value = scale * code + offset.
struct Affine {
  float scale = 0.0f;
  float offset = 0.0f;
};

/// acc plus a span's products for one weight row and token: dot = sum q_w q_a over the span,
/// a_scale = s_a, a_sum = s_a sum q_a over the group (spans shorter than a group, q6_k's,
/// have no offset).
QFLASH_HD inline float add_span(float acc, float dot, float a_scale, float a_sum, Affine w) {
  return fmaf(a_scale * w.scale, dot, fmaf(w.offset, a_sum, acc));
}

/// Codes<kF>::word(row, c): the codes of columns c .. c + 3 (c a multiple of 4) of a weight
/// row, first in the low byte; Codes<kF>::affine(row, c): the scale and offset of the span
/// (kSpan columns) that starts at column c.
template <WeightFormat kF>
struct Codes;

/// q8_0: codes int8, scale d per 32.
template <>
struct Codes<WeightFormat::kQ8_0> {
  static constexpr int kSpan = 32;
  QFLASH_HD static std::byte const* block(std::byte const* row, std::int64_t c) {
    return row + c / gguf::kQ8_0BlockSize * static_cast<std::int64_t>(sizeof(gguf::BlockQ8_0));
  }
  QFLASH_HD static std::uint32_t word(std::byte const* row, std::int64_t c) {
    return detail::load_u32(block(row, c) + offsetof(gguf::BlockQ8_0, qs) + c % gguf::kQ8_0BlockSize);
  }
  QFLASH_HD static Affine affine(std::byte const* row, std::int64_t c) {
    return {detail::fp16_at(block(row, c) + offsetof(gguf::BlockQ8_0, d)), 0.0f};
  }
};

/// q4_k: codes 0..15; sub-block j of 32 has scale d sc_j and offset -dmin m_j.
template <>
struct Codes<WeightFormat::kQ4K> {
  static constexpr int kSpan = 32;
  QFLASH_HD static std::byte const* block(std::byte const* row, std::int64_t c) {
    return row + c / gguf::kQ4KBlockSize * static_cast<std::int64_t>(sizeof(gguf::BlockQ4K));
  }
  QFLASH_HD static std::uint32_t word(std::byte const* row, std::int64_t c) {
    // Value i's code: the low (even j) or high nibble of qs[32 (j / 2) + i % 32].
    int const i = static_cast<int>(c % gguf::kQ4KBlockSize), j = i / 32;
    std::uint32_t const b = detail::load_u32(block(row, c) + offsetof(gguf::BlockQ4K, qs) + 32 * (j / 2) + i % 32);
    return b >> (4 * (j % 2)) & 0x0F0F0F0Fu;
  }
  QFLASH_HD static Affine affine(std::byte const* row, std::int64_t c) {
    std::byte const* const b = block(row, c);
    auto const* scales = reinterpret_cast<std::uint8_t const*>(b + offsetof(gguf::BlockQ4K, scales));
    gguf::Q4KScaleMin const sm = gguf::q4_k_scale_min(scales, static_cast<int>(c % gguf::kQ4KBlockSize) / 32);
    return {detail::fp16_at(b + offsetof(gguf::BlockQ4K, d)) * static_cast<float>(sm.scale),
            -(detail::fp16_at(b + offsetof(gguf::BlockQ4K, dmin)) * static_cast<float>(sm.min))};
  }
};

/// q6_k: codes -32..31 (6 bits less 32); sub-block of 16 with scale d sc.
template <>
struct Codes<WeightFormat::kQ6K> {
  static constexpr int kSpan = 16;
  QFLASH_HD static std::byte const* block(std::byte const* row, std::int64_t c) {
    return row + c / gguf::kQ6KBlockSize * static_cast<std::int64_t>(sizeof(gguf::BlockQ6K));
  }
  QFLASH_HD static std::uint32_t word(std::byte const* row, std::int64_t c) {
    // Value 128 h + 32 k + l: low 4 bits from nibble k / 2 of ql[64 h + 32 (k % 2) + l], high
    // 2 bits from bits 2k of qh[32 h + l]. Each byte less 32 without borrows between bytes.
    int const i = static_cast<int>(c % gguf::kQ6KBlockSize), h = i / 128, k = i % 128 / 32, l = i % 32;
    std::byte const* const b = block(row, c);
    std::uint32_t const lo = detail::load_u32(b + offsetof(gguf::BlockQ6K, ql) + 64 * h + 32 * (k % 2) + l);
    std::uint32_t const hi = detail::load_u32(b + offsetof(gguf::BlockQ6K, qh) + 32 * h + l);
    std::uint32_t const u = (lo >> (4 * (k / 2)) & 0x0F0F0F0Fu) | (hi >> (2 * k) & 0x03030303u) << 4;
    return ((u | 0x80808080u) - 0x20202020u) ^ 0x80808080u;
  }
  QFLASH_HD static Affine affine(std::byte const* row, std::int64_t c) {
    std::byte const* const b = block(row, c);
    auto const* sc = reinterpret_cast<std::int8_t const*>(b + offsetof(gguf::BlockQ6K, scales));
    return {detail::fp16_at(b + offsetof(gguf::BlockQ6K, d)) * static_cast<float>(sc[c % gguf::kQ6KBlockSize / 16]),
            0.0f};
  }
};

/// int4 group-128: codes 0..15, scale and offset (min) per 128.
template <>
struct Codes<WeightFormat::kInt4> {
  static constexpr int kSpan = 32;
  QFLASH_HD static std::byte const* block(std::byte const* row, std::int64_t c) {
    return row + c / kInt4GroupSize * static_cast<std::int64_t>(sizeof(BlockInt4G128));
  }
  QFLASH_HD static std::uint32_t word(std::byte const* row, std::int64_t c) {
    // Value i's code: the low (even i) or high nibble of qs[i / 2].
    std::uint32_t const b = detail::load_u16(block(row, c) + offsetof(BlockInt4G128, qs) + c % kInt4GroupSize / 2);
    return (b & 0xFu) | (b >> 4 & 0xFu) << 8 | (b >> 8 & 0xFu) << 16 | (b >> 12 & 0xFu) << 24;
  }
  QFLASH_HD static Affine affine(std::byte const* row, std::int64_t c) {
    std::byte const* const b = block(row, c);
    return {detail::fp16_at(b + offsetof(BlockInt4G128, scale)), detail::fp16_at(b + offsetof(BlockInt4G128, min))};
  }
};

/// The codes of columns c .. c + 15 (c a multiple of 16) of a weight row as four words: q4_k's
/// 16 code bytes in one 16-byte load where the row is 16-byte aligned (a warp-uniform test:
/// its lanes share the row), the other formats' as four words.
template <WeightFormat kF>
QFLASH_HD void words16(std::byte const* row, std::int64_t c, std::uint32_t (&w)[4]) {
  if constexpr (kF == WeightFormat::kQ4K) {
    using C = Codes<kF>;
    int const i = static_cast<int>(c % gguf::kQ4KBlockSize), j = i / 32;
    std::byte const* const p = C::block(row, c) + offsetof(gguf::BlockQ4K, qs) + 32 * (j / 2) + i % 32;
    std::uint32_t b[4];
#ifdef __CUDA_ARCH__
    if (reinterpret_cast<std::uintptr_t>(row) % 16 == 0) {
      uint4 const v = *reinterpret_cast<uint4 const*>(p);
      b[0] = v.x, b[1] = v.y, b[2] = v.z, b[3] = v.w;
    } else {
      for (int v = 0; v < 4; ++v) b[v] = detail::load_u32(p + 4 * v);
    }
#else
    std::memcpy(b, p, sizeof b);
#endif
    for (int v = 0; v < 4; ++v) w[v] = b[v] >> (4 * (j % 2)) & 0x0F0F0F0Fu;
  } else {
    for (int v = 0; v < 4; ++v) w[v] = Codes<kF>::word(row, c + 4 * v);
  }
}

/// The GEMV's work for one lane, 16 columns [c, c + 16) of a weight row (c a multiple of 16):
/// acc plus their products with one token's codes `a` (16 int8, four words), whose group has
/// scale a_scale and scaled code sum a_sum. The group's offset term goes with its first half.
QFLASH_HD inline float add_sixteen(float acc, std::uint32_t const (&w)[4], std::uint32_t const (&a)[4],
                                   float a_scale, float a_sum, Affine span, std::int64_t c) {
  int dot = 0;
  for (int v = 0; v < 4; ++v) dot = dot4(w[v], a[v], dot);
  bool const first_half = c % kGroup == 0;
  return add_span(acc, static_cast<float>(dot), a_scale, first_half ? a_sum : 0.0f, span);
}

}  // namespace qflash::kernels::linear_cuda
