/// @file
/// The geometry of linear's tensor-core path for block-format weights (q8_0, q4_k, q6_k, int4)
/// on CUDA (mma_blocks.cuh), as host-device code so that tests run it on the host.
///
/// A block format's products are of integer codes: the activations are rounded to 8-bit codes
/// as ref::round_activations rounds them (q8_0 blocks of 32 for q8_0 and int4, q8_k blocks of
/// 256 for q4_k and q6_k), and a weight value is scale * code + offset over a span of columns
/// (Codes<kF>::kSpan). Codes are integers of magnitude 128 or less, so exact in bf16, and a
/// span's dot product of codes, sum q_w q_a, is exact in the fp32 accumulators of
/// `mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32` (|sum| <= 32 * 128 * 128 < 2^24). Each span
/// then adds, per weight row and token, s_a s_w sum q_w q_a + o_w (s_a sum q_a): the
/// reference's sum of the same products, in another order and rounding.
///
/// A CTA owns mma::kBlockN rows of each of kMats weight matrices (the experts' gate and up:
/// 2) and 16 kMTiles tokens, as linear's bf16 path does, and walks the columns a group of
/// kGroup at a time. A stage holds the group's activation codes (bf16) and its scale s_a and
/// scaled code sum s_a sum q_a per token, copied with cp.async (16 bytes of codes, 4 of a
/// scale or sum: the tokens of a tile may be any rows, as the experts' are); each lane reads
/// its weight codes straight into its fragments (the blocks are 34, 144, 210 and 68 bytes:
/// not whole 16-byte copies). The mma's 16 k positions of a k-step are columns of the group in
/// another order, the same for A and B: the lanes of pair t hold columns 16 ks + 4t ..
/// 16 ks + 4t + 3, so a lane reads four consecutive codes of a row, and its A fragment of a
/// row is one 8-byte shared load.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "qflash/core/config.hpp"
#include "qflash/kernels/linear/mma_tile.hpp"
#include "qflash/kernels/linear/warp_blocks.hpp"
#include "qflash/numeric/gguf_blocks.hpp"
#include "qflash/numeric/int4.hpp"
#include "qflash/numeric/weight_format.hpp"

