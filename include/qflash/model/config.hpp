/// @file
/// The run-time model config: what the model's layers need to know that is not in the spec
/// (layer count and kinds, vocabulary, RoPE base, epsilons, lengths), plus the memory
/// arithmetic (parameters, KV bytes, recurrent state bytes) that sizing and the CLI report.
/// Plain data: io/hf_config.hpp fills it from a config.json, io/gguf from GGUF metadata.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "qflash/core/dtype.hpp"
#include "qflash/core/error.hpp"
#include "qflash/spec/moe_spec.hpp"

namespace qflash::model {

enum class LayerKind { kFullAttention, kLinearAttention };

constexpr std::string_view to_string(LayerKind k) {
  return k == LayerKind::kFullAttention ? "full_attention" : "linear_attention";
}

struct ModelConfig {
  std::string model_type;  ///< canonical family name: "qwen3_5_moe" or "qwen3_moe"
  ModelFamily family = ModelFamily::kAny;

  int d_model = 0, n_layer = 0, n_head = 0, n_head_kv = 0, d_head = 0, vocab = 0;
  int n_expert = 0, n_expert_used = 0, d_ff_expert = 0;
  int d_ff_shared = 0;  ///< 0 for qwen3_moe
  /// Gated DeltaNet; all 0 for qwen3_moe.
  int n_head_k_linear = 0, n_head_v_linear = 0, d_head_k_linear = 0, d_head_v_linear = 0,
      d_conv = 0;
  std::vector<LayerKind> layer_types;  ///< n_layer entries

  float rope_theta = 0;
  float partial_rotary_factor = 1;
  int rotary_dim = 0;  ///< leading dims of each head that RoPE rotates (d_head * factor, even)
  float rms_norm_eps = 0;
  bool norm_topk_prob = true;  ///< renormalize the top-k router weights
  bool tie_word_embeddings = false;
  bool attn_output_gate = false;  ///< q_proj also yields a sigmoid gate on the attention output
  /// RMSNorm weights are stored zero-centred and applied as (1 + w): qwen3_5_moe in HF
  /// checkpoints. llama.cpp's converter stores 1 + w, so its files apply them as plain weights.
  bool zero_centered_norms = false;
  /// Gated DeltaNet value heads in llama.cpp's tiled order (head j reads q/k head j % H_k)
  /// instead of HF's grouped order (j / (H_v / H_k)).
  bool tiled_value_heads = false;

  std::vector<int> eos_token_ids;  ///< config's, then generation_config's, without repeats
  std::optional<int> bos_token_id, pad_token_id;
  /// generation_config.json's sampling settings; unset when the file does not give them.
  struct GenerationDefaults {
    std::optional<bool> do_sample;
    std::optional<float> temperature, top_p, min_p, repetition_penalty;
    std::optional<int> top_k;
  } generation;
  int max_position_embeddings = 0;

  /// qwen3_moe: layer i is a dense MLP (width d_ff_dense) when it is in mlp_only_layers or
  /// (i + 1) % decoder_sparse_step != 0. load_config rejects such configs for now.
  std::vector<int> mlp_only_layers;
  int decoder_sparse_step = 1;
  int d_ff_dense = 0;  ///< "intermediate_size"; qwen3_moe only, used only by dense layers

  DType dtype = DType::kF32;  ///< "dtype"/"torch_dtype"; F32 (PyTorch's default) when absent
  std::string source;         ///< path of the config.json, for messages

