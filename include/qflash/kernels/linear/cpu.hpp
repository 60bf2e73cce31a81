/// @file
/// CPU kernels/linear. Threads take blocks of output rows; within a block, tokens go in
/// blocks whose activations stay in L2, so each weight row comes from memory once per call
/// whatever the token count (prefill reads the weights once, not once per few tokens).
/// - f32, bf16, f16: read in place; micro-tiles of 4 rows x 3 tokens (AVX2) or 4 x 4
///   (AVX-512), every weight load shared by the tile's tokens and every activation load by its
///   rows. Weights are widened exactly (bf16 by a shift: no AVX512_BF16 `vdpbf16ps`, which would
///   round the activations to bf16).
/// - q8_0, q4_k, q6_k, int4: activations quantized once per call to 8-bit blocks (q8_0 /
///   q8_k as llama.cpp does; q8_0 pairs for int4), then integer dot products per block
///   (cpu_quant.hpp: AVX2; cpu_quant_avx512.hpp: AVX-512 VNNI): a few rows per pass for one
///   token, 4 tokens per pass through a row for several (two rows for q8_0).
/// - bf16, q8_0, q4_k, q6_k and int4 with AMX (kAmx), at least kAmxMinTokens tokens and
///   kAmxMinRows rows, and whole 32-column chunks: AMX-BF16 tiles over the activations split into exact bf16 terms,
///   AMX-INT8 tiles over their 8-bit blocks (cpu_amx.hpp); rows past the last 16 as above.
/// - fp8_e4m3: under kFp8FusedMaxTokens tokens, converted in registers and multiplied at once
///   (fp8_tile_*); from it on, rows decoded to fp32 in registers (exactly as dequantize_row),
///   once per call, then the float tiles for every token.
/// Integer dot products take AVX-512 from kAvx512Vnni up (AVX2 below it, with AVX-VNNI's
/// vpdpbusd / vpdpwssd when the CPU has it: arch::avx_vnni()), float tiles from kAvx512;
/// without AVX2, scalar code.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <type_traits>
#include <vector>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/core/parallel.hpp"
#include "qflash/kernels/common/cpu_simd.hpp"
#include "qflash/kernels/linear/cpu_amx.hpp"
#include "qflash/kernels/linear/cpu_quant.hpp"
#include "qflash/kernels/linear/cpu_quant_avx512.hpp"
#include "qflash/kernels/linear/op.hpp"

namespace qflash::kernels::cpu {

/// The vector width a row kernel runs: AVX2 (8 fp32 lanes) or AVX-512 (16).
enum class Simd { kAvx2, kAvx512 };

/// Micro-tiles: kTileRows rows x kFloatTileTokens tokens of a float format share each load
/// (AVX2: 8 accumulators, reduced together; AVX-512: 16 of 32 zmm); one token goes through
/// kOneTokenRows rows at once. Rows are handed to the tiles kGroupRows at a time, and work items
/// are multiples of kTileRows. Token blocks (token_block) are multiples of kTileTokens where a
/// path does not give its own.
inline constexpr int kTileRows = 4;
inline constexpr int kTileTokens = 3;
inline constexpr int kOneTokenRows = 8;
inline constexpr int kGroupRows = 8;
template <Simd V>
inline constexpr int kFloatTileTokens = V == Simd::kAvx512 ? 4 : 2;
/// bf16 / f16 rows are widened to fp32 once per call for more tokens than this (each tile
/// converts its loads otherwise).
template <Simd V>
inline constexpr int kWidenAboveTokens = V == Simd::kAvx512 ? 4 : 3;
/// Activations of one token block are kept within this many bytes (an L2's share).
inline constexpr std::int64_t kTokenBlockBytes = 256 << 10;

/// Rows apart that the rows of one AVX2 decode pass go when rows are shorter than a page
/// (4096 / row bytes, 1 to 8), so that each of the pass's streams is in its own page: the
/// hardware prefetcher follows one stream per page, not several (Zen 3: 1 KiB bf16 rows,
/// 10-11 GB/s read 8 adjacent at a time, 17 GB/s a page apart).
inline std::int64_t page_apart_step(std::int64_t row_bytes) {
  return std::clamp<std::int64_t>(4096 / std::max<std::int64_t>(1, row_bytes), 1, 8);
}

/// One projection as the row kernels see it: token t of n_tokens reads activation row
/// x_index[t] (t when null) and writes output row y_index[t] (t when null), adding
/// y_scale[t] times its dot products when y_scale is set (the experts' weighted combine).
struct LinearRows {
  WeightView w;
  float const* x = nullptr;
  std::int64_t xs = 0;
  float* y = nullptr;
  std::int64_t ys = 0;
  std::int64_t n_tokens = 0;
  bool accumulate = false;
  std::byte const* xq = nullptr;  ///< quantized activations, xq_stride bytes per row
  std::int64_t xq_stride = 0;
  std::int32_t const* x_index = nullptr;
  std::int32_t const* y_index = nullptr;
  float const* y_scale = nullptr;
  SlotScratch<float>* scratch = nullptr;  ///< for rows decoded or widened to fp32 (prepared)
  AmxActivations amx{};  ///< the tokens packed for AMX tiles (data null: not packed)

  [[nodiscard]] std::int64_t x_of(std::int64_t t) const { return x_index ? x_index[t] : t; }
  [[nodiscard]] float const* x_row(std::int64_t t) const { return x + x_of(t) * xs; }
  [[nodiscard]] std::byte const* xq_row(std::int64_t t) const { return xq + x_of(t) * xq_stride; }
  [[nodiscard]] float* y_row(std::int64_t t) const { return y + (y_index ? y_index[t] : t) * ys; }
};

/// True when instance format F (kAny: all) compiles the path of format f.
template <WeightFormat F>
constexpr bool compiles(WeightFormat f) {
  return F == WeightFormat::kAny || F == f;
}

/// y[t, o] = v, += v (accumulate) or += y_scale[t] v as one FMA (what the vector stores do,
/// so that a row's result does not depend on which tile stored it).
inline void store_dot(LinearRows const& p, std::int64_t t, std::int64_t o, float v) {
  float& out = p.y_row(t)[o];
  if (p.y_scale)
    out = std::fma(p.y_scale[t], v, out);
  else
    out = p.accumulate ? out + v : v;
}

#if QFLASH_HAS_X86_SIMD
QFLASH_SIMD_BEGIN
/// store_dot for rows [o, o + 16) of token t.
QFLASH_TARGET_AVX512 inline void store_dots16(LinearRows const& p, std::int64_t t, std::int64_t o, float const* v) {
  float* out = p.y_row(t) + o;
  __m512 const d = _mm512_loadu_ps(v);
  if (p.y_scale)
    _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_set1_ps(p.y_scale[t]), d, _mm512_loadu_ps(out)));
  else
    _mm512_storeu_ps(out, p.accumulate ? _mm512_add_ps(_mm512_loadu_ps(out), d) : d);
}
QFLASH_SIMD_END

/// Rows [o0, o0 + rows) of p on AMX tiles of kind Tiles; returns the first row left.
template <class Tiles>
std::int64_t amx_rows_of(LinearRows const& p, std::int64_t o0, std::int64_t rows) {
  amx_rows<Tiles>(p.w.row(o0), p.w.row_bytes(), rows, p.amx, p.n_tokens,
                  [&](std::int64_t t, std::int64_t r, float const* v) { store_dots16(p, t, o0 + r, v); });
  return o0 + rows;
}

