/// @file
/// add + RMSNorm on the CPU: AVX-512, AVX2 and scalar row loops, threaded over rows.
///
/// One row is two passes over L1-resident data: pass 1 reads x (+ residual), stores the sum
/// h rounded to the activation dtype back into `residual` and accumulates sum(h^2) in fp32;
/// pass 2 re-reads h (now in L1) and writes y = h * inv_rms * (w + w_offset). DRAM sees each
/// of x, residual, y once, so the op is bound by memory bandwidth above a few hundred rows
/// (bench/kernels/add_rmsnorm_bench.cpp reports the fraction of measured read bandwidth).
///
/// The ISA level is chosen per call: arch::cpu_isa() for the plain launcher (capped by the
/// QFLASH_CPU_ISA environment variable), or explicitly through the overload taking a CpuIsa
/// (tests and benches run every level in one process). kAvx512Bf16 runs the AVX-512 path: the
/// bf16 conversions are integer arithmetic, identical on every level (common/cpu_simd.hpp).
/// With bf16 activations the AVX-512 path works on 32 elements at a time as even/odd fp32
/// halves, which halves the conversion work that otherwise bounds it.
///
/// Summation order is fixed by the width alone (lane-wise partial sums, then a fixed tree),
/// so a call is deterministic, whatever the thread count, and fused add+norm gives the same
/// bits as the add followed by a norm of the stored residual.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "qflash/arch/arch.hpp"
#include "qflash/arch/cpu_features.hpp"
#include "qflash/core/parallel.hpp"
#include "qflash/kernels/add_rmsnorm/op.hpp"
#include "qflash/kernels/common/bf16_bits.hpp"
#include "qflash/kernels/common/cpu_simd.hpp"

