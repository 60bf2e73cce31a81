/// @file
/// Integer dot products of GGUF weight rows with activations quantized to 8-bit blocks, as
/// llama.cpp computes them: q8_0 weights pair with q8_0 activations (blocks of 32), q4_k and
/// q6_k with q8_k (blocks of 256 with sums of 16); int4 (scale * code + min per group of 128)
/// with q8_0 blocks laid out as its nibbles are (ActQ8Pair) and each group's activation sum
/// for the min term. Within a block the sum is exact int32;
/// blocks combine in fp32, so the scalar and AVX2 paths differ only in the order of those
/// fp32 adds. Against fp32 activations the result differs by the activations' rounding:
/// |x - d q| <= d / 2 per value (+ d's own fp16 rounding for q8_0), see act_error_bound.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "qflash/kernels/common/cpu_simd.hpp"
#include "qflash/numeric/gguf_blocks.hpp"
#include "qflash/numeric/int4.hpp"
#include "qflash/numeric/weight_format.hpp"

namespace qflash::kernels::cpu {

using gguf::BlockQ4K;
using gguf::BlockQ6K;
using gguf::BlockQ8_0;
using gguf::BlockQ8K;

/// Activations for int4 rows, per 64 values: two q8_0 blocks of 32 (rounded as
/// gguf::quantize_q8_0_activations; past the row's end, zeros), the even values first and
/// then the odd ones, the order of an int4 byte's low and high nibbles, so that 128-bit half
/// h of `even` and `odd` holds block h; `d` holds block 0's scale 4 times, then block 1's.
/// An int4 activation row is ceil(n / 64) pairs, then one float per group of 128 values:
/// the sum of its d * q, for the groups' min term.
struct ActQ8Pair {
  std::int8_t even[32];  ///< values 0, 2, ..., 62
  std::int8_t odd[32];   ///< values 1, 3, ..., 63
  float d[8];
};
inline constexpr int kPairValues = 64;

/// The blocks activations are quantized to for a weight format's dot products.
enum class ActBlocks : int { kNone = 0, kQ8_0 = 1, kQ8K = 2, kQ8Pairs = 3 };
inline constexpr int kActBlockKinds = 4;

/// Weight rows of a q8_0 / q4_k panel: 16 on AVX-512 VNNI (cpu_quant_avx512.hpp:
/// q8_0_pack_panel), 8 on AVX2 (q8_0_pack_panel8, below).
inline constexpr int kPanelRows = 16;
inline constexpr int kAvx2PanelRows = 8;

constexpr ActBlocks act_blocks(WeightFormat f) {
  switch (f) {
    case WeightFormat::kQ8_0: return ActBlocks::kQ8_0;
    case WeightFormat::kQ4K:
    case WeightFormat::kQ6K: return ActBlocks::kQ8K;
    case WeightFormat::kInt4: return ActBlocks::kQ8Pairs;
    default: return ActBlocks::kNone;
  }
}

/// True for the formats whose rows are multiplied by quantized activations.
constexpr bool uses_quantized_activations(WeightFormat f) { return act_blocks(f) != ActBlocks::kNone; }

/// Activation blocks (q8_0 / q8_k blocks, or pairs) of a row of n values.
constexpr std::int64_t act_row_blocks(ActBlocks k, std::int64_t n) {
  switch (k) {
    case ActBlocks::kQ8_0: return n / gguf::kQ8_0BlockSize;
    case ActBlocks::kQ8K: return n / gguf::kQ4KBlockSize;
    case ActBlocks::kQ8Pairs: return (n + kPairValues - 1) / kPairValues;
    case ActBlocks::kNone: return 0;
  }
  return 0;
}

/// Bytes of one row of n activations quantized to `k` (0 for kNone).
constexpr std::int64_t act_row_bytes(ActBlocks k, std::int64_t n) {
  switch (k) {
    case ActBlocks::kQ8_0: return act_row_blocks(k, n) * std::int64_t{sizeof(BlockQ8_0)};
    case ActBlocks::kQ8K: return act_row_blocks(k, n) * std::int64_t{sizeof(BlockQ8K)};
    case ActBlocks::kQ8Pairs:
      return act_row_blocks(k, n) * std::int64_t{sizeof(ActQ8Pair)} +
             (n + kInt4GroupSize - 1) / kInt4GroupSize * std::int64_t{sizeof(float)};
    case ActBlocks::kNone: return 0;
  }
  return 0;
}
constexpr std::int64_t act_row_bytes(WeightFormat f, std::int64_t n) { return act_row_bytes(act_blocks(f), n); }

/// The group sums after an int4 activation row's n_pairs pairs.
inline float const* group_sums(ActQ8Pair const* x, std::int64_t n_pairs) {
  return reinterpret_cast<float const*>(x + n_pairs);
}

/// Quantizes one row of n activations for int4 rows (ActQ8Pair).
inline void quantize_pair_activations(float const* x, std::int64_t n, std::byte* out) {
  auto* pairs = reinterpret_cast<ActQ8Pair*>(out);
  std::int64_t const n_pairs = act_row_blocks(ActBlocks::kQ8Pairs, n);
  auto* sums = reinterpret_cast<float*>(pairs + n_pairs);
  for (std::int64_t g = 0; g * kInt4GroupSize < n; ++g) sums[g] = 0.0f;
  for (std::int64_t b = 0; b < 2 * n_pairs; ++b) {
    float block[gguf::kQ8_0BlockSize] = {};
    for (std::int64_t i = 0; i < gguf::kQ8_0BlockSize && b * gguf::kQ8_0BlockSize + i < n; ++i)
      block[i] = x[b * gguf::kQ8_0BlockSize + i];
    gguf::BlockQ8_0 const q = gguf::quantize_q8_0_activations(block);
    ActQ8Pair& pair = pairs[b / 2];
    int const half = static_cast<int>(b % 2);
    int sum = 0;
    for (int i = 0; i < gguf::kQ8_0BlockSize; ++i) {
      int const v = 32 * half + i;  // the value's place among the pair's 64
      (v % 2 == 0 ? pair.even : pair.odd)[v / 2] = q.qs[i];
      sum += q.qs[i];
    }
    float const d = to_float(q.d);
    for (int l = 0; l < 4; ++l) pair.d[4 * half + l] = d;
    if (b * gguf::kQ8_0BlockSize < n) sums[b * gguf::kQ8_0BlockSize / kInt4GroupSize] += d * static_cast<float>(sum);
  }
}

/// Quantizes one row of n activations (for kQ8_0 / kQ8K a whole number of blocks) to `k`.
inline void quantize_activations(ActBlocks k, float const* x, std::int64_t n, std::byte* out) {
  if (k == ActBlocks::kQ8_0) {
    auto* blocks = reinterpret_cast<BlockQ8_0*>(out);
    for (std::int64_t b = 0; b < n / gguf::kQ8_0BlockSize; ++b)
      blocks[b] = gguf::quantize_q8_0_activations(x + b * gguf::kQ8_0BlockSize);
  } else if (k == ActBlocks::kQ8K) {
    gguf::quantize_row_q8_k(x, static_cast<std::size_t>(n), reinterpret_cast<BlockQ8K*>(out));
  } else if (k == ActBlocks::kQ8Pairs) {
    quantize_pair_activations(x, n, out);
  }
}

// ---- scalar -------------------------------------------------------------------------------

inline float dot_scalar(BlockQ8_0 const* w, BlockQ8_0 const* x, std::int64_t nb) {
  float sum = 0.0f;
  for (std::int64_t b = 0; b < nb; ++b) {
    int s = 0;
    for (int i = 0; i < gguf::kQ8_0BlockSize; ++i) s += w[b].qs[i] * x[b].qs[i];
    sum += static_cast<float>(s) * (to_float(w[b].d) * to_float(x[b].d));
  }
  return sum;
}

inline float dot_scalar(BlockQ4K const* w, BlockQ8K const* x, std::int64_t nb) {
  float sum = 0.0f;
  for (std::int64_t b = 0; b < nb; ++b) {
    int dot = 0, mins = 0;
    for (int j = 0; j < gguf::kQ4KSubBlocks; ++j) {
      std::uint8_t const* q = w[b].qs + j / 2 * 32;
      int const shift = 4 * (j % 2);
      int s = 0;
      for (int l = 0; l < 32; ++l) s += ((q[l] >> shift) & 0xF) * x[b].qs[32 * j + l];
      gguf::Q4KScaleMin const sm = gguf::q4_k_scale_min(w[b].scales, j);
      dot += sm.scale * s;
      mins += sm.min * (x[b].bsums[2 * j] + x[b].bsums[2 * j + 1]);
    }
    sum += x[b].d * to_float(w[b].d) * static_cast<float>(dot) -
           x[b].d * to_float(w[b].dmin) * static_cast<float>(mins);
  }
  return sum;
}

inline float dot_scalar(BlockQ6K const* w, BlockQ8K const* x, std::int64_t nb) {
  float sum = 0.0f;
  for (std::int64_t b = 0; b < nb; ++b) {
    int dot = 0;
    for (int g = 0; g < gguf::kQ6KSubBlocks; ++g) {
      int s = 0;
      for (int l = 0; l < 16; ++l) s += gguf::q6_k_code(w[b], 16 * g + l) * x[b].qs[16 * g + l];
      dot += w[b].scales[g] * s;
    }
    sum += x[b].d * to_float(w[b].d) * static_cast<float>(dot);
  }
  return sum;
}

/// int4 rows against ActQ8Pair activations: per group, scale * sum(code * d q) + min * sum(d q).
inline float dot_scalar(BlockInt4G128 const* w, ActQ8Pair const* x, std::int64_t n_pairs) {
  float const* sums = group_sums(x, n_pairs);
  float sum = 0.0f, mins = 0.0f;
  for (std::int64_t j = 0; j < n_pairs; ++j) {
    BlockInt4G128 const& g = w[j / 2];
    int block[2] = {0, 0};
    for (int k = 0; k < 32; ++k) {
      int const v = kPairValues * static_cast<int>(j % 2) + 2 * k;
      block[k / 16] += int4_g128_code(g, v) * x[j].even[k] + int4_g128_code(g, v + 1) * x[j].odd[k];
    }
    sum += to_float(g.scale) * (x[j].d[0] * static_cast<float>(block[0]) + x[j].d[4] * static_cast<float>(block[1]));
    if (j % 2 == 1 || j == n_pairs - 1) mins += to_float(g.min) * sums[j / 2];
  }
  return sum + mins;
}

// ---- AVX2 ---------------------------------------------------------------------------------
#if QFLASH_HAS_X86_SIMD
QFLASH_SIMD_BEGIN

/// fp16 -> fp32 with F16C (exact, as to_float).
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE float avx2_float(Fp16 h) { return _cvtsh_ss(h.bits); }

/// 16 pairwise products u8 x s8 summed to int16 pairs (no saturation for |u| <= 63, or
/// |u| <= 127 with |s| <= 127), then pairs of those to int32, each scaled by `scale16`.
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m256i avx2_dot_u8s8(__m256i u, __m256i s, __m256i scale16) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale16);
}

