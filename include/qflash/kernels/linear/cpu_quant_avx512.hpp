/// @file
/// AVX-512 VNNI integer dot products of q8_0 / q4_k / q6_k / int4 weight rows with 8-bit
/// activations (the blocks of cpu_quant.hpp), for arch::CpuIsa::kAvx512Vnni and up.
/// `vpdpbusd` sums four u8 x s8 products into an int32 lane in one instruction (AVX2 needs
/// `maddubs` + `madd`), and `vpdpwssd` multiplies int16 pairs by the sub-block scales and adds
/// them in one. A 512-bit register holds two q8_0 blocks, two int4 pairs, or half a q4_k /
/// q6_k block laid against its activations. Within a block every sum is exact int32, so these
/// paths differ from the scalar and AVX2 ones only in the order of the fp32 adds that combine
/// blocks.
///
/// As in cpu_quant.hpp, `dot_avx512<R>` takes R rows against one token (decode) and
/// `dot_tokens_avx512<NT>` one row against NT tokens (prefill), unpacking each weight block
/// once for them (q8_0 also `dot_tile_avx512<R, NT>`); per (row, token) they run the same
/// operations in the same order, so a token's sums do not depend on the tokens beside it.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "qflash/kernels/linear/cpu_quant.hpp"

#if QFLASH_HAS_X86_SIMD
QFLASH_SIMD_BEGIN
namespace qflash::kernels::cpu {

using simd::avx512_halves_epi16;
using simd::avx512_halves_epi32;
using simd::avx512_join;
using simd::avx512_low;

/// Asks for the cache lines of `bytes` at `p` + `ahead` (the same blocks some rows further on)
/// into L2, not L1: a streamed line is used once, and on the 2-core AMX VM of
/// docs/performance.md one-thread q4_k decode read 5-10% more of the bandwidth so
/// (linear_bench). A block's last partial line comes with the next block's first.
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE void prefetch_ahead(void const* p, std::int64_t ahead, std::size_t bytes) {
  auto const* next = static_cast<char const*>(p) + ahead;
  for (std::size_t off = 0; off < bytes; off += 64) _mm_prefetch(next + off, _MM_HINT_T1);
}

/// Fewest bytes the q4_k and int4 row kernels prefetch ahead.
inline constexpr std::int64_t kPrefetchMinBytes = 4096;
/// How far those kernels look ahead when a pass reads rows `group` bytes long in all: whole
/// groups of rows, at least kPrefetchMinBytes. One group is too near for short rows: an
/// expert's down projection (4 rows of 288 bytes in q4_k) read 8.4-9.1 GB/s from memory with
/// one thread, 9.1-10.5 so; int4's 8.1 -> 9.0-9.2 (linear_bench, model-167 VM). q8_0 and q6_k
/// read 2-5% less so and keep one group.
inline std::int64_t prefetch_distance(std::int64_t group) {
  return group * ((kPrefetchMinBytes + group - 1) / group);
}

// ---- q8_0: two blocks per register, eight per step -----------------------------------------
// vpdpbusd multiplies unsigned by signed bytes: the weights' codes go in offset to q + 128 (one
// xor) and each sum starts at minus the offset's share (128 times the activations' sums per
// 4-byte group), so the int32 sums are exact. A register holds blocks b and b + 1 (the last
// one alone when the row has an odd count), their scales d_w d_x spread over its halves.

/// The scales of blocks b..b+7 as floats: two word permutes, no scalar conversions.
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m256 q8_0_scales8(BlockQ8_0 const* b) {
  static_assert(sizeof(BlockQ8_0) == 34);
  auto const* p = reinterpret_cast<char const*>(b);
  // Blocks 0-3's scales sit at bytes 0, 34, 68, 102 of p (words 0, 17, 34, 51 of two
  // registers); blocks 4-7's at the same words from p + 136.
  __m512i const idx = _mm512_zextsi128_si512(_mm_setr_epi16(0, 17, 34, 51, 0, 0, 0, 0));
  __m512i const lo = _mm512_permutex2var_epi16(_mm512_loadu_si512(p), idx, _mm512_loadu_si512(p + 64));
  __m512i const hi = _mm512_permutex2var_epi16(_mm512_loadu_si512(p + 136), idx, _mm512_loadu_si512(p + 200));
  return _mm256_cvtph_ps(_mm_unpacklo_epi64(_mm512_castsi512_si128(lo), _mm512_castsi512_si128(hi)));
}
/// The scales of block b and (when `both`) b + 1 in lanes 0 and 1, zero elsewhere.
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m256 q8_0_scales2(BlockQ8_0 const* b, bool both) {
  return _mm256_setr_ps(avx2_float(b[0].d), both ? avx2_float(b[1].d) : 0.0f, 0, 0, 0, 0, 0, 0);
}

/// The codes of blocks b and b + 1 (or b, then zeros).
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512i q8_0_codes(BlockQ8_0 const* b, bool both) {
  return both ? avx512_join(b[0].qs, b[1].qs) : avx512_low(b[0].qs);
}

/// Pair p of a step (blocks b + 2p and b + 2p + 1, or b + 2p alone) for R rows and NT tokens,
/// with d[r][t] the step's d_w d_x (lane k: block b + k).
template <int R, int NT>
QFLASH_TARGET_AVX512_VNNI QFLASH_SIMD_INLINE void q8_0_pair(__m512 (&acc)[R][NT], BlockQ8_0 const* w,
                                                           std::int64_t stride, BlockQ8_0 const* const* x,
                                                           std::int64_t b, int p, bool both,
                                                           __m256 const (&d)[R][NT]) {
  __m512i const offset = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i const lanes = avx512_halves_epi32(2 * p, 2 * p + 1);
  __m512i xq[NT], start[NT];
  for (int t = 0; t < NT; ++t) {
    xq[t] = q8_0_codes(x[t] + b + 2 * p, both);
    start[t] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, xq[t]));
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    __m512i const wq = _mm512_xor_si512(q8_0_codes(row_at(w, stride, r) + b + 2 * p, both), offset);
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      __m512i const dot = _mm512_dpbusd_epi32(start[t], wq, xq[t]);
      acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                  _mm512_permutexvar_ps(lanes, _mm512_castps256_ps512(d[r][t])), acc[r][t]);
    }
  }
}

