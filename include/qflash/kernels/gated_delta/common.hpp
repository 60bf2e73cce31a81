/// @file
/// Helpers shared by the Gated DeltaNet ops (causal_conv1d, gated_delta, gated_rmsnorm,
/// gdn_decode): which q/k head a value head reads, the query's scale, argument checks, and a
/// vectorisable fp32 exp / SiLU for the CPU kernels.
///
/// `std::exp` is an opaque libm call that keeps a loop scalar; `exp_nonpositive_f32` is plain
/// arithmetic (Cody-Waite reduction by ln 2 and the Cephes `expf` polynomial), so a loop of it
/// vectorises under whatever target the enclosing function is compiled for. Accuracy: a few
/// ulp (the fp64 references in tests/kernels/* check silu to ~1e-7 relative). NaN propagates.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include "qflash/core/config.hpp"

namespace qflash::kernels::gdn {

/// The q/k head that value head h reads, of n_head_k q/k heads and n_head_v value heads: h / group
/// (group = n_head_v / n_head_k, the checkpoint's order), or h mod n_head_k with tiled value heads
/// (the order llama.cpp's converter stores).
QFLASH_HD constexpr int key_head(int h, int n_head_k, int n_head_v, bool tiled) {
  return tiled ? h % n_head_k : h / (n_head_v / n_head_k);
}
/// The value head j (< group) of those that read q/k head kh; key_head's inverse.
QFLASH_HD constexpr int value_head(int kh, int j, int n_head_k, int n_head_v, bool tiled) {
  return tiled ? kh + j * n_head_k : kh * (n_head_v / n_head_k) + j;
}

/// The factor of an l2-normalized query, 1 / sqrt(d_k), rounded once to fp32 as every kernel
/// uses it.
QFLASH_HD inline float q_scale(int d_k) { return 1.0f / std::sqrt(static_cast<float>(d_k)); }

/// True when the byte ranges [a, a + a_bytes) and [b, b + b_bytes) intersect.
inline bool ranges_overlap(void const* a, std::int64_t a_bytes, void const* b, std::int64_t b_bytes) {
  auto const pa = reinterpret_cast<std::uintptr_t>(a);
  auto const pb = reinterpret_cast<std::uintptr_t>(b);
  return pa < pb + static_cast<std::uintptr_t>(b_bytes) &&
         pb < pa + static_cast<std::uintptr_t>(a_bytes);
}

/// Whether the n values at p are all different (each sequence's own row or state). Sorts a
/// copy, on the stack up to kOnStack values: a warm decode step allocates nothing.
template <class T>
bool distinct(T const* p, int n) {
  constexpr int kOnStack = 256;
  std::array<T, kOnStack> small;
  std::vector<T> large(n > kOnStack ? static_cast<std::size_t>(n) : 0);
  T* const v = n > kOnStack ? large.data() : small.data();
  std::copy(p, p + n, v);
  std::sort(v, v + n);
  return std::adjacent_find(v, v + n) == v + n;
}

/// The lowest argument exp_nonpositive_f32 takes: below it, e^x is e^-87 (~1.6e-38), not the
/// true subnormal or zero. The router on CUDA clamps at it too, so that experts that far below
/// the best tie there as on the CPU.
inline constexpr float kExpFloor = -87.0f;

/// e^x for x <= 0 (larger x: garbage; NaN propagates); x below kExpFloor counts as kExpFloor.
QFLASH_FORCEINLINE float exp_nonpositive_f32(float x) {
  // One clamp only: a second comparison invites jump threading, which copies everything
  // downstream (the silu division included) into each path, and the vectoriser then runs
  // every copy under masks (measured: 3 divisions per vector instead of 1).
  x = x < kExpFloor ? kExpFloor : x;
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kRoundShift = 12582912.0f;  // 1.5 * 2^23: (y + shift) - shift rounds y to an integer
  float const shifted = x * kLog2e + kRoundShift;  // n + 1.5 * 2^23: n in the low mantissa bits
  float const n = shifted - kRoundShift;
  // r = x - n ln2 in two steps (ln2 = C1 + C2, C1 exact in 9 bits) so r keeps full precision.
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  // n is in [-126, 0] after the clamp, so 2^n is a normal float built from its exponent bits.
  // n is read from shifted's bits, not converted from float: for a NaN x that would be
  // undefined; here it is some integer, and p (NaN) makes the result NaN.
  std::uint32_t const n_bits = std::bit_cast<std::uint32_t>(shifted) - std::bit_cast<std::uint32_t>(kRoundShift);
  return p * std::bit_cast<float>((n_bits + 127u) << 23);
}

/// silu(x) = x * sigmoid(x), with sigmoid from e = e^{-|x|} (never overflows):
/// 1 / (1 + e) for x >= 0, e / (1 + e) for x < 0.
QFLASH_FORCEINLINE float silu_f32(float x) {
  float const e = exp_nonpositive_f32(-std::fabs(x));
  float const num = x >= 0.0f ? 1.0f : e;
  return x * (num / (1.0f + e));
}

}  // namespace qflash::kernels::gdn
