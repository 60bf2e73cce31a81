/// @file
/// The chunked gated delta rule's state pass on tensor cores (device.cuh's state_kernel): its
/// tile geometry as host-device code, so that tests run it on the host against the PTX ISA's
/// fragment layouts; and chunk_kernel's shared memory and Gram blocks. Every product is 3xTF32
/// (common/tf32.hpp): about 2^-21 of |a| |b|.
///
/// A CTA (kThreads, kWarps warps) owns kCols state columns of one value head: S [d_k, kCols]
/// in shared memory for the whole call, rows kLd floats apart, zero past d_k (to whole tiles
/// of 16) and past d_v. For each chunk of n <= kMaxChunk tokens (the workspace of
/// chunk_kernel, laid out as ChunkLayout below):
///  1. warp w takes the chunk's tokens [16 w, 16 w + 16) and multiplies W and e^γ q̂ by S over
///     d_k (the two share S's fragments). V' = U − W S goes to shared memory (zero rows for
///     tokens past n); e^γ q̂ S stays in the warp's output accumulators.
///  2. After a barrier, the warp adds (Q Kᵀ ⊙ Γ) V' to its outputs (the k-tiles up to its last
///     token) and writes them.
///  3. The warp takes the state's row tiles [16 m, 16 m + 16) for m = w, w + kWarps, ...:
///     accumulators start from e^{γ_last} S and gain kdᵀ V' (kd = e^{γ_last − γ} k̂), and go
///     back to S in place. No warp reads S between this chunk's barrier and the next.
#pragma once

#include <cstddef>
#include <cstdint>

#include "qflash/core/config.hpp"
#include "qflash/kernels/common/tf32.hpp"