/// R rows (`stride` bytes apart) x NT tokens, out[r * NT + t]. Each weight pair is loaded and
/// offset once for the NT tokens, each activation pair once for the R rows; with kStream the
/// same blocks R rows on are prefetched (decode). Per (row, token) the operations and their
/// order do not depend on R or NT, so a token's sums are the same in every tile.
template <int R, int NT, bool kStream = false>
QFLASH_TARGET_AVX512_VNNI void q8_0_tile(BlockQ8_0 const* w, std::int64_t stride, BlockQ8_0 const* const* x,
                                         std::int64_t nb, float* out) {
  __m512 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  __m256 xd[NT], d[R][NT];
  std::int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    for (int t = 0; t < NT; ++t) xd[t] = q8_0_scales8(x[t] + b);
    for (int r = 0; r < R; ++r) {
      BlockQ8_0 const* wb = row_at(w, stride, r) + b;
      if constexpr (kStream) prefetch_ahead(wb, R * stride, 8 * sizeof(BlockQ8_0));
      __m256 const wd = q8_0_scales8(wb);
      for (int t = 0; t < NT; ++t) d[r][t] = _mm256_mul_ps(wd, xd[t]);
    }
    for (int p = 0; p < 4; ++p) q8_0_pair<R, NT>(acc, w, stride, x, b, p, true, d);
  }
  for (; b < nb; b += 2) {
    bool const both = b + 1 < nb;
    for (int t = 0; t < NT; ++t) xd[t] = q8_0_scales2(x[t] + b, both);
    for (int r = 0; r < R; ++r) {
      BlockQ8_0 const* wb = row_at(w, stride, r) + b;
      if constexpr (kStream) prefetch_ahead(wb, R * stride, 2 * sizeof(BlockQ8_0));
      __m256 const wd = q8_0_scales2(wb, both);
      for (int t = 0; t < NT; ++t) d[r][t] = _mm256_mul_ps(wd, xd[t]);
    }
    q8_0_pair<R, NT>(acc, w, stride, x, b, 0, both, d);
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) out[r * NT + t] = _mm512_reduce_add_ps(acc[r][t]);
}

template <int R>
QFLASH_TARGET_AVX512_VNNI void dot_avx512(BlockQ8_0 const* w, std::int64_t stride, BlockQ8_0 const* x,
                                          std::int64_t nb, float* out) {
  BlockQ8_0 const* const xs[1] = {x};
  q8_0_tile<R, 1, true>(w, stride, xs, nb, out);
}

template <int NT>
QFLASH_TARGET_AVX512_VNNI void dot_tokens_avx512(BlockQ8_0 const* w, BlockQ8_0 const* const* x, std::int64_t nb,
                                                 float* out) {
  q8_0_tile<1, NT>(w, 0, x, nb, out);
}

template <int R, int NT>
QFLASH_TARGET_AVX512_VNNI void dot_tile_avx512(BlockQ8_0 const* w, std::int64_t stride, BlockQ8_0 const* const* x,
                                               std::int64_t nb, float* out) {
  q8_0_tile<R, NT>(w, stride, x, nb, out);
}

// ---- q8_0 panels: 16 rows' blocks interleaved, for prefill ---------------------------------
// A panel holds, per block, 8 code registers (register k: bytes 4k..4k+3 of each of the 16
// rows' block, row m in dword m), the rows' scales as fp32, and each row's start: -128 times
// its code sum. A token's 4 code bytes are broadcast, offset to x + 128 (unsigned, one xor),
// and vpdpbusd adds them against a register for 16 rows at once; the start makes each int32
// the exact block sum, which is then added into fp32 as sum * (d_w * d_x) block after block:
// AmxQ8Tiles' arithmetic, so a panel row's sums equal the AMX tiles' bit for bit.

