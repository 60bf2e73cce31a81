/// @file
/// CPU kernels/gated_delta: both forms of op.hpp, threaded with parallel_for.
///
/// Everything reduces to four fp32 row primitives, chosen per ISA at run time (register-blocked
/// AVX-512 or AVX2 intrinsics; otherwise a plain-C++ body compiled for the baseline):
///   row_gemv:      c[0:n] = beta * c + alpha * sum_{d<kd} a[d] * B[d, 0:n]
///   rows4_gemm:    row_gemv for four rows of a sharing every load of B (the chunked GEMMs)
///   rank1_project: S[d, 0:n] = decay * S[d, 0:n] + k[d] * delta[0:n];  o[0:n] = sum_d q[d] * S[d, 0:n]
///   l2norm_scaled: y = x * scale / sqrt(sum(x^2) + eps)
///
/// The v-columns of S evolve independently (u, δ, the update, o and every chunked product are
/// column-wise), so both forms work on tiles of kTile state columns copied to contiguous,
/// 64-byte-aligned scratch. A d_k x 64 tile then stays in L1; read in place, the state's own
/// row stride (512 B at d_v = 128) maps a tile onto half the L1 sets and thrashes (measured on
/// row_gemv: 2.2x slower; unaligned rows cost another 1.4x).
///
/// q and k are normalised once per token block into head-major scratch (NormBlock).
/// kRecurrent: work items are (value head, tile); each runs every token of the block on its tile.
/// kChunked: work items are value heads; per chunk the L x L matrices (Gram, A, Γ) and W are
/// built once, A⁻¹ is applied by blocked forward substitution (A is unit lower triangular), then
/// each state tile gets U, V', O and its update. Scratch is one allocation per worker per block.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/core/parallel.hpp"
#include "qflash/kernels/common/cpu_simd.hpp"
#include "qflash/kernels/gated_delta/op.hpp"
#include "qflash/kernels/gated_delta/ref.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QFLASH_GATED_DELTA_X86 1
#include <immintrin.h>
#else
#define QFLASH_GATED_DELTA_X86 0
#endif

