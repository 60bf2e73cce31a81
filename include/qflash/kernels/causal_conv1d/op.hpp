/// @file
/// Causal depthwise conv1d with carried state, the Gated DeltaNet input conv (MODELS.md §3c.2).
///
/// One sequence, tokens in order. For channel c and token t of this call (K = d_conv):
///   y[t, c] = act( sum_{j=0..K-1} weight[c, j] * in[t - (K-1) + j, c] ),   act = silu or identity
/// where in[s] = x[s] for s >= 0 and in[s] = state[c, (K-1) + s] for s < 0 (the previous K-1
/// inputs, oldest first; zeros at sequence start). weight[c, K-1] multiplies the current token.
/// Afterwards `state` holds the last K-1 inputs of the sequence so far, including this call's,
/// so a sequence split over several calls gives the same y as one call. No bias (qwen3_5_moe
/// has none). Sums are fp32.
#pragma once

#include <cstdint>

#include "qflash/arch/arch.hpp"
#include "qflash/core/config.hpp"
#include "qflash/core/status.hpp"
#include "qflash/kernels/gated_delta/common.hpp"
#include "qflash/spec/moe_spec.hpp"

namespace qflash::kernels {

struct CausalConv1dArgs {
  float const* x = nullptr;       // [n_tokens, n_channels] pre-conv inputs of this call
  float const* weight = nullptr;  // [n_channels, d_conv]  HF conv1d.weight [C, 1, K] squeezed
  float* state = nullptr;         // [n_channels, d_conv - 1] in/out; may be null when d_conv == 1
  float* y = nullptr;             // [n_tokens, n_channels]; must not overlap x or state
  std::int64_t n_tokens = 0;
  int n_channels = 0;
  int d_conv = 0;
  bool apply_silu = true;
};

/// Checks arguments; the kernel width is the spec's d_conv when that is static.
template <MoeSpec S>
[[nodiscard]] inline Status can_implement_causal_conv1d(CausalConv1dArgs const& a) {
  if (!a.x || !a.weight || !a.y || a.n_tokens <= 0 || a.n_channels <= 0 || a.d_conv <= 0)
    return Status::kErrorInvalidProblem;
  if (a.d_conv > 1 && !a.state) return Status::kErrorInvalidProblem;
  if (S.d_conv != kDynamic && a.d_conv != S.d_conv) return Status::kErrorInvalidProblem;
  std::int64_t const act_bytes = a.n_tokens * a.n_channels * std::int64_t{sizeof(float)};
  std::int64_t const state_bytes = std::int64_t{a.n_channels} * (a.d_conv - 1) * std::int64_t{sizeof(float)};
  if (gdn::ranges_overlap(a.y, act_bytes, a.x, act_bytes)) return Status::kErrorInvalidProblem;
  // The state is read and rewritten from x's last tokens: apart from y and from x.
  if (a.d_conv > 1 && (gdn::ranges_overlap(a.y, act_bytes, a.state, state_bytes) ||
                       gdn::ranges_overlap(a.x, act_bytes, a.state, state_bytes)))
    return Status::kErrorInvalidProblem;
  return Status::kSuccess;
}

/// Launchers, one overload per arch tag: cpu.hpp, and sm80.cuh / sm90a.cuh (device pointers).
/// Each returns can_implement's verdict on bad arguments, else kSuccess (or kErrorCuda).
template <MoeSpec S>
Status launch_causal_conv1d(arch::Cpu, CausalConv1dArgs const& args, stream_t stream = nullptr);
template <MoeSpec S>
Status launch_causal_conv1d(arch::Sm80, CausalConv1dArgs const& args, stream_t stream);
template <MoeSpec S>
Status launch_causal_conv1d(arch::Sm90a, CausalConv1dArgs const& args, stream_t stream);
template <MoeSpec S, class Arch>
  requires(!arch::implemented_by<Arch, arch::Cpu, arch::Sm80, arch::Sm90a>)
Status launch_causal_conv1d(Arch, CausalConv1dArgs const&, stream_t = nullptr) {
  static_assert(dependent_false<Arch>, "kernels/causal_conv1d: no implementation for this arch");
  return Status::kErrorArchMismatch;
}

}  // namespace qflash::kernels
