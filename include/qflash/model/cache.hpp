/// @file
/// Per-sequence caches, owned by the caller (the runtime), read and written by layers through
/// the model's forward: contiguous K/V for full-attention layers, conv and recurrent state
/// for Gated DeltaNet layers. Paged and compressed KV replace `AttentionCache` later without
/// touching layer code.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/model/config.hpp"

namespace qflash::model {

/// K and V of one layer for positions [0, n): [n, n_head_kv, d_head] each, fp32.
struct AttentionCache {
  std::vector<float> k;
  std::vector<float> v;
};

/// Gated DeltaNet state of one layer: the last d_conv-1 conv inputs [conv_dim, d_conv-1] and
/// the recurrent state [n_head_v, d_k, d_v], both fp32.
struct LinearState {
  std::vector<float> conv;
  std::vector<float> recurrent;
};

class SequenceState {
 public:
  explicit SequenceState(ModelConfig const& cfg)
      : max_positions_(cfg.max_position_embeddings), layers_(cfg.layer_types.size()) {
    std::size_t const conv_dim = static_cast<std::size_t>(cfg.linear_conv_dim());
    for (std::size_t l = 0; l < layers_.size(); ++l)
      if (cfg.layer_types[l] == LayerKind::kLinearAttention) {
        layers_[l].linear.conv.assign(conv_dim * static_cast<std::size_t>(cfg.d_conv - 1), 0.0f);
        layers_[l].linear.recurrent.assign(static_cast<std::size_t>(cfg.n_head_v_linear) *
                                               static_cast<std::size_t>(cfg.d_head_k_linear) *
                                               static_cast<std::size_t>(cfg.d_head_v_linear),
                                           0.0f);
      }
  }

  /// Tokens already processed; the next token's position.
  [[nodiscard]] std::int64_t n_past() const { return n_past_; }
  void advance(std::int64_t n) { n_past_ += n; }
  [[nodiscard]] std::int64_t max_positions() const { return max_positions_; }

  AttentionCache& attention(std::size_t layer) { return layers_[layer].attention; }
  LinearState& linear(std::size_t layer) { return layers_[layer].linear; }

  /// Room for `positions` tokens of K/V in every attention layer, so that decoding up to
  /// there allocates nothing.
  void reserve(std::int64_t positions, ModelConfig const& cfg) {
    std::size_t const n = static_cast<std::size_t>(std::min(positions, max_positions_)) *
                          static_cast<std::size_t>(cfg.n_head_kv) * static_cast<std::size_t>(cfg.d_head);
    for (std::size_t l = 0; l < layers_.size(); ++l)
      if (cfg.layer_types[l] == LayerKind::kFullAttention) {
        layers_[l].attention.k.reserve(n);
        layers_[l].attention.v.reserve(n);
      }
  }

  /// Back to an empty sequence, keeping allocations.
  void reset() {
    n_past_ = 0;
    for (auto& l : layers_) {
      l.attention.k.clear();
      l.attention.v.clear();
      std::fill(l.linear.conv.begin(), l.linear.conv.end(), 0.0f);
      std::fill(l.linear.recurrent.begin(), l.linear.recurrent.end(), 0.0f);
    }
  }

  /// Bytes held now (K/V grow with the sequence; linear state is fixed).
  [[nodiscard]] std::size_t bytes() const {
    std::size_t b = 0;
    for (auto const& l : layers_)
      b += (l.attention.k.size() + l.attention.v.size() + l.linear.conv.size() +
            l.linear.recurrent.size()) * sizeof(float);
    return b;
  }

 private:
  struct Layer {
    AttentionCache attention;
    LinearState linear;
  };
  std::int64_t n_past_ = 0;
  std::int64_t max_positions_ = 0;
  std::vector<Layer> layers_;
};

}  // namespace qflash::model