/// Rows [o0, o1) of a projection whose tokens p.amx holds, on AMX tiles as far as whole
/// 16-row tiles go, for the formats F compiles; returns the first row left.
template <WeightFormat F>
std::int64_t amx_linear_rows(LinearRows const& p, std::int64_t o0, std::int64_t o1) {
  std::int64_t const rows = (o1 - o0) / kAmxRows * kAmxRows;
  WeightFormat const f = p.w.format;
  if (rows == 0) return o0;
  if constexpr (compiles<F>(WeightFormat::kBf16))
    if (f == WeightFormat::kBf16) return amx_rows_of<AmxBf16Tiles>(p, o0, rows);
  if constexpr (compiles<F>(WeightFormat::kQ8_0))
    if (f == WeightFormat::kQ8_0) return amx_rows_of<AmxQ8Tiles>(p, o0, rows);
  if constexpr (compiles<F>(WeightFormat::kQ4K))
    if (f == WeightFormat::kQ4K) return amx_rows_of<AmxKQuantTiles<AmxQ4K>>(p, o0, rows);
  if constexpr (compiles<F>(WeightFormat::kQ6K))
    if (f == WeightFormat::kQ6K) return amx_rows_of<AmxKQuantTiles<AmxQ6K>>(p, o0, rows);
  if constexpr (compiles<F>(WeightFormat::kInt4))
    if (f == WeightFormat::kInt4) return amx_rows_of<AmxInt4Tiles>(p, o0, rows);
  return o0;
}
#endif  // QFLASH_HAS_X86_SIMD

/// Packs token tile j of what p's rows read for AMX tiles into `out` (AmxActivations' layout
/// for p.w's format): fp32 rows for bf16, their quantized blocks (p.xq) for the others.
inline void amx_pack_tile(LinearRows const& p, std::int64_t j, std::byte* out) {
#if QFLASH_HAS_X86_SIMD
  if (p.w.format == WeightFormat::kQ8_0)
    amx_pack_q8_tile([&p](std::int64_t t) { return reinterpret_cast<BlockQ8_0 const*>(p.xq_row(t)); }, p.n_tokens,
                     p.w.cols / kAmxCols, j, out);
  else if (p.w.format == WeightFormat::kQ4K || p.w.format == WeightFormat::kQ6K)
    amx_pack_q8k_tile([&p](std::int64_t t) { return reinterpret_cast<BlockQ8K const*>(p.xq_row(t)); }, p.n_tokens,
                      p.w.cols / gguf::kQ4KBlockSize, j, out);
  else if (p.w.format == WeightFormat::kInt4)
    amx_pack_int4_tile([&p](std::int64_t t) { return reinterpret_cast<ActQ8Pair const*>(p.xq_row(t)); }, p.n_tokens,
                       p.w.cols / kAmxCols, j, out);
  else
    amx_pack_bf16_tile([&p](std::int64_t t) { return p.x_row(t); }, p.n_tokens, p.w.cols, j,
                       reinterpret_cast<bf16_bits*>(out));
#else
  (void)p, (void)j, (void)out;
#endif
}

/// Tokens per block so that a block's activation rows of `row_bytes` fit kTokenBlockBytes, a
/// multiple of the tile's `tile_tokens`.
inline std::int64_t token_block(std::int64_t row_bytes, std::int64_t n_tokens, int tile_tokens = kTileTokens) {
  std::int64_t const fit = std::max<std::int64_t>(tile_tokens, kTokenBlockBytes / std::max<std::int64_t>(1, row_bytes));
  return std::min(n_tokens, fit / tile_tokens * tile_tokens);
}

QFLASH_SIMD_INLINE float widen(float v) { return v; }
QFLASH_SIMD_INLINE float widen(bf16_bits v) { return bf16_to_float(v); }
QFLASH_SIMD_INLINE float widen(Fp16 v) { return to_float(v); }

/// Dot product of n fp32 values in 8 interleaved partial sums (the lanes of the SIMD paths).
inline float dot_scalar(float const* x, float const* w, std::int64_t n) {
  float part[8] = {};
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) part[l] += x[i + l] * w[i + l];
  for (; i < n; ++i) part[i % 8] += x[i] * w[i];
  return ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
}

#if QFLASH_HAS_X86_SIMD
QFLASH_SIMD_BEGIN

QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m256 avx2_load_weights(float const* p) { return _mm256_loadu_ps(p); }
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m256 avx2_load_weights(bf16_bits const* p) { return simd::avx2_load(p); }
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m256 avx2_load_weights(Fp16 const* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p)));
}

/// store_dot for rows [o, o + 8) (or 4) of token t.
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE void store_dots_avx2(LinearRows const& p, std::int64_t t, std::int64_t o, __m256 d) {
  float* out = p.y_row(t) + o;
  if (p.y_scale)
    _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_set1_ps(p.y_scale[t]), d, _mm256_loadu_ps(out)));
  else
    _mm256_storeu_ps(out, p.accumulate ? _mm256_add_ps(_mm256_loadu_ps(out), d) : d);
}
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE void store_dots_avx2(LinearRows const& p, std::int64_t t, std::int64_t o, __m128 d) {
  float* out = p.y_row(t) + o;
  if (p.y_scale)
    _mm_storeu_ps(out, _mm_fmadd_ps(_mm_set1_ps(p.y_scale[t]), d, _mm_loadu_ps(out)));
  else
    _mm_storeu_ps(out, p.accumulate ? _mm_add_ps(_mm_loadu_ps(out), d) : d);
}

/// Keeps v in a register: a vector used by several FMAs is loaded once, not folded into each
/// as a memory operand (which GCC does, and which makes the tiles load-bound).
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE void in_register(__m256& v) { __asm__("" : "+x"(v)); }

/// y[t0 + t, o + r step] for r < R, t < NT, with weight row o + r step at w + r step cols:
/// one pass over the columns, each weight vector multiplied into NT tokens and each activation
/// vector into R rows. Every (row, token) sum is one FMA chain over the columns in order,
/// whatever R and NT (the column tail too: std::fma, not left to the compiler's contraction,
/// which differs between instantiations), so a token's result does not depend on the tokens
/// beside it. One token goes through kOneTokenRows rows per pass (that many chains in flight),
/// with the next rows prefetched when they are adjacent (step 1). kWiden: the rows are also
/// stored widened to fp32 at `widened` (row stride cols), for the tiles of the next tokens.
template <class W, int R, int NT, bool kWiden = false>
QFLASH_TARGET_AVX2 void float_tile_avx2(LinearRows const& p, W const* w, std::int64_t o, std::int64_t t0,
                                        std::int64_t step = 1, float* widened = nullptr) {
  std::int64_t const n = p.w.cols;
  std::int64_t const n8 = n / 8 * 8;
  float const* x[NT];
  for (int t = 0; t < NT; ++t) x[t] = p.x_row(t0 + t);
  __m256 acc[R][NT];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  for (std::int64_t i = 0; i < n8; i += 8) {
    __m256 xv[NT];
#pragma GCC unroll 3
    for (int t = 0; t < NT; ++t) {
      xv[t] = _mm256_loadu_ps(x[t] + i);
      if constexpr (R > 1) in_register(xv[t]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      if constexpr (NT == 1)
        if (step == 1 && ((i * static_cast<std::int64_t>(sizeof(W))) & 63) == 0)
          _mm_prefetch(reinterpret_cast<char const*>(w + (R + r) * n + i), _MM_HINT_T0);
      __m256 wv = avx2_load_weights(w + r * step * n + i);
      if constexpr (NT > 1) in_register(wv);
      if constexpr (kWiden) _mm256_storeu_ps(widened + r * n + i, wv);
#pragma GCC unroll 3
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_fmadd_ps(wv, xv[t], acc[r][t]);
    }
  }
  if constexpr (kWiden)
    for (int r = 0; r < R; ++r)
      for (std::int64_t i = n8; i < n; ++i) widened[r * n + i] = widen(w[r * n + i]);
  float sums[R][NT];
  if constexpr (R * NT == 8) {  // all 8 reduced at once, each as avx2_reduce_add would
    __m256 v[8];
    for (int t = 0; t < NT; ++t)
      for (int r = 0; r < R; ++r) v[t * R + r] = acc[r][t];
    __m256 const reduced = simd::avx2_reduce_add8(v);
    if (n8 == n && step == 1) {  // no column tail: each token's R sums stored as a vector
      if constexpr (NT == 1) {
        store_dots_avx2(p, t0, o, reduced);
      } else {
        store_dots_avx2(p, t0, o, _mm256_castps256_ps128(reduced));
        store_dots_avx2(p, t0 + 1, o, _mm256_extractf128_ps(reduced, 1));
      }
      return;
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, reduced);
    for (int t = 0; t < NT; ++t)
      for (int r = 0; r < R; ++r) sums[r][t] = lanes[t * R + r];
  } else {
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < NT; ++t) sums[r][t] = simd::avx2_reduce_add(acc[r][t]);
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) {
      float s = sums[r][t];
      for (std::int64_t i = n8; i < n; ++i) s = std::fma(x[t][i], widen(w[r * step * n + i]), s);
      store_dot(p, t0 + t, o + r * step, s);
    }
}