// AVX-VNNI (vpdpwssd, vpdpbusd on ymm registers) folds a multiply-add and the add after it
// into one instruction with the same int32 sums. The kernels below take it as `kVnni` (callers
// choose it by arch::avx_vnni()); the two instructions are written as inline assembly with
// their AVX-VNNI ({vex}) encoding, so the AVX2 kernels need no other target attribute.

/// acc + avx2_dot_u8s8(u, s, scale16).
template <bool kVnni>
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m256i avx2_dot_u8s8_acc(__m256i acc, __m256i u, __m256i s, __m256i scale16) {
  if constexpr (kVnni) {
    __m256i const p16 = _mm256_maddubs_epi16(u, s);
    asm("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(p16), "x"(scale16));
    return acc;
  } else {
    return _mm256_add_epi32(acc, avx2_dot_u8s8(u, s, scale16));
  }
}

/// Each int32 lane: the products u0 x s0 and u1 x s1 (u8 x s8) of its four bytes, summed; for
/// u <= 15 (int4 codes), where the int16 pair sums of the AVX2 form cannot saturate.
template <bool kVnni>
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m256i avx2_dot2_u4s8(__m256i u0, __m256i s0, __m256i u1, __m256i s1) {
  if constexpr (kVnni) {
    __m256i acc = _mm256_setzero_si256();
    asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u0), "x"(s0));
    asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u1), "x"(s1));
    return acc;
  } else {
    __m256i const s16 = _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1));
    return _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
  }
}