inline constexpr std::int64_t kQ8_0PanelBlockBytes = 8 * 64 + 64 + 64;
inline constexpr std::int64_t kQ8_0PanelScales = 8 * 64, kQ8_0PanelStarts = 8 * 64 + 64;

/// The byte offsets of rows 0..15, `stride` apart: a panel's gather index.
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512i avx512_row_offsets(std::int64_t stride) {
  return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                            _mm512_set1_epi32(static_cast<int>(stride)));
}

/// Blocks [0, nb) of rows [0, 16) (`stride` bytes apart) into `panel` (nb * kQ8_0PanelBlockBytes).
QFLASH_TARGET_AVX512_VNNI inline void q8_0_pack_panel(BlockQ8_0 const* w, std::int64_t stride, std::int64_t nb,
                                                      std::byte* panel) {
  __m512i const rows = avx512_row_offsets(stride);
  __m512i const offset = _mm512_set1_epi8(static_cast<char>(0x80));
  for (std::int64_t b = 0; b < nb; ++b) {
    auto const* block = reinterpret_cast<char const*>(w + b);
    std::byte* out = panel + b * kQ8_0PanelBlockBytes;
    __m512i sum = _mm512_setzero_si512();  // 128 times each row's code sum
    for (int k = 0; k < 8; ++k) {
      __m512i const codes = _mm512_i32gather_epi32(rows, block + offsetof(BlockQ8_0, qs) + 4 * k, 1);
      _mm512_storeu_si512(out + 64 * k, codes);
      sum = _mm512_dpbusd_epi32(sum, offset, codes);
    }
    static_assert(offsetof(BlockQ8_0, d) == 0);
    __m512i const heads = _mm512_i32gather_epi32(rows, block, 1);  // d in each dword's low half
    _mm512_storeu_ps(out + kQ8_0PanelScales, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(heads)));
    _mm512_storeu_si512(out + kQ8_0PanelStarts, _mm512_sub_epi32(_mm512_setzero_si512(), sum));
  }
}

/// A panel's 16 rows against NT q8_0 activation rows x[t]: out[16 t + m].
template <int NT>
QFLASH_TARGET_AVX512_VNNI void q8_0_panel_tokens(std::byte const* panel, BlockQ8_0 const* const* x, std::int64_t nb,
                                                 float* out) {
  __m512i const offset = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (std::int64_t b = 0; b < nb; ++b) {
    std::byte const* pb = panel + b * kQ8_0PanelBlockBytes;
    __m512i sum[NT];
    __m512i const start = _mm512_loadu_si512(pb + kQ8_0PanelStarts);
    for (int t = 0; t < NT; ++t) sum[t] = start;
    for (int k = 0; k < 8; ++k) {
      __m512i const codes = _mm512_loadu_si512(pb + 64 * k);
      for (int t = 0; t < NT; ++t) {
        std::int32_t q;
        std::memcpy(&q, x[t][b].qs + 4 * k, 4);
        sum[t] = _mm512_dpbusd_epi32(sum[t], _mm512_xor_si512(_mm512_set1_epi32(q), offset), codes);
      }
    }
    __m512 const dw = _mm512_loadu_ps(pb + kQ8_0PanelScales);
    for (int t = 0; t < NT; ++t)
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[t]), _mm512_mul_ps(dw, _mm512_set1_ps(avx2_float(x[t][b].d))),
                               acc[t]);
  }
  for (int t = 0; t < NT; ++t) _mm512_storeu_ps(out + 16 * t, acc[t]);
}

// ---- q4_k panels ----------------------------------------------------------------------------
// Per block: 64 code registers (register g: values 4g..4g+3 of each of the 16 rows, as bytes
// 0..15, row m in dword m), the 8 sub-block scales as int32 per row, the 8 mins as int16 pairs
// per row (pair p: sub-blocks 2p, 2p + 1), then d and dmin as fp32. The codes are vpdpbusd's
// unsigned operand and the activations' bytes its signed one, so no offset is needed. Per
// (row, token) the sub-block sums are exact int32, scaled by their integer scales in int32, and
// the mins against the activations' sub-block sums in int32; the block then adds into fp32
// as sum * (d d_x) - mins * (dmin d_x).

inline constexpr std::int64_t kQ4KPanelBlockBytes = 64 * 64 + 8 * 64 + 4 * 64 + 2 * 64;
inline constexpr std::int64_t kQ4KPanelScales = 64 * 64, kQ4KPanelMins = kQ4KPanelScales + 8 * 64,
                              kQ4KPanelD = kQ4KPanelMins + 4 * 64;

/// Byte i of each dword of v, zero-extended.
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512i avx512_byte_epi32(__m512i v, int i) {
  return _mm512_and_si512(_mm512_srli_epi32(v, static_cast<unsigned>(8 * i)), _mm512_set1_epi32(0xff));
}

