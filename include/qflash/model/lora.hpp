/// @file
/// LoRA adapters as the model sees them: per layer, a low-rank update (kernels/linear's
/// LowRank: y += B (A x), B already scaled) beside each projection an adapter touches, and the
/// whole tables PEFT's `modules_to_save` replaces (embedding, lm_head). The router and the
/// shared-expert gate have none: routing stays the base model's. Applied unmerged, per
/// sequence, so sequences of one batch may use different adapters over the same base weights.
/// runtime/lora.hpp reads PEFT adapters into this and owns their bytes.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/kernels/expert_ffn/op.hpp"
#include "qflash/kernels/linear/op.hpp"
#include "qflash/model/weights.hpp"

namespace qflash::model {

using kernels::LowRank;

/// One layer's updates; empty members (and empty expert lists) are projections left alone.
struct LoraLayer {
  LowRank q, k, v, o;         ///< full attention (q: the whole q_proj, gate rows included)
  LowRank qkv, z, b, a, out;  ///< Gated DeltaNet in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj
  std::vector<LowRank> gate, up, down;  ///< routed experts: [n_expert] each, or empty
  LowRank shared_gate, shared_up, shared_down;

  /// The experts' updates as kernels/expert_ffn takes them (views into this layer).
  [[nodiscard]] kernels::ExpertLora experts() const {
    return {gate, up, down, shared_gate, shared_up, shared_down};
  }
  [[nodiscard]] bool touches_experts() const {
    return !gate.empty() || !up.empty() || !down.empty() || !shared_gate.empty() || !shared_up.empty() ||
           !shared_down.empty();
  }
};

/// A projection an adapter may update besides the routed experts: its PEFT module path inside
/// a layer, where its update lives, and the base matrix (null where the layer has none).
struct LoraProjection {
  std::string_view module;
  LowRank LoraLayer::*update;
  WeightView* (*base_of)(LayerWeights&);

  [[nodiscard]] WeightView* base(LayerWeights& w) const { return base_of(w); }
  [[nodiscard]] WeightView const* base(LayerWeights const& w) const {
    return base_of(const_cast<LayerWeights&>(w));  // read only
  }
};

namespace detail {
inline WeightView* in_attention(LayerWeights& w, WeightView AttentionWeights::*m) {
  return w.kind == LayerKind::kFullAttention ? &(w.attention.*m) : nullptr;
}
inline WeightView* in_deltanet(LayerWeights& w, WeightView LinearAttentionWeights::*m) {
  return w.kind == LayerKind::kFullAttention ? nullptr : &(w.linear.*m);
}
inline WeightView* in_shared_expert(LayerWeights& w, WeightView kernels::ExpertWeights::*m) {
  return w.moe.shared ? &(*w.moe.shared.*m) : nullptr;
}
}  // namespace detail

inline constexpr LoraProjection kLoraProjections[] = {
    {"self_attn.q_proj", &LoraLayer::q, [](LayerWeights& w) { return detail::in_attention(w, &AttentionWeights::q); }},
    {"self_attn.k_proj", &LoraLayer::k, [](LayerWeights& w) { return detail::in_attention(w, &AttentionWeights::k); }},
    {"self_attn.v_proj", &LoraLayer::v, [](LayerWeights& w) { return detail::in_attention(w, &AttentionWeights::v); }},
    {"self_attn.o_proj", &LoraLayer::o, [](LayerWeights& w) { return detail::in_attention(w, &AttentionWeights::o); }},
    {"linear_attn.in_proj_qkv", &LoraLayer::qkv,
     [](LayerWeights& w) { return detail::in_deltanet(w, &LinearAttentionWeights::qkv); }},
    {"linear_attn.in_proj_z", &LoraLayer::z, [](LayerWeights& w) { return detail::in_deltanet(w, &LinearAttentionWeights::z); }},
    {"linear_attn.in_proj_b", &LoraLayer::b, [](LayerWeights& w) { return detail::in_deltanet(w, &LinearAttentionWeights::b); }},
    {"linear_attn.in_proj_a", &LoraLayer::a, [](LayerWeights& w) { return detail::in_deltanet(w, &LinearAttentionWeights::a); }},
    {"linear_attn.out_proj", &LoraLayer::out,
     [](LayerWeights& w) { return detail::in_deltanet(w, &LinearAttentionWeights::out); }},
    {"mlp.shared_expert.gate_proj", &LoraLayer::shared_gate,
     [](LayerWeights& w) { return detail::in_shared_expert(w, &kernels::ExpertWeights::gate); }},
    {"mlp.shared_expert.up_proj", &LoraLayer::shared_up,
     [](LayerWeights& w) { return detail::in_shared_expert(w, &kernels::ExpertWeights::up); }},
    {"mlp.shared_expert.down_proj", &LoraLayer::shared_down,
     [](LayerWeights& w) { return detail::in_shared_expert(w, &kernels::ExpertWeights::down); }},
};

/// The routed experts' update lists ([n_expert] or empty) and the matrix of each expert they update.
struct LoraExpertProjection {
  std::string_view name;
  std::vector<LowRank> LoraLayer::*updates;
  WeightView kernels::ExpertWeights::*base;
};

inline constexpr LoraExpertProjection kLoraExpertProjections[] = {
    {"gate_proj", &LoraLayer::gate, &kernels::ExpertWeights::gate},
    {"up_proj", &LoraLayer::up, &kernels::ExpertWeights::up},
    {"down_proj", &LoraLayer::down, &kernels::ExpertWeights::down},
};

/// The projection a PEFT module path names, or null.
inline LoraProjection const* lora_projection(std::string_view module) {
  for (auto const& p : kLoraProjections)
    if (p.module == module) return &p;
  return nullptr;
}

/// "a full-attention layer", "a Gated DeltaNet layer without a shared expert", ...: for errors.
inline std::string describe_layer(LayerWeights const& w) {
  return std::string(w.kind == LayerKind::kFullAttention ? "a full-attention layer" : "a Gated DeltaNet layer") +
         (w.moe.shared ? "" : " without a shared expert");
}

struct LoraAdapter {
  std::string name;               ///< what requests and logs call it
  std::vector<LoraLayer> layers;  ///< [n_layer]
  std::optional<WeightView> embed, lm_head;  ///< modules_to_save: whole tables [vocab, d_model]
  std::shared_ptr<void const> storage;      ///< keeps the bytes behind the views alive
  int device = -1;  ///< -1: the views are host memory; else that CUDA device's (runtime/cuda/lora.hpp)

