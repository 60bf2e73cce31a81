/// @file
/// fp32 products on tf32 tensor cores (mma.sync.m16n8k8 .tf32), as host-device code so that
/// tests run the kernels' tiles on the host: the split of an fp32 value into two tf32 parts
/// (3xTF32: each product summed as big*big + big*small + small*big, about 2^-21 of |a| |b|
/// rather than tf32's 2^-11), and where the PTX ISA's fragment tables put a lane's registers.
/// Used by attention's prefill (attention/mma_tile.hpp) and the gated delta rule's chunked
/// state (gated_delta/mma_tile.hpp); mma_tf32.cuh issues the instruction.
#pragma once

#include <cstdint>

#include "qflash/core/config.hpp"
#include "qflash/numeric/minifloat.hpp"

namespace qflash::kernels::tf32 {

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
/// that operand is a tf32 value: 0 x Inf then makes the sum NaN where fp32 gives Inf.
/// Selects, not branches: the kernels split every fragment value, about 14 instructions each.
struct Tf32Pair {
  float big, small;
};
QFLASH_HD constexpr Tf32Pair split_tf32(float x) {
  constexpr std::uint32_t kExponent = 0x7F800000u, kTf32 = 0xFFFFE000u;
  std::uint32_t const u = qflash::detail::bits_of(x);
  std::uint32_t const magnitude = u & 0x7FFFFFFFu;
  // Rounded in magnitude, so that no NaN carries into the sign; past the largest float (an
  // overflow, Inf or NaN) the magnitude is cut to tf32 instead, and a NaN keeps its quiet bit.
  std::uint32_t const rounded = (magnitude + 0x1000u) & kTf32;
  std::uint32_t const big_magnitude =
      rounded < kExponent ? rounded : (magnitude & kTf32) | (magnitude > kExponent ? 0x00400000u : 0u);
  float const big = qflash::detail::float_of((u & 0x80000000u) | big_magnitude);
  float const rest = magnitude < kExponent ? x - big : 0.0f;  // finite, so rounded without overflow
  return {big, qflash::detail::float_of((qflash::detail::bits_of(rest) + 0x1000u) & kTf32)};
}

/// A lane's place in its fragments: group g = lane / 4 and t = lane % 4.
QFLASH_HD constexpr int group_of(int lane) { return lane / 4; }
QFLASH_HD constexpr int pair_of(int lane) { return lane % 4; }

/// Register r (0-3) of a lane's A fragment (16 x 8, row-major): row g, + 8 for odd r; column
/// t, + 4 for r >= 2.
QFLASH_HD constexpr int a_row(int lane, int r) { return group_of(lane) + 8 * (r % 2); }
QFLASH_HD constexpr int a_col(int lane, int r) { return pair_of(lane) + 4 * (r / 2); }

/// Register r (0-1) of a lane's B fragment (8 x 8): row (k) t, + 4 for r = 1; column g.
QFLASH_HD constexpr int b_row(int lane, int r) { return pair_of(lane) + 4 * r; }
QFLASH_HD constexpr int b_col(int lane) { return group_of(lane); }

/// Accumulator r (0-3) of a lane's C fragment (16 x 8): row g, + 8 for r >= 2; column 2t + r % 2.
QFLASH_HD constexpr int c_row(int lane, int r) { return group_of(lane) + 8 * (r / 2); }
QFLASH_HD constexpr int c_col(int lane, int r) { return 2 * pair_of(lane) + r % 2; }

}  // namespace qflash::kernels::tf32
