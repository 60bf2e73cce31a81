/// @file
/// Routed SwiGLU experts with weighted combine:
///   out[t] += sum_j w[t, j] * Down_e( silu(Gate_e x[t]) * (Up_e x[t]) ),  e = experts[t, j]
/// plus, when `shared` is given, out[t] += shared_weights[t] * Shared(x[t]) (the gated shared
/// expert, whose d_ff may differ). Tokens are grouped by expert so each expert's weights are
/// read once per call. A token with an adapter (token_lora) runs each projection P as
/// P x + B_P (A_P x) (LoRA, unmerged).
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

/// One adapter's low-rank updates of the experts (kernels/linear's LowRank): per routed expert
/// (empty spans: none), and of the shared expert.
struct ExpertLora {
  std::span<LowRank const> gate, up, down;  // [n_expert] each, or empty
  LowRank shared_gate, shared_up, shared_down;
};

struct ExpertFfnArgs {
  std::span<ExpertWeights const> experts;  // [n_expert]
  float const* x = nullptr;                 // [n_tokens, d_model]
  /// [n_tokens, n_expert_used] expert ids; kNoExpert: an unused slot. Another id outside
  /// [0, n_expert): the CPU returns kErrorInvalidProblem; CUDA, which launches before it could
  /// read them, treats the slot as unused.
  std::int32_t const* routes = nullptr;
  float const* route_weights = nullptr;     // [n_tokens, n_expert_used]
  float* out = nullptr;                     // [n_tokens, d_model], accumulated into
  std::int64_t n_tokens = 0;
  int n_expert_used = 0;
  ExpertWeights const* shared = nullptr;  // optional expert every token uses
  float const* shared_weights = nullptr;  // [n_tokens] its weight per token
  /// Gate, up and SwiGLU in one pass per block of expert rows; false: each its own pass over
  /// every expert (fusion::SwiGluSeparate, for comparison). Same math either way.
  bool fused_swiglu = true;
  /// out += the experts' weighted sum; false: out = it (out's values before are not read, so
  /// a caller need not clear it: on CUDA the combine writes instead of adding).
  bool accumulate = true;
  /// [n_tokens] each token's adapter (null entries: none), or null for no token: its updates
  /// run beside gate, up and down, g = Gate x + B_g (A_g x) and so on.
  ExpertLora const* const* token_lora = nullptr;
};

/// Whether `l`'s updates fit the experts of `a`.
inline bool lora_fits(ExpertLora const& l, ExpertFfnArgs const& a) {
  auto routed = [&](std::span<LowRank const> d, bool down) {
    if (d.empty()) return true;
    if (d.size() != a.experts.size()) return false;
    for (std::size_t e = 0; e < d.size(); ++e) {
      WeightView const& w = down ? a.experts[e].down : a.experts[e].gate;
      if (!d[e].fits(w.rows, w.cols)) return false;
    }
    return true;
  };
  if (!routed(l.gate, false) || !routed(l.up, false) || !routed(l.down, true)) return false;
  bool const shared_lora = !l.shared_gate.empty() || !l.shared_up.empty() || !l.shared_down.empty();
  if (!a.shared) return !shared_lora;
  return l.shared_gate.fits(a.shared->gate.rows, a.shared->gate.cols) &&
         l.shared_up.fits(a.shared->up.rows, a.shared->up.cols) &&
         l.shared_down.fits(a.shared->down.rows, a.shared->down.cols);
}

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
  if (a.token_lora)
    for (std::int64_t t = 0; t < a.n_tokens; ++t)  // sequences' tokens share their adapter: check each once
      if (ExpertLora const* l = a.token_lora[t]; l && (t == 0 || l != a.token_lora[t - 1]) && !lora_fits(*l, a))
        return Status::kErrorInvalidProblem;
  if (a.shared) {
    auto const& e = *a.shared;
    if (!a.shared_weights || e.gate.cols != d_model || e.up.cols != d_model || e.up.rows != e.gate.rows ||
        e.down.rows != d_model || e.down.cols != e.gate.rows)
      return Status::kErrorInvalidProblem;
  }
  return Status::kSuccess;
}

/// Launchers, one overload per arch tag: cpu.hpp, and sm80.cuh / sm90a.cuh (device pointers
/// in x, routes, weights and out and in the views' data; the spans and views themselves are
/// host memory. CUDA needs each projection's routed experts, and their LoRA updates, at one
/// stride (stacked.hpp): else kErrorNotSupported).
template <MoeSpec S>
Status launch_expert_ffn(arch::Cpu, ExpertFfnArgs const& args, stream_t stream = nullptr);
template <MoeSpec S>
Status launch_expert_ffn(arch::Sm80, ExpertFfnArgs const& args, stream_t stream);
template <MoeSpec S>
Status launch_expert_ffn(arch::Sm90a, ExpertFfnArgs const& args, stream_t stream);
template <MoeSpec S, class Arch>
  requires(!arch::implemented_by<Arch, arch::Cpu, arch::Sm80, arch::Sm90a>)
Status launch_expert_ffn(Arch, ExpertFfnArgs const&, stream_t = nullptr) {
  static_assert(dependent_false<Arch>, "kernels/expert_ffn: no implementation for this arch");
  return Status::kErrorArchMismatch;
}

}  // namespace qflash::kernels