QFLASH_SIMD_BEGIN
namespace qflash::kernels {

namespace add_rmsnorm_detail {

/// Typed view of one call. `n_cols` is ignored by row loops compiled for a static width.
template <class Act, class W>
struct CpuRows {
  Act const* x;      // [n_rows, n_cols]
  Act* residual;     // [n_rows, n_cols] in: residual, out: h = x + residual; null: h = x
  W const* weight;   // [n_cols]
  Act* y;            // [n_rows, n_cols]; may alias x
  int n_cols;
  float eps;
  float w_offset;    // 0: y = x_hat * w; 1: y = x_hat * (1 + w)
};

/// Shared by every path, so that they differ only in how sum(h^2) was added up.
inline float inv_rms(float sum_sq, int n_cols, float eps) {
  return 1.0f / std::sqrt(sum_sq / static_cast<float>(n_cols) + eps);
}

/// Below this many elements per thread, fork/join (~1.5-2 us) costs more than it saves. Xeon
/// VM, 2 threads, bf16 x 2048, best of 300: 4 rows serial 2.6 us vs 3.1 threaded; 8 rows 4.8
/// vs 3.6; 16 rows 9.7 vs 6.2. So a decode batch of up to 7 rows stays on the calling thread.
inline constexpr std::int64_t kMinElementsPerThread = 8 * 1024;

// ---- scalar ---------------------------------------------------------------------------------

inline float to_f32(float v) { return v; }
inline float to_f32(bf16_bits v) { return bf16_to_float(v); }

/// Stores `v` as T and returns what was stored, widened to fp32.
inline float store_rounded(float* p, float v) {
  *p = v;
  return v;
}
inline float store_rounded(bf16_bits* p, float v) {
  *p = float_to_bf16(v);
  return bf16_to_float(*p);
}

template <class Act>
Act from_f32(float v) {
  if constexpr (std::is_same_v<Act, float>)
    return v;
  else
    return float_to_bf16(v);
}

/// Portable loop: 8 partial sums (i mod 8), so the order matches no SIMD path but is fixed.
template <int N, class Act, class W>
void add_rmsnorm_rows_scalar(CpuRows<Act, W> const& a, std::int64_t row_begin,
                             std::int64_t row_end) {
  int const n = dim<N>(a.n_cols);
  constexpr int kLanes = 8;
  for (std::int64_t r = row_begin; r < row_end; ++r) {
    std::size_t const base = static_cast<std::size_t>(r) * static_cast<std::size_t>(n);
    Act const* x = a.x + base;
    Act* res = a.residual ? a.residual + base : nullptr;
    Act* y = a.y + base;

    float acc[kLanes] = {};
    for (int i = 0; i < n; ++i) {
      float h = to_f32(x[i]);
      if (res) h = store_rounded(res + i, h + to_f32(res[i]));
      acc[i % kLanes] += h * h;
    }
    float const sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    float const inv = inv_rms(sum, n, a.eps);

    Act const* hs = res ? res : x;
    for (int i = 0; i < n; ++i)
      y[i] = from_f32<Act>((to_f32(hs[i]) * inv) * (to_f32(a.weight[i]) + a.w_offset));
  }
}

#if QFLASH_HAS_X86_SIMD

// ---- AVX-512: 16 lanes, 4 accumulators (64 elements per step) -------------------------------

/// h = x (+ residual, stored back rounded), for one full vector or a masked tail.
template <class Act>
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512 avx512_add_residual(Act const* x, Act* res) {
  __m512 const h = simd::avx512_load(x);
  if (!res) return h;
  return simd::avx512_store_rounded(res, _mm512_add_ps(h, simd::avx512_load(res)));
}
template <class Act>
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE __m512 avx512_add_residual(Act const* x, Act* res,
                                                                  __mmask16 m) {
  __m512 const h = simd::avx512_load(x, m);
  if (!res) return h;
  return simd::avx512_store_rounded(res, _mm512_add_ps(h, simd::avx512_load(res, m)), m);
}

template <int N, class Act, class W>
QFLASH_TARGET_AVX512 void add_rmsnorm_rows_avx512(CpuRows<Act, W> const& a,
                                                  std::int64_t row_begin, std::int64_t row_end) {
  using namespace simd;
  int const n = dim<N>(a.n_cols);
  constexpr int kLanes = 16;
  constexpr int kStep = 4 * kLanes;
  int const n_main = n / kStep * kStep;
  int const n_full = n / kLanes * kLanes;
  int const n_tail = n - n_full;
  __mmask16 const tail = avx512_tail_mask(n_tail);
  __m512 const w_offset = _mm512_set1_ps(a.w_offset);

  for (std::int64_t r = row_begin; r < row_end; ++r) {
    std::size_t const base = static_cast<std::size_t>(r) * static_cast<std::size_t>(n);
    Act const* x = a.x + base;
    Act* res = a.residual ? a.residual + base : nullptr;
    Act* y = a.y + base;

    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    __m512 acc2 = _mm512_setzero_ps(), acc3 = _mm512_setzero_ps();
    int i = 0;
    for (; i < n_main; i += kStep) {
      __m512 const h0 = avx512_add_residual(x + i, res ? res + i : nullptr);
      __m512 const h1 = avx512_add_residual(x + i + 16, res ? res + i + 16 : nullptr);
      __m512 const h2 = avx512_add_residual(x + i + 32, res ? res + i + 32 : nullptr);
      __m512 const h3 = avx512_add_residual(x + i + 48, res ? res + i + 48 : nullptr);
      acc0 = _mm512_fmadd_ps(h0, h0, acc0);
      acc1 = _mm512_fmadd_ps(h1, h1, acc1);
      acc2 = _mm512_fmadd_ps(h2, h2, acc2);
      acc3 = _mm512_fmadd_ps(h3, h3, acc3);
    }
    for (; i < n_full; i += kLanes) {
      __m512 const h = avx512_add_residual(x + i, res ? res + i : nullptr);
      acc0 = _mm512_fmadd_ps(h, h, acc0);
    }
    if (n_tail) {
      __m512 const h = avx512_add_residual(x + i, res ? res + i : nullptr, tail);
      acc1 = _mm512_fmadd_ps(h, h, acc1);
    }
    float const sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0, acc1),
                                                         _mm512_add_ps(acc2, acc3)));
    __m512 const inv = _mm512_set1_ps(inv_rms(sum, n, a.eps));

    Act const* hs = res ? res : x;
    for (i = 0; i < n_full; i += kLanes) {
      __m512 const w = _mm512_add_ps(avx512_load(a.weight + i), w_offset);
      avx512_store(y + i, _mm512_mul_ps(_mm512_mul_ps(avx512_load(hs + i), inv), w));
    }
    if (n_tail) {
      __m512 const w = _mm512_add_ps(avx512_load(a.weight + i, tail), w_offset);
      avx512_store(y + i, _mm512_mul_ps(_mm512_mul_ps(avx512_load(hs + i, tail), inv), w), tail);
    }
  }
}

