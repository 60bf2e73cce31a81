/// @file
/// The tile geometry of linear's tensor-core path on CUDA (mma.cuh), as host-device code so that
/// tests run it on the host against the PTX ISA's fragment layouts.
///
/// The path computes y = x W^T for bf16 or fp8 e4m3 W with
/// `mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32` (an e4m3 value is a bf16 value: the lanes
/// widen the codes as they load them; the block scales multiply each stage's sums).
/// Activations are fp32: each is split into three bf16 parts, hi + mid + lo, whose sum is x to
/// within 2^-24 of |x|, and each part's products are summed into fp32 accumulators (bf16: the
/// hi part's apart from the others'; fp8: each stage's apart, then scaled; mma.cuh:
/// multiply_tiles).
/// A bf16 times a bf16 is exact in fp32, so each product is exact, as the CPU's are; the sums
/// differ from the CPU's in order, and in that the tensor cores align each step's products to
/// the largest and truncate rather than round each addition (the GPU tests' tolerance holds
/// rows of 4096 columns to it).
///
/// A CTA (kThreads) owns kBlockN rows of each of kMats weight matrices and kBlockM = 16 kMTiles
/// tokens, and walks the columns kBlockK at a time through shared memory. Warp w owns weight
/// rows [16 w, 16 w + 16) (two n-tiles of 8) for all kBlockM tokens. A stage holds the weight
/// tiles [kMats][kBlockN][kBlockK] and the three parts' activation tiles
/// [kParts][kBlockM][kBlockK], each row padded by 16 bytes, so that the 32 lanes' fragment
/// loads fall in different banks (or share a word).
#pragma once

#include <cstdint>

#include "qflash/core/config.hpp"
#include "qflash/numeric/bf16.hpp"
#include "qflash/numeric/fp8.hpp"
#include "qflash/numeric/weight_format.hpp"