/// Blocks [0, nb) of rows [0, 16) (`stride` bytes apart) into `panel` (nb * kQ4KPanelBlockBytes),
/// gathered a dword per row: 32 gathers give the 64 code registers (a dword of qs holds 4
/// values' low nibbles and 4 others' high ones), 4 the scales, mins, d and dmin.
QFLASH_TARGET_AVX512_VNNI inline void q4_k_pack_panel(BlockQ4K const* w, std::int64_t stride, std::int64_t nb,
                                                      std::byte* panel) {
  __m512i const rows = avx512_row_offsets(stride);
  __m512i const nibble = _mm512_set1_epi8(0x0f);
  for (std::int64_t b = 0; b < nb; ++b) {
    auto const* block = reinterpret_cast<char const*>(w + b);
    std::byte* out = panel + b * kQ4KPanelBlockBytes;
    // Values 64p + 4i.. sit in the low nibbles of qs dword 8p + i, values 64p + 32 + 4i.. in its high ones.
    for (int p = 0; p < 4; ++p)
      for (int i = 0; i < 8; ++i) {
        __m512i const q = _mm512_i32gather_epi32(rows, block + offsetof(BlockQ4K, qs) + 32 * p + 4 * i, 1);
        _mm512_storeu_si512(out + 64 * (16 * p + i), _mm512_and_si512(q, nibble));
        _mm512_storeu_si512(out + 64 * (16 * p + 8 + i), _mm512_and_si512(_mm512_srli_epi16(q, 4), nibble));
      }
    // gguf::q4_k_scale_min for 16 rows at once, from the 12 packed bytes as 3 dwords.
    __m512i const s0 = _mm512_i32gather_epi32(rows, block + offsetof(BlockQ4K, scales), 1);
    __m512i const s1 = _mm512_i32gather_epi32(rows, block + offsetof(BlockQ4K, scales) + 4, 1);
    __m512i const s2 = _mm512_i32gather_epi32(rows, block + offsetof(BlockQ4K, scales) + 8, 1);
    __m512i const low6 = _mm512_set1_epi32(63), low4 = _mm512_set1_epi32(15);
    __m512i mins_lo = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      __m512i sc, mn;
      if (j < 4) {
        sc = _mm512_and_si512(avx512_byte_epi32(s0, j), low6);
        mn = _mm512_and_si512(avx512_byte_epi32(s1, j), low6);
      } else {
        sc = _mm512_or_si512(_mm512_and_si512(avx512_byte_epi32(s2, j - 4), low4),
                             _mm512_slli_epi32(_mm512_srli_epi32(avx512_byte_epi32(s0, j - 4), 6), 4));
        mn = _mm512_or_si512(_mm512_srli_epi32(avx512_byte_epi32(s2, j - 4), 4),
                             _mm512_slli_epi32(_mm512_srli_epi32(avx512_byte_epi32(s1, j - 4), 6), 4));
      }
      _mm512_storeu_si512(out + kQ4KPanelScales + 64 * j, sc);
      if (j % 2 == 0)
        mins_lo = mn;
      else
        _mm512_storeu_si512(out + kQ4KPanelMins + 64 * (j / 2), _mm512_or_si512(mins_lo, _mm512_slli_epi32(mn, 16)));
    }
    static_assert(offsetof(BlockQ4K, d) == 0 && offsetof(BlockQ4K, dmin) == 2);
    __m512i const heads = _mm512_i32gather_epi32(rows, block, 1);
    _mm512_storeu_ps(out + kQ4KPanelD, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(heads)));
    _mm512_storeu_ps(out + kQ4KPanelD + 64, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(heads, 16))));
  }
}

