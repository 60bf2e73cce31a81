/// @file
/// The tile geometry of attention's tensor-core path on CUDA (mma.cuh), as host-device code so
/// that tests run it on the host against the PTX ISA's fragment layouts.
///
/// The path computes scores S = Q K^T and outputs O = P V with
/// `mma.sync.m16n8k8.row.col.f32.tf32.tf32.f32`. Queries, keys, values and the softmax weights
/// are fp32; each operand is split into two tf32 parts, big + small, and each product is
/// summed as big*big + big*small + small*big (3xTF32): a product's error is about 2^-21 of
/// |a| |b|, not bf16's 2^-8. A key or value head stored in bf16 is exact in tf32, so its
/// small part is zero and its products are skipped.
///
/// A CTA (kThreads) owns kRows query rows of one KV head (a row is one token and one query head
/// of the head's group, as in device.cuh), warp w rows [16 w, 16 w + 16), and walks the keys
/// kKeys at a time. Shared memory holds the rows' queries and a tile of keys and values,
/// decoded to fp32, each row padded to ld = 8 ceil(d / 8) + 4 floats so that the 32 lanes'
/// fragment loads fall in 32 different banks. A warp keeps its scores and its output rows in
/// accumulators: the scores' C fragments are the weights' A fragments once a tile's 8 keys are
/// read in the order 0, 2, 4, 6, 1, 3, 5, 7 (key 2t + j is column t + 4j), so no lane trades
/// values with another; the values' B fragments are read in the same order.
#pragma once

#include <cstdint>

#include "qflash/core/config.hpp"
#include "qflash/numeric/minifloat.hpp"

namespace qflash::kernels::attention_cuda::mma {

inline constexpr int kWarps = 4;
inline constexpr int kThreads = 32 * kWarps;
inline constexpr int kRows = 16 * kWarps;  ///< query rows per CTA
inline constexpr int kWidestHead = 256;  ///< wider heads take the warp-per-row kernel

/// Head widths compiled: a head of d runs in the kernel for the least of these >= d.
constexpr int head_bucket(int d) { return d <= 64 ? 64 : d <= 128 ? 128 : 256; }

/// Keys per tile for a head bucket: kD / 2 accumulators per lane hold a warp's output rows,
/// so the widest heads take fewer keys (fewer registers; and 98 KiB of shared memory a CTA at
/// 256, two CTAs an SM on sm_90).
constexpr int keys_per_tile(int kD) { return kD > 128 ? 16 : 32; }

/// Fewest rows (tokens times the group) for which attention takes this path.
inline constexpr std::int64_t kMinRows = kRows;

/// Floats between rows of a tile in shared memory for heads of d: d rounded up to whole
/// k-steps of 8, plus 4, so that rows 8 apart (and 2 apart) start in different banks.
QFLASH_HD constexpr int row_stride(int d) { return (d + 7) / 8 * 8 + 4; }

/// Floats of shared memory: the CTA's queries, then a tile of keys and one of values.
QFLASH_HD constexpr int smem_floats(int kD, int d) {
  return (kRows + 2 * keys_per_tile(kD)) * row_stride(d);
}

/// x rounded to tf32 (10 mantissa bits), to nearest with ties away from zero, as
/// cvt.rna.tf32.f32 rounds finite values; Inf unchanged, NaN quieted (a NaN in the 19 bits the
/// tensor cores read).
QFLASH_HD constexpr float tf32_round(float x) {
  std::uint32_t const u = qflash::detail::bits_of(x);
  if ((u & 0x7F800000u) == 0x7F800000u)
    return qflash::detail::float_of(u & 0x007FFFFFu ? (u | 0x00400000u) & 0xFFFFE000u : u);
  return qflash::detail::float_of((u + 0x1000u) & 0xFFFFE000u);
}

/// x as big + small, both tf32: big the tf32 nearest x (toward zero where the nearest is past
/// the largest float), small the tf32 nearest x - big (which fp32 holds exactly), so
/// |x - big - small| <= 2^-22 |x| (or 2^-137 for subnormal x). Inf and NaN: big = x (NaN
/// quieted), small = 0. An Inf still meets the other operand's small part, which is 0 where
/// that operand is a tf32 value (a weight of exactly 1, a bf16 key): 0 x Inf makes such a row
/// NaN where the CPU gives Inf (only non-finite cached keys or values do this).
struct Tf32Pair {
  float big, small;
};
QFLASH_HD constexpr Tf32Pair split_tf32(float x) {
  constexpr std::uint32_t kExponent = 0x7F800000u;
  std::uint32_t const u = qflash::detail::bits_of(x);
  if ((u & kExponent) == kExponent) return {tf32_round(x), 0.0f};
  float big = tf32_round(x);
  if ((qflash::detail::bits_of(big) & kExponent) == kExponent) big = qflash::detail::float_of(u & 0xFFFFE000u);
  return {big, tf32_round(x - big)};
}

/// A lane's place in its fragments: group g = lane / 4 and t = lane % 4.
QFLASH_HD constexpr int group_of(int lane) { return lane / 4; }
QFLASH_HD constexpr int pair_of(int lane) { return lane % 4; }

/// Register r (0-3) of a lane's A fragment (16 x 8, row-major): row g, + 8 for odd r; column
/// t, + 4 for r >= 2.
QFLASH_HD constexpr int a_row(int lane, int r) { return group_of(lane) + 8 * (r % 2); }
QFLASH_HD constexpr int a_col(int lane, int r) { return pair_of(lane) + 4 * (r / 2); }

/// Accumulator r (0-3) of a lane's C fragment (16 x 8): row g, + 8 for r >= 2; column 2t + r % 2.
QFLASH_HD constexpr int c_row(int lane, int r) { return group_of(lane) + 8 * (r / 2); }
QFLASH_HD constexpr int c_col(int lane, int r) { return 2 * pair_of(lane) + r % 2; }

/// Offset in floats from the CTA's queries of register r of warp w's A fragment of Q for
/// dimensions [8 ks, 8 ks + 8).
QFLASH_HD constexpr int q_offset(int lane, int r, int w, int ks, int ld) {
  return (16 * w + a_row(lane, r)) * ld + 8 * ks + a_col(lane, r);
}

/// Offset in floats from the key tile of register r (0-1) of the B fragment (8 dimensions x 8
/// keys, B[i][s] = K[s][i]) for keys [8 nt, 8 nt + 8) and dimensions [8 ks, 8 ks + 8): key g,
/// dimension t, + 4 for r = 1.
QFLASH_HD constexpr int k_offset(int lane, int r, int nt, int ks, int ld) {
  return (8 * nt + group_of(lane)) * ld + 8 * ks + pair_of(lane) + 4 * r;
}

/// The score accumulator (of the n-tile of the same 8 keys) that register r of the weights' A
/// fragment takes: row g + 8 (r % 2), key 2t + r / 2.
QFLASH_HD constexpr int p_from_c(int r) { return 2 * (r % 2) + r / 2; }

/// Offset in floats from the value tile of register r (0-1) of the B fragment (8 keys x 8
/// dimensions) for keys [8 kt, 8 kt + 8) and dimensions [8 nt, 8 nt + 8): key 2t + r (the
/// weights' column t + 4 r), dimension g.
QFLASH_HD constexpr int v_offset(int lane, int r, int kt, int nt, int ld) {
  return (8 * kt + 2 * pair_of(lane) + r) * ld + 8 * nt + group_of(lane);
}

}  // namespace qflash::kernels::attention_cuda::mma
