/// @file
/// MoE routing from router logits: p = softmax(logits) in fp32; the experts in descending p
/// (ties: lower expert id first); the first c of them, where the routing policy chooses c per
/// token (at most n_expert_used); and, when renormalize, w = p_I / sum(p_I), else w = p_I.
/// A token's slots past c hold expert kNoExpert and weight 0. With a shared expert, the
/// router's GEMV has one more output row, the shared-expert gate:
/// shared_weights[t] = sigmoid(logits[t, n_expert]). A call may do the router's GEMV first
/// (RouterGemv), as one kernel on CUDA for a decode step's tokens.
#pragma once

#include <cstdint>

#include "qflash/arch/arch.hpp"
#include "qflash/core/config.hpp"
#include "qflash/core/status.hpp"
#include "qflash/kernels/linear/op.hpp"
#include "qflash/spec/moe_spec.hpp"

namespace qflash::kernels {

/// A route slot that a token does not use (dynamic routing chose fewer experts).
inline constexpr std::int32_t kNoExpert = -1;

/// How many of a token's experts, sorted by probability, it is routed to.
struct RoutingPolicy {
  enum class Kind {
    kTopK,       ///< all n_expert_used (the model's top-k)
    kTopP,       ///< the fewest whose probabilities sum to at least p
    kThreshold,  ///< those with probability at least `threshold`
  };
  Kind kind = Kind::kTopK;
  float p = 1.0f;          ///< kTopP
  float threshold = 0.0f;  ///< kThreshold
  int k_min = 1;           ///< kTopP, kThreshold: at least this many
  int k_max = 0;           ///< at most this many (0: every route slot)

  /// How many of `sorted` (descending probabilities, n_expert_used of them) a token uses.
  [[nodiscard]] constexpr int count(float const* sorted, int n_expert_used) const {
    int const n = k_max > 0 && k_max < n_expert_used ? k_max : n_expert_used;
    int c = n;
    if (kind == Kind::kTopP) {
      float mass = 0;
      for (c = 0; c < n && mass < p;) mass += sorted[c++];
    } else if (kind == Kind::kThreshold) {
      for (c = 0; c < n && sorted[c] >= threshold;) ++c;
    }
    return c < k_min ? (k_min < n ? k_min : n) : c;
  }
  friend bool operator==(RoutingPolicy const&, RoutingPolicy const&) = default;
};

/// Whether the op accepts `p` (a fraction in range, counts positive).
[[nodiscard]] constexpr bool valid(RoutingPolicy const& p) {
  return p.k_min >= 1 && p.k_max >= 0 && (p.kind != RoutingPolicy::Kind::kTopP || (p.p > 0 && p.p <= 1)) &&
         (p.kind != RoutingPolicy::Kind::kThreshold || (p.threshold >= 0 && p.threshold <= 1));
}

/// The router's GEMV when a routing call does it first (RouterTopkArgs::gemv): the op writes
/// logits = x gate^T (kernels/linear's sums; the rows are the experts', then the shared-expert
/// gate's) and routes from them; the call's `logits` and `logits_stride` are not read. CUDA
/// runs both in one kernel for a decode step's tokens.
struct RouterGemv {
  WeightView gate;             // [n_expert (+ 1), d_model]
  float const* x = nullptr;    // [n_tokens, gate.cols]
  float* logits = nullptr;     // [n_tokens, gate.rows]
};

struct RouterTopkArgs {
  float const* logits = nullptr;  // [n_tokens, logits_stride]: n_expert router logits (+ the shared gate)
  std::int64_t logits_stride = 0;  ///< 0: n_expert
  std::int32_t* experts = nullptr;  // [n_tokens, n_expert_used]
  float* weights = nullptr;         // [n_tokens, n_expert_used]
  std::int64_t n_tokens = 0;
  int n_expert = 0;
  int n_expert_used = 0;  ///< route slots per token: the most experts a token may use
  bool renormalize = true;
  RoutingPolicy policy;
  RoutingPolicy const* token_policies = nullptr;  // [n_tokens]: each token's, instead of `policy`
  float* shared_weights = nullptr;  // [n_tokens] sigmoid of logits column n_expert; null: none
  /// The router's GEMV in the same call (optional; host memory, read when the call is made).
  RouterGemv const* gemv = nullptr;
};

/// The router's GEMV of a call that has one (gemv set).
constexpr LinearArgs gemv_of(RouterTopkArgs const& a) {
  LinearArgs l{};
  l.w = a.gemv->gate;
  l.x = a.gemv->x;
  l.y = a.gemv->logits;
  l.n_tokens = a.n_tokens;
  return l;
}

/// The routing a call does: from its logits, or from the GEMV's output when it has one.
constexpr RouterTopkArgs routing_of(RouterTopkArgs a) {
  if (a.gemv) {
    a.logits = a.gemv->logits;
    a.logits_stride = a.gemv->gate.rows;
    a.gemv = nullptr;
  }
  return a;
}

/// Checks everything but the per-token policies (which a CUDA launch cannot read on the host).
template <MoeSpec S>
[[nodiscard]] constexpr Status can_implement_router_topk_shape(RouterTopkArgs const& args) {
  if (args.gemv)
    if (Status s = can_implement_linear<S>(gemv_of(args)); s != Status::kSuccess) return s;
  RouterTopkArgs const a = routing_of(args);
  if (!a.logits || !a.experts || !a.weights || a.n_tokens < 0 || a.n_expert <= 0 ||
      a.n_expert_used <= 0 || a.n_expert_used > a.n_expert || a.logits_stride < 0 || !valid(a.policy) ||
      (a.logits_stride && a.logits_stride < a.n_expert + (a.shared_weights ? 1 : 0)) ||
      (a.shared_weights && !a.logits_stride))
    return Status::kErrorInvalidProblem;
  // The slots per token are the run's routing; a static top-k is the fast path when they match.
  if (S.n_expert != kDynamic && a.n_expert != S.n_expert) return Status::kErrorInvalidProblem;
  return Status::kSuccess;
}

/// Checks arguments, the per-token policies included (host memory).
template <MoeSpec S>
[[nodiscard]] constexpr Status can_implement_router_topk(RouterTopkArgs const& a) {
  if (Status s = can_implement_router_topk_shape<S>(a); s != Status::kSuccess) return s;
  if (a.token_policies)
    for (std::int64_t t = 0; t < a.n_tokens; ++t)
      if (!valid(a.token_policies[t])) return Status::kErrorInvalidProblem;
  return Status::kSuccess;
}

/// Launchers, one overload per arch tag: cpu.hpp, and sm80.cuh / sm90a.cuh (device pointers;
/// per-token policies are not read on the host, so the caller checks them where it makes
/// them, as model::check_routing does; at most 32 route slots).
template <MoeSpec S>
Status launch_router_topk(arch::Cpu, RouterTopkArgs const& args, stream_t stream = nullptr);
template <MoeSpec S>
Status launch_router_topk(arch::Sm80, RouterTopkArgs const& args, stream_t stream);
template <MoeSpec S>
Status launch_router_topk(arch::Sm90a, RouterTopkArgs const& args, stream_t stream);
template <MoeSpec S, class Arch>
  requires(!arch::implemented_by<Arch, arch::Cpu, arch::Sm80, arch::Sm90a>)
Status launch_router_topk(Arch, RouterTopkArgs const&, stream_t = nullptr) {
  static_assert(dependent_false<Arch>, "kernels/router_topk: no implementation for this arch");
  return Status::kErrorArchMismatch;
}

}  // namespace qflash::kernels