/// Asks for the bytes of block `b` of the next R rows (R * stride further on): rows are a
/// few cache lines long, too short for the hardware prefetcher to pick up each new group.
template <int R, class Block>
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE void prefetch_next_rows(Block const* block, std::int64_t stride) {
  auto const* next = reinterpret_cast<char const*>(block) + R * stride;
  for (std::size_t off = 0; off < sizeof(Block); off += 64) _mm_prefetch(next + off, _MM_HINT_T0);
}

/// Row r of blocks `stride` bytes apart, starting at w.
template <class Block>
QFLASH_SIMD_INLINE Block const* row_at(Block const* w, std::int64_t stride, int r) {
  return reinterpret_cast<Block const*>(reinterpret_cast<std::byte const*>(w) + r * stride);
}

/// The AVX2 dot products take R weight rows (`stride` bytes apart) against one activation
/// row and write R sums: each row keeps its own fp32 accumulator vector (independent FMA
/// chains) and shares the activation loads; the next R rows are prefetched meanwhile.
template <int R>
QFLASH_TARGET_AVX2 void dot_avx2(BlockQ8_0 const* w, std::int64_t stride, BlockQ8_0 const* x, std::int64_t nb,
                                 float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  __m256i const ones = _mm256_set1_epi16(1);
  auto row = [&](int r) { return row_at(w, stride, r); };
  for (std::int64_t b = 0; b < nb; ++b) {
    __m256i const xq = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(x[b].qs));
    float const dx = avx2_float(x[b].d);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      BlockQ8_0 const& wb = row(r)[b];
      if (b % 2 == 0) prefetch_next_rows<R>(&wb, stride);
      __m256i const wq = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(wb.qs));
      // u8 x s8 products need one unsigned side: |w| times x with w's sign.
      __m256i const s = avx2_dot_u8s8(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xq, wq), ones);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(avx2_float(wb.d) * dx), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = simd::avx2_reduce_add(acc[r]);
}

/// gguf::q4_k_scale_min for all 8 sub-blocks in registers: 8 scales (bytes 0..7) and 8 mins
/// (bytes 8..15) from the 12 packed bytes, which are read as 16 (the 4 past them are codes).
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m128i avx2_q4_k_scales(std::uint8_t const* packed) {
  __m128i const w = _mm_loadu_si128(reinterpret_cast<__m128i const*>(packed));  // words w0 w1 w2 -
  __m128i const a = _mm_shuffle_epi32(w, _MM_SHUFFLE(2, 1, 2, 0));               // w0 w2 w1 w2
  __m128i const b = _mm_shuffle_epi32(w, _MM_SHUFFLE(1, 1, 0, 0));               // w0 w0 w1 w1
  __m128i const low = _mm_and_si128(_mm_srlv_epi32(a, _mm_setr_epi32(0, 0, 0, 4)),
                                    _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  __m128i const high = _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(b, 6), _mm_setr_epi32(0, 0x03030303, 0, 0x03030303)), 4);
  return _mm_or_si128(low, high);
}

/// Byte masks that broadcast int16 lane j of each 128-bit half to all eight of its lanes.
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m256i avx2_broadcast16_mask(int j) {
  return _mm256_set1_epi16(static_cast<short>((2 * j) | (2 * j + 1) << 8));
}