/// Tokens [b0, b1) through rows [o, o + nr) whose weights are at w (row stride cols). With
/// `widened` (bf16 / f16 rows, several tokens), the first two tokens' tiles widen the rows into
/// it as they go, and the other tokens' read them there.
template <class W>
QFLASH_TARGET_AVX2 void float_group_avx2(LinearRows const& p, W const* w, std::int64_t o, int nr, std::int64_t b0,
                                         std::int64_t b1, float* widened = nullptr) {
  std::int64_t const n = p.w.cols;
  if (b1 - b0 == 1) {
    int r = 0;
    // Rows shorter than a page go kOneTokenRows at a time a page apart (rows r + s + k * step
    // of a group).
    int const step = static_cast<int>(page_apart_step(n * std::int64_t{sizeof(W)}));
    if (step > 1)
      for (; r + kOneTokenRows * step <= nr; r += kOneTokenRows * step)
        for (int s = 0; s < step; ++s)
          float_tile_avx2<W, kOneTokenRows, 1>(p, w + (r + s) * n, o + r + s, b0, step);
    for (; r + kOneTokenRows <= nr; r += kOneTokenRows) float_tile_avx2<W, kOneTokenRows, 1>(p, w + r * n, o + r, b0);
    for (; r < nr; ++r) float_tile_avx2<W, 1, 1>(p, w + r * n, o + r, b0);
    return;
  }
  std::int64_t t = b0;
  if constexpr (!std::is_same_v<W, float>)
    if (widened) {
      int r = 0;
      for (; r + kTileRows <= nr; r += kTileRows)
        float_tile_avx2<W, kTileRows, 2, true>(p, w + r * n, o + r, t, 1, widened + r * n);
      for (; r < nr; ++r) float_tile_avx2<W, 1, 2, true>(p, w + r * n, o + r, t, 1, widened + r * n);
      if (t + 2 < b1) float_group_avx2<float>(p, widened, o, nr, t + 2, b1);
      return;
    }
  for (; t + 2 <= b1; t += 2) {
    int r = 0;
    for (; r + kTileRows <= nr; r += kTileRows) float_tile_avx2<W, kTileRows, 2>(p, w + r * n, o + r, t);
    for (; r < nr; ++r) float_tile_avx2<W, 1, 2>(p, w + r * n, o + r, t);
  }
  if (t < b1) {
    int r = 0;
    for (; r + kOneTokenRows <= nr; r += kOneTokenRows) float_tile_avx2<W, kOneTokenRows, 1>(p, w + r * n, o + r, t);
    for (; r < nr; ++r) float_tile_avx2<W, 1, 1>(p, w + r * n, o + r, t);
  }
}

// ---- AVX-512 float tiles ------------------------------------------------------------------

QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512 avx512_load_weights(float const* p) { return _mm512_loadu_ps(p); }
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512 avx512_load_weights(bf16_bits const* p) { return simd::avx512_load(p); }
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512 avx512_load_weights(Fp16 const* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(p)));
}

/// float_tile_avx2 with 16 lanes.
template <class W, int R, int NT>
QFLASH_TARGET_AVX512 void float_tile_avx512(LinearRows const& p, W const* w, std::int64_t o, std::int64_t t0) {
  std::int64_t const n = p.w.cols;
  std::int64_t const n16 = n / 16 * 16;
  float const* x[NT];
  for (int t = 0; t < NT; ++t) x[t] = p.x_row(t0 + t);
  __m512 acc[R][NT];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (std::int64_t i = 0; i < n16; i += 16) {
    __m512 xv[NT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) xv[t] = _mm512_loadu_ps(x[t] + i);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      if constexpr (NT == 1)
        if (((i * static_cast<std::int64_t>(sizeof(W))) & 63) == 0)
          _mm_prefetch(reinterpret_cast<char const*>(w + (R + r) * n + i), _MM_HINT_T0);
      __m512 const wv = avx512_load_weights(w + r * n + i);
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) {
      float s = _mm512_reduce_add_ps(acc[r][t]);
      for (std::int64_t i = n16; i < n; ++i) s = std::fma(x[t][i], widen(w[r * n + i]), s);
      store_dot(p, t0 + t, o + r, s);
    }
}

template <class W, int R>
QFLASH_TARGET_AVX512 void float_tile_avx512(LinearRows const& p, W const* w, std::int64_t o, std::int64_t t0, int nt) {
  switch (nt) {
    case 1: return float_tile_avx512<W, R, 1>(p, w, o, t0);
    case 2: return float_tile_avx512<W, R, 2>(p, w, o, t0);
    case 3: return float_tile_avx512<W, R, 3>(p, w, o, t0);
    default: return float_tile_avx512<W, R, kFloatTileTokens<Simd::kAvx512>>(p, w, o, t0);
  }
}

template <class W>
QFLASH_TARGET_AVX512 void float_group_avx512(LinearRows const& p, W const* w, std::int64_t o, int nr, std::int64_t b0,
                                             std::int64_t b1) {
  std::int64_t const n = p.w.cols;
  if (b1 - b0 == 1) {
    int r = 0;
    for (; r + kOneTokenRows <= nr; r += kOneTokenRows)
      float_tile_avx512<W, kOneTokenRows, 1>(p, w + r * n, o + r, b0);
    for (; r < nr; ++r) float_tile_avx512<W, 1, 1>(p, w + r * n, o + r, b0);
    return;
  }
  constexpr int kTokens = kFloatTileTokens<Simd::kAvx512>;
  for (std::int64_t t = b0; t < b1; t += kTokens) {
    int const nt = static_cast<int>(std::min<std::int64_t>(kTokens, b1 - t));
    for (int r = 0; r < nr; r += kTileRows) {
      switch (std::min(kTileRows, nr - r)) {
        case 1: float_tile_avx512<W, 1>(p, w + r * n, o + r, t, nt); break;
        case 2: float_tile_avx512<W, 2>(p, w + r * n, o + r, t, nt); break;
        case 3: float_tile_avx512<W, 3>(p, w + r * n, o + r, t, nt); break;
        default: float_tile_avx512<W, kTileRows>(p, w + r * n, o + r, t, nt); break;
      }
    }
  }
}

template <class W>
QFLASH_TARGET_AVX512 void widen_avx512(W const* w, std::int64_t count, float* out) {
  std::int64_t const count16 = count / 16 * 16;
  for (std::int64_t i = 0; i < count16; i += 16) _mm512_storeu_ps(out + i, avx512_load_weights(w + i));
  for (std::int64_t i = count16; i < count; ++i) out[i] = widen(w[i]);
}

QFLASH_SIMD_END
#endif  // QFLASH_HAS_X86_SIMD

#if QFLASH_HAS_X86_SIMD
QFLASH_SIMD_BEGIN