  /// True when some layer updates the routed or shared experts.
  [[nodiscard]] bool touches_experts() const {
    for (auto const& l : layers)
      if (l.touches_experts()) return true;
    return false;
  }
};

/// Throws Error unless `name` can name an adapter in requests, logs and prefix-cache keys:
/// 1 to 64 of A-Z a-z 0-9 . _ - +.
inline void check_adapter_name(std::string const& name) {
  bool ok = !name.empty() && name.size() <= 64;
  for (char c : name)
    ok = ok && ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
                c == '-' || c == '+');
  QFLASH_CHECK(ok, "LoRA adapter name '", name, "' must be 1 to 64 of A-Z a-z 0-9 . _ - +");
}

/// Throws Error naming the adapter and the projection when an update or table does not fit
/// `w`'s matrices (runtime/lora.hpp checks files by name first; this guards adapters built in code).
inline void check_adapter(LoraAdapter const& ad, ModelWeights const& w) {
  QFLASH_CHECK(ad.layers.size() == w.layers.size(), "LoRA adapter '", ad.name, "' has ", ad.layers.size(),
               " layers, the model ", w.layers.size());
  auto fits = [&](LowRank const& d, WeightView const& m, std::string const& what) {
    QFLASH_CHECK(d.fits(m.rows, m.cols), "LoRA adapter '", ad.name, "': the update of ", what, " (A [", d.a.rows, ", ",
                 d.a.cols, "], B [", d.b.rows, ", ", d.b.cols, "], f32) does not fit its [", m.rows, ", ", m.cols,
                 "] matrix");
  };
  for (std::size_t l = 0; l < w.layers.size(); ++l) {
    LoraLayer const& u = ad.layers[l];
    LayerWeights const& lw = w.layers[l];
    std::string const L = "layer " + std::to_string(l) + " ";
    for (auto const& p : kLoraProjections) {
      LowRank const& d = u.*p.update;
      if (d.empty()) continue;
      WeightView const* m = p.base(lw);
      QFLASH_CHECK(m, "LoRA adapter '", ad.name, "': ", L, "is ", describe_layer(lw), ", which has no ", p.module,
                   ", but the adapter updates one there");
      fits(d, *m, L + std::string(p.module));
    }
    for (auto const& p : kLoraExpertProjections) {
      std::vector<LowRank> const& d = u.*p.updates;
      if (d.empty()) continue;
      QFLASH_CHECK(d.size() == lw.moe.experts.size(), "LoRA adapter '", ad.name, "': ", L, p.name, " updates for ",
                   d.size(), " experts, the model has ", lw.moe.experts.size());
      for (std::size_t e = 0; e < d.size(); ++e)
        fits(d[e], lw.moe.experts[e].*p.base, L + "expert " + std::to_string(e) + " " + std::string(p.name));
    }
  }
  for (auto const& [table, base, what] : {std::tuple{&ad.embed, &w.embed, "embed_tokens"},
                                          std::tuple{&ad.lm_head, &w.lm_head, "lm_head"}})
    QFLASH_CHECK(!*table || ((*table)->rows == base->rows && (*table)->cols == base->cols), "LoRA adapter '", ad.name,
                 "': its ", what, " is [", (*table)->rows, ", ", (*table)->cols, "], the model's [", base->rows, ", ",
                 base->cols, "]");
}

}  // namespace qflash::model
