/// @file
/// The model config from a llama.cpp GGUF file's metadata, for the architectures `qwen35moe`
/// (qwen3_5_moe) and `qwen3moe`: the `<arch>.*` keys llama.cpp's converter writes (MODELS.md
/// §5), with the facts the converter changes recorded in the config rather than undone in the
/// weights: norms are stored as 1 + w (so they apply as plain weights) and Gated DeltaNet value
/// heads are stored in tiled order. A missing required key or a value out of range is an
/// error naming the file and key. Host only.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "qflash/core/error.hpp"
#include "qflash/io/gguf.hpp"
#include "qflash/model/config.hpp"

namespace qflash::io {

namespace detail {

/// A positive integer metadata value that fits an int.
inline int gguf_positive(GgufFile const& f, std::string const& key) {
  std::int64_t const v = f.get_int(key);
  QFLASH_CHECK(v > 0 && v <= (std::int64_t{1} << 30), f.path(), ": metadata '", key, "' = ", v,
               " (expected a positive integer below 2^30)");
  return static_cast<int>(v);
}

inline int gguf_positive_or(GgufFile const& f, std::string const& key, int fallback) {
  return f.has(key) ? gguf_positive(f, key) : fallback;
}

}  // namespace detail

/// The config of a `qwen35moe` or `qwen3moe` GGUF file.
inline model::ModelConfig config_from_gguf(GgufFile const& f) {
  using detail::gguf_positive;
  using detail::gguf_positive_or;
  model::ModelConfig c;
  c.source = f.path();
  std::string const arch(f.architecture());
  QFLASH_CHECK(arch == "qwen35moe" || arch == "qwen3moe", f.path(), ": general.architecture '", arch,
               "' is not supported (expected qwen35moe or qwen3moe)");
  bool const qwen35 = arch == "qwen35moe";
  c.family = qwen35 ? ModelFamily::kQwen35Moe : ModelFamily::kQwen3Moe;
  c.model_type = std::string(to_string(c.family));
  auto key = [&](char const* k) { return arch + "." + k; };

  c.d_model = gguf_positive(f, key("embedding_length"));
  int const blocks = gguf_positive(f, key("block_count"));
  QFLASH_CHECK(blocks <= 4096, f.path(), ": metadata '", key("block_count"), "' = ", blocks,
               " is above 4096 layers");
  int const mtp = f.has(key("nextn_predict_layers")) ? static_cast<int>(f.get_int(key("nextn_predict_layers"))) : 0;
  QFLASH_CHECK(mtp >= 0 && mtp < blocks, f.path(), ": metadata '", key("nextn_predict_layers"), "' = ", mtp,
               " (expected fewer than block_count = ", blocks, ")");
  c.n_layer = blocks - mtp;  // the MTP blocks come last and are not run
  c.n_head = gguf_positive(f, key("attention.head_count"));
  c.n_head_kv = gguf_positive(f, key("attention.head_count_kv"));
  c.d_head = gguf_positive_or(f, key("attention.key_length"), c.d_model / c.n_head);
  int const d_value = gguf_positive_or(f, key("attention.value_length"), c.d_head);
  QFLASH_CHECK(d_value == c.d_head, f.path(), ": metadata '", key("attention.value_length"), "' = ", d_value,
               " differs from key_length ", c.d_head, " (expected equal)");
  c.n_expert = gguf_positive(f, key("expert_count"));
  c.n_expert_used = gguf_positive(f, key("expert_used_count"));
  c.d_ff_expert = gguf_positive(f, key("expert_feed_forward_length"));
  c.rope_theta = static_cast<float>(f.find_float(key("rope.freq_base")).value_or(qwen35 ? 1e7 : 1e6));
  c.rotary_dim = gguf_positive_or(f, key("rope.dimension_count"), c.d_head);
  QFLASH_CHECK(c.rotary_dim % 2 == 0 && c.rotary_dim <= c.d_head, f.path(), ": metadata '",
               key("rope.dimension_count"), "' = ", c.rotary_dim, " (expected an even number <= key_length ", c.d_head, ")");
  c.partial_rotary_factor = static_cast<float>(c.rotary_dim) / static_cast<float>(c.d_head);
  double const eps = f.find_float(key("attention.layer_norm_rms_epsilon")).value_or(1e-6);
  QFLASH_CHECK(eps > 0 && eps < 1, f.path(), ": metadata '", key("attention.layer_norm_rms_epsilon"), "' = ", eps,
               " (expected a small positive number)");
  c.rms_norm_eps = static_cast<float>(eps);
  c.max_position_embeddings = gguf_positive_or(f, key("context_length"), 32768);
  c.norm_topk_prob = true;  // llama.cpp renormalizes the top-k weights of both architectures
  c.tie_word_embeddings = f.find_tensor("output.weight") == nullptr;

  GgufTensor const& embd = f.tensor("token_embd.weight");
  QFLASH_CHECK(embd.n_dims == 2 && embd.ne[0] == c.d_model, f.path(), ": tensor 'token_embd.weight' has shape ",
               format_ne(embd), " (expected {", c.d_model, ", vocab})");
  QFLASH_CHECK(embd.ne[1] > 0 && embd.ne[1] <= (std::int64_t{1} << 30), f.path(), ": tensor 'token_embd.weight' vocabulary ",
               embd.ne[1], " is out of range");
  c.vocab = static_cast<int>(embd.ne[1]);
  auto token_id = [&](char const* k) -> std::optional<int> {
    auto id = f.find_int(k);
    if (!id) return std::nullopt;
    QFLASH_CHECK(*id >= 0 && *id < c.vocab, f.path(), ": metadata '", k, "' = ", *id,
                 " is outside the vocabulary [0, ", c.vocab, ")");
    return static_cast<int>(*id);
  };
  if (auto eos = token_id("tokenizer.ggml.eos_token_id")) c.eos_token_ids = {*eos};
  c.bos_token_id = token_id("tokenizer.ggml.bos_token_id");
  c.pad_token_id = token_id("tokenizer.ggml.padding_token_id");

  if (qwen35) {
    c.attn_output_gate = true;
    c.zero_centered_norms = false;  // the converter stored 1 + w
    c.tiled_value_heads = true;
    c.d_ff_shared = gguf_positive(f, key("expert_shared_feed_forward_length"));
    c.d_conv = gguf_positive(f, key("ssm.conv_kernel"));
    c.d_head_k_linear = gguf_positive(f, key("ssm.state_size"));
    c.n_head_k_linear = gguf_positive(f, key("ssm.group_count"));
    c.n_head_v_linear = gguf_positive(f, key("ssm.time_step_rank"));
    int const inner = gguf_positive(f, key("ssm.inner_size"));
    QFLASH_CHECK(inner % c.n_head_v_linear == 0, f.path(), ": metadata '", key("ssm.inner_size"), "' = ", inner,
                 " is not a multiple of ssm.time_step_rank ", c.n_head_v_linear);
    c.d_head_v_linear = inner / c.n_head_v_linear;
    int const interval = gguf_positive_or(f, key("full_attention_interval"), 4);
    for (int i = 0; i < c.n_layer; ++i)
      c.layer_types.push_back((i + 1) % interval == 0 ? model::LayerKind::kFullAttention
                                                      : model::LayerKind::kLinearAttention);
  } else {
    c.layer_types.assign(static_cast<std::size_t>(c.n_layer), model::LayerKind::kFullAttention);
  }
  c.dtype = DType::kF32;
  (void)c.spec(KvScheme::kAny, WeightFormat::kAny);  // why_invalid, naming the file
  return c;
}

}  // namespace qflash::io
