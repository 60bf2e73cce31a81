/// @file
/// MoE routing from router logits: p = softmax(logits) in fp32, the n_expert_used largest
/// (ties: lower expert id first), and, when renormalize, w = p_I / sum(p_I); else w = p_I.
/// Experts come out in descending weight order.
#pragma once

#include <cstdint>

#include "qflash/arch/arch.hpp"
#include "qflash/core/config.hpp"
#include "qflash/core/status.hpp"
#include "qflash/spec/moe_spec.hpp"

namespace qflash::kernels {

struct RouterTopkArgs {
  float const* logits = nullptr;  // [n_tokens, n_expert]
  std::int32_t* experts = nullptr;  // [n_tokens, n_expert_used]
  float* weights = nullptr;         // [n_tokens, n_expert_used]
  std::int64_t n_tokens = 0;
  int n_expert = 0;
  int n_expert_used = 0;
  bool renormalize = true;
};

template <MoeSpec S>
[[nodiscard]] constexpr Status can_implement_router_topk(RouterTopkArgs const& a) {
  if (!a.logits || !a.experts || !a.weights || a.n_tokens < 0 || a.n_expert <= 0 ||
      a.n_expert_used <= 0 || a.n_expert_used > a.n_expert)
    return Status::kErrorInvalidProblem;
  if ((S.n_expert != kDynamic && a.n_expert != S.n_expert) ||
      (S.n_expert_used != kDynamic && a.n_expert_used != S.n_expert_used))
    return Status::kErrorInvalidProblem;
  return Status::kSuccess;
}

template <MoeSpec S>
Status launch_router_topk(arch::Cpu, RouterTopkArgs const& args, stream_t stream = nullptr);

}  // namespace qflash::kernels