  [[nodiscard]] bool is_moe_layer(int i) const {
    if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), i) != mlp_only_layers.end())
      return false;
    return n_expert > 0 && (i + 1) % decoder_sparse_step == 0;
  }
  [[nodiscard]] int n_layer_of(LayerKind k) const {
    return static_cast<int>(std::count(layer_types.begin(), layer_types.end(), k));
  }

  /// The run-time spec; throws Error naming `source` when `why_invalid` objects.
  [[nodiscard]] MoeSpec spec(KvScheme kv, WeightFormat w) const {
    MoeSpec s{
        .family = family,
        .d_model = d_model,
        .n_head = n_head,
        .n_head_kv = n_head_kv,
        .d_head = d_head,
        .n_expert = n_expert,
        .n_expert_used = n_expert_used,
        .d_ff_expert = d_ff_expert,
        .d_ff_shared = d_ff_shared,
        .n_head_k_linear = n_head_k_linear,
        .n_head_v_linear = n_head_v_linear,
        .d_head_k_linear = d_head_k_linear,
        .d_head_v_linear = d_head_v_linear,
        .d_conv = d_conv,
        .kv = kv,
        .weights = w,
    };
    auto why = why_invalid(s);
    QFLASH_CHECK(why.empty(), source, ": unsupported model: ", why);
    check_sizes();
    return s;
  }

  /// Bounds far above any published model, so that a corrupt config fails here by name, and
  /// the int64 size arithmetic below (parameters, bytes) cannot overflow.
  void check_sizes() const {
    constexpr std::int64_t kMaxWidth = std::int64_t{1} << 17, kMaxCount = std::int64_t{1} << 14;
    auto bound = [&](char const* name, std::int64_t v, std::int64_t hi) {
      QFLASH_CHECK(v <= hi, source, ": ", name, " = ", v, " is above ", hi, " (not a real model's size)");
    };
    bound("hidden size", d_model, kMaxWidth);
    bound("head dim", d_head, kMaxWidth);
    bound("expert ffn size", d_ff_expert, kMaxWidth);
    bound("shared expert ffn size", d_ff_shared, kMaxWidth);
    bound("dense ffn size", d_ff_dense, kMaxWidth);
    bound("linear key head dim", d_head_k_linear, kMaxWidth);
    bound("linear value head dim", d_head_v_linear, kMaxWidth);
    bound("attention heads", n_head, kMaxCount);
    bound("kv heads", n_head_kv, kMaxCount);
    bound("experts", n_expert, kMaxCount);
    bound("linear key heads", n_head_k_linear, kMaxCount);
    bound("linear value heads", n_head_v_linear, kMaxCount);
    bound("layers", n_layer, 4096);
    bound("vocabulary", vocab, std::int64_t{1} << 24);
    bound("max positions", max_position_embeddings, std::int64_t{1} << 24);
  }

  // --- Parameter counts (text model only: no MTP, no vision tower) --------------------------
  [[nodiscard]] std::int64_t n_params_full_attention_layer() const {
    std::int64_t const dm = d_model, q = std::int64_t{n_head} * d_head,
                       kv = std::int64_t{n_head_kv} * d_head;
    return dm * q * (attn_output_gate ? 2 : 1)  // q_proj (+ gate)
           + 2 * dm * kv                        // k_proj, v_proj
           + q * dm                             // o_proj
           + 2 * std::int64_t{d_head};          // q_norm, k_norm
  }
  // --- Gated DeltaNet widths ----------------------------------------------------------------
  [[nodiscard]] std::int64_t linear_key_dim() const { return std::int64_t{n_head_k_linear} * d_head_k_linear; }
  [[nodiscard]] std::int64_t linear_value_dim() const { return std::int64_t{n_head_v_linear} * d_head_v_linear; }
  /// Channels of the causal conv: q | k | v.
  [[nodiscard]] std::int64_t linear_conv_dim() const { return 2 * linear_key_dim() + linear_value_dim(); }

  [[nodiscard]] std::int64_t n_params_linear_attention_layer() const {
    std::int64_t const dm = d_model, hv = n_head_v_linear;
    std::int64_t const value_dim = linear_value_dim();
    std::int64_t const conv_dim = linear_conv_dim();
    return conv_dim * dm         // in_proj_qkv
           + value_dim * dm      // in_proj_z
           + 2 * hv * dm         // in_proj_b, in_proj_a
           + conv_dim * d_conv   // conv1d (no bias)
           + 2 * hv              // dt_bias, A_log
           + d_head_v_linear     // norm
           + dm * value_dim;     // out_proj
  }
  [[nodiscard]] std::int64_t n_params_expert() const {
    return 3 * std::int64_t{d_ff_expert} * d_model;  // gate, up, down
  }
  [[nodiscard]] std::int64_t n_params_shared_expert() const {
    return d_ff_shared > 0 ? 3 * std::int64_t{d_ff_shared} * d_model + d_model : 0;  // + gate
  }
  [[nodiscard]] std::int64_t n_params_router() const {
    return std::int64_t{n_expert} * d_model;
  }
  [[nodiscard]] std::int64_t n_params_dense_mlp() const {
    return 3 * std::int64_t{d_ff_dense} * d_model;
  }

  /// Parameters of the text model: embedding, layers, final norm, and lm_head unless tied.
  [[nodiscard]] std::int64_t n_params_total() const {
    return n_params_counted(false);
  }
  /// Parameters touched per token: mixers, norms, routers, n_expert_used experts, the shared
  /// expert and lm_head; not the embedding table (a lookup reads one row).
  [[nodiscard]] std::int64_t n_params_active() const { return n_params_counted(true); }

  /// K and V of every full-attention layer for one token (no quantization scales).
  [[nodiscard]] std::int64_t kv_bytes_per_token(DType kv_dtype) const {
    return std::int64_t{n_layer_of(LayerKind::kFullAttention)} * 2 * n_head_kv * d_head *
           static_cast<std::int64_t>(size_of(kv_dtype));
  }

  /// Gated DeltaNet state of one sequence, independent of its length: per linear layer the
  /// conv state [conv_dim, d_conv - 1] and the recurrent state [H_v, d_k, d_v].
  [[nodiscard]] std::int64_t linear_state_bytes_per_sequence(DType conv_dtype,
                                                             DType state_dtype) const {
    if (d_conv == 0) return 0;
    std::int64_t const conv_dim = linear_conv_dim();
    std::int64_t const per_layer =
        conv_dim * (d_conv - 1) * static_cast<std::int64_t>(size_of(conv_dtype)) +
        std::int64_t{n_head_v_linear} * d_head_k_linear * d_head_v_linear *
            static_cast<std::int64_t>(size_of(state_dtype));
    return std::int64_t{n_layer_of(LayerKind::kLinearAttention)} * per_layer;
  }

 private:
  [[nodiscard]] std::int64_t n_params_counted(bool active) const {
    std::int64_t const table = std::int64_t{vocab} * d_model;
    std::int64_t n = 0;
    for (int i = 0; i < n_layer; ++i) {
      n += 2 * std::int64_t{d_model};  // input_layernorm, post_attention_layernorm
      n += layer_types[static_cast<std::size_t>(i)] == LayerKind::kFullAttention
               ? n_params_full_attention_layer()
               : n_params_linear_attention_layer();
      if (is_moe_layer(i))
        n += n_params_router() + (active ? n_expert_used : n_expert) * n_params_expert() +
             n_params_shared_expert();
      else
        n += n_params_dense_mlp();
    }
    n += d_model;  // final norm
    if (active) return n + table;  // lm_head (tied or not)
    return n + table + (tie_word_embeddings ? 0 : table);
  }
};

}  // namespace qflash::model
