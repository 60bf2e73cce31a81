/// @file
/// CPU kernels/linear: output rows split over threads; for each weight row, up to four token
/// rows share every weight load. f32 and bf16 rows are read in place; rows of the other
/// formats are decoded once per call into a thread-local fp32 row, which then serves every
/// token. AVX-512 and AVX2 paths chosen at run time; scalar otherwise.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/core/parallel.hpp"
#include "qflash/kernels/common/cpu_simd.hpp"
#include "qflash/kernels/linear/op.hpp"

namespace qflash::kernels::cpu {

/// How many tokens share one pass over a weight row.
inline constexpr int kTokenTile = 4;

struct LinearRows {
  WeightView w;
  float const* x;
  std::int64_t xs;
  float* y;
  std::int64_t ys;
  std::int64_t n_tokens;
  bool accumulate;
};

inline void store_dot(LinearRows const& p, std::int64_t t, std::int64_t o, float v) {
  float& out = p.y[t * p.ys + o];
  out = p.accumulate ? out + v : v;
}

inline void linear_rows_scalar(LinearRows const& p, std::int64_t o0, std::int64_t o1) {
  auto const* w = static_cast<float const*>(p.w.data);
  for (std::int64_t o = o0; o < o1; ++o)
    for (std::int64_t t = 0; t < p.n_tokens; ++t) {
      float acc = 0;
      for (std::int64_t i = 0; i < p.w.cols; ++i) acc += p.x[t * p.xs + i] * w[o * p.w.cols + i];
      store_dot(p, t, o, acc);
    }
}

#if QFLASH_HAS_X86_SIMD
/// Sum of the 16 lanes: halves added, then the AVX2 reduction.
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE float avx512_reduce_add(__m512 v) {
  __m256 const lo = _mm512_castps512_ps256(v);
  __m256 const hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return simd::avx2_reduce_add(_mm256_add_ps(lo, hi));
}

template <class W>
QFLASH_TARGET_AVX512 void linear_rows_avx512(LinearRows const& p, std::int64_t o0, std::int64_t o1) {
  std::int64_t const n = p.w.cols;
  auto const* w = static_cast<W const*>(p.w.data);
  for (std::int64_t o = o0; o < o1; ++o) {
    W const* row = w + o * n;
    for (std::int64_t t0 = 0; t0 < p.n_tokens; t0 += kTokenTile) {
      int const nt = static_cast<int>(std::min<std::int64_t>(kTokenTile, p.n_tokens - t0));
      __m512 acc[kTokenTile] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                                _mm512_setzero_ps()};
      for (std::int64_t i = 0; i < n; i += 16) {
        __mmask16 const m = simd::avx512_tail_mask(static_cast<int>(std::min<std::int64_t>(16, n - i)));
        __m512 const wv = simd::avx512_load(row + i, m);
        for (int t = 0; t < nt; ++t)
          acc[t] = _mm512_fmadd_ps(wv, simd::avx512_load(p.x + (t0 + t) * p.xs + i, m), acc[t]);
      }
      for (int t = 0; t < nt; ++t) store_dot(p, t0 + t, o, avx512_reduce_add(acc[t]));
    }
  }
}

QFLASH_SIMD_INLINE float widen(float v) { return v; }
QFLASH_SIMD_INLINE float widen(bf16_bits v) { return bf16_to_float(v); }

template <class W>
QFLASH_TARGET_AVX2 void linear_rows_avx2(LinearRows const& p, std::int64_t o0, std::int64_t o1) {
  std::int64_t const n = p.w.cols;
  std::int64_t const n8 = n / 8 * 8;
  auto const* w = static_cast<W const*>(p.w.data);
  for (std::int64_t o = o0; o < o1; ++o) {
    W const* row = w + o * n;
    for (std::int64_t t0 = 0; t0 < p.n_tokens; t0 += kTokenTile) {
      int const nt = static_cast<int>(std::min<std::int64_t>(kTokenTile, p.n_tokens - t0));
      __m256 acc[kTokenTile] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                                _mm256_setzero_ps()};
      for (std::int64_t i = 0; i < n8; i += 8) {
        __m256 const wv = simd::avx2_load(row + i);
        for (int t = 0; t < nt; ++t)
          acc[t] = _mm256_fmadd_ps(wv, simd::avx2_load(p.x + (t0 + t) * p.xs + i), acc[t]);
      }
      for (int t = 0; t < nt; ++t) {
        float s = simd::avx2_reduce_add(acc[t]);
        for (std::int64_t i = n8; i < n; ++i) s += p.x[(t0 + t) * p.xs + i] * widen(row[i]);
        store_dot(p, t0 + t, o, s);
      }
    }
  }
}
#endif