namespace qflash::kernels::cpu {

namespace gated_delta_detail {

/// v-columns of the state handled together: 4 AVX-512 vectors. The d_k x 64 tile (32 KiB at
/// d_k = 128) stays in the 48 KiB L1 of the measured Xeon (Sapphire Rapids class) while a
/// recurrent work item runs all its tokens, or a chunk runs its tile.
inline constexpr int kTile = 64;

// ---- Row primitives: plain body (vectorised by the compiler for the caller's target) -------

/// c[0:n] = beta * c[0:n] + alpha * sum_{d<kd} a[d] * b[d * ldb + 0:n]; c is not read when
/// beta == 0. Rows of b must not overlap c.
QFLASH_FORCEINLINE void row_gemv_plain(int kd, float const* a, float const* b, std::int64_t ldb,
                                       int n, float* c, float alpha, float beta) {
  constexpr int kW = 64;
  for (int c0 = 0; c0 < n; c0 += kW) {
    int const w = n - c0 < kW ? n - c0 : kW;
    float acc[kW];
    for (int j = 0; j < kW; ++j) acc[j] = 0.0f;
    for (int d = 0; d < kd; ++d) {
      float const ad = a[d];
      float const* br = b + d * ldb + c0;
      for (int j = 0; j < w; ++j) acc[j] += ad * br[j];
    }
    float* cr = c + c0;
    if (beta == 0.0f) {
      for (int j = 0; j < w; ++j) cr[j] = alpha * acc[j];
    } else {
      for (int j = 0; j < w; ++j) cr[j] = beta * cr[j] + alpha * acc[j];
    }
  }
}

/// For d < kd: s[d, 0:n] = decay * s[d, 0:n] + k[d] * delta[0:n]; then o[0:n] = sum_d q[d] s[d, 0:n]
/// with the updated rows. s rows are lds apart.
QFLASH_FORCEINLINE void rank1_project_plain(int kd, float decay, float const* k, float const* delta,
                                            float const* q, float* s, std::int64_t lds, int n,
                                            float* o) {
  constexpr int kW = 64;
  for (int c0 = 0; c0 < n; c0 += kW) {
    int const w = n - c0 < kW ? n - c0 : kW;
    float acc[kW];
    for (int j = 0; j < kW; ++j) acc[j] = 0.0f;
    float const* dl = delta + c0;
    for (int d = 0; d < kd; ++d) {
      float* sr = s + d * lds + c0;
      float const kd_ = k[d], qd = q[d];
      for (int j = 0; j < w; ++j) {
        float const x = decay * sr[j] + kd_ * dl[j];
        sr[j] = x;
        acc[j] += qd * x;
      }
    }
    for (int j = 0; j < w; ++j) o[c0 + j] = acc[j];
  }
}

/// Four rows at once: for r < 4, c[r * ldc + 0:n] = beta * c[r] + alpha[r * alpha_stride] *
/// sum_{d<kd} a[r * lda + d] * b[d * ldb + 0:n]. The AVX-512 version shares every load of b
/// among the four rows; this one is four row_gemv.
QFLASH_FORCEINLINE void rows4_gemm_plain(int kd, float const* a, std::int64_t lda, float const* b,
                                         std::int64_t ldb, int n, float* c, std::int64_t ldc,
                                         float const* alpha, std::int64_t alpha_stride, float beta) {
  for (int r = 0; r < 4; ++r)
    row_gemv_plain(kd, a + r * lda, b, ldb, n, c + r * ldc, alpha[r * alpha_stride], beta);
}

inline void rows4_gemm_baseline(int kd, float const* a, std::int64_t lda, float const* b,
                                std::int64_t ldb, int n, float* c, std::int64_t ldc,
                                float const* alpha, std::int64_t alpha_stride, float beta) {
  rows4_gemm_plain(kd, a, lda, b, ldb, n, c, ldc, alpha, alpha_stride, beta);
}
inline void row_gemv_baseline(int kd, float const* a, float const* b, std::int64_t ldb, int n,
                              float* c, float alpha, float beta) {
  row_gemv_plain(kd, a, b, ldb, n, c, alpha, beta);
}
inline void rank1_project_baseline(int kd, float decay, float const* k, float const* delta,
                                   float const* q, float* s, std::int64_t lds, int n, float* o) {
  rank1_project_plain(kd, decay, k, delta, q, s, lds, n, o);
}

#if QFLASH_GATED_DELTA_X86
// ---- Row primitives: AVX2, the accumulators in registers -------------------------------------

/// Lanes [0, w - 8 v) of vector v of a block, as a maskload / maskstore mask.
__attribute__((target("avx2,fma,f16c"))) inline __m256i avx2_mask(int w, int v) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(std::clamp(w - 8 * v, 0, 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/// rows4_gemm's product for R rows of a on one block of 8 NV columns, the last w of them masked
/// unless kFull. Per column: FMAs over d in order, then alpha times the sum, plus beta c by an
/// FMA (the arithmetic of rows4_gemm_avx512). With several rows each load of b is shared by
/// all of them; with one it is an FMA operand.
template <int R, int NV, bool kFull>
__attribute__((target("avx2,fma,f16c"))) inline void rows_block_avx2(int kd, float const* a, std::int64_t lda,
                                                                     float const* b, std::int64_t ldb, int w,
                                                                     float* c, std::int64_t ldc, float const* alpha,
                                                                     std::int64_t alpha_stride, float beta) {
  static_assert(R * NV + (R > 1 ? NV : 0) <= 16, "accumulators and shared loads fit the 16 registers");
  __m256i mask[NV];
  for (int v = 0; v < NV; ++v) mask[v] = kFull ? _mm256_set1_epi32(-1) : avx2_mask(w, v);
  __m256 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int d = 0; d < kd; ++d) {
    __m256 bv[NV];
    for (int v = 0; v < NV; ++v) {
      bv[v] = kFull ? _mm256_loadu_ps(b + d * ldb + 8 * v) : _mm256_maskload_ps(b + d * ldb + 8 * v, mask[v]);
      if constexpr (R > 1) __asm__("" : "+x"(bv[v]));  // one load shared by the rows, not folded into each FMA
    }
    for (int r = 0; r < R; ++r) {
      __m256 const av = _mm256_broadcast_ss(a + r * lda + d);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(av, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 const va = _mm256_set1_ps(alpha[r * alpha_stride]), vb = _mm256_set1_ps(beta);
    float* cr = c + r * ldc;
    for (int v = 0; v < NV; ++v) {
      __m256 x = _mm256_mul_ps(acc[r][v], va);
      if (beta != 0.0f)
        x = _mm256_fmadd_ps(kFull ? _mm256_loadu_ps(cr + 8 * v) : _mm256_maskload_ps(cr + 8 * v, mask[v]), vb, x);
      if (kFull)
        _mm256_storeu_ps(cr + 8 * v, x);
      else
        _mm256_maskstore_ps(cr + 8 * v, mask[v], x);
    }
  }
}

/// rows_block_avx2 for a block of w <= 8 NV columns: the fewest vectors that hold it.
template <int R, int NV>
__attribute__((target("avx2,fma,f16c"))) inline void rows_width_avx2(int kd, float const* a, std::int64_t lda,
                                                                     float const* b, std::int64_t ldb, int w,
                                                                     float* c, std::int64_t ldc, float const* alpha,
                                                                     std::int64_t alpha_stride, float beta) {
  if constexpr (NV > 1)
    if (w <= 8 * (NV - 1)) return rows_width_avx2<R, NV - 1>(kd, a, lda, b, ldb, w, c, ldc, alpha, alpha_stride, beta);
  if (w == 8 * NV)
    rows_block_avx2<R, NV, true>(kd, a, lda, b, ldb, w, c, ldc, alpha, alpha_stride, beta);
  else
    rows_block_avx2<R, NV, false>(kd, a, lda, b, ldb, w, c, ldc, alpha, alpha_stride, beta);
}

/// R rows of a times b, in blocks of 8 NV columns.
template <int R, int NV>
__attribute__((target("avx2,fma,f16c"))) inline void rows_gemm_avx2(int kd, float const* a, std::int64_t lda,
                                                                    float const* b, std::int64_t ldb, int n,
                                                                    float* c, std::int64_t ldc, float const* alpha,
                                                                    std::int64_t alpha_stride, float beta) {
  for (int c0 = 0; c0 < n; c0 += 8 * NV)
    rows_width_avx2<R, NV>(kd, a, lda, b + c0, ldb, std::min(8 * NV, n - c0), c + c0, ldc, alpha, alpha_stride, beta);
}

/// Four rows: 4 x 3 accumulators and 3 shared loads of b per d.
__attribute__((target("avx2,fma,f16c"))) inline void rows4_gemm_avx2(
    int kd, float const* a, std::int64_t lda, float const* b, std::int64_t ldb, int n, float* c,
    std::int64_t ldc, float const* alpha, std::int64_t alpha_stride, float beta) {
  rows_gemm_avx2<4, 3>(kd, a, lda, b, ldb, n, c, ldc, alpha, alpha_stride, beta);
}

/// One row: 8 accumulators (64 columns), so 8 FMA chains are in flight.
__attribute__((target("avx2,fma,f16c"))) inline void row_gemv_avx2(int kd, float const* a, float const* b,
                                                                   std::int64_t ldb, int n, float* c, float alpha,
                                                                   float beta) {
  rows_gemm_avx2<1, 8>(kd, a, 0, b, ldb, n, c, 0, &alpha, 0, beta);
}

/// rank1_project on one block of 8 NV columns (the last w masked unless kFull): per column
/// s = k[d] delta + decay s, then o += q[d] s, over d in order (rank1_project_avx512's arithmetic).
template <int NV, bool kFull>
__attribute__((target("avx2,fma,f16c"))) inline void rank1_block_avx2(int kd, float decay, float const* k,
                                                                      float const* delta, float const* q, float* s,
                                                                      std::int64_t lds, int w, float* o) {
  __m256i mask[NV];
  __m256 dv[NV], ov[NV];
  for (int v = 0; v < NV; ++v) {
    mask[v] = kFull ? _mm256_set1_epi32(-1) : avx2_mask(w, v);
    dv[v] = kFull ? _mm256_loadu_ps(delta + 8 * v) : _mm256_maskload_ps(delta + 8 * v, mask[v]);
    ov[v] = _mm256_setzero_ps();
  }
  __m256 const dec = _mm256_set1_ps(decay);
  for (int d = 0; d < kd; ++d) {
    __m256 const kb = _mm256_broadcast_ss(k + d), qb = _mm256_broadcast_ss(q + d);
    float* const sr = s + d * lds;
    for (int v = 0; v < NV; ++v) {
      __m256 const old = kFull ? _mm256_loadu_ps(sr + 8 * v) : _mm256_maskload_ps(sr + 8 * v, mask[v]);
      __m256 const x = _mm256_fmadd_ps(kb, dv[v], _mm256_mul_ps(dec, old));
      if (kFull)
        _mm256_storeu_ps(sr + 8 * v, x);
      else
        _mm256_maskstore_ps(sr + 8 * v, mask[v], x);
      ov[v] = _mm256_fmadd_ps(qb, x, ov[v]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    if (kFull)
      _mm256_storeu_ps(o + 8 * v, ov[v]);
    else
      _mm256_maskstore_ps(o + 8 * v, mask[v], ov[v]);
  }
}

/// rank1_block_avx2 for a block of w <= 8 NV columns: the fewest vectors that hold it.
template <int NV>
__attribute__((target("avx2,fma,f16c"))) inline void rank1_width_avx2(int kd, float decay, float const* k,
                                                                      float const* delta, float const* q, float* s,
                                                                      std::int64_t lds, int w, float* o) {
  if constexpr (NV > 1)
    if (w <= 8 * (NV - 1)) return rank1_width_avx2<NV - 1>(kd, decay, k, delta, q, s, lds, w, o);
  if (w == 8 * NV)
    rank1_block_avx2<NV, true>(kd, decay, k, delta, q, s, lds, w, o);
  else
    rank1_block_avx2<NV, false>(kd, decay, k, delta, q, s, lds, w, o);
}

/// Blocks of 32 columns: 4 delta vectors and 4 sums stay in registers.
__attribute__((target("avx2,fma,f16c"))) inline void rank1_project_avx2(int kd, float decay, float const* k,
                                                                        float const* delta, float const* q, float* s,
                                                                        std::int64_t lds, int n, float* o) {
  for (int c0 = 0; c0 < n; c0 += 32)
    rank1_width_avx2<4>(kd, decay, k, delta + c0, q, s + c0, lds, std::min(32, n - c0), o + c0);
}

// ---- Row primitives: AVX-512, up to 4 vectors (64 columns) held in registers ----------------

#define QFLASH_GATED_DELTA_AVX512 \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")))

/// Lane mask of vector v (columns [16v, 16v + 16)) in a block of w columns.
QFLASH_GATED_DELTA_AVX512 inline __mmask16 avx512_mask(int w, int v) {
  int const r = std::clamp(w - 16 * v, 0, 16);
  return static_cast<__mmask16>((1u << r) - 1u);
}

// The blocks below keep their vectors in named variables, not arrays: GCC 12 spills __m512
// arrays to the stack on every iteration, which halves the FMA rate.

/// row_gemv on one block of w <= 16 * NV columns (NV <= 4). Two accumulator sets (even and
/// odd d) keep 2 * NV independent FMA chains in flight.
template <int NV>
QFLASH_GATED_DELTA_AVX512 inline void row_gemv_block_avx512(int kd, float const* a, float const* b,
                                                            std::int64_t ldb, int w, float* c,
                                                            float alpha, float beta) {
  static_assert(NV >= 1 && NV <= 4);
  __mmask16 const m0 = avx512_mask(w, 0), m1 = avx512_mask(w, 1), m2 = avx512_mask(w, 2),
                  m3 = avx512_mask(w, 3);
  __m512 x0 = _mm512_setzero_ps(), x1 = x0, x2 = x0, x3 = x0;  // even d
  __m512 y0 = x0, y1 = x0, y2 = x0, y3 = x0;                    // odd d
  int d = 0;
  for (; d + 1 < kd; d += 2) {
    __m512 const ae = _mm512_set1_ps(a[d]);
    __m512 const ao = _mm512_set1_ps(a[d + 1]);
    float const* be = b + d * ldb;
    float const* bo = be + ldb;
    x0 = _mm512_fmadd_ps(ae, _mm512_maskz_loadu_ps(m0, be), x0);
    y0 = _mm512_fmadd_ps(ao, _mm512_maskz_loadu_ps(m0, bo), y0);
    if constexpr (NV > 1) {
      x1 = _mm512_fmadd_ps(ae, _mm512_maskz_loadu_ps(m1, be + 16), x1);
      y1 = _mm512_fmadd_ps(ao, _mm512_maskz_loadu_ps(m1, bo + 16), y1);
    }
    if constexpr (NV > 2) {
      x2 = _mm512_fmadd_ps(ae, _mm512_maskz_loadu_ps(m2, be + 32), x2);
      y2 = _mm512_fmadd_ps(ao, _mm512_maskz_loadu_ps(m2, bo + 32), y2);
    }
    if constexpr (NV > 3) {
      x3 = _mm512_fmadd_ps(ae, _mm512_maskz_loadu_ps(m3, be + 48), x3);
      y3 = _mm512_fmadd_ps(ao, _mm512_maskz_loadu_ps(m3, bo + 48), y3);
    }
  }
  if (d < kd) {
    __m512 const ae = _mm512_set1_ps(a[d]);
    float const* be = b + d * ldb;
    x0 = _mm512_fmadd_ps(ae, _mm512_maskz_loadu_ps(m0, be), x0);
    if constexpr (NV > 1) x1 = _mm512_fmadd_ps(ae, _mm512_maskz_loadu_ps(m1, be + 16), x1);
    if constexpr (NV > 2) x2 = _mm512_fmadd_ps(ae, _mm512_maskz_loadu_ps(m2, be + 32), x2);
    if constexpr (NV > 3) x3 = _mm512_fmadd_ps(ae, _mm512_maskz_loadu_ps(m3, be + 48), x3);
  }
  __m512 const va = _mm512_set1_ps(alpha);
  __m512 const vb = _mm512_set1_ps(beta);
  auto finish = [&](__m512 even, __m512 odd, __mmask16 m, float* cv)
                    QFLASH_GATED_DELTA_AVX512 {
    __m512 r = _mm512_mul_ps(_mm512_add_ps(even, odd), va);
    if (beta != 0.0f) r = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, cv), vb, r);
    _mm512_mask_storeu_ps(cv, m, r);
  };
  finish(x0, y0, m0, c);
  if constexpr (NV > 1) finish(x1, y1, m1, c + 16);
  if constexpr (NV > 2) finish(x2, y2, m2, c + 32);
  if constexpr (NV > 3) finish(x3, y3, m3, c + 48);
}

QFLASH_GATED_DELTA_AVX512 inline void row_gemv_avx512(int kd, float const* a, float const* b,
                                                      std::int64_t ldb, int n, float* c, float alpha,
                                                      float beta) {
  for (int c0 = 0; c0 < n; c0 += 64) {
    int const w = std::min(64, n - c0);
    switch ((w + 15) / 16) {
      case 1: row_gemv_block_avx512<1>(kd, a, b + c0, ldb, w, c + c0, alpha, beta); break;
      case 2: row_gemv_block_avx512<2>(kd, a, b + c0, ldb, w, c + c0, alpha, beta); break;
      case 3: row_gemv_block_avx512<3>(kd, a, b + c0, ldb, w, c + c0, alpha, beta); break;
      default: row_gemv_block_avx512<4>(kd, a, b + c0, ldb, w, c + c0, alpha, beta); break;
    }
  }
}

/// rank1_project on one block of w <= 16 * NV columns (NV <= 4).
template <int NV>
QFLASH_GATED_DELTA_AVX512 inline void rank1_project_block_avx512(int kd, float decay,
                                                                 float const* k, float const* delta,
                                                                 float const* q, float* s,
                                                                 std::int64_t lds, int w, float* o) {
  static_assert(NV >= 1 && NV <= 4);
  __mmask16 const m0 = avx512_mask(w, 0), m1 = avx512_mask(w, 1), m2 = avx512_mask(w, 2),
                  m3 = avx512_mask(w, 3);
  __m512 const d0 = _mm512_maskz_loadu_ps(m0, delta), d1 = _mm512_maskz_loadu_ps(m1, delta + 16),
               d2 = _mm512_maskz_loadu_ps(m2, delta + 32), d3 = _mm512_maskz_loadu_ps(m3, delta + 48);
  __m512 o0 = _mm512_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
  __m512 const dec = _mm512_set1_ps(decay);
  for (int d = 0; d < kd; ++d) {
    __m512 const kb = _mm512_set1_ps(k[d]);
    __m512 const qb = _mm512_set1_ps(q[d]);
    float* sr = s + d * lds;
    __m512 const s0 = _mm512_fmadd_ps(kb, d0, _mm512_mul_ps(dec, _mm512_maskz_loadu_ps(m0, sr)));
    _mm512_mask_storeu_ps(sr, m0, s0);
    o0 = _mm512_fmadd_ps(qb, s0, o0);
    if constexpr (NV > 1) {
      __m512 const s1 = _mm512_fmadd_ps(kb, d1, _mm512_mul_ps(dec, _mm512_maskz_loadu_ps(m1, sr + 16)));
      _mm512_mask_storeu_ps(sr + 16, m1, s1);
      o1 = _mm512_fmadd_ps(qb, s1, o1);
    }
    if constexpr (NV > 2) {
      __m512 const s2 = _mm512_fmadd_ps(kb, d2, _mm512_mul_ps(dec, _mm512_maskz_loadu_ps(m2, sr + 32)));
      _mm512_mask_storeu_ps(sr + 32, m2, s2);
      o2 = _mm512_fmadd_ps(qb, s2, o2);
    }
    if constexpr (NV > 3) {
      __m512 const s3 = _mm512_fmadd_ps(kb, d3, _mm512_mul_ps(dec, _mm512_maskz_loadu_ps(m3, sr + 48)));
      _mm512_mask_storeu_ps(sr + 48, m3, s3);
      o3 = _mm512_fmadd_ps(qb, s3, o3);
    }
  }
  _mm512_mask_storeu_ps(o, m0, o0);
  if constexpr (NV > 1) _mm512_mask_storeu_ps(o + 16, m1, o1);
  if constexpr (NV > 2) _mm512_mask_storeu_ps(o + 32, m2, o2);
  if constexpr (NV > 3) _mm512_mask_storeu_ps(o + 48, m3, o3);
}

QFLASH_GATED_DELTA_AVX512 inline void rank1_project_avx512(int kd, float decay, float const* k,
                                                           float const* delta, float const* q,
                                                           float* s, std::int64_t lds, int n,
                                                           float* o) {
  for (int c0 = 0; c0 < n; c0 += 64) {
    int const w = std::min(64, n - c0);
    float const* dd = delta + c0;
    float* ss = s + c0;
    float* oo = o + c0;
    switch ((w + 15) / 16) {
      case 1: rank1_project_block_avx512<1>(kd, decay, k, dd, q, ss, lds, w, oo); break;
      case 2: rank1_project_block_avx512<2>(kd, decay, k, dd, q, ss, lds, w, oo); break;
      case 3: rank1_project_block_avx512<3>(kd, decay, k, dd, q, ss, lds, w, oo); break;
      default: rank1_project_block_avx512<4>(kd, decay, k, dd, q, ss, lds, w, oo); break;
    }
  }
}

/// Finishes one row of rows4_gemm: c = beta * c + alpha * acc over four vectors.
QFLASH_GATED_DELTA_AVX512 inline void rows4_store_avx512(__m512 x0, __m512 x1, __m512 x2, __m512 x3,
                                                         __mmask16 const (&m)[4], float* c,
                                                         float alpha, float beta) {
  __m512 const va = _mm512_set1_ps(alpha);
  __m512 const vb = _mm512_set1_ps(beta);
  __m512 r0 = _mm512_mul_ps(x0, va), r1 = _mm512_mul_ps(x1, va), r2 = _mm512_mul_ps(x2, va),
         r3 = _mm512_mul_ps(x3, va);
  if (beta != 0.0f) {
    r0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m[0], c), vb, r0);
    r1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m[1], c + 16), vb, r1);
    r2 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m[2], c + 32), vb, r2);
    r3 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m[3], c + 48), vb, r3);
  }
  _mm512_mask_storeu_ps(c, m[0], r0);
  _mm512_mask_storeu_ps(c + 16, m[1], r1);
  _mm512_mask_storeu_ps(c + 32, m[2], r2);
  _mm512_mask_storeu_ps(c + 48, m[3], r3);
}

