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

struct LoraAdapter {
  std::string name;               ///< what requests and logs call it
  std::vector<LoraLayer> layers;  ///< [n_layer]
  std::optional<WeightView> embed, lm_head;  ///< modules_to_save: whole tables [vocab, d_model]
  std::shared_ptr<void const> storage;      ///< keeps the bytes behind the views alive
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
    if (lw.kind == LayerKind::kFullAttention) {
      fits(u.q, lw.attention.q, L + "q_proj");
      fits(u.k, lw.attention.k, L + "k_proj");
      fits(u.v, lw.attention.v, L + "v_proj");
      fits(u.o, lw.attention.o, L + "o_proj");
      QFLASH_CHECK(u.qkv.empty() && u.z.empty() && u.b.empty() && u.a.empty() && u.out.empty(), "LoRA adapter '",
                   ad.name, "': ", L, "is full attention but the adapter updates Gated DeltaNet projections there");
    } else {
      fits(u.qkv, lw.linear.qkv, L + "in_proj_qkv");
      fits(u.z, lw.linear.z, L + "in_proj_z");
      fits(u.b, lw.linear.b, L + "in_proj_b");
      fits(u.a, lw.linear.a, L + "in_proj_a");
      fits(u.out, lw.linear.out, L + "out_proj");
      QFLASH_CHECK(u.q.empty() && u.k.empty() && u.v.empty() && u.o.empty(), "LoRA adapter '", ad.name, "': ", L,
                   "is Gated DeltaNet but the adapter updates attention projections there");
    }
    auto experts = [&](std::vector<LowRank> const& d, bool down, char const* what) {
      if (d.empty()) return;
      QFLASH_CHECK(d.size() == lw.moe.experts.size(), "LoRA adapter '", ad.name, "': ", L, what, " updates for ",
                   d.size(), " experts, the model has ", lw.moe.experts.size());
      for (std::size_t e = 0; e < d.size(); ++e) {
        auto const& x = lw.moe.experts[e];
        fits(d[e], down ? x.down : x.gate, L + "expert " + std::to_string(e) + " " + what);
      }
    };
    experts(u.gate, false, "gate_proj");
    experts(u.up, false, "up_proj");
    experts(u.down, true, "down_proj");
    bool const shared = !u.shared_gate.empty() || !u.shared_up.empty() || !u.shared_down.empty();
    QFLASH_CHECK(!shared || lw.moe.shared, "LoRA adapter '", ad.name, "': ", L,
                 "has no shared expert but the adapter updates one");
    if (shared) {
      fits(u.shared_gate, lw.moe.shared->gate, L + "shared_expert.gate_proj");
      fits(u.shared_up, lw.moe.shared->up, L + "shared_expert.up_proj");
      fits(u.shared_down, lw.moe.shared->down, L + "shared_expert.down_proj");
    }
  }
  for (auto const& [table, base, what] : {std::tuple{&ad.embed, &w.embed, "embed_tokens"},
                                          std::tuple{&ad.lm_head, &w.lm_head, "lm_head"}})
    QFLASH_CHECK(!*table || ((*table)->rows == base->rows && (*table)->cols == base->cols), "LoRA adapter '", ad.name,
                 "': its ", what, " is [", (*table)->rows, ", ", (*table)->cols, "], the model's [", base->rows, ", ",
                 base->cols, "]");
}

}  // namespace qflash::model
