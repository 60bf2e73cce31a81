/// @file
/// Gated RMSNorm, the Gated DeltaNet output norm (MODELS.md §3a, `linear_attn.norm`):
///   y[r] = weight ⊙ (x[r] * rsqrt(mean(x[r]^2) + eps)) ⊙ silu(z[r])
/// per row r of n_cols (rows = tokens x value heads, n_cols = d_v; one weight shared by all
/// heads). The weight is plain, not the zero-centred (1 + w) of the other qwen3_5_moe norms.
/// All fp32; the sum of squares is fp32.
#pragma once

#include <cstdint>

#include "qflash/arch/arch.hpp"
#include "qflash/core/config.hpp"
#include "qflash/core/status.hpp"
#include "qflash/kernels/gated_delta/common.hpp"
#include "qflash/spec/moe_spec.hpp"

namespace qflash::kernels {

struct GatedRmsNormArgs {
  float const* x = nullptr;       // [n_rows, n_cols]
  float const* z = nullptr;       // [n_rows, n_cols] gate
  float const* weight = nullptr;  // [n_cols]
  float* y = nullptr;             // [n_rows, n_cols]; may alias x (exactly), must not overlap z
  std::int64_t n_rows = 0;
  int n_cols = 0;
  float eps = 1e-6f;
};

/// Checks arguments; the row width is the spec's d_head_v_linear when that is static.
template <MoeSpec S>
[[nodiscard]] inline Status can_implement_gated_rmsnorm(GatedRmsNormArgs const& a) {
  if (!a.x || !a.z || !a.weight || !a.y || a.n_rows <= 0 || a.n_cols <= 0 || !(a.eps >= 0.0f))
    return Status::kErrorInvalidProblem;
  if (S.d_head_v_linear != kDynamic && a.n_cols != S.d_head_v_linear)
    return Status::kErrorInvalidProblem;
  std::int64_t const bytes = a.n_rows * a.n_cols * std::int64_t{sizeof(float)};
  if ((a.y != a.x && gdn::ranges_overlap(a.y, bytes, a.x, bytes)) ||
      gdn::ranges_overlap(a.y, bytes, a.z, bytes))
    return Status::kErrorInvalidProblem;
  return Status::kSuccess;
}

/// Launchers, one overload per arch tag: cpu.hpp, and sm80.cuh / sm90a.cuh (device pointers).
template <MoeSpec S>
Status launch_gated_rmsnorm(arch::Cpu, GatedRmsNormArgs const& args, stream_t stream = nullptr);
template <MoeSpec S>
Status launch_gated_rmsnorm(arch::Sm80, GatedRmsNormArgs const& args, stream_t stream);
template <MoeSpec S>
Status launch_gated_rmsnorm(arch::Sm90a, GatedRmsNormArgs const& args, stream_t stream);
template <MoeSpec S, class Arch>
  requires(!arch::implemented_by<Arch, arch::Cpu, arch::Sm80, arch::Sm90a>)
Status launch_gated_rmsnorm(Arch, GatedRmsNormArgs const&, stream_t = nullptr) {
  static_assert(dependent_false<Arch>, "kernels/gated_rmsnorm: no implementation for this arch");
  return Status::kErrorArchMismatch;
}

}  // namespace qflash::kernels