// ---- AVX-512, bf16 activations: 32 per step as even/odd halves (common/cpu_simd.hpp) -------
// With bf16 the row loop is bound by conversion work, not by memory. Xeon VM at 2.1 GHz, one
// core, 4 x 2048 in L2, best of 200 (bench/kernels/add_rmsnorm_bench measures the threaded
// DRAM case): 16 at a time via vpmovzxwd/vpmovdw 0.40 ns/element, this 0.29 (fp32: 0.23).

template <class W>
QFLASH_TARGET_AVX512 QFLASH_SIMD_INLINE simd::Avx512Pair avx512_weight_pair(W const* w, __mmask32 m,
                                                                          __m512 w_offset) {
  simd::Avx512Pair p = simd::avx512_load_pair(w, m);
  return {_mm512_add_ps(p.even, w_offset), _mm512_add_ps(p.odd, w_offset)};
}

template <int N, class W>
QFLASH_TARGET_AVX512 void add_rmsnorm_rows_avx512_bf16(CpuRows<bf16_bits, W> const& a,
                                                       std::int64_t row_begin, std::int64_t row_end) {
  using namespace simd;
  int const n = dim<N>(a.n_cols);
  constexpr int kStep = 32;
  int const n_full = n / kStep * kStep;
  int const n_tail = n - n_full;
  __mmask32 const tail = static_cast<__mmask32>((1ull << n_tail) - 1u);
  constexpr __mmask32 kAll = ~__mmask32{0};
  __m512 const w_offset = _mm512_set1_ps(a.w_offset);

  for (std::int64_t r = row_begin; r < row_end; ++r) {
    std::size_t const base = static_cast<std::size_t>(r) * static_cast<std::size_t>(n);
    bf16_bits const* x = a.x + base;
    bf16_bits* res = a.residual ? a.residual + base : nullptr;
    bf16_bits* y = a.y + base;

    __m512 acc_even = _mm512_setzero_ps(), acc_odd = _mm512_setzero_ps();
    auto pass1 = [&](int i, __mmask32 m) QFLASH_TARGET_AVX512 {
      Avx512Pair h = m == kAll ? avx512_load_pair(x + i) : avx512_load_pair(x + i, m);
      if (res) {
        Avx512Pair const rv = m == kAll ? avx512_load_pair(res + i) : avx512_load_pair(res + i, m);
        __m512i const even = avx512_round_bf16_hi(_mm512_add_ps(h.even, rv.even));
        __m512i const odd = avx512_round_bf16_hi(_mm512_add_ps(h.odd, rv.odd));
        if (m == kAll)
          avx512_store_pair(res + i, even, odd);
        else
          avx512_store_pair(res + i, even, odd, m);
        h = {avx512_bf16_hi_value(even), avx512_bf16_hi_value(odd)};
      }
      acc_even = _mm512_fmadd_ps(h.even, h.even, acc_even);
      acc_odd = _mm512_fmadd_ps(h.odd, h.odd, acc_odd);
    };
    for (int i = 0; i < n_full; i += kStep) pass1(i, kAll);
    if (n_tail) pass1(n_full, tail);
    float const sum = _mm512_reduce_add_ps(_mm512_add_ps(acc_even, acc_odd));
    __m512 const inv = _mm512_set1_ps(inv_rms(sum, n, a.eps));

    bf16_bits const* hs = res ? res : x;
    auto pass2 = [&](int i, __mmask32 m) QFLASH_TARGET_AVX512 {
      Avx512Pair const h = m == kAll ? avx512_load_pair(hs + i) : avx512_load_pair(hs + i, m);
      Avx512Pair const w = avx512_weight_pair(a.weight + i, m, w_offset);
      __m512i const even = avx512_round_bf16_hi(_mm512_mul_ps(_mm512_mul_ps(h.even, inv), w.even));
      __m512i const odd = avx512_round_bf16_hi(_mm512_mul_ps(_mm512_mul_ps(h.odd, inv), w.odd));
      if (m == kAll)
        avx512_store_pair(y + i, even, odd);
      else
        avx512_store_pair(y + i, even, odd, m);
    };
    for (int i = 0; i < n_full; i += kStep) pass2(i, kAll);
    if (n_tail) pass2(n_full, tail);
  }
}

