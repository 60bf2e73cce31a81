/// @file
/// The tile geometry of attention's tensor-core path on CUDA (mma.cuh), as host-device code so
/// that tests run it on the host against the PTX ISA's fragment layouts.
///
/// The path computes scores S = Q K^T and outputs O = P V with
/// `mma.sync.m16n8k8.row.col.f32.tf32.tf32.f32`. Queries, keys, values and the softmax weights
/// are fp32; each operand is split into two tf32 parts, big + small, and each product is
/// summed as big*big + big*small + small*big (3xTF32, common/tf32.hpp): a product's error is
/// about 2^-21 of |a| |b|, not bf16's 2^-8. A key or value head stored in bf16 is exact in
/// tf32, so its small part is zero and its products are skipped. An Inf key or value meets a
/// weight's or query's zero small part, so such a row is NaN where the CPU gives Inf.
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
#include "qflash/kernels/common/tf32.hpp"

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

using tf32::a_col;
using tf32::a_row;
using tf32::c_col;
using tf32::c_row;
using tf32::group_of;
using tf32::pair_of;
using tf32::split_tf32;
using tf32::Tf32Pair;

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
