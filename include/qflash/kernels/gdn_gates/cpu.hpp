/// @file
/// CPU kernels/gdn_gates: fp32, one pass over [n_tokens, n_head_v] (tiny: no threads). The
/// sigmoid and softplus are plain arithmetic (gated_delta/common.hpp's exp and a Cephes-style
/// log1p), so the loop vectorises; one body compiled under AVX-512, AVX2 and the baseline
/// target, chosen at run time (arch::cpu_isa()). Accuracy: a few ulp against fp64.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/kernels/gated_delta/common.hpp"
#include "qflash/kernels/gdn_gates/op.hpp"

namespace qflash::kernels::cpu {

namespace gdn_gates_detail {

/// log(1 + u) for u in [0, 1]: y = 1 + u split as m 2^e with m in [sqrt(1/2), sqrt(2)), the
/// Cephes logf polynomial on m - 1, and the rounding of 1 + u put back ((u - (y - 1)) / y), so
/// a tiny u keeps its relative accuracy.
QFLASH_FORCEINLINE float log1p_unit_f32(float u) {
  float const y = 1.0f + u;
  auto const bits = std::bit_cast<std::uint32_t>(y);
  float e = static_cast<float>(static_cast<std::int32_t>(bits >> 23) - 126);     // y = m 2^e, m in [0.5, 1)
  float m = std::bit_cast<float>((bits & 0x007fffffu) | 0x3f000000u);
  bool const low = m < 0.70710678118654752f;
  e = low ? e - 1.0f : e;
  float const x = low ? m + m - 1.0f : m - 1.0f;
  float const z = x * x;
  float p = 7.0376836292e-2f;
  p = p * x - 1.1514610310e-1f;
  p = p * x + 1.1676998740e-1f;
  p = p * x - 1.2420140846e-1f;
  p = p * x + 1.4249322787e-1f;
  p = p * x - 1.6668057665e-1f;
  p = p * x + 2.0000714765e-1f;
  p = p * x - 2.4999993993e-1f;
  p = p * x + 3.3333331174e-1f;
  float r = p * x * z;
  r = r + e * -2.12194440e-4f;
  r = r - 0.5f * z;
  r = x + r;
  r = r + e * 0.693359375f;
  return r + (u - (y - 1.0f)) / y;
}

/// Tokens [0, n) of the op; `hv` value heads.
QFLASH_FORCEINLINE void gates(GdnGatesArgs const& a, int hv) {
  for (std::int64_t t = 0; t < a.n_tokens; ++t) {
    float* const beta = a.beta + t * hv;
    float* const g = a.g + t * hv;
    for (int h = 0; h < hv; ++h) {
      float const b = beta[h];
      float const eb = gdn::exp_nonpositive_f32(-std::fabs(b));
      beta[h] = (b >= 0.0f ? 1.0f : eb) / (1.0f + eb);  // sigmoid(b)
      float const x = g[h] + a.dt_bias[h];
      float const ex = gdn::exp_nonpositive_f32(-std::fabs(x));
      float const softplus = x > 20.0f ? x : std::fmax(x, 0.0f) + log1p_unit_f32(ex);  // log(1 + e^x)
      g[h] = a.neg_a[h] * softplus;
    }
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq"))) inline void gates_avx512(
    GdnGatesArgs const& a, int hv) {
  gates(a, hv);
}
__attribute__((target("avx2,fma,f16c"))) inline void gates_avx2(GdnGatesArgs const& a, int hv) { gates(a, hv); }
#endif
inline void gates_baseline(GdnGatesArgs const& a, int hv) { gates(a, hv); }

}  // namespace gdn_gates_detail

/// The op for HV value heads (kDynamic: any) on ISA level `isa`; arguments already checked.
template <int HV>
Status gdn_gates(arch::CpuIsa isa, GdnGatesArgs const& a) {
  namespace d = gdn_gates_detail;
  int const hv = dim<HV>(a.n_head_v);
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (isa >= arch::CpuIsa::kAvx512) {
    d::gates_avx512(a, hv);
    return Status::kSuccess;
  }
  if (isa >= arch::CpuIsa::kAvx2) {
    d::gates_avx2(a, hv);
    return Status::kSuccess;
  }
#endif
  (void)isa;
  d::gates_baseline(a, hv);
  return Status::kSuccess;
}

}  // namespace qflash::kernels::cpu

namespace qflash::kernels {

template <MoeSpec S>
Status launch_gdn_gates(arch::Cpu, GdnGatesArgs const& a, stream_t) {
  if (Status s = can_implement_gdn_gates<S>(a); s != Status::kSuccess) return s;
  return cpu::gdn_gates<S.n_head_v_linear>(arch::cpu_isa(), a);
}

}  // namespace qflash::kernels