template <int R, bool kVnni = false>
QFLASH_TARGET_AVX2 void dot_avx2(BlockQ4K const* w, std::int64_t stride, BlockQ8K const* x, std::int64_t nb,
                                 float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  __m256i const nibble = _mm256_set1_epi8(0x0f);
  __m256i const next_mask = _mm256_set1_epi8(2);  // avx2_broadcast16_mask(j) -> (j + 1)
  auto row = [&](int r) { return row_at(w, stride, r); };
  for (std::int64_t b = 0; b < nb; ++b) {
    // bsums[2j] + bsums[2j + 1] in int32 lane j: sub-block j's activation sum, for every row.
    __m256i const x_sums =
        _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(x[b].bsums)), _mm256_set1_epi16(1));
    __m256i scales[R];  // the 8 sub-block scales as int16, in both 128-bit halves
    __m256i dot[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      BlockQ4K const& wb = row(r)[b];
      prefetch_next_rows<R>(&wb, stride);
      __m128i const packed = avx2_q4_k_scales(wb.scales);
      scales[r] = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(packed));
      // mins: m_j * x_sums_j in lane j (each min in the low int16 of its lane, 0 above it; a
      // sum of 32 activations, |sum| <= 4096, is its lane's low int16 too).
      __m256i const m32 = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(packed, packed));
      __m256 const mins = _mm256_cvtepi32_ps(_mm256_madd_epi16(m32, x_sums));
      acc[r] = _mm256_fnmadd_ps(mins, _mm256_set1_ps(x[b].d * avx2_float(wb.dmin)), acc[r]);
      dot[r] = _mm256_setzero_si256();
    }
    __m256i mask_lo = avx2_broadcast16_mask(0);  // built by adds, not loaded per sub-block
#pragma GCC unroll 1
    for (int p = 0; p < 4; ++p) {  // sub-blocks 2p (low nibbles) and 2p + 1 (high nibbles)
      __m256i const x_lo = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(x[b].qs + 64 * p));
      __m256i const x_hi = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(x[b].qs + 64 * p + 32));
      __m256i const mask_hi = _mm256_add_epi8(mask_lo, next_mask);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        __m256i const q = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(row(r)[b].qs + 32 * p));
        __m256i const lo = _mm256_and_si256(q, nibble);
        __m256i const hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), nibble);
        dot[r] = avx2_dot_u8s8_acc<kVnni>(dot[r], lo, x_lo, _mm256_shuffle_epi8(scales[r], mask_lo));
        dot[r] = avx2_dot_u8s8_acc<kVnni>(dot[r], hi, x_hi, _mm256_shuffle_epi8(scales[r], mask_hi));
      }
      mask_lo = _mm256_add_epi8(mask_hi, next_mask);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_set1_ps(x[b].d * avx2_float(row(r)[b].d)), acc[r]);
  }
  for (int r = 0; r < R; ++r) out[r] = simd::avx2_reduce_add(acc[r]);
}

/// Half h of a q6_k block as 4 vectors of unsigned codes q + 32 (0..63): vector k holds
/// values 128h + 32k + l, l = 0..31.
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE void avx2_q6_k_codes(BlockQ6K const& wb, int h, __m256i* codes) {
  __m256i const nibble = _mm256_set1_epi8(0x0f);
  __m256i const two = _mm256_set1_epi8(0x03);
  __m256i const l0 = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(wb.ql + 64 * h));
  __m256i const l1 = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(wb.ql + 64 * h + 32));
  __m256i const qh = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(wb.qh + 32 * h));
  codes[0] = _mm256_or_si256(_mm256_and_si256(l0, nibble), _mm256_slli_epi16(_mm256_and_si256(qh, two), 4));
  codes[1] = _mm256_or_si256(_mm256_and_si256(l1, nibble),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), two), 4));
  codes[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), nibble),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), two), 4));
  codes[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), nibble),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), two), 4));
}

template <int R, bool kVnni = false>
QFLASH_TARGET_AVX2 void dot_avx2(BlockQ6K const* w, std::int64_t stride, BlockQ8K const* x, std::int64_t nb,
                                 float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  auto row = [&](int r) { return row_at(w, stride, r); };
  for (std::int64_t b = 0; b < nb; ++b) {
    __m256i const bs = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(x[b].bsums));
    __m256i dot[R];
    for (int r = 0; r < R; ++r) {
      prefetch_next_rows<R>(&row(r)[b], stride);
      dot[r] = _mm256_setzero_si256();
    }
    for (int h = 0; h < 2; ++h) {
      __m256i xq[4];
      for (int k = 0; k < 4; ++k)
        xq[k] = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(x[b].qs + 128 * h + 32 * k));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        BlockQ6K const& wb = row(r)[b];
        __m256i codes[4];
        avx2_q6_k_codes(wb, h, codes);
        for (int k = 0; k < 4; ++k) {
          int const g = 8 * h + 2 * k;  // the quarter's two sub-blocks of 16
          __m256i const scale = _mm256_setr_m128i(_mm_set1_epi16(wb.scales[g]), _mm_set1_epi16(wb.scales[g + 1]));
          dot[r] = avx2_dot_u8s8_acc<kVnni>(dot[r], codes[k], xq[k], scale);
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      BlockQ6K const& wb = row(r)[b];
      // The codes are q + 32: subtract 32 * scale_g * bsums[g].
      __m256i const sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<__m128i const*>(wb.scales)));
      __m256i const total = _mm256_sub_epi32(dot[r], _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_set1_ps(x[b].d * avx2_float(wb.d)), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = simd::avx2_reduce_add(acc[r]);
}

