/// @file
/// Routed SwiGLU experts with weighted combine:
///   out[t] += sum_j w[t, j] * Down_e( silu(Gate_e x[t]) * (Up_e x[t]) ),  e = experts[t, j]
/// plus, when `shared` is given, out[t] += shared_weights[t] * Shared(x[t]) (the gated shared
/// expert, whose d_ff may differ). Tokens are grouped by expert so each expert's weights are
/// read once per call.
#pragma once

#include <cstdint>
#include <span>

#include "qflash/arch/arch.hpp"
#include "qflash/core/config.hpp"
#include "qflash/core/status.hpp"
#include "qflash/kernels/linear/op.hpp"
#include "qflash/kernels/router_topk/op.hpp"
#include "qflash/spec/moe_spec.hpp"

namespace qflash::kernels {

struct ExpertWeights {
  WeightView gate;  // [d_ff, d_model]
  WeightView up;    // [d_ff, d_model]
  WeightView down;  // [d_model, d_ff]
};

struct ExpertFfnArgs {
  std::span<ExpertWeights const> experts;  // [n_expert]
  float const* x = nullptr;                 // [n_tokens, d_model]
  std::int32_t const* routes = nullptr;     // [n_tokens, n_expert_used] expert ids; kNoExpert: unused slot
  float const* route_weights = nullptr;     // [n_tokens, n_expert_used]
  float* out = nullptr;                     // [n_tokens, d_model], accumulated into
  std::int64_t n_tokens = 0;
  int n_expert_used = 0;
  ExpertWeights const* shared = nullptr;  // optional expert every token uses
  float const* shared_weights = nullptr;  // [n_tokens] its weight per token
};

template <MoeSpec S>
[[nodiscard]] Status can_implement_expert_ffn(ExpertFfnArgs const& a) {
  if (a.experts.empty() || !a.x || !a.routes || !a.route_weights || !a.out || a.n_tokens < 0 ||
      a.n_expert_used <= 0)
    return Status::kErrorInvalidProblem;
  std::int64_t const d_model = a.experts[0].gate.cols;
  std::int64_t const d_ff = a.experts[0].gate.rows;
  for (auto const& e : a.experts)
    if (e.gate.rows != d_ff || e.up.rows != d_ff || e.gate.cols != d_model ||
        e.up.cols != d_model || e.down.rows != d_model || e.down.cols != d_ff)
      return Status::kErrorInvalidProblem;
  if (S.d_model != kDynamic && d_model != S.d_model) return Status::kErrorInvalidProblem;
  if (a.shared) {
    auto const& e = *a.shared;
    if (!a.shared_weights || e.gate.cols != d_model || e.up.cols != d_model || e.up.rows != e.gate.rows ||
        e.down.rows != d_model || e.down.cols != e.gate.rows)
      return Status::kErrorInvalidProblem;
  }
  return Status::kSuccess;
}

template <MoeSpec S>
Status launch_expert_ffn(arch::Cpu, ExpertFfnArgs const& args, stream_t stream = nullptr);
template <MoeSpec S, class Arch>
  requires(!arch::implemented_by<Arch, arch::Cpu>)
Status launch_expert_ffn(Arch, ExpertFfnArgs const&, stream_t = nullptr) {
  static_assert(dependent_false<Arch>, "kernels/expert_ffn: no implementation for this arch");
  return Status::kErrorArchMismatch;
}

}  // namespace qflash::kernels