/// Row r decoded to fp32, equal to dequantize_row: fp8_e4m3 in registers (the bytes `ahead`
/// further on prefetched meanwhile: rows are too short for the hardware prefetcher to catch
/// up within one), other formats by dequantize_row.
QFLASH_TARGET_AVX2 inline void decode_row_avx2(WeightView const& w, std::int64_t r, float* y, std::int64_t ahead = 0) {
  std::int64_t const n = w.cols, n8 = n / 8 * 8;
  if (w.format == WeightFormat::kFp8E4m3) {
    auto const* q = reinterpret_cast<std::uint8_t const*>(w.row(r));
    float const* scales = w.scale_row(r);
    for (std::int64_t i = 0; i < n8; i += 8) {  // 8 columns never straddle a 128-column tile
      if (ahead && i % 64 == 0) _mm_prefetch(reinterpret_cast<char const*>(q + i + ahead), _MM_HINT_T0);
      _mm256_storeu_ps(y + i, simd::avx2_fp8x8(q + i, _mm256_set1_ps(256.0f * scales[i / kFp8BlockSize])));
    }
    for (std::int64_t i = n8; i < n; ++i) y[i] = to_float(Fp8E4m3{q[i]}) * scales[i / kFp8BlockSize];
    return;
  }
  dequantize_row(w, r, y);
}

/// decode_row_avx2 with 16 lanes.
QFLASH_TARGET_AVX512 inline void decode_row_avx512(WeightView const& w, std::int64_t r, float* y, std::int64_t ahead = 0) {
  std::int64_t const n = w.cols, n16 = n / 16 * 16;
  if (w.format == WeightFormat::kFp8E4m3) {
    auto const* q = reinterpret_cast<std::uint8_t const*>(w.row(r));
    float const* scales = w.scale_row(r);
    for (std::int64_t i = 0; i < n16; i += 16) {  // 16 columns never straddle a 128-column tile
      if (ahead && i % 64 == 0) _mm_prefetch(reinterpret_cast<char const*>(q + i + ahead), _MM_HINT_T0);
      _mm512_storeu_ps(y + i, simd::avx512_fp8x16(q + i, _mm512_set1_ps(256.0f * scales[i / kFp8BlockSize])));
    }
    for (std::int64_t i = n16; i < n; ++i) y[i] = to_float(Fp8E4m3{q[i]}) * scales[i / kFp8BlockSize];
    return;
  }
  dequantize_row(w, r, y);
}

/// fp8_e4m3 rows multiplied in registers (fp8_tile_*): R rows x NT tokens per pass, 4 x 1 for
/// one token (more rows streaming), 1 x NT for several (each conversion shared by NT tokens).
inline constexpr int kFp8Rows = 4;
inline constexpr int kFp8Tokens = 4;

/// Columns [n_vec, n) of an fp8 row times x, in order, exactly as dequantize_row's values.
inline float fp8_tail_dot(std::uint8_t const* q, float const* scales, float const* x, std::int64_t n_vec,
                          std::int64_t n) {
  float v = 0.0f;
  for (std::int64_t c = n_vec; c < n; ++c) v = std::fma(to_float(Fp8E4m3{q[c]}) * scales[c / kFp8BlockSize], x[c], v);
  return v;
}

/// fp8_e4m3 rows [o, o + R) times NT activation rows, out[r * NT + t], with no decoded copy: 32
/// bytes of a row become fp16 bit patterns of the values / 256 (exact, subnormals included),
/// widened to fp32 and multiplied into each token; per 128-column scale tile the products are
/// summed, then scaled by 256 times the tile's scale; the columns past the last 32, in
/// fp8_tail_dot. A row holding an e4m3 NaN (magnitude 0x7f) gives NaN, as its dequantized
/// products would. Every (row, token) sum is the same chain for any R and NT, so a token's
/// results do not depend on the tokens beside it. The next R rows are prefetched.
template <int R, int NT>
QFLASH_TARGET_AVX512 void fp8_tile_avx512(WeightView const& w, std::int64_t o, float const* const* x, float* out) {
  std::int64_t const n = w.cols, n32 = n / 32 * 32, ahead = R * w.row_bytes();
  std::uint8_t const* q[R];
  float const* sc[R];
  __m512 acc[R][NT];
  __m512i mag_max[R];
  for (int r = 0; r < R; ++r) {
    q[r] = reinterpret_cast<std::uint8_t const*>(w.row(o + r));
    sc[r] = w.scale_row(o + r);
    mag_max[r] = _mm512_setzero_si512();
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  }
  __m512i const low7 = _mm512_set1_epi16(0x7f), sign = _mm512_set1_epi16(static_cast<short>(0x8000));
  for (std::int64_t c0 = 0; c0 < n32; c0 += kFp8BlockSize) {
    std::int64_t const c1 = std::min<std::int64_t>(c0 + kFp8BlockSize, n32);
    __m512 tile[R][NT];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < NT; ++t) tile[r][t] = _mm512_setzero_ps();
    for (std::int64_t c = c0; c < c1; c += 32) {
      __m512 xl[NT], xh[NT];
      for (int t = 0; t < NT; ++t) {
        xl[t] = _mm512_loadu_ps(x[t] + c);
        xh[t] = _mm512_loadu_ps(x[t] + c + 16);
      }
      for (int r = 0; r < R; ++r) {
        if (c % 64 == 0) _mm_prefetch(reinterpret_cast<char const*>(q[r] + c + ahead), _MM_HINT_T0);
        __m512i const b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(q[r] + c)));
        __m512i const mag = _mm512_and_si512(b, low7);
        mag_max[r] = _mm512_max_epu16(mag_max[r], mag);
        // (mag << 7) | the sign bit of (b << 8)
        __m512i const h = _mm512_ternarylogic_epi32(_mm512_slli_epi16(mag, 7), _mm512_slli_epi16(b, 8), sign, 0xF8);
        __m512 const lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
        __m512 const hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
        for (int t = 0; t < NT; ++t) tile[r][t] = _mm512_fmadd_ps(hi, xh[t], _mm512_fmadd_ps(lo, xl[t], tile[r][t]));
      }
    }
    for (int r = 0; r < R; ++r) {
      __m512 const s256 = _mm512_set1_ps(256.0f * sc[r][c0 / kFp8BlockSize]);
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_fmadd_ps(tile[r][t], s256, acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r) {
    bool const nan = _mm512_cmpeq_epi16_mask(mag_max[r], low7) != 0;
    for (int t = 0; t < NT; ++t) {
      float const v = _mm512_reduce_add_ps(acc[r][t]) + fp8_tail_dot(q[r], sc[r], x[t], n32, n);
      out[r * NT + t] = nan ? std::numeric_limits<float>::quiet_NaN() : v;
    }
  }
}

/// fp8_tile_avx512 with 8 lanes: 16 bytes of a row at a time.
template <int R, int NT>
QFLASH_TARGET_AVX2 void fp8_tile_avx2(WeightView const& w, std::int64_t o, float const* const* x, float* out) {
  std::int64_t const n = w.cols, n16 = n / 16 * 16, ahead = R * w.row_bytes();
  std::uint8_t const* q[R];
  float const* sc[R];
  __m256 acc[R][NT];
  __m256i mag_max[R];
  for (int r = 0; r < R; ++r) {
    q[r] = reinterpret_cast<std::uint8_t const*>(w.row(o + r));
    sc[r] = w.scale_row(o + r);
    mag_max[r] = _mm256_setzero_si256();
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  }
  __m256i const low7 = _mm256_set1_epi16(0x7f), sign = _mm256_set1_epi16(static_cast<short>(0x8000));
  for (std::int64_t c0 = 0; c0 < n16; c0 += kFp8BlockSize) {
    std::int64_t const c1 = std::min<std::int64_t>(c0 + kFp8BlockSize, n16);
    __m256 tile[R][NT];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < NT; ++t) tile[r][t] = _mm256_setzero_ps();
    for (std::int64_t c = c0; c < c1; c += 16) {
      for (int r = 0; r < R; ++r) {
        if (c % 64 == 0) _mm_prefetch(reinterpret_cast<char const*>(q[r] + c + ahead), _MM_HINT_T0);
        __m256i const b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<__m128i const*>(q[r] + c)));
        __m256i const mag = _mm256_and_si256(b, low7);
        mag_max[r] = _mm256_max_epu16(mag_max[r], mag);
        __m256i const h = _mm256_or_si256(_mm256_slli_epi16(mag, 7), _mm256_and_si256(_mm256_slli_epi16(b, 8), sign));
        __m256 const lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        __m256 const hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
        for (int t = 0; t < NT; ++t)
          tile[r][t] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x[t] + c + 8),
                                       _mm256_fmadd_ps(lo, _mm256_loadu_ps(x[t] + c), tile[r][t]));
      }
    }
    for (int r = 0; r < R; ++r) {
      __m256 const s256 = _mm256_set1_ps(256.0f * sc[r][c0 / kFp8BlockSize]);
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_fmadd_ps(tile[r][t], s256, acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r) {
    bool const nan = _mm256_movemask_epi8(_mm256_cmpeq_epi16(mag_max[r], low7)) != 0;
    for (int t = 0; t < NT; ++t) {
      float const v = simd::avx2_reduce_add(acc[r][t]) + fp8_tail_dot(q[r], sc[r], x[t], n16, n);
      out[r * NT + t] = nan ? std::numeric_limits<float>::quiet_NaN() : v;
    }
  }
}

