/// @file
/// CPU kernels/gated_rmsnorm: rows split into blocks over the threads; per row one vectorised
/// sum of squares, then one vectorised pass for norm, weight and gate. One body, compiled under
/// AVX-512, AVX2 and the baseline target and chosen at run time (arch::cpu_isa()).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/core/parallel.hpp"
#include "qflash/kernels/gated_delta/common.hpp"
#include "qflash/kernels/gated_rmsnorm/op.hpp"
#include "qflash/kernels/gated_rmsnorm/ref.hpp"

namespace qflash::kernels::cpu {

namespace gated_rmsnorm_detail {

/// Rows [r0, r1). y may alias x: each element is read before it is written, at the same index.
QFLASH_FORCEINLINE void norm_rows(GatedRmsNormArgs const& a, std::int64_t r0, std::int64_t r1) {
  int const n = a.n_cols;
  for (std::int64_t r = r0; r < r1; ++r) {
    float const* x = a.x + r * n;
    float const* z = a.z + r * n;
    float* y = a.y + r * n;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int c = 0; c < n; ++c) ss += x[c] * x[c];
    float const inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + a.eps);
    for (int c = 0; c < n; ++c) y[c] = a.weight[c] * (x[c] * inv) * gdn::silu_f32(z[c]);
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq"))) inline void
norm_rows_avx512(GatedRmsNormArgs const& a, std::int64_t r0, std::int64_t r1) {
  norm_rows(a, r0, r1);
}
__attribute__((target("avx2,fma,f16c"))) inline void norm_rows_avx2(GatedRmsNormArgs const& a,
                                                                    std::int64_t r0, std::int64_t r1) {
  norm_rows(a, r0, r1);
}
#endif
inline void norm_rows_baseline(GatedRmsNormArgs const& a, std::int64_t r0, std::int64_t r1) {
  norm_rows(a, r0, r1);
}

using RowsFn = void (*)(GatedRmsNormArgs const&, std::int64_t, std::int64_t);

/// norm_rows compiled for `isa` (the op's rows, bit for bit, wherever they are called from).
inline RowsFn rows_fn(arch::CpuIsa isa) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (isa >= arch::CpuIsa::kAvx512) return &norm_rows_avx512;
  if (isa >= arch::CpuIsa::kAvx2) return &norm_rows_avx2;
#endif
  (void)isa;
  return &norm_rows_baseline;
}

}  // namespace gated_rmsnorm_detail

/// The whole norm with an explicit ISA level (tests run every level this CPU has).
inline Status gated_rmsnorm(arch::CpuIsa isa, GatedRmsNormArgs const& a) {
  if (Status s = can_implement_gated_rmsnorm<MoeSpec{}>(a); s != Status::kSuccess) return s;
  gated_rmsnorm_detail::RowsFn const rows_fn = gated_rmsnorm_detail::rows_fn(isa);
  // Blocks of about 16K elements: enough work to amortise scheduling, enough blocks to balance.
  std::int64_t const block = std::max<std::int64_t>(1, 16384 / a.n_cols);
  std::int64_t const n_blocks = (a.n_rows + block - 1) / block;
  parallel_for(0, n_blocks, [&](std::int64_t b) {
    rows_fn(a, b * block, std::min(a.n_rows, (b + 1) * block));
  });
  return Status::kSuccess;
}

}  // namespace qflash::kernels::cpu

namespace qflash::kernels {

template <MoeSpec S>
Status launch_gated_rmsnorm(arch::Cpu, GatedRmsNormArgs const& args, stream_t) {
  if (Status s = can_implement_gated_rmsnorm<S>(args); s != Status::kSuccess) return s;
  return cpu::gated_rmsnorm(arch::cpu_isa(), args);
}

}  // namespace qflash::kernels