/// A panel's 16 rows against NT q8_k activation rows x[t]: out[16 t + m].
template <int NT>
QFLASH_TARGET_AVX512_VNNI void q4_k_panel_tokens(std::byte const* panel, BlockQ8K const* const* x, std::int64_t nb,
                                                 float* out) {
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (std::int64_t b = 0; b < nb; ++b) {
    std::byte const* pb = panel + b * kQ4KPanelBlockBytes;
    __m512i sum[NT], min[NT];
    for (int t = 0; t < NT; ++t) sum[t] = min[t] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      __m512i sub[NT];
      for (int t = 0; t < NT; ++t) sub[t] = _mm512_setzero_si512();
      for (int g = 0; g < 8; ++g) {
        __m512i const codes = _mm512_loadu_si512(pb + 64 * (8 * j + g));
        for (int t = 0; t < NT; ++t) {
          std::int32_t q;
          std::memcpy(&q, x[t][b].qs + 32 * j + 4 * g, 4);
          sub[t] = _mm512_dpbusd_epi32(sub[t], codes, _mm512_set1_epi32(q));
        }
      }
      __m512i const sc = _mm512_loadu_si512(pb + kQ4KPanelScales + 64 * j);
      for (int t = 0; t < NT; ++t) sum[t] = _mm512_add_epi32(sum[t], _mm512_mullo_epi32(sub[t], sc));
    }
    for (int p = 0; p < 4; ++p) {
      __m512i const mins = _mm512_loadu_si512(pb + kQ4KPanelMins + 64 * p);
      for (int t = 0; t < NT; ++t) {
        std::int16_t const* bs = x[t][b].bsums + 4 * p;  // sub-block 2p: bs[0] + bs[1]; 2p + 1: bs[2] + bs[3]
        auto const lo = static_cast<std::uint16_t>(bs[0] + bs[1]), hi = static_cast<std::uint16_t>(bs[2] + bs[3]);
        min[t] = _mm512_dpwssd_epi32(min[t], mins, _mm512_set1_epi32(static_cast<std::int32_t>(lo | (std::uint32_t{hi} << 16))));
      }
    }
    __m512 const d = _mm512_loadu_ps(pb + kQ4KPanelD), dmin = _mm512_loadu_ps(pb + kQ4KPanelD + 64);
    for (int t = 0; t < NT; ++t) {
      __m512 const xd = _mm512_set1_ps(x[t][b].d);
      acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(min[t]), _mm512_mul_ps(dmin, xd), acc[t]);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[t]), _mm512_mul_ps(d, xd), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) _mm512_storeu_ps(out + 16 * t, acc[t]);
}

// ---- q4_k: a block's 128 code bytes as two registers -------------------------------------
// Code register h (bytes 64h..64h+64) holds sub-blocks 4h and 4h+2 in its low nibbles and
// 4h+1 and 4h+3 in its high ones; the activations are gathered to match.

/// A q8_k block laid out against q4_k's code registers.
struct Q4KActs {
  __m512i lo[2], hi[2];
};
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE Q4KActs q4_k_acts(BlockQ8K const& x) {
  Q4KActs a;
  for (int h = 0; h < 2; ++h) {
    a.lo[h] = avx512_join(x.qs + 128 * h, x.qs + 128 * h + 64);
    a.hi[h] = avx512_join(x.qs + 128 * h + 32, x.qs + 128 * h + 96);
  }
  return a;
}

/// gguf::q4_k_scale_min for up to four blocks at once, one per 128-bit lane (as
/// avx2_q4_k_scales: each lane's 16 bytes are a block's 12 packed bytes and 4 code bytes): 8
/// scales in bytes 0-7 and 8 mins in bytes 8-15 of each lane.
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512i avx512_q4_k_scales(__m512i w) {
  __m512i const a = _mm512_shuffle_epi32(w, static_cast<_MM_PERM_ENUM>(_MM_SHUFFLE(2, 1, 2, 0)));  // w0 w2 w1 w2
  __m512i const b = _mm512_shuffle_epi32(w, static_cast<_MM_PERM_ENUM>(_MM_SHUFFLE(1, 1, 0, 0)));  // w0 w0 w1 w1
  __m512i const low = _mm512_and_si512(_mm512_srlv_epi32(a, _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0, 0, 4))),
                                       _mm512_broadcast_i32x4(_mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f)));
  __m512i const high = _mm512_slli_epi32(
      _mm512_and_si512(_mm512_srli_epi32(b, 6), _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0x03030303, 0, 0x03030303))), 4);
  return _mm512_or_si512(low, high);
}

/// A shuffle control that makes int16 lanes of byte `lo` of each 128-bit lane (zero-extended)
/// in 128-bit lanes 0-1 and of byte `hi` in lanes 2-3.
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512i avx512_bytes_to_words(int lo, int hi) {
  return avx512_halves_epi16(static_cast<short>(0x8000 | lo), static_cast<short>(0x8000 | hi));
}

/// What a q4_k block's scales and mins contribute: the int16 scale of every code lane per
/// code register and nibble half, and the mins term against the activations' sums.
struct Q4KScales {
  __m512i lo[2], hi[2];
  __m256i min16;  ///< m0 m0 m1 m1 ... m7 m7, against bsums
};
/// From avx512_q4_k_scales's bytes of the block, in every 128-bit lane.
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE Q4KScales q4_k_scales_avx512(__m512i packed) {
  Q4KScales s;
  for (int h = 0; h < 2; ++h) {
    s.lo[h] = _mm512_shuffle_epi8(packed, avx512_bytes_to_words(4 * h, 4 * h + 2));
    s.hi[h] = _mm512_shuffle_epi8(packed, avx512_bytes_to_words(4 * h + 1, 4 * h + 3));
  }
  // words m0 m0 m1 m1 m2 m2 m3 m3 | m4 m4 m5 m5 m6 m6 m7 m7 (bytes 8-15)
  __m256i const mins = _mm256_setr_epi8(8, -128, 8, -128, 9, -128, 9, -128, 10, -128, 10, -128, 11, -128, 11, -128,
                                        12, -128, 12, -128, 13, -128, 13, -128, 14, -128, 14, -128, 15, -128, 15, -128);
  s.min16 = _mm256_shuffle_epi8(_mm512_castsi512_si256(packed), mins);
  return s;
}
/// ... of one block.
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE Q4KScales q4_k_scales_avx512(BlockQ4K const& wb) {
  return q4_k_scales_avx512(
      avx512_q4_k_scales(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<__m128i const*>(wb.scales)))));
}