QFLASH_SIMD_END
#endif  // QFLASH_HAS_X86_SIMD

#if QFLASH_HAS_X86_SIMD
/// Tokens [b0, b1) through rows [o, o + nr) whose fp32-compatible weights are at w.
template <Simd V, class W>
void float_group(LinearRows const& p, W const* w, std::int64_t o, int nr, std::int64_t b0, std::int64_t b1) {
  if constexpr (V == Simd::kAvx512)
    float_group_avx512<W>(p, w, o, nr, b0, b1);
  else
    float_group_avx2<W>(p, w, o, nr, b0, b1);
}

/// Rows [o0, o1) of an f32 / bf16 / f16 projection. With many tokens, bf16 and f16 row groups
/// are widened to fp32 once per token block, so the tiles' inner loop only multiplies.
template <Simd V, class W>
void float_rows(LinearRows const& p, std::int64_t o0, std::int64_t o1) {
  std::int64_t const n = p.w.cols;
  std::int64_t const tb = token_block(n * 4, p.n_tokens, kFloatTileTokens<V>);
  bool const widen_rows = !std::is_same_v<W, float> && p.n_tokens > kWidenAboveTokens<V>;
  float* const widened = widen_rows ? p.scratch->get(static_cast<std::size_t>(kGroupRows * n)) : nullptr;
  for (std::int64_t b0 = 0; b0 < p.n_tokens; b0 += tb) {
    std::int64_t const b1 = std::min(p.n_tokens, b0 + tb);
    if (b1 - b0 == 1) {  // decode: all rows at once, so that they can go a page apart (float_group_avx2)
      float_group<V, W>(p, static_cast<W const*>(p.w.data) + o0 * n, o0, static_cast<int>(o1 - o0), b0, b1);
      continue;
    }
    for (std::int64_t o = o0; o < o1; o += kGroupRows) {
      int const nr = static_cast<int>(std::min<std::int64_t>(kGroupRows, o1 - o));
      W const* w = static_cast<W const*>(p.w.data) + o * n;
      // The next group's rows come while this one's tiles run: from the L2 or L3 (a model
      // whose weights fit there), a group's first reads otherwise wait for each line.
      if (o + kGroupRows < o1)
        simd::prefetch_bytes(w + kGroupRows * n, std::min<std::int64_t>(kGroupRows, o1 - o - kGroupRows) * n * std::int64_t{sizeof(W)});
      if (!widen_rows) {
        float_group<V, W>(p, w, o, nr, b0, b1);
        continue;
      }
      if constexpr (V == Simd::kAvx512) {
        widen_avx512(w, nr * n, widened);
        float_group_avx512<float>(p, widened, o, nr, b0, b1);
      } else {
        float_group_avx2<W>(p, w, o, nr, b0, b1, widened);
      }
    }
  }
}
#endif  // QFLASH_HAS_X86_SIMD

#if QFLASH_HAS_X86_SIMD
/// Below this many tokens fp8 rows are multiplied in registers (fp8_tile_*, every token
/// converting the row again); from it on, decoded once per call for all tokens, and a token's
/// sums then equal its one-token sums within fp32 rounding.
inline constexpr std::int64_t kFp8FusedMaxTokens = 8;

inline bool fp8_fused_applies(arch::CpuIsa isa, WeightFormat f, std::int64_t n_tokens) {
  return f == WeightFormat::kFp8E4m3 && isa >= arch::CpuIsa::kAvx2 && n_tokens < kFp8FusedMaxTokens;
}

/// Tokens [t0, t0 + NT) through fp8 rows [o, o + R) (fp8_tile_*), stored.
template <Simd V, int R, int NT>
void fp8_tile(LinearRows const& p, std::int64_t o, std::int64_t t0) {
  float const* x[NT];
  for (int t = 0; t < NT; ++t) x[t] = p.x_row(t0 + t);
  float out[R * NT];
  if constexpr (V == Simd::kAvx512)
    fp8_tile_avx512<R, NT>(p.w, o, x, out);
  else
    fp8_tile_avx2<R, NT>(p.w, o, x, out);
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) store_dot(p, t0 + t, o + r, out[r * NT + t]);
}

/// Rows [o0, o1) of an fp8_e4m3 projection with fp8_tile_*: one token kFp8Rows rows at a time;
/// several, each row through kFp8Tokens tokens at a time.
template <Simd V>
void fp8_rows_fused(LinearRows const& p, std::int64_t o0, std::int64_t o1) {
  if (p.n_tokens == 1) {
    std::int64_t o = o0;
    for (; o + kFp8Rows <= o1; o += kFp8Rows) fp8_tile<V, kFp8Rows, 1>(p, o, 0);
    for (; o < o1; ++o) fp8_tile<V, 1, 1>(p, o, 0);
    return;
  }
  for (std::int64_t o = o0; o < o1; ++o) {
    std::int64_t t = 0;
    for (; t + kFp8Tokens <= p.n_tokens; t += kFp8Tokens) fp8_tile<V, 1, kFp8Tokens>(p, o, t);
    switch (p.n_tokens - t) {
      case 3: fp8_tile<V, 1, 3>(p, o, t); break;
      case 2: fp8_tile<V, 1, 2>(p, o, t); break;
      case 1: fp8_tile<V, 1, 1>(p, o, t); break;
      default: break;
    }
  }
}
#endif  // QFLASH_HAS_X86_SIMD

