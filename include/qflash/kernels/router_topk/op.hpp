/// @file
/// MoE routing from router logits: p = softmax(logits) in fp32, the n_expert_used largest
/// (ties: lower expert id first), and, when renormalize, w = p_I / sum(p_I); else w = p_I.
/// Experts come out in descending weight order. With a shared expert, the router's GEMV has
/// one more output row, the shared-expert gate: shared_weights[t] = sigmoid(logits[t, n_expert]).
#pragma once

#include <cstdint>

#include "qflash/arch/arch.hpp"
#include "qflash/core/config.hpp"
#include "qflash/core/status.hpp"
#include "qflash/spec/moe_spec.hpp"

namespace qflash::kernels {

struct RouterTopkArgs {
  float const* logits = nullptr;  // [n_tokens, logits_stride]: n_expert router logits (+ the shared gate)
  std::int64_t logits_stride = 0;  ///< 0: n_expert
  std::int32_t* experts = nullptr;  // [n_tokens, n_expert_used]
  float* weights = nullptr;         // [n_tokens, n_expert_used]
  std::int64_t n_tokens = 0;
  int n_expert = 0;
  int n_expert_used = 0;
  bool renormalize = true;
  float* shared_weights = nullptr;  // [n_tokens] sigmoid of logits column n_expert; null: none
};

template <MoeSpec S>
[[nodiscard]] constexpr Status can_implement_router_topk(RouterTopkArgs const& a) {
  if (!a.logits || !a.experts || !a.weights || a.n_tokens < 0 || a.n_expert <= 0 ||
      a.n_expert_used <= 0 || a.n_expert_used > a.n_expert || a.logits_stride < 0 ||
      (a.logits_stride && a.logits_stride < a.n_expert + (a.shared_weights ? 1 : 0)) ||
      (a.shared_weights && !a.logits_stride))
    return Status::kErrorInvalidProblem;
  if ((S.n_expert != kDynamic && a.n_expert != S.n_expert) ||
      (S.n_expert_used != kDynamic && a.n_expert_used != S.n_expert_used))
    return Status::kErrorInvalidProblem;
  return Status::kSuccess;
}

template <MoeSpec S>
Status launch_router_topk(arch::Cpu, RouterTopkArgs const& args, stream_t stream = nullptr);
template <MoeSpec S, class Arch>
  requires(!arch::implemented_by<Arch, arch::Cpu>)
Status launch_router_topk(Arch, RouterTopkArgs const&, stream_t = nullptr) {
  static_assert(dependent_false<Arch>, "kernels/router_topk: no implementation for this arch");
  return Status::kErrorArchMismatch;
}

}  // namespace qflash::kernels