namespace qflash::kernels::gated_delta_cuda {

inline constexpr int kCols = 32;     ///< state columns per CTA
inline constexpr int kMaxChunk = 64;  ///< tokens per chunk on the device, at most

inline constexpr std::size_t kMaxChunkSmem = 99 * 1024;  ///< what sm_86 and sm_89 opt in to per block

/// Floats between chunk_kernel's rows of q̂ and k̂ in shared memory: d_k in whole k-steps of 8,
/// and 4 more (4 times an odd number), so that the lanes of an A or B fragment (rows g < 8,
/// columns t < 4) read 32 different banks.
QFLASH_HD constexpr int chunk_ld(int dk) { return (dk + 7) / 8 * 8 + 4; }

/// Floats between the columns of chunk_kernel's A (Γ first) in shared memory, which it keeps by
/// columns, so that the substitution reads 16 rows of a column as four aligned float4s: c in
/// whole n-tiles of 8, and 4 more, so that a C fragment's lanes (rows g, columns 2 t) write 32
/// different banks.
QFLASH_HD constexpr int chunk_lda(int c) { return (c + 7) / 8 * 8 + 4; }

inline constexpr int kSolveRows = 16;  ///< rows a thread of chunk_kernel's substitution holds at a time

/// Floats of chunk_kernel's A in shared memory: c columns chunk_lda apart, and kSolveRows more,
/// so that the substitution's reads of kSolveRows rows of a column (past the chunk's last
/// token, in its last block) stay inside A.
QFLASH_HD constexpr int chunk_a_floats(int c) { return c * chunk_lda(c) + kSolveRows; }

/// Shared memory of chunk_kernel for chunks of c tokens: q̂ and k̂ rows (chunk_ld apart), A,
/// and per token e^g, e^γ, β and Γ_{last, j}.
QFLASH_HD constexpr std::size_t chunk_smem(int c, int dk) {
  return (2 * static_cast<std::size_t>(c) * chunk_ld(dk) + static_cast<std::size_t>(chunk_a_floats(c)) +
          4 * static_cast<std::size_t>(c)) *
         sizeof(float);
}

/// Tokens per chunk on the device for the op's chunk_size and d_k: at most kMaxChunk, halved
/// while chunk_kernel's shared memory would pass kMaxChunkSmem.
QFLASH_HD constexpr int chunk_tokens(int chunk_size, int dk) {
  int c = chunk_size < kMaxChunk ? chunk_size : kMaxChunk;
  while (c > 1 && chunk_smem(c, dk) > kMaxChunkSmem) c /= 2;
  return c;
}

/// A 16 x 16 block of chunk_kernel's Gram products K Kᵀ and Q Kᵀ: rows 16 mt.., columns 16 ct..
/// (two n-tiles of 8, which share the rows' A fragments).
struct GramBlock {
  int mt, ct;
};
/// The blocks on or below the diagonal (ct <= mt), numbered row by row: m row tiles hold
/// m (m + 1) / 2 of them.
QFLASH_HD constexpr int gram_blocks(int row_tiles) { return row_tiles * (row_tiles + 1) / 2; }
QFLASH_HD constexpr GramBlock gram_block(int t) {
  int mt = 0;
  while (t > mt) t -= mt + 1, ++mt;
  return {mt, t};
}

/// One chunk's and value head's piece of the workspace, for chunks of up to c tokens: W, e^γ q̂
/// and e^{γ_last − γ} k̂ [c, d_k], U [c, d_v], Q Kᵀ ⊙ Γ [c, c] (rows and columns up to the
/// chunk's length; zero above the diagonal), e^{γ_last}.
struct ChunkLayout {
  int c, dk, dv;
  [[nodiscard]] QFLASH_HD std::int64_t floats() const {
    return (std::int64_t{c} * (3 * dk + dv + c) + 1 + 3) / 4 * 4;
  }
  [[nodiscard]] QFLASH_HD float* w(float* base) const { return base; }
  [[nodiscard]] QFLASH_HD float* qg(float* base) const { return base + std::int64_t{c} * dk; }
  [[nodiscard]] QFLASH_HD float* kd(float* base) const { return base + 2 * std::int64_t{c} * dk; }
  [[nodiscard]] QFLASH_HD float* u(float* base) const { return base + 3 * std::int64_t{c} * dk; }
  [[nodiscard]] QFLASH_HD float* qk(float* base) const { return u(base) + std::int64_t{c} * dv; }
  [[nodiscard]] QFLASH_HD float* last(float* base) const { return qk(base) + c * c; }
};

namespace mma {

inline constexpr int kWarps = kMaxChunk / 16;  ///< a warp per 16 tokens of a chunk
inline constexpr int kThreads = 32 * kWarps;
inline constexpr int kNTiles = kCols / 8;  ///< n-tiles of the CTA's columns
/// Floats between rows of S and V' in shared memory: a B fragment's lanes read rows t and
/// columns g, banks 8 t + g, all 32 different.
inline constexpr int kLd = kCols + 8;

/// Rows of S in shared memory: d_k in whole tiles of 16.
QFLASH_HD constexpr int state_rows(int d_k) { return (d_k + 15) / 16 * 16; }

/// Floats of shared memory: S, then V' [kMaxChunk][kLd].
QFLASH_HD constexpr int smem_floats(int d_k) { return (state_rows(d_k) + kMaxChunk) * kLd; }

using tf32::a_col;
using tf32::a_row;
using tf32::c_col;
using tf32::c_row;

/// Offset in floats, in S or V', of register r (0-1) of the B fragment for rows (k)
/// [8 kt, 8 kt + 8) and columns [8 nt, 8 nt + 8).
QFLASH_HD constexpr int b_offset(int lane, int r, int kt, int nt) {
  return (8 * kt + tf32::b_row(lane, r)) * kLd + 8 * nt + tf32::b_col(lane);
}

/// Offset in floats, in S or V', of accumulator r (0-3) of the C fragment for rows
/// [16 mt, 16 mt + 16) and columns [8 nt, 8 nt + 8).
QFLASH_HD constexpr int c_offset(int lane, int r, int mt, int nt) {
  return (16 * mt + c_row(lane, r)) * kLd + 8 * nt + c_col(lane, r);
}

}  // namespace mma
}  // namespace qflash::kernels::gated_delta_cuda