/// Rows [o0, o1) of a projection whose rows are decoded to fp32 first (fp8_e4m3, and any
/// format an instance does not compile a path for): groups of kGroupRows rows decoded once,
/// then every token.
inline void linear_rows_decoded(arch::CpuIsa isa, LinearRows const& p, std::int64_t o0, std::int64_t o1) {
  std::int64_t const n = p.w.cols;
#if QFLASH_HAS_X86_SIMD
  if (fp8_fused_applies(isa, p.w.format, p.n_tokens))
    return isa >= arch::CpuIsa::kAvx512 ? fp8_rows_fused<Simd::kAvx512>(p, o0, o1) : fp8_rows_fused<Simd::kAvx2>(p, o0, o1);
  if (isa >= arch::CpuIsa::kAvx2) {
    bool const avx512 = isa >= arch::CpuIsa::kAvx512;
    float* const decoded = p.scratch->get(static_cast<std::size_t>(kGroupRows * n));
    std::int64_t const tb = token_block(n * 4, p.n_tokens, avx512 ? kFloatTileTokens<Simd::kAvx512> : kFloatTileTokens<Simd::kAvx2>);
    std::int64_t const ahead = kGroupRows * p.w.row_bytes();
    for (std::int64_t o = o0; o < o1; o += kGroupRows) {
      int const nr = static_cast<int>(std::min<std::int64_t>(kGroupRows, o1 - o));
      for (int r = 0; r < nr; ++r) {
        if (avx512)
          decode_row_avx512(p.w, o + r, decoded + r * n, ahead);
        else
          decode_row_avx2(p.w, o + r, decoded + r * n, ahead);
      }
      for (std::int64_t b0 = 0; b0 < p.n_tokens; b0 += tb) {
        std::int64_t const b1 = std::min(p.n_tokens, b0 + tb);
        if (avx512)
          float_group<Simd::kAvx512, float>(p, decoded, o, nr, b0, b1);
        else
          float_group<Simd::kAvx2, float>(p, decoded, o, nr, b0, b1);
      }
    }
    return;
  }
#endif
  (void)isa;
  float* const decoded = p.w.format == WeightFormat::kF32 ? nullptr : p.scratch->get(static_cast<std::size_t>(n));
  for (std::int64_t o = o0; o < o1; ++o) {
    float const* row = decoded;
    if (p.w.format == WeightFormat::kF32)
      row = reinterpret_cast<float const*>(p.w.row(o));
    else
      dequantize_row(p.w, o, decoded);
    for (std::int64_t t = 0; t < p.n_tokens; ++t) store_dot(p, t, o, dot_scalar(p.x_row(t), row, n));
  }
}

/// Fewest tokens that run q8_0 and q4_k rows in panels (q8_0_panel_tokens, q4_k_panel_tokens;
/// q8_0_panel8_tokens, q4_k_panel8_tokens on AVX2).
inline constexpr std::int64_t kPanelMinTokens = 8;

/// The weight blocks that have panels (panel_rows): the one list.
template <class WB>
inline constexpr bool kPanelBlock = std::is_same_v<WB, BlockQ8_0> || std::is_same_v<WB, BlockQ4K>;

/// Rows of a panel at `isa`: 16 on AVX-512 VNNI, 8 on AVX2.
inline int panel_rows_at(arch::CpuIsa isa) {
  return isa >= arch::CpuIsa::kAvx512Vnni ? kPanelRows : kAvx2PanelRows;
}

/// True when rows in format f of a projection of n_tokens tokens run in panels at `isa`
/// (panel_rows_at(isa) rows each; the rows past the last whole panel, and token blocks under
/// kPanelMinTokens, on the row kernels). A token's sums there equal its one-token sums within
/// fp32 rounding.
inline bool panels_apply(arch::CpuIsa isa, WeightFormat f, std::int64_t n_tokens) {
  bool const panels = f == WeightFormat::kQ8_0  ? kPanelBlock<BlockQ8_0>
                      : f == WeightFormat::kQ4K ? kPanelBlock<BlockQ4K>
                      : f == WeightFormat::kQ6K ? kPanelBlock<BlockQ6K>
                      : f == WeightFormat::kInt4 && kPanelBlock<BlockInt4G128>;
  return panels && isa >= arch::CpuIsa::kAvx2 && n_tokens >= kPanelMinTokens;
}

#if QFLASH_HAS_X86_SIMD
/// Tokens a quantized weight row is multiplied into per pass when there are several.
inline constexpr int kQuantTokens = 4;
/// Rows one token goes through per pass.
template <Simd V>
inline constexpr int kQuantRows = V == Simd::kAvx512 ? 4 : 2;

/// R rows of blocks `stride` bytes apart against one activation row (cpu_quant*.hpp).
template <Simd V, int R, class WB, class XB>
void quant_dot(WB const* w, std::int64_t stride, XB const* x, std::int64_t nb, float* out) {
  if constexpr (V == Simd::kAvx512) {
    dot_avx512<R>(w, stride, x, nb, out);
  } else if constexpr (std::is_same_v<WB, BlockQ8_0>) {
    if (arch::avx_vnni()) {
      XB const* const xs[1] = {x};
      return dot_tile_avx_vnni<R, 1, true>(w, stride, xs, nb, out);
    }
    dot_avx2<R>(w, stride, x, nb, out);
  } else {
    arch::avx_vnni() ? dot_avx2<R, true>(w, stride, x, nb, out) : dot_avx2<R, false>(w, stride, x, nb, out);
  }
}

/// One row against NT activation rows (cpu_quant*.hpp).
template <Simd V, int NT, class WB, class XB>
void quant_dot_tokens(WB const* w, XB const* const* x, std::int64_t nb, float* out) {
  if constexpr (V == Simd::kAvx512) {
    dot_tokens_avx512<NT>(w, x, nb, out);
  } else if constexpr (std::is_same_v<WB, BlockQ8_0>) {
    if (arch::avx_vnni()) return dot_tile_avx_vnni<1, NT>(w, 0, x, nb, out);
    dot_tokens_avx2<NT>(w, x, nb, out);
  } else {
    arch::avx_vnni() ? dot_tokens_avx2<NT, true>(w, x, nb, out) : dot_tokens_avx2<NT, false>(w, x, nb, out);
  }
}

/// Rows per pass for several tokens: q8_0 needs no unpacking, so two rows share each
/// activation load (dot_tile_avx2, dot_tile_avx512); other blocks are unpacked once per row
/// for its tokens.
template <class WB>
inline constexpr int kQuantTileRows = std::is_same_v<WB, BlockQ8_0> ? 2 : 1;

/// R rows (`stride` bytes apart) against NT activation rows, out[r * NT + t].
template <Simd V, int R, int NT, class WB, class XB>
void quant_dot_tile(WB const* w, std::int64_t stride, XB const* const* x, std::int64_t nb, float* out) {
  if constexpr (R == 1)
    quant_dot_tokens<V, NT>(w, x, nb, out);
  else if constexpr (V == Simd::kAvx512)
    dot_tile_avx512<R, NT>(w, stride, x, nb, out);
  else {
    if constexpr (std::is_same_v<WB, BlockQ8_0>)
      if (arch::avx_vnni()) return dot_tile_avx_vnni<R, NT>(w, stride, x, nb, out);
    dot_tile_avx2<R, NT>(w, stride, x, nb, out);
  }
}

/// Tokens [b0, b1) through rows [o, o + R), kQuantTokens per pass.
template <Simd V, int R, class WB, class XB>
void quant_rows_tokens(LinearRows const& p, std::int64_t o, std::int64_t nb, std::int64_t b0, std::int64_t b1) {
  auto const* rows = reinterpret_cast<WB const*>(p.w.row(o));
  std::int64_t const stride = p.w.row_bytes();
  for (std::int64_t t = b0; t < b1; t += kQuantTokens) {
    int const nt = static_cast<int>(std::min<std::int64_t>(kQuantTokens, b1 - t));
    XB const* x[kQuantTokens];
    for (int k = 0; k < nt; ++k) x[k] = reinterpret_cast<XB const*>(p.xq_row(t + k));
    float out[R * kQuantTokens];
    switch (nt) {
      case 1: quant_dot_tile<V, R, 1>(rows, stride, x, nb, out); break;
      case 2: quant_dot_tile<V, R, 2>(rows, stride, x, nb, out); break;
      case 3: quant_dot_tile<V, R, 3>(rows, stride, x, nb, out); break;
      default: quant_dot_tile<V, R, kQuantTokens>(rows, stride, x, nb, out); break;
    }
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < nt; ++k) store_dot(p, t + k, o + r, out[r * nt + k]);
  }
}

/// Rows and tokens of a panel pass at SIMD width V.
template <Simd V>
inline constexpr int kPanelRowsOf = V == Simd::kAvx512 ? kPanelRows : kAvx2PanelRows;
template <Simd V>
inline constexpr int kPanelTokensOf = V == Simd::kAvx512 ? 8 : 4;

