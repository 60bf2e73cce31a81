// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 and m16n8k8 ...tf32.tf32.f32 run on the
// host over a warp's registers, for tests of the CUDA tensor-core tiles
// (kernels/linear/mma_tile.hpp, mma_blocks.hpp; kernels/attention/mma_tile.hpp;
// kernels/gated_delta/mma_tile.hpp).
#pragma once

#include <array>
#include <cstdint>

#include "qflash/kernels/common/tf32.hpp"
#include "qflash/numeric/bf16.hpp"

namespace qflash::test {

using Regs4 = std::array<std::uint32_t, 4>;
using Regs2 = std::array<std::uint32_t, 2>;
using Acc = std::array<float, 4>;

inline float bf16_lo(std::uint32_t word) { return to_float(Bf16{static_cast<std::uint16_t>(word & 0xFFFF)}); }
inline float bf16_hi(std::uint32_t word) { return to_float(Bf16{static_cast<std::uint16_t>(word >> 16)}); }

/// C += A B over the warp's accumulator registers (c[r] of lane g * 4 + t is
/// C[g + 8 (r / 2)][2t + r % 2]): each element's products added in k's order.
template <int K>
void accumulate(std::array<Acc, 32>& c, float const (&A)[16][K], float const (&B)[K][8]) {
  float C[16][8];
  for (int lane = 0; lane < 32; ++lane)
    for (int r = 0; r < 4; ++r) C[(lane >> 2) + 8 * (r / 2)][2 * (lane % 4) + r % 2] = c[lane][r];
  for (int i = 0; i < 16; ++i)
    for (int k = 0; k < K; ++k)
      for (int j = 0; j < 8; ++j) C[i][j] += A[i][k] * B[k][j];
  for (int lane = 0; lane < 32; ++lane)
    for (int r = 0; r < 4; ++r) c[lane][r] = C[(lane >> 2) + 8 * (r / 2)][2 * (lane % 4) + r % 2];
}

/// c += a b, each register's values placed where the PTX ISA's fragment tables put them
/// ("Matrix Fragments for mma.m16n8k16 with floating point type"; g = lane >> 2, t = lane % 4):
///   A 16x16: register r holds A[g + 8 (r % 2)][2t + 8 (r / 2) + {0, 1}] (low half first);
///   B 16x8:  register r holds B[2t + 8 r + {0, 1}][g];
///   C 16x8:  c[r] is C[g + 8 (r / 2)][2t + r % 2].
inline void emulate_mma(std::array<Acc, 32>& c, std::array<Regs4, 32> const& a, std::array<Regs2, 32> const& b) {
  float A[16][16], B[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    int const g = lane >> 2, t = lane % 4;
    for (int r = 0; r < 4; ++r) {
      A[g + 8 * (r % 2)][2 * t + 8 * (r / 2)] = bf16_lo(a[lane][r]);
      A[g + 8 * (r % 2)][2 * t + 8 * (r / 2) + 1] = bf16_hi(a[lane][r]);
    }
    for (int r = 0; r < 2; ++r) {
      B[2 * t + 8 * r][g] = bf16_lo(b[lane][r]);
      B[2 * t + 8 * r + 1][g] = bf16_hi(b[lane][r]);
    }
  }
  accumulate<16>(c, A, B);
}

using Floats4 = std::array<float, 4>;
using Floats2 = std::array<float, 2>;

/// c += a b for m16n8k8 with tf32 operands (fp32 registers; the kernels clear their low 13
/// bits, so each product is exact in fp32), placed as the PTX ISA's tables for .tf32 put them
/// (g = lane >> 2, t = lane % 4):
///   A 16x8: register r holds A[g + 8 (r % 2)][t + 4 (r / 2)];
///   B 8x8:  register r holds B[t + 4 r][g];
///   C 16x8: c[r] is C[g + 8 (r / 2)][2t + r % 2].
inline void emulate_mma_tf32(std::array<Acc, 32>& c, std::array<Floats4, 32> const& a,
                             std::array<Floats2, 32> const& b) {
  float A[16][8], B[8][8];
  for (int lane = 0; lane < 32; ++lane) {
    int const g = lane >> 2, t = lane % 4;
    for (int r = 0; r < 4; ++r) A[g + 8 * (r % 2)][t + 4 * (r / 2)] = a[lane][r];
    for (int r = 0; r < 2; ++r) B[t + 4 * r][g] = b[lane][r];
  }
  accumulate<8>(c, A, B);
}

/// c += a b as tf32::mma_3x does: each operand split into its tf32 parts, small products
/// first; b_exact: b's small parts are zero and skipped.
inline void emulate_mma_3xtf32(std::array<Acc, 32>& c, std::array<Floats4, 32> const& a,
                               std::array<Floats2, 32> const& b, bool b_exact = false) {
  std::array<Floats4, 32> a_big{}, a_small{};
  std::array<Floats2, 32> b_big{}, b_small{};
  for (int lane = 0; lane < 32; ++lane) {
    for (int r = 0; r < 4; ++r) {
      auto const s = kernels::tf32::split_tf32(a[lane][r]);
      a_big[lane][r] = s.big, a_small[lane][r] = s.small;
    }
    for (int r = 0; r < 2; ++r) {
      auto const s = kernels::tf32::split_tf32(b[lane][r]);
      b_big[lane][r] = s.big, b_small[lane][r] = s.small;
    }
  }
  emulate_mma_tf32(c, a_small, b_big);
  if (!b_exact) emulate_mma_tf32(c, a_big, b_small);
  emulate_mma_tf32(c, a_big, b_big);
}

}  // namespace qflash::test