/// rows4_gemm: 4 rows x 64 columns = 16 accumulators; per d, 4 loads of b and 4 broadcasts
/// feed 16 FMAs, so the FMA ports rather than the load ports set the pace.
QFLASH_GATED_DELTA_AVX512 inline void rows4_gemm_avx512(int kd, float const* a, std::int64_t lda,
                                                        float const* b, std::int64_t ldb, int n,
                                                        float* c, std::int64_t ldc,
                                                        float const* alpha,
                                                        std::int64_t alpha_stride, float beta) {
  float const* a0 = a;
  float const* a1 = a + lda;
  float const* a2 = a + 2 * lda;
  float const* a3 = a + 3 * lda;
  for (int c0 = 0; c0 < n; c0 += 64) {
    int const w = std::min(64, n - c0);
    __mmask16 const m[4] = {avx512_mask(w, 0), avx512_mask(w, 1), avx512_mask(w, 2), avx512_mask(w, 3)};
    __m512 const z = _mm512_setzero_ps();
    __m512 x00 = z, x01 = z, x02 = z, x03 = z, x10 = z, x11 = z, x12 = z, x13 = z;
    __m512 x20 = z, x21 = z, x22 = z, x23 = z, x30 = z, x31 = z, x32 = z, x33 = z;
    float const* br = b + c0;
    for (int d = 0; d < kd; ++d, br += ldb) {
      __m512 const b0 = _mm512_maskz_loadu_ps(m[0], br);
      __m512 const b1 = _mm512_maskz_loadu_ps(m[1], br + 16);
      __m512 const b2 = _mm512_maskz_loadu_ps(m[2], br + 32);
      __m512 const b3 = _mm512_maskz_loadu_ps(m[3], br + 48);
      __m512 av = _mm512_set1_ps(a0[d]);
      x00 = _mm512_fmadd_ps(av, b0, x00); x01 = _mm512_fmadd_ps(av, b1, x01);
      x02 = _mm512_fmadd_ps(av, b2, x02); x03 = _mm512_fmadd_ps(av, b3, x03);
      av = _mm512_set1_ps(a1[d]);
      x10 = _mm512_fmadd_ps(av, b0, x10); x11 = _mm512_fmadd_ps(av, b1, x11);
      x12 = _mm512_fmadd_ps(av, b2, x12); x13 = _mm512_fmadd_ps(av, b3, x13);
      av = _mm512_set1_ps(a2[d]);
      x20 = _mm512_fmadd_ps(av, b0, x20); x21 = _mm512_fmadd_ps(av, b1, x21);
      x22 = _mm512_fmadd_ps(av, b2, x22); x23 = _mm512_fmadd_ps(av, b3, x23);
      av = _mm512_set1_ps(a3[d]);
      x30 = _mm512_fmadd_ps(av, b0, x30); x31 = _mm512_fmadd_ps(av, b1, x31);
      x32 = _mm512_fmadd_ps(av, b2, x32); x33 = _mm512_fmadd_ps(av, b3, x33);
    }
    rows4_store_avx512(x00, x01, x02, x03, m, c + c0, alpha[0], beta);
    rows4_store_avx512(x10, x11, x12, x13, m, c + ldc + c0, alpha[alpha_stride], beta);
    rows4_store_avx512(x20, x21, x22, x23, m, c + 2 * ldc + c0, alpha[2 * alpha_stride], beta);
    rows4_store_avx512(x30, x31, x32, x33, m, c + 3 * ldc + c0, alpha[3 * alpha_stride], beta);
  }
}

