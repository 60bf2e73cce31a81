/// @file
/// The tile geometry of linear's tensor-core path on CUDA (mma.cuh), as host-device code so that
/// tests run it on the host against the PTX ISA's fragment layouts.
///
/// The path computes y = x W^T for bf16 W with `mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32`.
/// Activations are fp32: each is split into three bf16 parts, hi + mid + lo, whose sum is x to
/// within 2^-24 of |x|, and each part's products are summed into the same fp32 accumulators.
/// A bf16 times a bf16 is exact in fp32, so the sums are fp32 sums of the exact products, as
/// the CPU's are, in another order.
///
/// A CTA (kThreads) owns kBlockN rows of each of kMats weight matrices and kBlockM = 16 kMTiles
/// tokens, and walks the columns kBlockK at a time through shared memory. Warp w owns weight
/// rows [16 w, 16 w + 16) (two n-tiles of 8) for all kBlockM tokens. A stage holds the weight
/// tiles [kMats][kBlockN][kBlockK] and the three parts' activation tiles
/// [kParts][kBlockM][kBlockK], rows kLd bf16 apart, so that the 32 lanes' 4-byte fragment
/// loads fall in 32 different banks.
#pragma once

#include <cstdint>

#include "qflash/core/config.hpp"
#include "qflash/numeric/bf16.hpp"

namespace qflash::kernels::linear_cuda::mma {

inline constexpr int kParts = 3;          ///< bf16 parts of an fp32 activation
inline constexpr int kWarps = 4;
inline constexpr int kThreads = 32 * kWarps;
inline constexpr int kBlockN = 16 * kWarps;  ///< weight rows per CTA
inline constexpr int kBlockK = 32;           ///< columns per stage: two k-steps of 16
inline constexpr int kLd = kBlockK + 8;      ///< shared row stride in bf16: 80 bytes, 20 banks
inline constexpr int kChunk = 8;             ///< bf16 per 16-byte copy
inline constexpr int kChunksPerRow = kBlockK / kChunk;
inline constexpr int kNTiles = 2;            ///< n-tiles of 8 rows per warp
/// Fewest tokens for which linear takes this path (fewer: the warp GEMV, which reads the
/// weights once for up to 4 tokens at a time without staging them).
inline constexpr std::int64_t kMinTokens = 16;

/// The stage layout for kMTiles m-tiles of 16 tokens and kMats weight matrices whose rows the
/// CTA multiplies by the same activations (the experts' gate and up: 2).
template <int kMTiles, int kMats = 1>
struct Tile {
  static constexpr int kBlockM = 16 * kMTiles;
  static constexpr int kARows = kParts * kBlockM;       ///< part-major: row p kBlockM + token
  static constexpr int kWRows = kMats * kBlockN;         ///< the weight tiles first
  static constexpr int kWElems = kWRows * kLd;
  static constexpr int kStageElems = kWElems + kARows * kLd;
  static constexpr int kCopies = (kWRows + kARows) * kChunksPerRow;  ///< 16-byte copies a stage
};

/// x = hi + mid + lo to within 2^-24 |x| (finite x; or 2^-133, bf16's least subnormal, for
/// tiny x): each part is the bf16 nearest to what the parts before it leave, and each
/// remainder is exact in fp32.
QFLASH_HD constexpr void split3(float x, std::uint16_t (&part)[kParts]) {
  for (int p = 0; p < kParts; ++p) {
    Bf16 const h = to_bf16(x);
    part[p] = h.bits;
    x -= to_float(h);
  }
}

/// One 16-byte copy of a stage: the weight tiles' rows come first, then the activation parts'.
struct StageCopy {
  bool weight;  ///< a weight row's chunk, else an activation part's
  int mat;      ///< weight matrix
  int row;      ///< row of the weight matrix's tile, or token in the tile
  int part;     ///< activation part (0: hi)
  int col;      ///< first column in the stage (a multiple of kChunk)
  int smem;     ///< first bf16 of the destination in the stage
};
template <int kMTiles, int kMats = 1>
QFLASH_HD constexpr StageCopy stage_copy(int c) {
  using T = Tile<kMTiles, kMats>;
  int const r = c / kChunksPerRow, col = c % kChunksPerRow * kChunk;
  if (r < T::kWRows) return {true, r / kBlockN, r % kBlockN, 0, col, r * kLd + col};
  int const a = r - T::kWRows;
  return {false, 0, a % T::kBlockM, a / T::kBlockM, col, T::kWElems + a * kLd + col};
}

/// A lane's place in its fragments: group g = lane / 4 (a row of A and C, a column of B) and
/// t = lane % 4 (a pair of columns of A, rows of B and columns of C).
QFLASH_HD constexpr int group_of(int lane) { return lane / 4; }
QFLASH_HD constexpr int pair_of(int lane) { return lane % 4; }

/// Register r (0-3) of a lane's A fragment (16 tokens x 16 columns, row-major) for m-tile mt,
/// activation part p and k-step ks of a stage: the 32-bit word (two bf16, the lower column
/// in the low half) at this offset in words from the stage's start. Rows g and g + 8 for
/// r = 0, 1 (and 2, 3); columns 2t, 2t + 1, plus 8 for r = 2, 3.
template <int kMTiles, int kMats = 1>
QFLASH_HD constexpr int a_word(int lane, int r, int mt, int p, int ks) {
  using T = Tile<kMTiles, kMats>;
  int const row = p * T::kBlockM + mt * 16 + group_of(lane) + 8 * (r % 2);
  int const col = ks * 16 + 2 * pair_of(lane) + 8 * (r / 2);
  return (T::kWElems + row * kLd + col) / 2;
}

/// Register r (0-1) of a lane's B fragment (16 columns x 8 weight rows, "col": B[k][n] =
/// W[n][k], so a register's two k are adjacent in a weight row) for the n-tile whose first row
/// in the stage is n0 (matrix j's rows start at j kBlockN): weight row n0 + g, columns 2t,
/// 2t + 1, plus 8 for r = 1.
QFLASH_HD constexpr int b_word(int lane, int r, int n0, int ks) {
  return ((n0 + group_of(lane)) * kLd + ks * 16 + 2 * pair_of(lane) + 8 * r) / 2;
}

/// Accumulator r (0-3) of a lane's C fragment (16 tokens x 8 weight rows): its token in the
/// m-tile (g, or g + 8 for r = 2, 3) and its weight row in the n-tile (2t, 2t + 1).
QFLASH_HD constexpr int c_token(int lane, int r) { return group_of(lane) + 8 * (r / 2); }
QFLASH_HD constexpr int c_row(int lane, int r) { return 2 * pair_of(lane) + r % 2; }

}  // namespace qflash::kernels::linear_cuda::mma
