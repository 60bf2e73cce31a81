/// @file
/// CPU kernels/gdn_gates: fp32, one pass over [n_tokens, n_head_v] (tiny: no threads).
#pragma once

#include <cmath>

#include "qflash/kernels/gdn_gates/op.hpp"

namespace qflash::kernels::cpu {

/// The op for HV value heads (kDynamic: any); arguments already checked.
template <int HV>
Status gdn_gates(GdnGatesArgs const& a) {
  int const hv = dim<HV>(a.n_head_v);
  for (std::int64_t t = 0; t < a.n_tokens; ++t)
    for (int h = 0; h < hv; ++h) {
      std::int64_t const i = t * hv + h;
      a.beta[i] = 1.0f / (1.0f + std::exp(-a.beta[i]));
      float const x = a.g[i] + a.dt_bias[h];
      float const softplus = x > 20.0f ? x : std::log1p(std::exp(x));
      a.g[i] = a.neg_a[h] * softplus;
    }
  return Status::kSuccess;
}

}  // namespace qflash::kernels::cpu

namespace qflash::kernels {

template <MoeSpec S>
Status launch_gdn_gates(arch::Cpu, GdnGatesArgs const& a, stream_t) {
  if (Status s = can_implement_gdn_gates<S>(a); s != Status::kSuccess) return s;
  return cpu::gdn_gates<S.n_head_v_linear>(a);
}

}  // namespace qflash::kernels