#undef QFLASH_GATED_DELTA_AVX512
#endif  // QFLASH_GATED_DELTA_X86

/// l2norm_scaled: y[0:n] = x[0:n] * scale / sqrt(sum(x^2) + eps).
QFLASH_FORCEINLINE void l2norm_plain(float const* x, int n, float eps, float scale, float* y) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  float const f = scale / std::sqrt(ss + eps);
  for (int i = 0; i < n; ++i) y[i] = x[i] * f;
}
inline void l2norm_baseline(float const* x, int n, float eps, float scale, float* y) {
  l2norm_plain(x, n, eps, scale, y);
}
#if QFLASH_GATED_DELTA_X86
__attribute__((target("avx2,fma,f16c"))) inline void l2norm_avx2(float const* x, int n, float eps,
                                                                 float scale, float* y) {
  l2norm_plain(x, n, eps, scale, y);
}
__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq"))) inline void l2norm_avx512(
    float const* x, int n, float eps, float scale, float* y) {
  l2norm_plain(x, n, eps, scale, y);
}
#endif

/// The row primitives of one ISA level.
struct RowKernels {
  void (*row_gemv)(int kd, float const* a, float const* b, std::int64_t ldb, int n, float* c,
                   float alpha, float beta);
  void (*rank1_project)(int kd, float decay, float const* k, float const* delta, float const* q,
                        float* s, std::int64_t lds, int n, float* o);
  void (*l2norm_scaled)(float const* x, int n, float eps, float scale, float* y);
  void (*rows4_gemm)(int kd, float const* a, std::int64_t lda, float const* b, std::int64_t ldb,
                     int n, float* c, std::int64_t ldc, float const* alpha,
                     std::int64_t alpha_stride, float beta);