namespace qflash::kernels::linear_cuda::mma_blocks {

inline constexpr int kGroup = 32;   ///< columns per stage: two k-steps of 16
inline constexpr int kCodeLd = 48;  ///< an activation row's stride in a stage, in bf16: 96 bytes

/// Whether this path reads format f.
QFLASH_HD constexpr bool reads(WeightFormat f) {
  return f == WeightFormat::kQ8_0 || f == WeightFormat::kQ4K || f == WeightFormat::kQ6K || f == WeightFormat::kInt4;
}

/// Whether weights `w` can take this path: a block format whose rows are whole groups (int4's
/// last block may be short of 128, not of a group).
inline bool stageable(WeightView const& w) { return reads(w.format) && w.cols % kGroup == 0; }

/// Whether linear of `w` over n_tokens takes this path.
inline bool usable(WeightView const& w, std::int64_t n_tokens) {
  return n_tokens >= mma::kMinTokens && stageable(w);
}

/// The stage layout in bytes for kMTiles m-tiles of 16 tokens: codes [kBlockM][kCodeLd] bf16,
/// then scales [kBlockM] and sums [kBlockM] fp32.
template <int kMTiles>
struct Tile {
  static constexpr int kBlockM = 16 * kMTiles;
  static constexpr int kRowCopies = kGroup * 2 / mma::kCopyBytes;  ///< 16-byte copies per token's codes
  static constexpr int kScaleBase = kBlockM * kCodeLd * 2;
  static constexpr int kSumBase = kScaleBase + kBlockM * 4;
  static constexpr int kStageBytes = kSumBase + kBlockM * 4;
  static constexpr int kCopies = kBlockM * (kRowCopies + 2);
};

/// One copy of a stage: 16 bytes of a token's codes, or its 4-byte scale or sum.
struct StageCopy {
  int what;   ///< 0: codes, 1: scale, 2: sum
  int token;  ///< token of the tile
  int col;    ///< codes: first column in the group
  int smem;   ///< first byte of the destination in the stage
};
template <int kMTiles>
QFLASH_HD constexpr StageCopy stage_copy(int c) {
  using T = Tile<kMTiles>;
  if (c < T::kBlockM * T::kRowCopies) {
    int const token = c / T::kRowCopies, chunk = c % T::kRowCopies;
    return {0, token, chunk * mma::kChunk, token * kCodeLd * 2 + chunk * mma::kCopyBytes};
  }
  c -= T::kBlockM * T::kRowCopies;
  int const what = 1 + c / T::kBlockM, token = c % T::kBlockM;
  return {what, token, 0, (what == 1 ? T::kScaleBase : T::kSumBase) + 4 * token};
}
/// Bytes of a stage copy.
QFLASH_HD constexpr int copy_bytes(StageCopy const& s) { return s.what == 0 ? mma::kCopyBytes : 4; }

/// The first of the four codes (bf16) of tile token `token` that a lane's A fragment takes in
/// k-step ks, as an offset in bf16 from the stage's start: registers 0 | 2 are the codes of
/// token g, registers 1 | 3 those of token g + 8 (mma_tile.hpp's g and t).
QFLASH_HD constexpr int a_offset(int token, int lane, int ks) {
  return token * kCodeLd + 16 * ks + 4 * mma::pair_of(lane);
}

/// A code (a small integer) as bf16: exact.
QFLASH_HD constexpr std::uint16_t bf16_of_code(int q) {
  return static_cast<std::uint16_t>(qflash::detail::bits_of(static_cast<float>(q)) >> 16);
}
/// Two codes as a bf16 pair (the first in the low half).
QFLASH_HD constexpr std::uint32_t bf16_pair(int lo, int hi) {
  return bf16_of_code(lo) | std::uint32_t{bf16_of_code(hi)} << 16;
}

/// A span's weights: value = scale * code + offset.
struct Affine {
  float scale = 0.0f;
  float offset = 0.0f;
};

/// Codes<kF>::four(row, c, q): the codes of columns c .. c + 3 (c a multiple of 4) of a weight
/// row; Codes<kF>::affine(row, c): the scale and offset of the span that starts at column c.
/// The products scale * code + offset are the format's dequantized values.
template <WeightFormat kF>
struct Codes;

namespace detail {
using linear_cuda::detail::fp16_at;
using linear_cuda::detail::load_u16;
/// Four bytes at an even offset.
QFLASH_HD inline std::uint32_t load_u32(std::byte const* p) {
  return load_u16(p) | std::uint32_t{load_u16(p + 2)} << 16;
}
}  // namespace detail

/// q8_0: codes int8, scale d per 32.
template <>
struct Codes<WeightFormat::kQ8_0> {
  static constexpr int kSpan = 32;
  QFLASH_HD static std::byte const* block(std::byte const* row, std::int64_t c) {
    return row + c / gguf::kQ8_0BlockSize * static_cast<std::int64_t>(sizeof(gguf::BlockQ8_0));
  }
  QFLASH_HD static void four(std::byte const* row, std::int64_t c, int (&q)[4]) {
    std::uint32_t const b =
        detail::load_u32(block(row, c) + offsetof(gguf::BlockQ8_0, qs) + c % gguf::kQ8_0BlockSize);
    for (int v = 0; v < 4; ++v) q[v] = static_cast<std::int8_t>(b >> (8 * v));
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
  QFLASH_HD static void four(std::byte const* row, std::int64_t c, int (&q)[4]) {
    int const i = static_cast<int>(c % gguf::kQ4KBlockSize), j = i / 32;
    // Value i's code: the low (even j) or high nibble of qs[32 (j / 2) + i % 32].
    std::uint32_t const b = detail::load_u32(block(row, c) + offsetof(gguf::BlockQ4K, qs) + 32 * (j / 2) + i % 32);
    for (int v = 0; v < 4; ++v) q[v] = static_cast<int>(b >> (8 * v + 4 * (j % 2)) & 0xF);
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
  QFLASH_HD static void four(std::byte const* row, std::int64_t c, int (&q)[4]) {
    // Value 128 h + 32 k + l: low 4 bits from nibble k / 2 of ql[64 h + 32 (k % 2) + l], high
    // 2 bits from bits 2k of qh[32 h + l].
    int const i = static_cast<int>(c % gguf::kQ6KBlockSize), h = i / 128, k = i % 128 / 32, l = i % 32;
    std::byte const* const b = block(row, c);
    std::uint32_t const lo = detail::load_u32(b + offsetof(gguf::BlockQ6K, ql) + 64 * h + 32 * (k % 2) + l);
    std::uint32_t const hi = detail::load_u32(b + offsetof(gguf::BlockQ6K, qh) + 32 * h + l);
    for (int v = 0; v < 4; ++v)
      q[v] = static_cast<int>((lo >> (8 * v + 4 * (k / 2)) & 0xF) | (hi >> (8 * v + 2 * k) & 3) << 4) - 32;
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
  QFLASH_HD static void four(std::byte const* row, std::int64_t c, int (&q)[4]) {
    std::uint32_t const b = detail::load_u16(block(row, c) + offsetof(BlockInt4G128, qs) + c % kInt4GroupSize / 2);
    for (int v = 0; v < 4; ++v) q[v] = static_cast<int>(b >> (4 * v) & 0xF);
  }
  QFLASH_HD static Affine affine(std::byte const* row, std::int64_t c) {
    std::byte const* const b = block(row, c);
    return {detail::fp16_at(b + offsetof(BlockInt4G128, scale)), detail::fp16_at(b + offsetof(BlockInt4G128, min))};
  }
};

/// A lane's B fragment for k-step ks of the group at column k0 of a weight row (nullptr: a row
/// past the matrix, zeros): register 0 holds the codes of columns 16 ks + 4t and + 1,
/// register 1 those of + 2 and + 3.
template <WeightFormat kF>
QFLASH_HD void b_fragment(std::byte const* row, std::int64_t k0, int lane, int ks, std::uint32_t (&b)[2]) {
  if (!row) {
    b[0] = b[1] = 0;
    return;
  }
  int q[4];
  Codes<kF>::four(row, k0 + 16 * ks + 4 * mma::pair_of(lane), q);
  b[0] = bf16_pair(q[0], q[1]);
  b[1] = bf16_pair(q[2], q[3]);
}

/// acc plus a span's products for one weight row and token: dot = sum q_w q_a over the span,
/// a_scale = s_a, a_sum = s_a sum q_a over the group (spans shorter than a group, q6_k's,
/// have no offset).
QFLASH_HD inline float add_span(float acc, float dot, float a_scale, float a_sum, Affine w) {
  return fmaf(a_scale * w.scale, dot, fmaf(w.offset, a_sum, acc));
}

}  // namespace qflash::kernels::linear_cuda::mma_blocks