namespace qflash::kernels::linear_cuda::mma {

inline constexpr int kParts = 3;          ///< bf16 parts of an fp32 activation
inline constexpr int kWarps = 4;
inline constexpr int kThreads = 32 * kWarps;
inline constexpr int kBlockN = 16 * kWarps;  ///< weight rows per CTA
inline constexpr int kBlockK = 32;           ///< columns per stage: two k-steps of 16
inline constexpr int kCopyBytes = 16;        ///< one cp.async
inline constexpr int kChunk = kCopyBytes / 2;  ///< bf16 per copy
inline constexpr int kLd = kBlockK + 8;      ///< activation rows' shared stride in bf16: 80 bytes, 20 banks
inline constexpr int kNTiles = 2;            ///< n-tiles of 8 rows per warp
/// Fewest tokens for which linear takes this path (fewer: the warp GEMV, which reads the
/// weights once for up to 4 tokens at a time without staging them).
inline constexpr std::int64_t kMinTokens = 16;

/// Bytes per weight value of a format this path reads (bf16, fp8 e4m3), else 0.
QFLASH_HD constexpr int weight_bytes(WeightFormat f) {
  return f == WeightFormat::kBf16 ? 2 : (f == WeightFormat::kFp8E4m3 ? 1 : 0);
}

/// Whether weights `w` (rows of one tensor whose first is scale_row0) can be staged by this
/// path: bf16 or fp8 rows that are whole 16-byte copies from 16-byte aligned memory, and fp8
/// scale blocks that a CTA's kBlockN rows never straddle.
inline bool stageable(WeightView const& w) {
  int const bytes = weight_bytes(w.format);
  return bytes > 0 && (w.cols * bytes) % kCopyBytes == 0 && reinterpret_cast<std::uintptr_t>(w.data) % 16 == 0 &&
         (bytes == 2 || (w.scales && w.scale_row0 % kBlockN == 0));
}

/// Weight rows' shared stride in bytes for kWBytes-byte weights (bf16: 2, fp8 e4m3: 1): the
/// stage's columns plus 16 bytes, so that the fragment loads of 8 rows fall in 8 bank groups.
template <int kWBytes>
inline constexpr int kWLd = kBlockK * kWBytes + kCopyBytes;

/// The stage layout, in bytes, for kMTiles m-tiles of 16 tokens and kMats weight matrices of
/// kWBytes-byte values whose rows the CTA multiplies by the same activations (the experts'
/// gate and up: 2). The weight tiles come first, then the activation parts.
template <int kMTiles, int kMats = 1, int kWBytes = 2>
struct Tile {
  static constexpr int kBlockM = 16 * kMTiles;
  static constexpr int kARows = kParts * kBlockM;  ///< part-major: row p kBlockM + token
  static constexpr int kWRows = kMats * kBlockN;
  static constexpr int kWCopies = kBlockK * kWBytes / kCopyBytes;  ///< per weight row
  static constexpr int kACopies = kBlockK / kChunk;                ///< per activation row
  static constexpr int kABase = kWRows * kWLd<kWBytes>;
  static constexpr int kStageBytes = kABase + kARows * kLd * 2;
  static constexpr int kCopies = kWRows * kWCopies + kARows * kACopies;  ///< a stage's
};

/// x = hi + mid + lo to within 2^-24 |x| (finite x; or 2^-133, bf16's least subnormal, for
/// tiny x): each part is the bf16 nearest to what the parts before it leave (hi: toward zero
/// where the nearest is past bf16's largest), and each remainder is exact in fp32. Inf and
/// NaN: hi = x, mid = lo = 0, so that an Inf activation's products are the CPU's. An Inf
/// weight times the parts of a finite activation gives NaN where a part is 0 or of the other
/// sign (the CPU gives Inf).
QFLASH_HD constexpr void split3(float x, std::uint16_t (&part)[kParts]) {
  constexpr std::uint32_t kExponent = 0x7F800000u;
  auto const finite = [](float v) { return (qflash::detail::bits_of(v) & kExponent) != kExponent; };
  for (int p = 0; p < kParts; ++p) {
    Bf16 h = to_bf16(x);
    if (!finite(to_float(h)) && finite(x)) h = Bf16{static_cast<std::uint16_t>(qflash::detail::bits_of(x) >> 16)};
    part[p] = h.bits;
    x = finite(x) ? x - to_float(h) : 0.0f;
  }
}

/// Two e4m3 codes (the lower column in the low byte) as a bf16 pair (the lower column in the
/// low half): exact, as every e4m3 value is a bf16 value; NaN stays NaN.
QFLASH_HD constexpr std::uint32_t bf16_pair_of_e4m3(std::uint16_t codes) {
  std::uint32_t const lo = qflash::detail::bits_of(qflash::detail::decode_e4m3_branchless(codes & 0xFFu));
  std::uint32_t const hi = qflash::detail::bits_of(qflash::detail::decode_e4m3_branchless(codes >> 8));
  return lo >> 16 | (hi & 0xFFFF0000u);
}

/// One 16-byte copy of a stage.
struct StageCopy {
  bool weight;  ///< a weight row's chunk, else an activation part's
  int mat;      ///< weight matrix
  int row;      ///< row of the weight matrix's tile, or token in the tile
  int part;     ///< activation part (0: hi)
  int col;      ///< first column in the stage
  int smem;     ///< first byte of the destination in the stage
};
template <int kMTiles, int kMats = 1, int kWBytes = 2>
QFLASH_HD constexpr StageCopy stage_copy(int c) {
  using T = Tile<kMTiles, kMats, kWBytes>;
  if (c < T::kWRows * T::kWCopies) {
    int const r = c / T::kWCopies, chunk = c % T::kWCopies;
    return {true, r / kBlockN, r % kBlockN, 0, chunk * kCopyBytes / kWBytes, r * kWLd<kWBytes> + chunk * kCopyBytes};
  }
  c -= T::kWRows * T::kWCopies;
  int const a = c / T::kACopies, chunk = c % T::kACopies;
  return {false, 0, a % T::kBlockM, a / T::kBlockM, chunk * kChunk, T::kABase + a * kLd * 2 + chunk * kCopyBytes};
}

/// A lane's place in its fragments: group g = lane / 4 (a row of A and C, a column of B) and
/// t = lane % 4 (a pair of columns of A, rows of B and columns of C).
QFLASH_HD constexpr int group_of(int lane) { return lane / 4; }
QFLASH_HD constexpr int pair_of(int lane) { return lane % 4; }

/// Register r (0-3) of a lane's A fragment (16 tokens x 16 columns, row-major) for m-tile mt,
/// activation part p and k-step ks of a stage: the 32-bit word (two bf16, the lower column
/// in the low half) at this offset in words from the stage's start. Rows g and g + 8 for
/// r = 0, 1 (and 2, 3); columns 2t, 2t + 1, plus 8 for r = 2, 3.
template <int kMTiles, int kMats = 1, int kWBytes = 2>
QFLASH_HD constexpr int a_word(int lane, int r, int mt, int p, int ks) {
  using T = Tile<kMTiles, kMats, kWBytes>;
  int const row = p * T::kBlockM + mt * 16 + group_of(lane) + 8 * (r % 2);
  int const col = ks * 16 + 2 * pair_of(lane) + 8 * (r / 2);
  return (T::kABase + (row * kLd + col) * 2) / 4;
}

/// Register r (0-1) of a lane's B fragment (16 columns x 8 weight rows, "col": B[k][n] =
/// W[n][k], so a register's two k are adjacent in a weight row) for the n-tile whose first row
/// in the stage is n0 (matrix j's rows start at j kBlockN): weight row n0 + g, columns 2t,
/// 2t + 1, plus 8 for r = 1. The offset in bytes of those two values in the stage (bf16: one
/// 4-byte word; fp8: two bytes that bf16_pair_of_e4m3 widens).
template <int kWBytes = 2>
QFLASH_HD constexpr int b_offset(int lane, int r, int n0, int ks) {
  return (n0 + group_of(lane)) * kWLd<kWBytes> + (ks * 16 + 2 * pair_of(lane) + 8 * r) * kWBytes;
}

/// Accumulator r (0-3) of a lane's C fragment (16 tokens x 8 weight rows): its token in the
/// m-tile (g, or g + 8 for r = 2, 3) and its weight row in the n-tile (2t, 2t + 1).
QFLASH_HD constexpr int c_token(int lane, int r) { return group_of(lane) + 8 * (r / 2); }
QFLASH_HD constexpr int c_row(int lane, int r) { return 2 * pair_of(lane) + r % 2; }

}  // namespace qflash::kernels::linear_cuda::mma