  /// rows4_gemm over m rows: blocks of four, then row_gemv for the rest.
  void gemm_rows(int m, int kd, float const* a, std::int64_t lda, float const* b, std::int64_t ldb,
                 int n, float* c, std::int64_t ldc, float const* alpha, std::int64_t alpha_stride,
                 float beta) const {
    int r = 0;
    for (; r + 4 <= m; r += 4)
      rows4_gemm(kd, a + r * lda, lda, b, ldb, n, c + r * ldc, ldc, alpha + r * alpha_stride,
                 alpha_stride, beta);
    for (; r < m; ++r) row_gemv(kd, a + r * lda, b, ldb, n, c + r * ldc, alpha[r * alpha_stride], beta);
  }
};

inline RowKernels row_kernels(arch::CpuIsa isa) {
#if QFLASH_GATED_DELTA_X86
  if (isa >= arch::CpuIsa::kAvx512)
    return {&row_gemv_avx512, &rank1_project_avx512, &l2norm_avx512, &rows4_gemm_avx512};
  if (isa >= arch::CpuIsa::kAvx2)
    return {&row_gemv_avx2, &rank1_project_avx2, &l2norm_avx2, &rows4_gemm_avx2};
#endif
  (void)isa;
  return {&row_gemv_baseline, &rank1_project_baseline, &l2norm_baseline, &rows4_gemm_baseline};
}

// ---- Shared pieces -------------------------------------------------------------------------

/// n rounded up to a whole AVX-512 vector (16 floats), so every scratch row starts on a cache
/// line: unaligned 64-byte loads and stores split across two lines and cost twice.
constexpr std::int64_t pad16(std::int64_t n) { return (n + 15) / 16 * 16; }

/// A reusable float buffer whose data(n) is 64-byte aligned and holds n floats; it grows when
/// asked for more and never shrinks, so a warm decode step allocates nothing. Not zeroed:
/// every scratch element is written before it is read. Debug builds fill it with NaN on each
/// data(n) so a read of an unwritten element shows up in the outputs the tests compare.
class AlignedFloats {
 public:
  float* data(std::size_t n) {
    if (n > capacity_) {
      buf_.reset(new float[n + 16]);
      capacity_ = n;
    }
    auto const misalign = reinterpret_cast<std::uintptr_t>(buf_.get()) % 64;
    float* p = buf_.get() + (misalign ? (64 - misalign) / sizeof(float) : 0);
#if !defined(NDEBUG)
    std::fill_n(p, n, std::numeric_limits<float>::quiet_NaN());
#endif
    return p;
  }

