/// @file
/// The model's weights as views: every matrix a WeightView with its own format, small vectors
/// (norms, conv, gate parameters) FloatViews of fp32. Who owns the bytes (a mapped checkpoint,
/// buffers quantized at load, a device's copies) is the runtime's business
/// (runtime/load_model.hpp); layers only read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "qflash/kernels/expert_ffn/op.hpp"
#include "qflash/kernels/linear/op.hpp"
#include "qflash/model/config.hpp"

namespace qflash::model {

using kernels::ExpertWeights;
using kernels::WeightView;

/// A read-only fp32 vector of the weights, owned elsewhere (host or device memory). Made from
/// a vector that outlives it, never from a temporary one.
class FloatView {
 public:
  FloatView() = default;
  FloatView(float const* data, std::size_t size) : data_(data), size_(size) {}
  FloatView(std::vector<float> const& v) : data_(v.data()), size_(v.size()) {}  // NOLINT: a view of v
  FloatView(std::vector<float>&&) = delete;

  [[nodiscard]] float const* data() const { return data_; }
  [[nodiscard]] std::size_t size() const { return size_; }
  [[nodiscard]] bool empty() const { return size_ == 0; }
  [[nodiscard]] float const* begin() const { return data_; }
  [[nodiscard]] float const* end() const { return data_ + size_; }
  float operator[](std::size_t i) const { return data_[i]; }

 private:
  float const* data_ = nullptr;
  std::size_t size_ = 0;
};

struct AttentionWeights {
  WeightView q;  // [n_head * d_head * (gated ? 2 : 1), d_model]: per head [query | gate]
  WeightView k;  // [n_head_kv * d_head, d_model]
  WeightView v;  // [n_head_kv * d_head, d_model]
  WeightView o;  // [d_model, n_head * d_head]
  FloatView q_norm;  // [d_head]
  FloatView k_norm;  // [d_head]
};

struct LinearAttentionWeights {
  WeightView qkv;  // [2 * n_head_k * d_k + n_head_v * d_v, d_model]
  WeightView z;    // [n_head_v * d_v, d_model]
  WeightView b;    // [n_head_v, d_model]
  WeightView a;    // [n_head_v, d_model]
  WeightView out;  // [d_model, n_head_v * d_v]
  FloatView conv;     // [conv_dim, d_conv]
  FloatView dt_bias;  // [n_head_v]
  FloatView neg_a;    // [n_head_v]: -exp(A_log)
  FloatView norm;     // [d_v], plain weight
};

struct MoeWeights {
  /// [n_expert (+ 1), d_model]: the router, and with a shared expert its gate as one more row,
  /// so one GEMV gives both.
  WeightView router;
  std::vector<ExpertWeights> experts;  // [n_expert]
  std::optional<ExpertWeights> shared;
};

struct LayerWeights {
  LayerKind kind{};
  FloatView input_norm;  // [d_model]
  FloatView post_norm;   // [d_model]
  AttentionWeights attention;
  LinearAttentionWeights linear;
  MoeWeights moe;
};

struct ModelWeights {
  WeightView embed;    // [vocab, d_model]
  WeightView lm_head;  // [vocab, d_model]
  FloatView final_norm;  // [d_model]
  std::vector<LayerWeights> layers;

  /// Calls fn(name, view) for every matrix, experts included (e.g. to count bytes per format).
  template <class Fn>
  void for_each_matrix(Fn&& fn) const {
    fn("embed", embed);
    if (lm_head.data != embed.data) fn("lm_head", lm_head);
    for (std::size_t l = 0; l < layers.size(); ++l) {
      auto const& w = layers[l];
      std::string const L = "layers." + std::to_string(l) + ".";
      if (w.kind == LayerKind::kFullAttention) {
        fn(L + "attention.q", w.attention.q);
        fn(L + "attention.k", w.attention.k);
        fn(L + "attention.v", w.attention.v);
        fn(L + "attention.o", w.attention.o);
      } else {
        fn(L + "linear.qkv", w.linear.qkv);
        fn(L + "linear.z", w.linear.z);
        fn(L + "linear.b", w.linear.b);
        fn(L + "linear.a", w.linear.a);
        fn(L + "linear.out", w.linear.out);
      }
      fn(L + "moe.router", w.moe.router);
      for (std::size_t e = 0; e < w.moe.experts.size(); ++e) {
        std::string const E = L + "moe.experts." + std::to_string(e) + ".";
        fn(E + "gate", w.moe.experts[e].gate);
        fn(E + "up", w.moe.experts[e].up);
        fn(E + "down", w.moe.experts[e].down);
      }
      if (w.moe.shared) {
        fn(L + "moe.shared.gate", w.moe.shared->gate);
        fn(L + "moe.shared.up", w.moe.shared->up);
        fn(L + "moe.shared.down", w.moe.shared->down);
      }
    }
  }
};

}  // namespace qflash::model