/// int4: code nibbles as they lie (low = even values, high = odd) against ActQ8Pair
/// activations; the two blocks of a pair stay apart in the two 128-bit halves.
template <int R, bool kVnni = false>
QFLASH_TARGET_AVX2 void dot_avx2(BlockInt4G128 const* w, std::int64_t stride, ActQ8Pair const* x, std::int64_t n_pairs,
                                 float* out) {
  __m256 acc[R];
  float mins[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    mins[r] = 0.0f;
  }
  __m256i const nibble = _mm256_set1_epi8(0x0f);
  float const* sums = group_sums(x, n_pairs);
  auto row = [&](int r) { return row_at(w, stride, r); };
  for (std::int64_t j = 0; j < n_pairs; ++j) {
    __m256i const xe = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(x[j].even));
    __m256i const xo = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(x[j].odd));
    __m256 const dx = _mm256_loadu_ps(x[j].d);
    bool const group_end = j % 2 == 1 || j == n_pairs - 1;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      BlockInt4G128 const& g = row(r)[j / 2];
      if (j % 2 == 0) prefetch_next_rows<R>(&g, stride);
      __m256i const q = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(g.qs + 32 * (j % 2)));
      __m256i const lo = _mm256_and_si256(q, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), nibble);
      __m256 const scale = _mm256_mul_ps(dx, _mm256_set1_ps(avx2_float(g.scale)));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(avx2_dot2_u4s8<kVnni>(lo, xe, hi, xo)), scale, acc[r]);
      if (group_end) mins[r] = std::fma(avx2_float(g.min), sums[j / 2], mins[r]);  // fused in every kernel alike
    }
  }
  for (int r = 0; r < R; ++r) out[r] = simd::avx2_reduce_add(acc[r]) + mins[r];
}

// ---- AVX2, several tokens per weight row (prefill) --------------------------------------
// One weight row (q8_0: R rows) against NT activation rows: each weight block is unpacked
// once (codes, scales, signs) and multiplied into the NT tokens. Per (row, token) the
// operations and their order are dot_avx2's, so a token's result does not depend on how
// many share its call.

/// R rows (`stride` bytes apart) x NT tokens of q8_0, out[r * NT + t]: each weight block is
/// loaded and its signs taken once for the NT tokens, each activation block loaded and its
/// scale widened once for the R rows.
template <int R, int NT>
QFLASH_TARGET_AVX2 void dot_tile_avx2(BlockQ8_0 const* w, std::int64_t stride, BlockQ8_0 const* const* x,
                                      std::int64_t nb, float* out) {
  __m256 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  __m256i const ones = _mm256_set1_epi16(1);
  for (std::int64_t b = 0; b < nb; ++b) {
    __m256i wq[R], w_abs[R];
    __m256 dw[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      BlockQ8_0 const& wb = row_at(w, stride, r)[b];
      wq[r] = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(wb.qs));
      w_abs[r] = _mm256_sign_epi8(wq[r], wq[r]);
      dw[r] = _mm256_set1_ps(avx2_float(wb.d));
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      __m256i const xq = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(x[t][b].qs));
      __m256 const dx = _mm256_set1_ps(avx2_float(x[t][b].d));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        __m256i const s = avx2_dot_u8s8(w_abs[r], _mm256_sign_epi8(xq, wq[r]), ones);
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw[r], dx), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) out[r * NT + t] = simd::avx2_reduce_add(acc[r][t]);
}

template <int NT>
QFLASH_TARGET_AVX2 void dot_tokens_avx2(BlockQ8_0 const* w, BlockQ8_0 const* const* x, std::int64_t nb, float* out) {
  dot_tile_avx2<1, NT>(w, 0, x, nb, out);
}

/// dot_tile_avx2 with AVX-VNNI: vpdpbusd multiplies unsigned by signed bytes, so the weights
/// go in offset to w + 128 (one xor per row) and each block's sum starts at -128 times the
/// activations' sum (one vpdpbusd per token): the same exact int32 sums as the sign trick with
/// one instruction for the products (instead of two signs, vpmaddubsw and vpmaddwd), then the
/// same fp32 steps, so the results equal dot_tile_avx2's bit for bit. With kStream the blocks
/// R rows on are prefetched (decode, as dot_avx2).
template <int R, int NT, bool kStream = false>
QFLASH_TARGET_AVX_VNNI void dot_tile_avx_vnni(BlockQ8_0 const* w, std::int64_t stride, BlockQ8_0 const* const* x,
                                              std::int64_t nb, float* out) {
  __m256 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  __m256i const offset = _mm256_set1_epi8(static_cast<char>(0x80));
  for (std::int64_t b = 0; b < nb; ++b) {
    __m256i wq[R];
    __m256 dw[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      BlockQ8_0 const& wb = row_at(w, stride, r)[b];
      if constexpr (kStream)
        if (b % 2 == 0) prefetch_next_rows<R>(&wb, stride);
      wq[r] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(wb.qs)), offset);
      dw[r] = _mm256_set1_ps(avx2_float(wb.d));
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      __m256i const xq = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(x[t][b].qs));
      __m256 const dx = _mm256_set1_ps(avx2_float(x[t][b].d));
      __m256i const start =
          _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), offset, xq));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        __m256i const s = _mm256_dpbusd_avx_epi32(start, wq[r], xq);
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw[r], dx), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) out[r * NT + t] = simd::avx2_reduce_add(acc[r][t]);
}

template <int NT, bool kVnni = false>
QFLASH_TARGET_AVX2 void dot_tokens_avx2(BlockQ4K const* w, BlockQ8K const* const* x, std::int64_t nb, float* out) {
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  __m256i const nibble = _mm256_set1_epi8(0x0f);
  for (std::int64_t b = 0; b < nb; ++b) {
    BlockQ4K const& wb = w[b];
    __m128i const packed = avx2_q4_k_scales(wb.scales);
    __m256i const scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(packed));
    __m128i const m8 = _mm_unpackhi_epi64(packed, packed);
    __m256i const m16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
    float const d = avx2_float(wb.d), dmin = avx2_float(wb.dmin);
    __m256i dot[NT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      __m256i const bs = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(x[t][b].bsums));
      __m256 const mins = _mm256_cvtepi32_ps(_mm256_madd_epi16(m16, bs));
      acc[t] = _mm256_fnmadd_ps(mins, _mm256_set1_ps(x[t][b].d * dmin), acc[t]);
      dot[t] = _mm256_setzero_si256();
    }