 private:
  std::unique_ptr<float[]> buf_;
  std::size_t capacity_ = 0;
};

/// Operand addressing of one call.
struct Layout {
  std::int64_t qs, ks, vs;  // token strides of q, k, v
  float q_scale;            // 1 / sqrt(d_k)

  explicit Layout(GatedDeltaArgs const& a)
      : qs(a.q_stride_or_default()),
        ks(a.k_stride_or_default()),
        vs(a.v_stride_or_default()),
        q_scale(a.q_scale()) {}
};

/// Runs `fn(item, scratch)` for items [0, n_items) split into one contiguous range per worker;
/// each worker uses its own 64-byte-aligned scratch buffer of `scratch_floats` for the whole
/// call (one per worker index, owned by the calling thread and kept across calls).
template <class Fn>
void for_each_item(std::int64_t n_items, std::size_t scratch_floats, Fn&& fn) {
  std::int64_t const n_workers = std::min<std::int64_t>(max_threads(), n_items);
  thread_local std::vector<AlignedFloats> scratch_of;
  if (scratch_of.size() < static_cast<std::size_t>(n_workers)) scratch_of.resize(static_cast<std::size_t>(n_workers));
  auto& per_worker = scratch_of;
  parallel_for(0, n_workers, [&](std::int64_t w) {
    float* const buf = per_worker[static_cast<std::size_t>(w)].data(scratch_floats);
    for (std::int64_t i = n_items * w / n_workers; i < n_items * (w + 1) / n_workers; ++i) fn(i, buf);
  });
}

/// Copies columns [c0, c0 + nc) of a head's state [dk, dv] to / from a contiguous tile
/// [dk, kTile] (see the file comment for why).
inline void load_tile(float const* s, int dk, int dv, int c0, int nc, float* tile) {
  for (int d = 0; d < dk; ++d)
    std::copy_n(s + std::int64_t{d} * dv + c0, nc, tile + std::int64_t{d} * kTile);
}
inline void store_tile(float const* tile, int dk, int dv, int c0, int nc, float* s) {
  for (int d = 0; d < dk; ++d)
    std::copy_n(tile + std::int64_t{d} * kTile, nc, s + std::int64_t{d} * dv + c0);
}

// ---- Normalised q and k, a block of tokens at a time -----------------------------------------

/// q̂ (scaled by 1/sqrt(d_k)) and k̂ of tokens [t0, t0 + n) of a call, stored head-major
/// [n_head_k, block, dkp] so that every work item reads its rows as one contiguous stream: in
/// the operands, a head's rows of successive tokens are n_head_k * d_k floats apart, beyond what
/// the hardware prefetchers follow (measured: the strided reads cost ~20% of the recurrent form).
/// Each row is also normalised once, not once per value head and state tile.
struct NormBlock {
  std::int64_t block, dkp;
  float* q;  // [n_head_k, block, dkp]
  float* k;  // [n_head_k, block, dkp]

  [[nodiscard]] float const* q_row(int kh, std::int64_t i) const { return q + (kh * block + i) * dkp; }
  [[nodiscard]] float const* k_row(int kh, std::int64_t i) const { return k + (kh * block + i) * dkp; }
};

/// Tokens per NormBlock: 256 keeps it at 4 MiB for 16 heads of 128 dims, and the state reload
/// per block (one d_k x d_v copy per value head) under 2% of the block's work.
inline constexpr std::int64_t kNormBlockTokens = 256;

inline void normalize_block(RowKernels const& rk, GatedDeltaArgs const& a, Layout const& l,
                            std::int64_t t0, std::int64_t n, NormBlock const& nb) {
  int const dk = a.d_k;
  // Token-major, so the operands are read row by row (contiguous across heads).
  parallel_for(0, n, [&](std::int64_t i) {
    std::int64_t const t = t0 + i;
    for (std::int64_t kh = 0; kh < a.n_head_k; ++kh) {
      rk.l2norm_scaled(a.q + t * l.qs + kh * dk, dk, a.l2norm_eps, l.q_scale,
                       nb.q + (kh * nb.block + i) * nb.dkp);
      rk.l2norm_scaled(a.k + t * l.ks + kh * dk, dk, a.l2norm_eps, 1.0f,
                       nb.k + (kh * nb.block + i) * nb.dkp);
    }
  });
}

// ---- kRecurrent ----------------------------------------------------------------------------

/// Tokens [t0, t0 + n) (one NormBlock) of every (value head, state tile) work item.
inline void recurrent_block(RowKernels const& rk, GatedDeltaArgs const& a, Layout const& l,
                            NormBlock const& nb, std::int64_t t0, std::int64_t n) {
  int const dk = a.d_k, dv = a.d_v;
  std::int64_t const n_tiles = (dv + kTile - 1) / kTile;
  std::size_t const scratch = static_cast<std::size_t>(dk * kTile + 2 * kTile);
  for_each_item(a.n_head_v * n_tiles, scratch, [&](std::int64_t item, float* buf) {
    int const h = static_cast<int>(item / n_tiles);
    int const c0 = static_cast<int>(item % n_tiles) * kTile;
    int const nc = std::min(kTile, dv - c0);
    int const kh = a.key_head(h);
    float* const s = a.state + std::int64_t{h} * dk * dv;
    // One token reads the tile twice: a copy each way would cost more than the strided reads.
    bool const in_place = n == 1;
    float* const st = in_place ? s + c0 : buf;  // [dk, kTile] this tile of S, rows lds apart
    std::int64_t const lds = in_place ? dv : kTile;
    float* const u = buf + dk * kTile;          // [kTile]
    float* const delta = u + kTile;             // [kTile]
    if (!in_place) load_tile(s, dk, dv, c0, nc, st);
    for (std::int64_t i = 0; i < n; ++i) {
      std::int64_t const t = t0 + i;
      // v's rows of successive tokens are kilobytes apart, beyond the hardware prefetchers.
      if (i + 2 < n) simd::prefetch_bytes(a.v + (t + 2) * l.vs + std::int64_t{h} * dv + c0, nc * 4);
      float const* qn = nb.q_row(kh, i);
      float const* kn = nb.k_row(kh, i);
      float const decay = std::exp(a.g[t * a.n_head_v + h]);
      float const beta = a.beta[t * a.n_head_v + h];
      float const* v = a.v + t * l.vs + std::int64_t{h} * dv + c0;
      rk.row_gemv(dk, kn, st, lds, nc, u, 1.0f, 0.0f);  // u = S_{t-1}ᵀ k̂
      for (int c = 0; c < nc; ++c) delta[c] = beta * (v[c] - decay * u[c]);
      rk.rank1_project(dk, decay, kn, delta, qn, st, lds, nc, a.out + (t * a.n_head_v + h) * dv + c0);
    }
    if (!in_place) store_tile(st, dk, dv, c0, nc, s);
  });
}

