/// @file
/// The MoE block of both families: the router's GEMV (the shared-expert gate its extra row)
/// and softmax/top-k (or the run's dynamic policy)/renormalise with the gate's sigmoid in one
/// op (one kernel for a decode step on CUDA), the routed SwiGLU experts grouped by expert, and
/// the gated shared expert (qwen3_5_moe).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "qflash/kernels/expert_ffn/op.hpp"
#include "qflash/kernels/router_topk/op.hpp"
#include "qflash/model/config.hpp"
#include "qflash/model/layers/common.hpp"
#include "qflash/model/weights.hpp"

namespace qflash::model {

/// What the router chose for a batch's tokens in one MoE layer, for statistics and logs.
struct RouteRecord {
  std::size_t layer = 0;
  std::int64_t n_tokens = 0;
  int n_expert = 0;
  int n_expert_used = 0;                  ///< route slots per token
  float const* logits = nullptr;         // [n_tokens, logits_stride]; the first n_expert are the experts'
  std::int64_t logits_stride = 0;
  std::int32_t const* experts = nullptr;  // [n_tokens, n_expert_used]; kernels::kNoExpert: slot unused
  float const* weights = nullptr;         // [n_tokens, n_expert_used]

  /// Entropy (nats) of token t's softmax over all n_expert router logits.
  [[nodiscard]] double entropy(std::int64_t t) const {
    float const* l = logits + t * logits_stride;
    double const mx = *std::max_element(l, l + n_expert);
    double z = 0, zx = 0;
    for (int e = 0; e < n_expert; ++e) {
      double const x = l[e] - mx, p = std::exp(x);
      z += p;
      zx += p * x;
    }
    return std::log(z) - zx / z;  // -sum p log p with p = exp(x) / z
  }
  /// The experts token t uses: its first slots (a dynamic policy leaves the last ones unused).
  [[nodiscard]] std::span<std::int32_t const> used(std::int64_t t) const {
    std::int32_t const* row = experts + t * n_expert_used;
    int n = 0;
    while (n < n_expert_used && row[n] != kernels::kNoExpert) ++n;
    return {row, static_cast<std::size_t>(n)};
  }
};
/// Called for each MoE layer's routing, with the kernels' buffers in the model's Memory: by the
/// layer as it routes on the CPU; for a device model by Model::forward, layer by layer, once the
/// step is done (so the host may read them).
using RouteObserver = std::function<void(RouteRecord const&)>;

template <MoeSpec S, class Arch>
class MoeBlock {
 public:
  /// @param deferred  a device model's list of the step's routing records, which Model::forward
  ///   hands the observer once the step is done
  /// @param slot, n_moe_layers  this block's place among the model's MoE blocks, and their count:
  ///   where it keeps its routing until then
  MoeBlock(ModelConfig const& cfg, MoeWeights const& w, std::size_t layer, RouteObserver const* observer = nullptr,
           std::vector<RouteRecord>* deferred = nullptr, std::int64_t slot = 0, std::int64_t n_moe_layers = 1)
      : cfg_(cfg),
        w_(w),
        layer_(layer),
        observer_(observer),
        deferred_(deferred),
        slot_(slot),
        n_moe_layers_(n_moe_layers) {}

  /// out = MoE(x) (out += when accumulate), routed as `b` says; fused_swiglu picks the experts'
  /// fusion (model/fusion.hpp). @param x [n_tokens, d_model] normed input; @param out [n_tokens, d_model]
  void forward(Batch const& b, float const* x, float* out, Scratch& s, stream_t stream, bool accumulate = false,
               bool fused_swiglu = true) const {
    std::int64_t const T = b.n_tokens();
    int const n_expert = dim<S.n_expert>(cfg_.n_expert);
    int const k = b.route_slots > 0 ? b.route_slots : dim<S.n_expert_used>(cfg_.n_expert_used);
    bool const shared = w_.shared.has_value();
    bool const observed = observer_ && *observer_;
    // A device model's observer reads every layer's routing once the step is done (Model::forward),
    // so each layer keeps its own: no wait per layer, and the step may still be one CUDA graph.
    bool const deferred = observed && deferred_;
    std::int64_t const n_logits = T * w_.router.rows;
    std::int64_t const slot_logits = T * (n_expert + 1);  // room for the shared-expert gate row in every layer
    QFLASH_CHECK(!deferred || w_.router.rows <= n_expert + 1, "layer ", layer_, "'s router has ", w_.router.rows,
                 " rows, more than its ", n_expert, " experts and a shared-expert gate");
    float* logits = deferred ? s.sized(s.step_router, n_moe_layers_ * slot_logits) + slot_ * slot_logits
                             : s.sized(s.router, n_logits);
    std::int32_t* routes = deferred ? s.sized(s.step_routes, n_moe_layers_ * T * k) + slot_ * T * k
                                    : s.sized(s.routes, T * k);
    float* weights = deferred ? s.sized(s.step_route_weights, n_moe_layers_ * T * k) + slot_ * T * k
                              : s.sized(s.route_weights, T * k);
    float* shared_gate = s.sized(s.shared_gate, T);

    kernels::RouterGemv const gemv{w_.router, x, logits};
    kernels::RouterTopkArgs r{};  // the router's GEMV and the routing in one call
    r.gemv = &gemv;
    r.experts = routes;
    r.weights = weights;
    r.n_tokens = T;
    r.n_expert = n_expert;
    r.n_expert_used = k;
    r.renormalize = cfg_.norm_topk_prob;
    r.policy = b.policy;
    r.token_policies = b.on_device.token_policies;
    r.shared_weights = shared ? shared_gate : nullptr;
    check_launch(kernels::launch_router_topk<S>(Arch{}, r, stream), "router");
    RouteRecord const record{layer_, T, n_expert, k, logits, w_.router.rows, routes, weights};
    if (deferred) {
      deferred_->push_back(record);
    } else if (observed) {
      s.memory->synchronize(stream);  // the observer reads the choices on the host
      (*observer_)(record);
    }

    kernels::ExpertFfnArgs e{};
    e.fused_swiglu = fused_swiglu;
    e.accumulate = accumulate;
    e.experts = w_.experts;
    e.x = x;
    e.routes = routes;
    e.route_weights = weights;
    e.out = out;
    e.n_tokens = T;
    e.n_expert_used = k;
    if (shared) {  // every token through the shared expert too, weighted by its sigmoid gate
      e.shared = &*w_.shared;
      e.shared_weights = shared_gate;
    }
    // Each token with an adapter that updates this layer's experts points at its updates.
    s.expert_lora.clear();
    s.expert_lora.reserve(b.adapter_runs.size());  // no reallocation: token_lora points into it
    for (AdapterRun const& run : b.adapter_runs) {
      LoraLayer const& l = run.adapter->layers[layer_];
      if (!l.touches_experts()) continue;
      if (s.expert_lora.empty()) s.token_lora.assign(static_cast<std::size_t>(T), nullptr);
      s.expert_lora.push_back(l.experts());
      std::fill(s.token_lora.begin() + run.begin, s.token_lora.begin() + run.end, &s.expert_lora.back());
    }
    if (!s.expert_lora.empty()) e.token_lora = s.token_lora.data();
    check_launch(kernels::launch_expert_ffn<S>(Arch{}, e, stream), "expert_ffn");
  }

 private:
  ModelConfig const& cfg_;
  MoeWeights const& w_;
  std::size_t layer_;
  RouteObserver const* observer_;
  std::vector<RouteRecord>* deferred_;
  std::int64_t slot_, n_moe_layers_;
};

}  // namespace qflash::model