/// acc - d_x dmin sum_j m_j (bsums[2j] + bsums[2j+1]) + d_x d sum_j s_j (codes_j . x_j), with
/// d_x d and d_x dmin given in every lane.
QFLASH_TARGET_AVX512_VNNI QFLASH_SIMD_INLINE __m512 q4_k_block(__m512 acc, __m512i const* lo, __m512i const* hi,
                                                              Q4KScales const& s, BlockQ8K const& x,
                                                              Q4KActs const& xa, __m512 xd_d, __m512 xd_dmin) {
  __m256i const bs = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(x.bsums));
  __m512 const mins = _mm512_zextps256_ps512(_mm256_cvtepi32_ps(_mm256_madd_epi16(s.min16, bs)));
  acc = _mm512_fnmadd_ps(mins, xd_dmin, acc);
  __m512i dot_lo = _mm512_setzero_si512(), dot_hi = _mm512_setzero_si512();  // two chains in flight
  for (int h = 0; h < 2; ++h) {
    dot_lo = _mm512_dpwssd_epi32(dot_lo, _mm512_maddubs_epi16(lo[h], xa.lo[h]), s.lo[h]);
    dot_hi = _mm512_dpwssd_epi32(dot_hi, _mm512_maddubs_epi16(hi[h], xa.hi[h]), s.hi[h]);
  }
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(dot_lo, dot_hi)), xd_d, acc);
}

/// The low and high nibbles of a q4_k block's two code registers.
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE void q4_k_codes(BlockQ4K const& wb, __m512i* lo, __m512i* hi) {
  __m512i const nibble = _mm512_set1_epi8(0x0f);
  for (int h = 0; h < 2; ++h) {
    __m512i const q = _mm512_loadu_si512(wb.qs + 64 * h);
    lo[h] = _mm512_and_si512(q, nibble);
    hi[h] = _mm512_and_si512(_mm512_srli_epi16(q, 4), nibble);
  }
}

template <int R>
QFLASH_TARGET_AVX512_VNNI void dot_avx512(BlockQ4K const* w, std::int64_t stride, BlockQ8K const* x,
                                          std::int64_t nb, float* out) {
  std::int64_t const ahead = prefetch_distance(R * stride);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (std::int64_t b = 0; b < nb; ++b) {
    Q4KActs const xa = q4_k_acts(x[b]);
    // Four rows' block heads (d, dmin, packed scales) in one register: their scales unpacked
    // and their d and dmin converted at once, then stored. Each row reads its own back by
    // broadcast loads (load ports), where register permutes would add to the shuffle port
    // that unpacking the codes keeps busy.
    alignas(64) __m128i packed_rows[4];  // row r's unpacked scales and mins
    alignas(32) float dd_rows[8];        // x.d d_r at 2r, x.d dmin_r at 2r + 1
    if constexpr (R == 4) {
      static_assert(offsetof(BlockQ4K, scales) == 4);
      __m128i head[4];
      for (int r = 0; r < 4; ++r) head[r] = _mm_loadu_si128(reinterpret_cast<__m128i const*>(row_at(w, stride, r) + b));
      __m512i const heads = _mm512_inserti32x4(
          _mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(head[0]), head[1], 1), head[2], 2), head[3], 3);
      _mm512_store_si512(packed_rows, avx512_q4_k_scales(_mm512_bsrli_epi128(heads, 4)));
      __m512i const d_dmin = _mm512_permutexvar_epi32(_mm512_zextsi128_si512(_mm_setr_epi32(0, 4, 8, 12)), heads);
      _mm256_store_ps(dd_rows, _mm256_mul_ps(_mm256_cvtph_ps(_mm512_castsi512_si128(d_dmin)), _mm256_set1_ps(x[b].d)));
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      BlockQ4K const& wb = row_at(w, stride, r)[b];
      prefetch_ahead(&wb, ahead, sizeof(BlockQ4K));
      __m512i lo[2], hi[2];
      q4_k_codes(wb, lo, hi);
      if constexpr (R == 4) {
        Q4KScales const s = q4_k_scales_avx512(_mm512_broadcast_i32x4(_mm_load_si128(packed_rows + r)));
        acc[r] = q4_k_block(acc[r], lo, hi, s, x[b], xa, _mm512_set1_ps(dd_rows[2 * r]), _mm512_set1_ps(dd_rows[2 * r + 1]));
      } else {
        acc[r] = q4_k_block(acc[r], lo, hi, q4_k_scales_avx512(wb), x[b], xa, _mm512_set1_ps(x[b].d * avx2_float(wb.d)),
                            _mm512_set1_ps(x[b].d * avx2_float(wb.dmin)));
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

template <int NT>
QFLASH_TARGET_AVX512_VNNI void dot_tokens_avx512(BlockQ4K const* w, BlockQ8K const* const* x, std::int64_t nb,
                                                 float* out) {
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (std::int64_t b = 0; b < nb; ++b) {
    BlockQ4K const& wb = w[b];
    __m512i lo[2], hi[2];
    q4_k_codes(wb, lo, hi);
    Q4KScales const s = q4_k_scales_avx512(wb);
    float const d = avx2_float(wb.d), dmin = avx2_float(wb.dmin);
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t)
      acc[t] = q4_k_block(acc[t], lo, hi, s, x[t][b], q4_k_acts(x[t][b]), _mm512_set1_ps(x[t][b].d * d),
                          _mm512_set1_ps(x[t][b].d * dmin));
  }
  for (int t = 0; t < NT; ++t) out[t] = _mm512_reduce_add_ps(acc[t]);
}

// ---- q6_k: register k holds quarter k of each half ------------------------------------------
// Register k = codes of values 32k..32k+32 (sub-blocks 2k, 2k+1) and 128+32k..128+32k+32
// (sub-blocks 8+2k, 9+2k), as unsigned q + 32.

/// Bits 4-5 of the codes whose high bits sit at `shift` in qh.
template <int Shift>
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512i q6_k_high(__m512i qh) {
  return _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, Shift), _mm512_set1_epi8(0x03)), 4);
}

QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE void q6_k_codes(BlockQ6K const& wb, __m512i* codes) {
  __m512i const nibble = _mm512_set1_epi8(0x0f);
  __m512i const l0 = avx512_join(wb.ql, wb.ql + 64);
  __m512i const l1 = avx512_join(wb.ql + 32, wb.ql + 96);
  __m512i const qh = _mm512_loadu_si512(wb.qh);
  codes[0] = _mm512_or_si512(_mm512_and_si512(l0, nibble), q6_k_high<0>(qh));
  codes[1] = _mm512_or_si512(_mm512_and_si512(l1, nibble), q6_k_high<2>(qh));
  codes[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), nibble), q6_k_high<4>(qh));
  codes[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), nibble), q6_k_high<6>(qh));
}

/// A q6_k block's int16 sub-block scales per code lane of each register, and all 16 as int16.
struct Q6KScales {
  __m512i lane[4];
  __m256i all;
};
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE Q6KScales q6_k_scales_avx512(BlockQ6K const& wb) {
  Q6KScales s;
  s.all = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<__m128i const*>(wb.scales)));
  __m512i const all = _mm512_castsi256_si512(s.all);
  for (int k = 0; k < 4; ++k) {
    // int16 lanes 0-7: sub-block 2k, 8-15: 2k+1, 16-23: 8+2k, 24-31: 9+2k
    __m512i const idx = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_setr_m128i(_mm_set1_epi16(static_cast<short>(2 * k)),
                                                 _mm_set1_epi16(static_cast<short>(2 * k + 1)))),
        _mm256_setr_m128i(_mm_set1_epi16(static_cast<short>(8 + 2 * k)), _mm_set1_epi16(static_cast<short>(9 + 2 * k))),
        1);
    s.lane[k] = _mm512_permutexvar_epi16(idx, all);
  }
  return s;
}

QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE void q6_k_acts(BlockQ8K const& x, __m512i* xk) {
  for (int k = 0; k < 4; ++k) xk[k] = avx512_join(x.qs + 32 * k, x.qs + 128 + 32 * k);
}

/// acc + d_x d (sum_g s_g (codes_g . x_g) - 32 sum_g s_g bsums_g): the codes are q + 32.
QFLASH_TARGET_AVX512_VNNI QFLASH_SIMD_INLINE __m512 q6_k_block(__m512 acc, __m512i const* codes, Q6KScales const& s,
                                                              BlockQ8K const& x, __m512i const* xk, float d) {
  __m512i dot = _mm512_setzero_si512();
  for (int k = 0; k < 4; ++k) dot = _mm512_dpwssd_epi32(dot, _mm512_maddubs_epi16(codes[k], xk[k]), s.lane[k]);
  __m256i const bs = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(x.bsums));
  __m512i const offset = _mm512_zextsi256_si512(_mm256_slli_epi32(_mm256_madd_epi16(s.all, bs), 5));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot, offset)), _mm512_set1_ps(x.d * d), acc);
}