// ---- kChunked ------------------------------------------------------------------------------

/// Scratch of one chunked worker for chunks of up to `lc` tokens; row strides are padded to 16.
struct ChunkScratch {
  std::int64_t lcp, dkp, n_tiles;
  float* w;     // [lc, dkp]  W = A⁻¹ diag(β e^γ) K
  float* knt;   // [dk, lcp]  k̂ transposed, for the Gram rows
  float* kdt;   // [dk, lcp]  (k̂_j e^{γ_last − γ_j}) transposed, for the state update
  float* am;    // [lc, lcp]  strictlower(diag(β) K Kᵀ ⊙ Γ)
  float* qk;    // [lc, lcp]  lower(Q Kᵀ ⊙ Γ)
  float* gm;    // [lc, lcp]  Γ, lower triangle
  float* vp;    // [lc, kTile] U, then V' = U − W S, on one column tile
  float* eg;    // [lcp]      e^{g_i}
  float* ecum;  // [lcp]      e^{γ_i}
  float* beta;  // [lcp]
  float* st;    // [n_tiles, dk, kTile] the head's state, tile-major

  ChunkScratch(int lc, int dk, int dv)
      : lcp(pad16(lc)), dkp(pad16(dk)), n_tiles((dv + kTile - 1) / kTile) {}

  [[nodiscard]] std::size_t floats(int lc, int dk) const {
    return static_cast<std::size_t>(lc * dkp + 2 * dk * lcp + 3 * lc * lcp + lc * kTile +
                                    3 * lcp + n_tiles * dk * kTile);
  }
  void bind(float* p, int lc, int dk) {
    auto take = [&](std::int64_t n) { float* r = p; p += n; return r; };
    w = take(lc * dkp);
    knt = take(dk * lcp); kdt = take(dk * lcp);
    am = take(lc * lcp); qk = take(lc * lcp); gm = take(lc * lcp);
    vp = take(lc * kTile);
    eg = take(lcp); ecum = take(lcp); beta = take(lcp);
    st = take(n_tiles * dk * kTile);
  }
};

inline constexpr float kOne = 1.0f;
inline constexpr float kMinusOne = -1.0f;

/// Forward substitution with the unit lower-triangular A = I + am (strictly lower part used):
/// x_i ← x_i − Σ_{j<i} am_ij x_j for rows i < n, in order (rows ldx apart, ncols columns). Each
/// block of four rows takes the rows above it in one rows4_gemm, then resolves its own triangle.
inline void forward_substitute(RowKernels const& rk, float const* am, std::int64_t ld, int n,
                               float* x, std::int64_t ldx, int ncols) {
  for (int i0 = 0; i0 < n; i0 += 4) {
    int const m = std::min(4, n - i0);
    if (i0 > 0) rk.gemm_rows(m, i0, am + i0 * ld, ld, x, ldx, ncols, x + i0 * ldx, ldx, &kMinusOne, 0, 1.0f);
    for (int r = 1; r < m; ++r)
      rk.row_gemv(r, am + (i0 + r) * ld + i0, x + i0 * ldx, ldx, ncols, x + (i0 + r) * ldx, -1.0f, 1.0f);
  }
}

/// One chunk [t0, t0 + n) of value head h on the state tiles in sc.st. qn, kn: the chunk's q̂
/// and k̂ rows, sc.dkp apart.
inline void chunk_step(RowKernels const& rk, GatedDeltaArgs const& a, Layout const& l,
                       ChunkScratch const& sc, float const* qn, float const* kn, int h,
                       std::int64_t t0, int n) {
  int const dk = a.d_k, dv = a.d_v;
  std::int64_t const ld = sc.lcp, ldk = sc.dkp;
  std::int64_t const ldo = std::int64_t{a.n_head_v} * dv;  // token stride of out

  for (int i = 0; i < n; ++i) {
    std::int64_t const t = t0 + i;
    for (int d = 0; d < dk; ++d) sc.knt[d * ld + i] = kn[i * ldk + d];
    sc.eg[i] = std::exp(a.g[t * a.n_head_v + h]);
    sc.ecum[i] = (i ? sc.ecum[i - 1] : 1.0f) * sc.eg[i];
    sc.beta[i] = a.beta[t * a.n_head_v + h];
  }
  // Γ_ij = e^{γ_i − γ_j} = Γ_{i−1,j} e^{g_i}: products of per-token decays as the recurrence
  // forms them, never a ratio of two underflowing e^{γ}.
  for (int i = 0; i < n; ++i) {
    float* gi = sc.gm + i * ld;
    for (int j = 0; j < i; ++j) gi[j] = sc.gm[(i - 1) * ld + j] * sc.eg[i];
    gi[i] = 1.0f;
  }
  // Gram rows K Kᵀ and Q Kᵀ, four rows at a time up to the block's last column; then
  // A = strictlower(diag(β) K Kᵀ ⊙ Γ) and QKᵀ ⊙ Γ on and below the diagonal. Entries above
  // are left unused in am and zeroed in qk, whose rows the output reads up to the block's end.
  for (int i0 = 0; i0 < n; i0 += 4) {
    int const m = std::min(4, n - i0);
    int const cols = std::min(i0 + 4, n);
    rk.gemm_rows(m, dk, kn + i0 * ldk, ldk, sc.knt, ld, cols, sc.am + i0 * ld, ld, &kOne, 0, 0.0f);
    rk.gemm_rows(m, dk, qn + i0 * ldk, ldk, sc.knt, ld, cols, sc.qk + i0 * ld, ld, &kOne, 0, 0.0f);
  }
  for (int i = 0; i < n; ++i) {
    float* ai = sc.am + i * ld;
    float* qi = sc.qk + i * ld;
    float const* gi = sc.gm + i * ld;
    for (int j = 0; j < i; ++j) ai[j] *= sc.beta[i] * gi[j];
    for (int j = 0; j <= i; ++j) qi[j] *= gi[j];
    for (int j = i + 1; j < std::min(i / 4 * 4 + 4, n); ++j) qi[j] = 0.0f;
  }
  // W = A⁻¹ diag(β e^γ) K.
  for (int i = 0; i < n; ++i) {
    float* wi = sc.w + i * ldk;
    float const* kin = kn + i * ldk;
    float const bw = sc.beta[i] * sc.ecum[i];
    for (int d = 0; d < dk; ++d) wi[d] = bw * kin[d];
  }
  forward_substitute(rk, sc.am, ld, n, sc.w, ldk, dk);
  // (k̂_j e^{γ_last − γ_j}) transposed, for the state update.
  float const* glast = sc.gm + (n - 1) * ld;
  for (int d = 0; d < dk; ++d)
    for (int j = 0; j < n; ++j) sc.kdt[d * ld + j] = kn[j * ldk + d] * glast[j];

  // The rest is column-wise in the v-dim: one state tile at a time, held in L1.
  float* const out0 = a.out + (t0 * a.n_head_v + h) * dv;  // row of token t0, head h
  for (std::int64_t tile = 0; tile < sc.n_tiles; ++tile) {
    int const c0 = static_cast<int>(tile) * kTile;
    int const nc = std::min(kTile, dv - c0);
    float* const st = sc.st + tile * dk * kTile;
    // U = A⁻¹ diag(β) V.
    for (int i = 0; i < n; ++i) {
      float* ui = sc.vp + i * kTile;
      float const* vi = a.v + (t0 + i) * l.vs + std::int64_t{h} * dv + c0;
      for (int c = 0; c < nc; ++c) ui[c] = sc.beta[i] * vi[c];
    }
    forward_substitute(rk, sc.am, ld, n, sc.vp, kTile, nc);
    // V' = U − W S, with the state as it was before this chunk.
    rk.gemm_rows(n, dk, sc.w, ldk, st, kTile, nc, sc.vp, kTile, &kMinusOne, 0, 1.0f);
    // O_i = e^{γ_i} q̂_iᵀ S + Σ_{j≤i} (QKᵀ ⊙ Γ)_ij V'_j.
    rk.gemm_rows(n, dk, qn, ldk, st, kTile, nc, out0 + c0, ldo, sc.ecum, 1, 0.0f);
    for (int i0 = 0; i0 < n; i0 += 4)
      rk.gemm_rows(std::min(4, n - i0), std::min(i0 + 4, n), sc.qk + i0 * ld, ld, sc.vp, kTile, nc,
                   out0 + i0 * ldo + c0, ldo, &kOne, 0, 1.0f);
    // S ← e^{γ_last} S + Σ_j e^{γ_last − γ_j} k̂_j V'_jᵀ.
    rk.gemm_rows(dk, n, sc.kdt, ld, sc.vp, kTile, nc, st, kTile, &kOne, 0, sc.ecum[n - 1]);
  }
}