// ---- AVX2: 8 lanes, 4 accumulators (32 elements per step) -----------------------------------

template <class Act>
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m256 avx2_add_residual(Act const* x, Act* res) {
  __m256 const h = simd::avx2_load(x);
  if (!res) return h;
  return simd::avx2_store_rounded(res, _mm256_add_ps(h, simd::avx2_load(res)));
}
template <class Act>
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m256 avx2_add_residual(Act const* x, Act* res, int n) {
  __m256 const h = simd::avx2_load_partial(x, n);
  if (!res) return h;
  return simd::avx2_store_rounded_partial(res, _mm256_add_ps(h, simd::avx2_load_partial(res, n)), n);
}

template <int N, class Act, class W>
QFLASH_TARGET_AVX2 void add_rmsnorm_rows_avx2(CpuRows<Act, W> const& a, std::int64_t row_begin,
                                              std::int64_t row_end) {
  using namespace simd;
  int const n = dim<N>(a.n_cols);
  constexpr int kLanes = 8;
  constexpr int kStep = 4 * kLanes;
  int const n_main = n / kStep * kStep;
  int const n_full = n / kLanes * kLanes;
  int const n_tail = n - n_full;
  __m256 const w_offset = _mm256_set1_ps(a.w_offset);

  for (std::int64_t r = row_begin; r < row_end; ++r) {
    std::size_t const base = static_cast<std::size_t>(r) * static_cast<std::size_t>(n);
    Act const* x = a.x + base;
    Act* res = a.residual ? a.residual + base : nullptr;
    Act* y = a.y + base;

    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    __m256 acc2 = _mm256_setzero_ps(), acc3 = _mm256_setzero_ps();
    int i = 0;
    for (; i < n_main; i += kStep) {
      __m256 const h0 = avx2_add_residual(x + i, res ? res + i : nullptr);
      __m256 const h1 = avx2_add_residual(x + i + 8, res ? res + i + 8 : nullptr);
      __m256 const h2 = avx2_add_residual(x + i + 16, res ? res + i + 16 : nullptr);
      __m256 const h3 = avx2_add_residual(x + i + 24, res ? res + i + 24 : nullptr);
      acc0 = _mm256_fmadd_ps(h0, h0, acc0);
      acc1 = _mm256_fmadd_ps(h1, h1, acc1);
      acc2 = _mm256_fmadd_ps(h2, h2, acc2);
      acc3 = _mm256_fmadd_ps(h3, h3, acc3);
    }
    for (; i < n_full; i += kLanes) {
      __m256 const h = avx2_add_residual(x + i, res ? res + i : nullptr);
      acc0 = _mm256_fmadd_ps(h, h, acc0);
    }
    if (n_tail) {
      __m256 const h = avx2_add_residual(x + i, res ? res + i : nullptr, n_tail);
      acc1 = _mm256_fmadd_ps(h, h, acc1);
    }
    float const sum =
        avx2_reduce_add(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
    __m256 const inv = _mm256_set1_ps(inv_rms(sum, n, a.eps));

    Act const* hs = res ? res : x;
    for (i = 0; i < n_full; i += kLanes) {
      __m256 const w = _mm256_add_ps(avx2_load(a.weight + i), w_offset);
      avx2_store(y + i, _mm256_mul_ps(_mm256_mul_ps(avx2_load(hs + i), inv), w));
    }
    if (n_tail) {
      __m256 const w = _mm256_add_ps(avx2_load_partial(a.weight + i, n_tail), w_offset);
      avx2_store_partial(y + i, _mm256_mul_ps(_mm256_mul_ps(avx2_load_partial(hs + i, n_tail), inv), w),
                         n_tail);
    }
  }
}

#endif  // QFLASH_HAS_X86_SIMD

/// Splits rows into at most max_threads() contiguous chunks and runs the ISA's row loop.
template <int N, class Act, class W>
void add_rmsnorm_cpu_typed(arch::CpuIsa isa, CpuRows<Act, W> const& a, std::int64_t n_rows) {
  using RowsFn = void (*)(CpuRows<Act, W> const&, std::int64_t, std::int64_t);
  RowsFn fn = &add_rmsnorm_rows_scalar<N, Act, W>;
#if QFLASH_HAS_X86_SIMD
  if (isa >= arch::CpuIsa::kAvx512) {
    if constexpr (std::is_same_v<Act, bf16_bits>)
      fn = &add_rmsnorm_rows_avx512_bf16<N, W>;
    else
      fn = &add_rmsnorm_rows_avx512<N, Act, W>;
  }
  else if (isa >= arch::CpuIsa::kAvx2)
    fn = &add_rmsnorm_rows_avx2<N, Act, W>;
#else
  (void)isa;
#endif
  std::int64_t const elements = n_rows * dim<N>(a.n_cols);
  std::int64_t const n_chunks =
      std::min({std::max<std::int64_t>(1, elements / kMinElementsPerThread), n_rows,
                static_cast<std::int64_t>(max_threads())});
  if (n_chunks <= 1) {
    fn(a, 0, n_rows);
    return;
  }
  std::int64_t const per = n_rows / n_chunks;
  std::int64_t const extra = n_rows % n_chunks;
  parallel_for(0, n_chunks, [&](std::int64_t c) {
    std::int64_t const begin = c * per + std::min(c, extra);
    fn(a, begin, begin + per + (c < extra ? 1 : 0));
  });
}

/// Runs a checked problem on `isa` (which the caller has verified this CPU supports).
template <int N>
void add_rmsnorm_cpu(arch::CpuIsa isa, AddRmsNormArgs const& args) {
  float const w_offset = args.weight_kind == NormWeight::kZeroCentered ? 1.0f : 0.0f;
  auto run = [&](auto const* x, auto const* weight) {
    using Act = std::remove_cv_t<std::remove_pointer_t<decltype(x)>>;
    using W = std::remove_cv_t<std::remove_pointer_t<decltype(weight)>>;
    CpuRows<Act, W> const rows{x, static_cast<Act*>(args.residual), weight,
                               static_cast<Act*>(args.y), args.n_cols, args.eps, w_offset};
    add_rmsnorm_cpu_typed<N>(isa, rows, args.n_rows);
  };
  auto with_weight = [&](auto const* x) {
    if (args.weight_dtype == DType::kF32)
      run(x, static_cast<float const*>(args.weight));
    else
      run(x, static_cast<bf16_bits const*>(args.weight));
  };
  if (args.dtype == DType::kF32)
    with_weight(static_cast<float const*>(args.x));
  else
    with_weight(static_cast<bf16_bits const*>(args.x));
}

/// The best level of this processor, ignoring QFLASH_CPU_ISA (what an explicit request may use).
inline arch::CpuIsa detected_cpu_isa() {
  static arch::CpuIsa const isa = arch::detect_cpu_isa();
  return isa;
}

}  // namespace add_rmsnorm_detail