#pragma GCC unroll 1
    for (int p = 0; p < 4; ++p) {
      __m256i const q = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(wb.qs + 32 * p));
      __m256i const lo = _mm256_and_si256(q, nibble);
      __m256i const hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), nibble);
      __m256i const scale_lo = _mm256_shuffle_epi8(scales, avx2_broadcast16_mask(2 * p));
      __m256i const scale_hi = _mm256_shuffle_epi8(scales, avx2_broadcast16_mask(2 * p + 1));
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) {
        __m256i const x_lo = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(x[t][b].qs + 64 * p));
        __m256i const x_hi = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(x[t][b].qs + 64 * p + 32));
        dot[t] = avx2_dot_u8s8_acc<kVnni>(dot[t], lo, x_lo, scale_lo);
        dot[t] = avx2_dot_u8s8_acc<kVnni>(dot[t], hi, x_hi, scale_hi);
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t)
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t]), _mm256_set1_ps(x[t][b].d * d), acc[t]);
  }
  for (int t = 0; t < NT; ++t) out[t] = simd::avx2_reduce_add(acc[t]);
}

template <int NT, bool kVnni = false>
QFLASH_TARGET_AVX2 void dot_tokens_avx2(BlockQ6K const* w, BlockQ8K const* const* x, std::int64_t nb, float* out) {
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  for (std::int64_t b = 0; b < nb; ++b) {
    BlockQ6K const& wb = w[b];
    __m256i dot[NT];
    for (int t = 0; t < NT; ++t) dot[t] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      __m256i codes[4];
      avx2_q6_k_codes(wb, h, codes);
      for (int k = 0; k < 4; ++k) {
        int const g = 8 * h + 2 * k;
        __m256i const scale = _mm256_setr_m128i(_mm_set1_epi16(wb.scales[g]), _mm_set1_epi16(wb.scales[g + 1]));
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) {
          __m256i const xq = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(x[t][b].qs + 128 * h + 32 * k));
          dot[t] = avx2_dot_u8s8_acc<kVnni>(dot[t], codes[k], xq, scale);
        }
      }
    }
    __m256i const sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<__m128i const*>(wb.scales)));
    float const d = avx2_float(wb.d);
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      __m256i const bs = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(x[t][b].bsums));
      __m256i const total = _mm256_sub_epi32(dot[t], _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_set1_ps(x[t][b].d * d), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) out[t] = simd::avx2_reduce_add(acc[t]);
}

template <int NT, bool kVnni = false>
QFLASH_TARGET_AVX2 void dot_tokens_avx2(BlockInt4G128 const* w, ActQ8Pair const* const* x, std::int64_t n_pairs,
                                        float* out) {
  __m256 acc[NT];
  float mins[NT];
  for (int t = 0; t < NT; ++t) {
    acc[t] = _mm256_setzero_ps();
    mins[t] = 0.0f;
  }
  __m256i const nibble = _mm256_set1_epi8(0x0f);
  for (std::int64_t j = 0; j < n_pairs; ++j) {
    BlockInt4G128 const& g = w[j / 2];
    __m256i const q = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(g.qs + 32 * (j % 2)));
    __m256i const lo = _mm256_and_si256(q, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), nibble);
    __m256 const gs = _mm256_set1_ps(avx2_float(g.scale));
    bool const group_end = j % 2 == 1 || j == n_pairs - 1;
    float const gm = avx2_float(g.min);
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      ActQ8Pair const& a = x[t][j];
      __m256i const s32 =
          avx2_dot2_u4s8<kVnni>(lo, _mm256_loadu_si256(reinterpret_cast<__m256i const*>(a.even)), hi,
                                _mm256_loadu_si256(reinterpret_cast<__m256i const*>(a.odd)));
      __m256 const scale = _mm256_mul_ps(_mm256_loadu_ps(a.d), gs);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), scale, acc[t]);
      if (group_end) mins[t] = std::fma(gm, group_sums(x[t], n_pairs)[j / 2], mins[t]);
    }
  }
  for (int t = 0; t < NT; ++t) out[t] = simd::avx2_reduce_add(acc[t]) + mins[t];
}

// ---- AVX2 panels: 8 rows' blocks interleaved, for prefill ----------------------------------
// cpu_quant_avx512.hpp's 16-row panels at AVX2's width: register k of a block holds bytes
// 4k..4k+3 of each of the 8 rows (row m in dword m), so one broadcast of a token's 4 bytes
// meets 8 rows at once and a block ends in one int32 per row: one conversion and one fp32
// multiply-add per 8 rows instead of per row, and no horizontal sums.

/// Within each 128-bit half: dword k of each of r[0..3] into r[k] (two 4 x 4 transposes).
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE void avx2_transpose4_epi32(__m256i* r) {
  __m256i const t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
  __m256i const t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
  r[0] = _mm256_unpacklo_epi64(t0, t2);
  r[1] = _mm256_unpackhi_epi64(t0, t2);
  r[2] = _mm256_unpacklo_epi64(t1, t3);
  r[3] = _mm256_unpackhi_epi64(t1, t3);
}

/// Dword k of each of r[0..7] into r[k] (an 8 x 8 transpose of dwords).
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE void avx2_transpose8_epi32(__m256i* r) {
  avx2_transpose4_epi32(r);
  avx2_transpose4_epi32(r + 4);
  for (int k = 0; k < 4; ++k) {
    __m256i const lo = r[k], hi = r[k + 4];
    r[k] = _mm256_permute2x128_si256(lo, hi, 0x20);
    r[k + 4] = _mm256_permute2x128_si256(lo, hi, 0x31);
  }
}