/// Tokens [t0, t0 + n) (one NormBlock, a whole number of chunks but for the call's last) of
/// every value head.
inline void chunked_block(RowKernels const& rk, GatedDeltaArgs const& a, Layout const& l,
                          NormBlock const& nb, std::int64_t t0, std::int64_t n, int lc) {
  int const dk = a.d_k, dv = a.d_v;
  ChunkScratch const shape(lc, dk, dv);
  for_each_item(a.n_head_v, shape.floats(lc, dk), [&](std::int64_t h, float* buf) {
    ChunkScratch sc = shape;
    sc.bind(buf, lc, dk);
    int const kh = a.key_head(static_cast<int>(h));
    float* const s = a.state + h * dk * dv;
    for (std::int64_t tile = 0; tile < sc.n_tiles; ++tile) {
      int const c0 = static_cast<int>(tile) * kTile;
      load_tile(s, dk, dv, c0, std::min(kTile, dv - c0), sc.st + tile * dk * kTile);
    }
    for (std::int64_t i0 = 0; i0 < n; i0 += lc) {
      int const len = static_cast<int>(std::min<std::int64_t>(lc, n - i0));
      chunk_step(rk, a, l, sc, nb.q_row(kh, i0), nb.k_row(kh, i0), static_cast<int>(h), t0 + i0, len);
    }
    for (std::int64_t tile = 0; tile < sc.n_tiles; ++tile) {
      int const c0 = static_cast<int>(tile) * kTile;
      store_tile(sc.st + tile * dk * kTile, dk, dv, c0, std::min(kTile, dv - c0), s);
    }
  });
}

/// Both forms (a.form; chunks of a.chunk_size): tokens in NormBlocks (whole chunks for
/// kChunked), q and k normalised per block.
inline void run_blocks(RowKernels const& rk, GatedDeltaArgs const& a) {
  Layout const l(a);
  int const lc = static_cast<int>(std::min<std::int64_t>(a.chunk_size, a.n_tokens));
  std::int64_t block = std::min(a.n_tokens, kNormBlockTokens);
  if (a.form == DeltaRuleForm::kChunked) block = std::min(a.n_tokens, (block + lc - 1) / lc * lc);
  std::int64_t const dkp = pad16(a.d_k);
  thread_local AlignedFloats buf;  // the calling thread's; workers reach it through nb
  float* const norms = buf.data(static_cast<std::size_t>(2 * a.n_head_k * block * dkp));
  NormBlock const nb{block, dkp, norms, norms + a.n_head_k * block * dkp};
  for (std::int64_t t0 = 0; t0 < a.n_tokens; t0 += block) {
    std::int64_t const n = std::min(block, a.n_tokens - t0);
    normalize_block(rk, a, l, t0, n, nb);
    if (a.form == DeltaRuleForm::kRecurrent)
      recurrent_block(rk, a, l, nb, t0, n);
    else
      chunked_block(rk, a, l, nb, t0, n, lc);
  }
}

}  // namespace gated_delta_detail

/// The delta rule with an explicit ISA level (tests run every level this CPU has), in `form`
/// with `chunk_size` in place of the arguments' own.
inline Status gated_delta(arch::CpuIsa isa, GatedDeltaArgs a, DeltaRuleForm form, int chunk_size = 64) {
  namespace d = gated_delta_detail;
  a.form = form;
  a.chunk_size = chunk_size;
  if (Status s = can_implement_gated_delta<MoeSpec{}>(a); s != Status::kSuccess) return s;
  d::run_blocks(d::row_kernels(isa), a);
  return Status::kSuccess;
}

}  // namespace qflash::kernels::cpu

namespace qflash::kernels {

template <MoeSpec S>
Status launch_gated_delta(arch::Cpu, GatedDeltaArgs const& args, stream_t) {
  if (Status s = can_implement_gated_delta<S>(args); s != Status::kSuccess) return s;
  return cpu::gated_delta(arch::cpu_isa(), args, args.form, args.chunk_size);
}

}  // namespace qflash::kernels
