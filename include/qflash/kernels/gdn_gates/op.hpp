/// @file
/// The per-token gates of Gated DeltaNet (MODELS.md §3c.4), per value head h, in fp32:
///   beta[t, h] = sigmoid(b[t, h])
///   g[t, h]    = neg_a[h] * softplus(a[t, h] + dt_bias[h]),   neg_a = -exp(A_log) < 0
/// In place: `beta` holds b on entry, `g` holds a. softplus(x) = x for x > 20 (as torch's).
#pragma once

#include <cstdint>

#include "qflash/arch/arch.hpp"
#include "qflash/core/config.hpp"
#include "qflash/core/status.hpp"
#include "qflash/spec/moe_spec.hpp"

namespace qflash::kernels {

struct GdnGatesArgs {
  float* beta = nullptr;           // [n_tokens, n_head_v]  in: b, out: beta
  float* g = nullptr;              // [n_tokens, n_head_v]  in: a, out: log decay g <= 0
  float const* dt_bias = nullptr;  // [n_head_v]
  float const* neg_a = nullptr;    // [n_head_v]
  std::int64_t n_tokens = 0;
  int n_head_v = 0;
};

/// Checks arguments; n_head_v is the spec's n_head_v_linear when static.
template <MoeSpec S>
[[nodiscard]] constexpr Status can_implement_gdn_gates(GdnGatesArgs const& a) {
  if (!a.beta || !a.g || !a.dt_bias || !a.neg_a || a.n_tokens < 0 || a.n_head_v <= 0 || a.beta == a.g)
    return Status::kErrorInvalidProblem;
  if (S.n_head_v_linear != kDynamic && a.n_head_v != S.n_head_v_linear) return Status::kErrorInvalidProblem;
  return Status::kSuccess;
}

/// Launchers, one overload per arch tag: cpu.hpp, and sm80.cuh / sm90a.cuh (device pointers).
template <MoeSpec S>
Status launch_gdn_gates(arch::Cpu, GdnGatesArgs const& args, stream_t stream = nullptr);
template <MoeSpec S>
Status launch_gdn_gates(arch::Sm80, GdnGatesArgs const& args, stream_t stream);
template <MoeSpec S>
Status launch_gdn_gates(arch::Sm90a, GdnGatesArgs const& args, stream_t stream);
template <MoeSpec S, class Arch>
  requires(!arch::implemented_by<Arch, arch::Cpu, arch::Sm80, arch::Sm90a>)
Status launch_gdn_gates(Arch, GdnGatesArgs const&, stream_t = nullptr) {
  static_assert(dependent_false<Arch>, "kernels/gdn_gates: no implementation for this arch");
  return Status::kErrorArchMismatch;
}

}  // namespace qflash::kernels