/// add + RMSNorm on the CPU with an explicit ISA level (tests and benches compare levels in
/// one process). Synchronous.
/// @tparam S     the spec; a static d_model fixes the row width at compile time
/// @param isa    kScalar, kAvx2, kAvx512 or kAvx512Bf16 (runs the AVX-512 path)
/// @return kErrorNotSupported when this CPU lacks `isa`, else as can_implement_add_rmsnorm
template <MoeSpec S>
[[nodiscard]] Status launch_add_rmsnorm(arch::Cpu, arch::CpuIsa isa, AddRmsNormArgs const& args) {
  static_assert(valid(S), "add_rmsnorm: invalid MoeSpec");
  if (Status s = can_implement_add_rmsnorm<S>(args); s != Status::kSuccess) return s;
  if (isa > add_rmsnorm_detail::detected_cpu_isa()) return Status::kErrorNotSupported;
  add_rmsnorm_detail::add_rmsnorm_cpu<S.d_model>(isa, args);
  return Status::kSuccess;
}

/// add + RMSNorm on the CPU at arch::cpu_isa(). Synchronous; `stream` is ignored.
template <MoeSpec S>
Status launch_add_rmsnorm(arch::Cpu, AddRmsNormArgs const& args, stream_t) {
  static_assert(valid(S), "add_rmsnorm: invalid MoeSpec");
  if (Status s = can_implement_add_rmsnorm<S>(args); s != Status::kSuccess) return s;
  add_rmsnorm_detail::add_rmsnorm_cpu<S.d_model>(arch::cpu_isa(), args);
  return Status::kSuccess;
}

}  // namespace qflash::kernels
QFLASH_SIMD_END