/// The 8 rows' fp16 scales at `offset` in their blocks, as fp32.
template <class Block>
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m256 avx2_panel_scales(Block const* w, std::int64_t stride, std::int64_t b,
                                                               std::size_t offset) {
  alignas(16) std::uint16_t h[8];
  for (int m = 0; m < 8; ++m)
    std::memcpy(&h[m], reinterpret_cast<char const*>(row_at(w, stride, m) + b) + offset, sizeof h[m]);
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<__m128i const*>(h)));
}

/// Loads the 32 bytes at `offset` in block b of each of the 8 rows and transposes them.
template <class Block>
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE void avx2_panel_load(Block const* w, std::int64_t stride, std::int64_t b,
                                                           std::size_t offset, __m256i* r) {
  for (int m = 0; m < 8; ++m)
    r[m] = _mm256_loadu_si256(
        reinterpret_cast<__m256i const*>(reinterpret_cast<char const*>(row_at(w, stride, m) + b) + offset));
  avx2_transpose8_epi32(r);
}

// q8_0, per block: the 8 code registers, the same with each byte's magnitude (the sign
// trick's unsigned operand: |w| x sign(x, w) = w x), then the rows' scales as fp32. Per
// (row, token) the block's sum is exact int32 and adds into fp32 as sum * (d_w d_x).
inline constexpr std::int64_t kQ8_0Panel8BlockBytes = 8 * 32 + 8 * 32 + 32;
inline constexpr std::int64_t kQ8_0Panel8Magnitudes = 8 * 32, kQ8_0Panel8Scales = 16 * 32;

/// Blocks [0, nb) of rows [0, 8) (`stride` bytes apart) into `panel` (nb * kQ8_0Panel8BlockBytes).
QFLASH_TARGET_AVX2 inline void q8_0_pack_panel8(BlockQ8_0 const* w, std::int64_t stride, std::int64_t nb,
                                                std::byte* panel) {
  for (std::int64_t b = 0; b < nb; ++b) {
    std::byte* out = panel + b * kQ8_0Panel8BlockBytes;
    __m256i r[8];
    avx2_panel_load(w, stride, b, offsetof(BlockQ8_0, qs), r);
    for (int k = 0; k < 8; ++k) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * k), r[k]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + kQ8_0Panel8Magnitudes + 32 * k),
                          _mm256_sign_epi8(r[k], r[k]));
    }
    _mm256_storeu_ps(reinterpret_cast<float*>(out + kQ8_0Panel8Scales),
                     avx2_panel_scales(w, stride, b, offsetof(BlockQ8_0, d)));
  }
}

/// A panel's 8 rows against NT q8_0 activation rows x[t]: out[8 t + m].
template <int NT>
QFLASH_TARGET_AVX2 void q8_0_panel8_tokens(std::byte const* panel, BlockQ8_0 const* const* x, std::int64_t nb,
                                           float* out) {
  __m256i const ones = _mm256_set1_epi16(1);
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  for (std::int64_t b = 0; b < nb; ++b) {
    std::byte const* pb = panel + b * kQ8_0Panel8BlockBytes;
    __m256i sum[NT];
    for (int t = 0; t < NT; ++t) sum[t] = _mm256_setzero_si256();
#pragma GCC unroll 1  // unrolled, GCC keeps every product for a tree of adds and spills them
    for (int k = 0; k < 8; ++k) {
      __m256i const codes = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(pb + 32 * k));
      __m256i const magnitudes =
          _mm256_loadu_si256(reinterpret_cast<__m256i const*>(pb + kQ8_0Panel8Magnitudes + 32 * k));
      for (int t = 0; t < NT; ++t) {
        std::int32_t q;
        std::memcpy(&q, x[t][b].qs + 4 * k, 4);
        __m256i const signed_x = _mm256_sign_epi8(_mm256_set1_epi32(q), codes);
        sum[t] = _mm256_add_epi32(sum[t], avx2_dot_u8s8(magnitudes, signed_x, ones));
      }
    }
    __m256 const dw = _mm256_loadu_ps(reinterpret_cast<float const*>(pb + kQ8_0Panel8Scales));
    for (int t = 0; t < NT; ++t)
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t]), _mm256_mul_ps(dw, _mm256_set1_ps(avx2_float(x[t][b].d))),
                               acc[t]);
  }
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(out + 8 * t, acc[t]);
}

// q4_k, per block: 64 code registers (register 8j + g: values 4g..4g+3 of sub-block j, as
// bytes 0..15), the 8 sub-block scales per row as an int16 pair (s, s), the 8 mins as int16
// pairs per row (pair p: sub-blocks 2p, 2p + 1), then d and dmin as fp32. A sub-block's
// products (codes <= 15, |x| <= 128) sum in int16 without saturating (16 x 15 x 128 <= 32767
// per lane), one vpmaddwd scales them into int32; the block then adds into fp32 as
// sum * (d d_x) - mins * (dmin d_x), as the 16-row panels do.
inline constexpr std::int64_t kQ4KPanel8BlockBytes = 64 * 32 + 8 * 32 + 4 * 32 + 2 * 32;
inline constexpr std::int64_t kQ4KPanel8Scales = 64 * 32, kQ4KPanel8Mins = kQ4KPanel8Scales + 8 * 32,
                              kQ4KPanel8D = kQ4KPanel8Mins + 4 * 32;