/// Tokens [b0, b1) through the whole panels of rows [o0, o1) of a q8_0 or q4_k projection (WB
/// its block, XB the activations'), each panel packed once for them; returns the first row left.
template <Simd V, class WB, class XB>
std::int64_t panel_rows(LinearRows const& p, std::int64_t o0, std::int64_t o1, std::int64_t nb, std::int64_t b0,
                        std::int64_t b1) {
  constexpr bool kQ8_0 = std::is_same_v<WB, BlockQ8_0>, kWide = V == Simd::kAvx512;
  constexpr int kRows = kPanelRowsOf<V>, kTokens = kPanelTokensOf<V>;
  constexpr std::int64_t kBlockBytes = kWide ? (kQ8_0 ? kQ8_0PanelBlockBytes : kQ4KPanelBlockBytes)
                                             : (kQ8_0 ? kQ8_0Panel8BlockBytes : kQ4KPanel8BlockBytes);
  thread_local std::vector<std::byte> panel;
  panel.resize(static_cast<std::size_t>(nb * kBlockBytes));
  auto tokens = [&]<int NT>(XB const* const* x, float* out) {
    if constexpr (kWide && kQ8_0)
      q8_0_panel_tokens<NT>(panel.data(), x, nb, out);
    else if constexpr (kWide)
      q4_k_panel_tokens<NT>(panel.data(), x, nb, out);
    else if constexpr (kQ8_0)
      q8_0_panel8_tokens<NT>(panel.data(), x, nb, out);
    else
      q4_k_panel8_tokens<NT>(panel.data(), x, nb, out);
  };
  std::int64_t o = o0;
  for (; o + kRows <= o1; o += kRows) {
    auto const* w = reinterpret_cast<WB const*>(p.w.row(o));
    if constexpr (kWide && kQ8_0)
      q8_0_pack_panel(w, p.w.row_bytes(), nb, panel.data());
    else if constexpr (kWide)
      q4_k_pack_panel(w, p.w.row_bytes(), nb, panel.data());
    else if constexpr (kQ8_0)
      q8_0_pack_panel8(w, p.w.row_bytes(), nb, panel.data());
    else
      q4_k_pack_panel8(w, p.w.row_bytes(), nb, panel.data());
    for (std::int64_t t = b0; t < b1;) {
      std::int64_t const left = b1 - t;
      int const nt = left >= kTokens ? kTokens : left >= 4 ? 4 : left >= 2 ? 2 : 1;
      XB const* x[kTokens];
      for (int k = 0; k < nt; ++k) x[k] = reinterpret_cast<XB const*>(p.xq_row(t + k));
      alignas(64) float out[kTokens * kRows];
      switch (nt) {
        case 1: tokens.template operator()<1>(x, out); break;
        case 2: tokens.template operator()<2>(x, out); break;
        case 4: tokens.template operator()<4>(x, out); break;
        default: tokens.template operator()<kTokens>(x, out); break;
      }
      for (int k = 0; k < nt; ++k) {
        if constexpr (kWide)
          store_dots16(p, t + k, o, out + kRows * k);
        else
          for (int r = 0; r < kRows; ++r) store_dot(p, t + k, o + r, out[kRows * k + r]);
      }
      t += nt;
    }
  }
  return o;
}

/// Rows [o0, o1) of a q8_0 / q4_k / q6_k / int4 projection (WB its block, XB the
/// activations'): one token goes through kQuantRows rows per pass (decode: the weights stream
/// from memory, the next rows prefetched); several go kQuantTokens per pass through each row
/// (prefill: each block unpacked once for them). Both give a token the same sums, bit for bit;
/// q8_0 and q4_k run kPanelMinTokens or more through panels instead.
template <Simd V, class WB, class XB>
void quant_rows_simd(LinearRows const& p, std::int64_t o0, std::int64_t o1) {
  constexpr int kRows = kQuantRows<V>;
  std::int64_t const nb = act_row_blocks(act_blocks(p.w.format), p.w.cols);
  std::int64_t const stride = p.w.row_bytes();
  std::int64_t const tb = std::max<std::int64_t>(1, token_block(p.xq_stride, p.n_tokens));
  for (std::int64_t b0 = 0; b0 < p.n_tokens; b0 += tb) {
    std::int64_t const b1 = std::min(p.n_tokens, b0 + tb);
    if (b1 - b0 > 1) {
      constexpr int kTile = kQuantTileRows<WB>;
      std::int64_t o = o0;
      if constexpr (kPanelBlock<WB>)
        if (b1 - b0 >= kPanelMinTokens) o = panel_rows<V, WB, XB>(p, o0, o1, nb, b0, b1);
      if constexpr (kTile > 1)
        for (; o + kTile <= o1; o += kTile) quant_rows_tokens<V, kTile, WB, XB>(p, o, nb, b0, b1);
      for (; o < o1; ++o) quant_rows_tokens<V, 1, WB, XB>(p, o, nb, b0, b1);
      continue;
    }
    auto const* x = reinterpret_cast<XB const*>(p.xq_row(b0));
    std::int64_t o = o0;
    if constexpr (V == Simd::kAvx2) {
      // Rows shorter than a page, kRows at a time a page apart.
      std::int64_t const step = page_apart_step(stride);
      if (step > 1)
        for (; o + kRows * step <= o1; o += kRows * step)
          for (std::int64_t s = 0; s < step; ++s) {
            float out[kRows];
            quant_dot<V, kRows>(reinterpret_cast<WB const*>(p.w.row(o + s)), stride * step, x, nb, out);
            for (int r = 0; r < kRows; ++r) store_dot(p, b0, o + s + r * step, out[r]);
          }
    }
    for (; o < o1; o += kRows) {
      int const nr = static_cast<int>(std::min<std::int64_t>(kRows, o1 - o));
      auto const* rows = reinterpret_cast<WB const*>(p.w.row(o));
      float out[kRows];
      if (nr == kRows)
        quant_dot<V, kRows>(rows, stride, x, nb, out);
      else
        for (int r = 0; r < nr; ++r) quant_dot<V, 1>(row_at(rows, stride, r), stride, x, nb, out + r);
      for (int r = 0; r < nr; ++r) store_dot(p, b0, o + r, out[r]);
    }
  }
}
#endif  // QFLASH_HAS_X86_SIMD

/// Rows [o0, o1) of a q8_0 / q4_k / q6_k / int4 projection (WB its block, XB the activations').
template <class WB, class XB>
void quant_rows(arch::CpuIsa isa, LinearRows const& p, std::int64_t o0, std::int64_t o1) {
#if QFLASH_HAS_X86_SIMD
  if (isa >= arch::CpuIsa::kAvx512Vnni) return quant_rows_simd<Simd::kAvx512, WB, XB>(p, o0, o1);
  if (isa >= arch::CpuIsa::kAvx2) return quant_rows_simd<Simd::kAvx2, WB, XB>(p, o0, o1);
#endif
  (void)isa;
  std::int64_t const nb = act_row_blocks(act_blocks(p.w.format), p.w.cols);
  for (std::int64_t o = o0; o < o1; ++o) {
    auto const* row = reinterpret_cast<WB const*>(p.w.row(o));
    for (std::int64_t t = 0; t < p.n_tokens; ++t)
      store_dot(p, t, o, dot_scalar(row, reinterpret_cast<XB const*>(p.xq_row(t)), nb));
  }
}

#if QFLASH_HAS_X86_SIMD
/// Rows [o0, o1) of an f32 / bf16 / f16 projection that F compiles, with vectors V; false
/// for other formats.
template <WeightFormat F, Simd V>
bool float_rows_any(LinearRows const& p, std::int64_t o0, std::int64_t o1) {
  WeightFormat const f = p.w.format;
  if constexpr (compiles<F>(WeightFormat::kF32))
    if (f == WeightFormat::kF32) return float_rows<V, float>(p, o0, o1), true;
  if constexpr (compiles<F>(WeightFormat::kBf16))
    if (f == WeightFormat::kBf16) return float_rows<V, bf16_bits>(p, o0, o1), true;
  if constexpr (compiles<F>(WeightFormat::kF16))
    if (f == WeightFormat::kF16) return float_rows<V, Fp16>(p, o0, o1), true;
  return false;
}
#endif  // QFLASH_HAS_X86_SIMD