inline void linear_rows_decoded(arch::CpuIsa isa, LinearRows const& p, std::int64_t o0, std::int64_t o1);

/// Rows [o0, o1) of an f32 (W = float) or bf16 (W = bf16_bits) projection.
template <class W>
void linear_rows_direct(arch::CpuIsa isa, LinearRows const& p, std::int64_t o0, std::int64_t o1) {
#if QFLASH_HAS_X86_SIMD
  if (isa >= arch::CpuIsa::kAvx512) return linear_rows_avx512<W>(p, o0, o1);
  if (isa >= arch::CpuIsa::kAvx2) return linear_rows_avx2<W>(p, o0, o1);
#endif
  if constexpr (std::is_same_v<W, float>) {
    linear_rows_scalar(p, o0, o1);
  } else {
    linear_rows_decoded(isa, p, o0, o1);
  }
}

/// Rows [o0, o1) of a projection whose rows are decoded to fp32 first (any format).
inline void linear_rows_decoded(arch::CpuIsa isa, LinearRows const& p, std::int64_t o0, std::int64_t o1) {
  thread_local std::vector<float> decoded;
  decoded.resize(static_cast<std::size_t>(p.w.cols));
  for (std::int64_t o = o0; o < o1; ++o) {
    dequantize_row(p.w, o, decoded.data());
    LinearRows one = p;
    one.w = WeightView{WeightFormat::kF32, decoded.data(), 1, p.w.cols};
    one.y = p.y + o;
    linear_rows_direct<float>(isa, one, 0, 1);
  }
}

/// True when instance format F (kAny: all) compiles the path of format f.
template <WeightFormat F>
constexpr bool compiles(WeightFormat f) {
  return F == WeightFormat::kAny || F == f;
}

/// Runs rows [o0, o1) of the projection with the given ISA level, for the formats F compiles.
template <WeightFormat F>
void linear_rows(arch::CpuIsa isa, LinearRows const& p, std::int64_t o0, std::int64_t o1) {
  if constexpr (compiles<F>(WeightFormat::kF32))
    if (p.w.format == WeightFormat::kF32) return linear_rows_direct<float>(isa, p, o0, o1);
  if constexpr (compiles<F>(WeightFormat::kBf16))
    if (p.w.format == WeightFormat::kBf16) return linear_rows_direct<bf16_bits>(isa, p, o0, o1);
  linear_rows_decoded(isa, p, o0, o1);
}

/// The whole projection with an explicit ISA level (tests run every level this CPU has);
/// compiled for the weight formats F (kAny: all of them).
template <WeightFormat F = WeightFormat::kAny>
Status linear(arch::CpuIsa isa, LinearArgs const& a) {
  if (Status s = can_implement_linear<MoeSpec{.weights = F}>(a); s != Status::kSuccess) return s;
  LinearRows const p{a.w, a.x, a.x_stride ? a.x_stride : a.w.cols, a.y,
                     a.y_stride ? a.y_stride : a.w.rows, a.n_tokens, a.accumulate};
  // Blocks of rows small enough to balance threads, large enough to amortise scheduling.
  std::int64_t const block = std::max<std::int64_t>(8, a.w.rows / (8 * max_threads()));
  std::int64_t const n_blocks = (a.w.rows + block - 1) / block;
  parallel_for(0, n_blocks, block * a.w.cols * std::max<std::int64_t>(1, a.n_tokens), [&](std::int64_t b) {
    linear_rows<F>(isa, p, b * block, std::min(a.w.rows, (b + 1) * block));
  });
  return Status::kSuccess;
}

}  // namespace qflash::kernels::cpu

namespace qflash::kernels {

template <MoeSpec S>
Status launch_linear(arch::Cpu, LinearArgs const& args, stream_t) {
  return cpu::linear<S.weights>(arch::cpu_isa(), args);
}

}  // namespace qflash::kernels