/// Blocks [0, nb) of rows [0, 8) (`stride` bytes apart) into `panel` (nb * kQ4KPanel8BlockBytes).
QFLASH_TARGET_AVX2 inline void q4_k_pack_panel8(BlockQ4K const* w, std::int64_t stride, std::int64_t nb,
                                                std::byte* panel) {
  __m256i const nibble = _mm256_set1_epi8(0x0f);
  for (std::int64_t b = 0; b < nb; ++b) {
    std::byte* out = panel + b * kQ4KPanel8BlockBytes;
    // Values 64p + 4i.. sit in the low nibbles of qs dword 8p + i, values 64p + 32 + 4i.. in its high ones.
    for (int p = 0; p < 4; ++p) {
      __m256i r[8];
      avx2_panel_load(w, stride, b, offsetof(BlockQ4K, qs) + 32 * p, r);
      for (int i = 0; i < 8; ++i) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * (16 * p + i)), _mm256_and_si256(r[i], nibble));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * (16 * p + 8 + i)),
                            _mm256_and_si256(_mm256_srli_epi16(r[i], 4), nibble));
      }
    }
    // Each row's scales and mins as int16 pairs (pair p: sub-blocks 2p, 2p + 1), rows k and
    // k + 4 in the halves of register k, transposed to pair p of every row in register p.
    __m256i scales[4], mins[4];
    for (int k = 0; k < 4; ++k) {
      __m128i const lo = avx2_q4_k_scales(row_at(w, stride, k)[b].scales);
      __m128i const hi = avx2_q4_k_scales(row_at(w, stride, k + 4)[b].scales);
      scales[k] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi64(lo, hi));
      mins[k] = _mm256_cvtepu8_epi16(_mm_unpackhi_epi64(lo, hi));
    }
    avx2_transpose4_epi32(scales);
    avx2_transpose4_epi32(mins);
    for (int p = 0; p < 4; ++p) {
      auto* sc = reinterpret_cast<__m256i*>(out + kQ4KPanel8Scales + 64 * p);
      _mm256_storeu_si256(sc, _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(scales[p], 0xa0), 0xa0));  // (s_2p, s_2p)
      _mm256_storeu_si256(sc + 1, _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(scales[p], 0xf5), 0xf5));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + kQ4KPanel8Mins + 32 * p), mins[p]);
    }
    _mm256_storeu_ps(reinterpret_cast<float*>(out + kQ4KPanel8D),
                     avx2_panel_scales(w, stride, b, offsetof(BlockQ4K, d)));
    _mm256_storeu_ps(reinterpret_cast<float*>(out + kQ4KPanel8D + 32),
                     avx2_panel_scales(w, stride, b, offsetof(BlockQ4K, dmin)));
  }
}

/// A panel's 8 rows against NT q8_k activation rows x[t]: out[8 t + m].
template <int NT>
QFLASH_TARGET_AVX2 void q4_k_panel8_tokens(std::byte const* panel, BlockQ8K const* const* x, std::int64_t nb,
                                           float* out) {
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  for (std::int64_t b = 0; b < nb; ++b) {
    std::byte const* pb = panel + b * kQ4KPanel8BlockBytes;
    __m256i sum[NT];
    for (int t = 0; t < NT; ++t) sum[t] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      __m256i sub[NT];
      for (int t = 0; t < NT; ++t) sub[t] = _mm256_setzero_si256();
#pragma GCC unroll 1  // as in q8_0_panel8_tokens
      for (int g = 0; g < 8; ++g) {
        __m256i const codes = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(pb + 32 * (8 * j + g)));
        for (int t = 0; t < NT; ++t) {
          std::int32_t q;
          std::memcpy(&q, x[t][b].qs + 32 * j + 4 * g, 4);
          sub[t] = _mm256_add_epi16(sub[t], _mm256_maddubs_epi16(codes, _mm256_set1_epi32(q)));
        }
      }
      __m256i const sc = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(pb + kQ4KPanel8Scales + 32 * j));
      for (int t = 0; t < NT; ++t) sum[t] = _mm256_add_epi32(sum[t], _mm256_madd_epi16(sub[t], sc));
    }
    __m256i min[NT];
    for (int t = 0; t < NT; ++t) min[t] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      __m256i const mins = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(pb + kQ4KPanel8Mins + 32 * p));
      for (int t = 0; t < NT; ++t) {
        std::int16_t const* bs = x[t][b].bsums + 4 * p;  // sub-block 2p: bs[0] + bs[1]; 2p + 1: bs[2] + bs[3]
        auto const lo = static_cast<std::uint16_t>(bs[0] + bs[1]), hi = static_cast<std::uint16_t>(bs[2] + bs[3]);
        __m256i const pair = _mm256_set1_epi32(static_cast<std::int32_t>(lo | (std::uint32_t{hi} << 16)));
        min[t] = _mm256_add_epi32(min[t], _mm256_madd_epi16(mins, pair));
      }
    }
    __m256 const d = _mm256_loadu_ps(reinterpret_cast<float const*>(pb + kQ4KPanel8D));
    __m256 const dmin = _mm256_loadu_ps(reinterpret_cast<float const*>(pb + kQ4KPanel8D + 32));
    for (int t = 0; t < NT; ++t) {
      __m256 const xd = _mm256_set1_ps(x[t][b].d);
      acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(min[t]), _mm256_mul_ps(dmin, xd), acc[t]);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t]), _mm256_mul_ps(d, xd), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(out + 8 * t, acc[t]);
}

QFLASH_SIMD_END
#endif  // QFLASH_HAS_X86_SIMD

}  // namespace qflash::kernels::cpu