/// Runs rows [o0, o1) of the projection with the given ISA level, for the formats F compiles.
template <WeightFormat F>
void linear_rows(arch::CpuIsa isa, LinearRows const& p, std::int64_t o0, std::int64_t o1) {
  WeightFormat const f = p.w.format;
#if QFLASH_HAS_X86_SIMD
  if (p.amx.data && p.amx.format == f && isa >= arch::CpuIsa::kAmx)
    if ((o0 = amx_linear_rows<F>(p, o0, o1)) == o1) return;
#endif
  if constexpr (compiles<F>(WeightFormat::kQ8_0))
    if (f == WeightFormat::kQ8_0) return quant_rows<BlockQ8_0, BlockQ8_0>(isa, p, o0, o1);
  if constexpr (compiles<F>(WeightFormat::kQ4K))
    if (f == WeightFormat::kQ4K) return quant_rows<BlockQ4K, BlockQ8K>(isa, p, o0, o1);
  if constexpr (compiles<F>(WeightFormat::kQ6K))
    if (f == WeightFormat::kQ6K) return quant_rows<BlockQ6K, BlockQ8K>(isa, p, o0, o1);
  if constexpr (compiles<F>(WeightFormat::kInt4))
    if (f == WeightFormat::kInt4) return quant_rows<BlockInt4G128, ActQ8Pair>(isa, p, o0, o1);
#if QFLASH_HAS_X86_SIMD
  if (isa >= arch::CpuIsa::kAvx512 ? float_rows_any<F, Simd::kAvx512>(p, o0, o1)
                                    : isa >= arch::CpuIsa::kAvx2 && float_rows_any<F, Simd::kAvx2>(p, o0, o1))
    return;
#endif
  linear_rows_decoded(isa, p, o0, o1);
}

/// Quantizes n_rows activation rows of `cols` values (xs floats apart) to `k` into `out`,
/// `stride` bytes per row, in parallel when there are many.
inline void quantize_rows(ActBlocks k, float const* x, std::int64_t xs, std::int64_t n_rows, std::int64_t cols,
                          std::byte* out, std::int64_t stride) {
  parallel_for(0, n_rows, cols * 4, [&](std::int64_t t) { quantize_activations(k, x + t * xs, cols, out + t * stride); });
}

/// Output rows per work item: small enough to balance `threads`, large enough to amortise
/// scheduling; a multiple of `multiple` (the micro-tile's rows; AMX: a pass's 32).
inline std::int64_t row_block(std::int64_t rows, int threads, std::int64_t multiple = kTileRows) {
  std::int64_t const block = std::clamp<std::int64_t>(rows / (8 * threads), multiple, std::max<std::int64_t>(64, multiple));
  return (block + multiple - 1) / multiple * multiple;
}

/// Packs p's tokens for AMX tiles into `buf` and points p.amx at them.
inline void amx_pack(LinearRows& p, std::vector<std::byte>& buf) {
  buf.resize(static_cast<std::size_t>(amx_packed_bytes(p.w.format, p.n_tokens, p.w.cols)));
  parallel_for(0, (p.n_tokens + kAmxTokens - 1) / kAmxTokens, kAmxTokens * p.w.cols * 8,
               [&](std::int64_t j) { amx_pack_tile(p, j, buf.data()); });
  p.amx = {buf.data(), p.w.cols / kAmxCols, p.w.format};
}

/// Most projections one call takes (kernels/linear_group).
inline constexpr int kMaxLinearParts = 4;

/// Projections of one input (same x, x_stride, n_tokens and columns; checked by the caller)
/// with an explicit ISA level, in one parallel region over every part's row blocks. The
/// activations are quantized once per kind of 8-bit block and packed for AMX once per format,
/// and each part's rows go in the blocks linear() gives it alone, so every part's results are
/// a lone call's, bit for bit. Compiled for the weight formats F (kAny: all of them).
template <WeightFormat F = WeightFormat::kAny>
void linear_parts(arch::CpuIsa isa, std::span<LinearArgs const> parts) {
  std::size_t const n = parts.size();
  thread_local SlotScratch<float> scratch;  // the calling thread's; items reach it through p
  // The calling thread's buffers (workers reach them through p.xq and p.amx, never by name).
  thread_local std::array<std::vector<std::byte>, kMaxLinearParts> quantized, packed;
  scratch.prepare();
  std::array<LinearRows, kMaxLinearParts> p{};
  std::array<std::int64_t, kMaxLinearParts> block{};
  std::array<std::int64_t, kMaxLinearParts + 1> block_begin{};  // part i: blocks [block_begin[i], block_begin[i + 1])
  std::int64_t work = 0;
  for (std::size_t i = 0; i < n; ++i) {
    LinearArgs const& a = parts[i];
    WeightFormat const f = a.w.format;
    LinearRows& r = p[i];
    r = {a.w, a.x, a.x_stride ? a.x_stride : a.w.cols, a.y, a.y_stride ? a.y_stride : a.w.rows, a.n_tokens,
         a.accumulate};
    r.scratch = &scratch;
    if (uses_quantized_activations(f)) {
      // Each token's activations quantized once, shared by every row, and by every part
      // with the same kind of blocks.
      for (std::size_t j = 0; j < i && !r.xq; ++j)
        if (p[j].xq && act_blocks(p[j].w.format) == act_blocks(f)) r.xq = p[j].xq, r.xq_stride = p[j].xq_stride;
      if (!r.xq) {
        r.xq_stride = act_row_bytes(f, a.w.cols);
        quantized[i].resize(static_cast<std::size_t>(r.xq_stride * a.n_tokens));
        r.xq = quantized[i].data();
        quantize_rows(act_blocks(f), r.x, r.xs, a.n_tokens, a.w.cols, quantized[i].data(), r.xq_stride);
      }
    }
    bool const amx = amx_applies(isa, f, a.w.rows, a.w.cols, a.n_tokens);
    if (amx) {
      for (std::size_t j = 0; j < i && !r.amx.data; ++j)
        if (p[j].amx.data && p[j].amx.format == f) r.amx = p[j].amx;
      if (!r.amx.data) amx_pack(r, packed[i]);
    }
    block[i] = row_block(a.w.rows, max_threads(),
                         amx                                ? 2 * kAmxRows
                         : panels_apply(isa, f, a.n_tokens) ? panel_rows_at(isa)
                                                            : kTileRows);
    block_begin[i + 1] = block_begin[i] + (a.w.rows + block[i] - 1) / block[i];
    work += a.w.rows * a.w.cols * std::max<std::int64_t>(1, a.n_tokens);
  }
  std::int64_t const n_blocks = block_begin[n];
  parallel_for(0, n_blocks, (work + n_blocks - 1) / n_blocks, [&](std::int64_t k) {
    std::size_t i = 0;
    while (k >= block_begin[i + 1]) ++i;
    std::int64_t const o0 = (k - block_begin[i]) * block[i];
    linear_rows<F>(isa, p[i], o0, std::min(p[i].w.rows, o0 + block[i]));
  });
}

/// The whole projection with an explicit ISA level (tests run every level this CPU has);
/// compiled for the weight formats F (kAny: all of them).
template <WeightFormat F = WeightFormat::kAny>
Status linear(arch::CpuIsa isa, LinearArgs const& a) {
  if (Status s = can_implement_linear<MoeSpec{.weights = F}>(a); s != Status::kSuccess) return s;
  linear_parts<F>(isa, std::span(&a, 1));
  return Status::kSuccess;
}

}  // namespace qflash::kernels::cpu

namespace qflash::kernels {

template <MoeSpec S>
Status launch_linear(arch::Cpu, LinearArgs const& args, stream_t) {
  return cpu::linear<S.weights>(arch::cpu_isa(), args);
}

}  // namespace qflash::kernels