template <int R>
QFLASH_TARGET_AVX512_VNNI void dot_avx512(BlockQ6K const* w, std::int64_t stride, BlockQ8K const* x,
                                          std::int64_t nb, float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (std::int64_t b = 0; b < nb; ++b) {
    __m512i xk[4];
    q6_k_acts(x[b], xk);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      BlockQ6K const& wb = row_at(w, stride, r)[b];
      prefetch_ahead(&wb, R * stride, sizeof(BlockQ6K));
      __m512i codes[4];
      q6_k_codes(wb, codes);
      acc[r] = q6_k_block(acc[r], codes, q6_k_scales_avx512(wb), x[b], xk, avx2_float(wb.d));
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

template <int NT>
QFLASH_TARGET_AVX512_VNNI void dot_tokens_avx512(BlockQ6K const* w, BlockQ8K const* const* x, std::int64_t nb,
                                                 float* out) {
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (std::int64_t b = 0; b < nb; ++b) {
    BlockQ6K const& wb = w[b];
    __m512i codes[4];
    q6_k_codes(wb, codes);
    Q6KScales const s = q6_k_scales_avx512(wb);
    float const d = avx2_float(wb.d);
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      __m512i xk[4];
      q6_k_acts(x[t][b], xk);
      acc[t] = q6_k_block(acc[t], codes, s, x[t][b], xk, d);
    }
  }
  for (int t = 0; t < NT; ++t) out[t] = _mm512_reduce_add_ps(acc[t]);
}

// ---- int4: one group of 128 (two activation pairs) per register --------------------------

/// Activation pairs j and j + 1 (or j alone): even and odd values, and per-lane scales.
struct Int4Acts {
  __m512i even, odd;
  __m512 d;
};
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE Int4Acts int4_acts(ActQ8Pair const* x, bool both) {
  if (both)
    return {avx512_join(x[0].even, x[1].even), avx512_join(x[0].odd, x[1].odd),
            _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(x[0].d)), _mm256_loadu_ps(x[1].d), 1)};
  return {avx512_low(x[0].even), avx512_low(x[0].odd), _mm512_zextps256_ps512(_mm256_loadu_ps(x[0].d))};
}

/// Nibbles of a group's codes (or of its first half alone): low = even values, high = odd.
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE void int4_codes(BlockInt4G128 const& g, bool both, __m512i& lo, __m512i& hi) {
  __m512i const q = both ? _mm512_loadu_si512(g.qs) : avx512_low(g.qs);
  __m512i const nibble = _mm512_set1_epi8(0x0f);
  lo = _mm512_and_si512(q, nibble);
  hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), nibble);
}

QFLASH_TARGET_AVX512_VNNI QFLASH_SIMD_INLINE __m512 int4_group(__m512 acc, __m512i lo, __m512i hi, Int4Acts const& xa,
                                                              __m512 scale) {
  __m512i const dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xa.even), hi, xa.odd);
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(xa.d, scale), acc);
}

template <int R>
QFLASH_TARGET_AVX512_VNNI void dot_avx512(BlockInt4G128 const* w, std::int64_t stride, ActQ8Pair const* x,
                                          std::int64_t n_pairs, float* out) {
  std::int64_t const ahead = prefetch_distance(R * stride);
  __m512 acc[R];
  float mins[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
    mins[r] = 0.0f;
  }
  float const* sums = group_sums(x, n_pairs);
  for (std::int64_t j = 0; j < n_pairs; j += 2) {
    bool const both = j + 1 < n_pairs;
    Int4Acts const xa = int4_acts(x + j, both);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      BlockInt4G128 const& g = row_at(w, stride, r)[j / 2];
      prefetch_ahead(&g, ahead, sizeof(BlockInt4G128));
      __m512i lo, hi;
      int4_codes(g, both, lo, hi);
      acc[r] = int4_group(acc[r], lo, hi, xa, _mm512_set1_ps(avx2_float(g.scale)));
      mins[r] = std::fma(avx2_float(g.min), sums[j / 2], mins[r]);  // fused in every kernel alike
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]) + mins[r];
}

template <int NT>
QFLASH_TARGET_AVX512_VNNI void dot_tokens_avx512(BlockInt4G128 const* w, ActQ8Pair const* const* x,
                                                 std::int64_t n_pairs, float* out) {
  __m512 acc[NT];
  float mins[NT];
  for (int t = 0; t < NT; ++t) {
    acc[t] = _mm512_setzero_ps();
    mins[t] = 0.0f;
  }
  for (std::int64_t j = 0; j < n_pairs; j += 2) {
    bool const both = j + 1 < n_pairs;
    BlockInt4G128 const& g = w[j / 2];
    __m512i lo, hi;
    int4_codes(g, both, lo, hi);
    __m512 const scale = _mm512_set1_ps(avx2_float(g.scale));
    float const gm = avx2_float(g.min);
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      acc[t] = int4_group(acc[t], lo, hi, int4_acts(x[t] + j, both), scale);
      mins[t] = std::fma(gm, group_sums(x[t], n_pairs)[j / 2], mins[t]);
    }
  }
  for (int t = 0; t < NT; ++t) out[t] = _mm512_reduce_add_ps(acc[t]) + mins[t];
}

}  // namespace qflash::kernels::cpu
QFLASH_SIMD_END
#endif  // QFLASH_HAS_X86_SIMD
