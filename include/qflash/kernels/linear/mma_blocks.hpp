/// @file
/// The geometry of linear's tensor-core path for block-format weights (q8_0, q4_k, q6_k, int4)
/// on CUDA (mma_blocks.cuh), as host-device code so that tests run it on the host.
///
/// A block format's products are of integer codes (block_codes.hpp): the activations' 8-bit
/// codes, and the weights' small codes over spans of columns with a scale and an offset. Codes
/// are integers of magnitude 128 or less, so exact in bf16, and a span's dot product of codes,
/// sum q_w q_a, is exact in the fp32 accumulators of
/// `mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32` (|sum| <= 32 * 128 * 128 < 2^24); each span
/// then adds s_a s_w sum q_w q_a + o_w (s_a sum q_a) per weight row and token (add_span).
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
#include "qflash/kernels/linear/block_codes.hpp"
#include "qflash/kernels/linear/mma_tile.hpp"
#include "qflash/numeric/weight_format.hpp"

namespace qflash::kernels::linear_cuda::mma_blocks {

inline constexpr int kCodeLd = 48;  ///< an activation row's stride in a stage, in bf16: 96 bytes
static_assert(kGroup == 32, "a stage is a group: two k-steps of 16");

/// Whether weights `w` can take this path: a block format, rows of any length. The columns run
/// to padded_cols(cols): an int4 row may end mid-group, and past its end the activations'
/// codes are zeros (quantize_kernel), so the last block's codes there add nothing.
inline bool stageable(WeightView const& w) { return reads_codes(w.format); }

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

/// A lane's B fragment for k-step ks of the group at column k0 of a weight row (nullptr: a row
/// past the matrix, zeros): register 0 holds the codes of columns 16 ks + 4t and + 1,
/// register 1 those of + 2 and + 3.
template <WeightFormat kF>
QFLASH_HD void b_fragment(std::byte const* row, std::int64_t k0, int lane, int ks, std::uint32_t (&b)[2]) {
  if (!row) {
    b[0] = b[1] = 0;
    return;
  }
  std::uint32_t const w = Codes<kF>::word(row, k0 + 16 * ks + 4 * mma::pair_of(lane));
  b[0] = bf16_pair(code_of(w, 0), code_of(w, 1));
  b[1] = bf16_pair(code_of(w, 2), code_of(w, 3));
}

}  // namespace qflash::kernels::linear_cuda::mma_blocks
