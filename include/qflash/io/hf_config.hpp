/// @file
/// The run-time model config, read from a Hugging Face `config.json` (plus
/// `generation_config.json`) for the two supported families: qwen3_5_moe (Qwen3.5/3.6 MoE,
/// text config flat or nested under "text_config") and qwen3_moe (Qwen3-30B-A3B style).
/// Absent keys take the defaults of transformers' config classes (Qwen3_5MoeTextConfig,
/// Qwen3MoeConfig), and nothing else; keys of the wrong type or out of range are errors that
/// name the file and the field. The config itself (and its memory arithmetic) is
/// model/config.hpp. Host only.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "qflash/core/dtype.hpp"
#include "qflash/core/error.hpp"
#include "qflash/core/log.hpp"
#include "qflash/io/json.hpp"
#include "qflash/model/config.hpp"
#include "qflash/spec/kv_scheme.hpp"
#include "qflash/spec/moe_spec.hpp"

namespace qflash::io {

using model::LayerKind;
using model::ModelConfig;

namespace detail {

inline DType parse_torch_dtype(JsonFields const& f, std::string_view key) {
  std::string s = f.string(key);
  std::string_view v = s;
  if (v.starts_with("torch.")) v.remove_prefix(6);
  if (v == "bfloat16") return DType::kBF16;
  if (v == "float16" || v == "half") return DType::kF16;
  if (v == "float32" || v == "float") return DType::kF32;
  f.fail(key, "one of \"bfloat16\", \"float16\", \"float32\"");
}

struct Rope {
  double theta = 10000.0;  // transformers' RotaryEmbeddingConfigMixin.default_theta
  std::optional<double> partial_rotary_factor;
};

/// RoPE from "rope_parameters" (new) or "rope_scaling" (old), else top-level "rope_theta" /
/// "partial_rotary_factor" (the precedence of transformers' convert_rope_params_to_dict).
/// Only the default rope type is supported; "mrope" (an old alias) and the mrope_section /
/// mrope_interleaved keys are accepted: for text every MRoPE stream carries the same position,
/// so interleaved MRoPE equals plain RoPE and the sections are checked, then ignored.
inline Rope parse_rope(JsonFields const& f) {
  Rope r;
  std::optional<JsonFields> params;
  for (std::string_view key : {"rope_parameters", "rope_scaling"}) {
    if (f.has(key)) {
      params.emplace(f.object(key));
      break;
    }
  }
  if (f.has("rope_theta")) r.theta = f.number("rope_theta");
  if (f.has("partial_rotary_factor")) r.partial_rotary_factor = f.number("partial_rotary_factor");
  if (params) {
    std::string type = "default";
    if (params->has("rope_type"))
      type = params->string("rope_type");
    else if (params->has("type"))
      type = params->string("type");
    if (type != "default" && type != "mrope")
      QFLASH_FAIL(f.file(), ": rope type '", type, "' (field '",
                  params->has("rope_type") ? params->field("rope_type") : params->field("type"),
                  "') is not supported; only the default RoPE is");
    if (params->has("rope_theta")) r.theta = params->number("rope_theta");
    if (params->has("partial_rotary_factor"))
      r.partial_rotary_factor = params->number("partial_rotary_factor");
  }
  QFLASH_CHECK(r.theta > 0, f.file(), ": rope_theta must be positive, got ", r.theta);
  return r;
}

/// Checks mrope_section (when present) sums to rotary_dim / 2, as transformers requires.
inline void check_mrope_section(JsonFields const& f, int rotary_dim) {
  for (std::string_view key : {"rope_parameters", "rope_scaling"}) {
    if (!f.has(key)) continue;
    JsonFields p = f.object(key);
    if (!p.has("mrope_section")) return;
    auto sec = p.int_list("mrope_section", {});
    int sum = 0;
    for (int s : sec) sum += s;
    if (sum != rotary_dim / 2)
      p.fail("mrope_section", "sections summing to rotary_dim / 2 = " +
                                  std::to_string(rotary_dim / 2));
    if (p.has("mrope_interleaved")) (void)p.boolean("mrope_interleaved", false);
    return;
  }
}

/// num_hidden_layers, bounded so that a corrupt value fails here rather than in an allocation.
inline int layer_count(JsonFields const& f, int fallback) {
  constexpr int kMaxLayers = 4096;
  return static_cast<int>(f.integer("num_hidden_layers", fallback, 1, kMaxLayers,
                                    "a positive integer up to 4096"));
}

inline std::vector<LayerKind> parse_layer_types(JsonFields const& f, int n_layer) {
  std::vector<LayerKind> out;
  if (f.has("layer_types")) {
    auto names = f.string_list("layer_types");
    if (static_cast<int>(names.size()) != n_layer)
      f.fail("layer_types", "a list of " + std::to_string(n_layer) +
                                " entries (num_hidden_layers)");
    for (auto const& s : names) {
      // transformers remaps the legacy names "attention" and "mamba".
      if (s == "full_attention" || s == "attention")
        out.push_back(LayerKind::kFullAttention);
      else if (s == "linear_attention" || s == "mamba")
        out.push_back(LayerKind::kLinearAttention);
      else
        f.fail("layer_types", "a list of \"full_attention\" / \"linear_attention\"");
    }
    return out;
  }
  int const interval = f.positive_int("full_attention_interval", 4);
  for (int i = 0; i < n_layer; ++i)
    out.push_back((i + 1) % interval == 0 ? LayerKind::kFullAttention
                                          : LayerKind::kLinearAttention);
  return out;
}

/// Whether config.json's `key` (perhaps under text_config) sets a size of the model: a key
/// transformers defaults to a full-size model's value rather than deriving it.
inline bool is_size_field(std::string_view key, bool qwen35) {
  static constexpr std::array<std::string_view, 14> kSizes{
      "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size", "num_experts",
      "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "linear_num_key_heads",
      "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"};
  if (key.starts_with("text_config.")) key.remove_prefix(12);
  // qwen3_moe derives head_dim from hidden_size / num_attention_heads.
  return std::find(kSizes.begin(), kSizes.end(), key) != kSizes.end() || (qwen35 && key == "head_dim");
}

}  // namespace detail

/// Reads `dir/config.json` (and `dir/generation_config.json` when present). Throws Error naming
/// the file and the field for an unsupported model type, a field of the wrong type or range,
/// or a feature the runtime lacks (RoPE scaling, attention bias, sliding window, dense layers).
inline ModelConfig load_config(std::string const& dir) {
  namespace fs = std::filesystem;
  std::string const path = (fs::path(dir) / "config.json").string();
  Json const root = read_json_file(path);
  JsonFields const top(root, path);

  ModelConfig c;
  c.source = path;
  std::string const type = top.string("model_type");
  bool const qwen35 = type == "qwen3_5_moe" || type == "qwen3_5_moe_text";
  if (!qwen35 && type != "qwen3_moe")
    QFLASH_FAIL(path, ": model_type '", type,
                "' is not supported (supported: qwen3_5_moe, qwen3_5_moe_text, qwen3_moe)");
  c.family = qwen35 ? ModelFamily::kQwen35Moe : ModelFamily::kQwen3Moe;
  c.model_type = std::string(to_string(c.family));

  // The text model's fields: nested for the multimodal qwen3_5_moe checkpoints, flat otherwise.
  bool const nested = qwen35 && top.has("text_config");
  JsonFields const t = nested ? top.object("text_config") : top;
  if (nested && t.has("model_type")) {
    std::string tt = t.string("model_type");
    if (tt != "qwen3_5_moe_text" && tt != "qwen3_5_moe")
      t.fail("model_type", "\"qwen3_5_moe_text\"");
  }
  // Keys that can sit at either level: the text config first, then the top level.
  auto either = [&](std::string_view key) -> JsonFields const& {
    return (!nested || t.has(key) || !top.has(key)) ? t : top;
  };

  if (qwen35) {  // Qwen3_5MoeTextConfig defaults
    c.vocab = t.positive_int("vocab_size", 248320);
    c.d_model = t.positive_int("hidden_size", 2048);
    c.n_layer = detail::layer_count(t, 40);
    c.n_head = t.positive_int("num_attention_heads", 16);
    c.n_head_kv = t.positive_int("num_key_value_heads", 2);
    c.d_head = t.positive_int("head_dim", 256);
    c.max_position_embeddings = t.positive_int("max_position_embeddings", 32768);
    c.n_expert = t.positive_int("num_experts", 256);
    c.n_expert_used = t.positive_int("num_experts_per_tok", 8);
    c.d_ff_expert = t.positive_int("moe_intermediate_size", 512);
    c.d_ff_shared = t.positive_int("shared_expert_intermediate_size", 512);
    c.n_head_k_linear = t.positive_int("linear_num_key_heads", 16);
    c.n_head_v_linear = t.positive_int("linear_num_value_heads", 32);
    c.d_head_k_linear = t.positive_int("linear_key_head_dim", 128);
    c.d_head_v_linear = t.positive_int("linear_value_head_dim", 128);
    c.d_conv = t.positive_int("linear_conv_kernel_dim", 4);
    c.layer_types = detail::parse_layer_types(t, c.n_layer);
    // The reference deletes norm_topk_prob and always renormalizes; read it only to check type.
    if (t.has("norm_topk_prob") && !t.boolean("norm_topk_prob", true))
      QFLASH_LOG_WARN(path, ": ", t.field("norm_topk_prob"),
                      " is false, but qwen3_5_moe always renormalizes the top-k weights "
                      "(as transformers does); ignoring it");
    c.norm_topk_prob = true;
    // The reference always gates the attention output (q_proj is 2x wide).
    if (!t.boolean("attn_output_gate", true))
      QFLASH_FAIL(path, ": field '", t.field("attn_output_gate"),
                  "' is false; qwen3_5_moe without the attention output gate is not supported");
    c.attn_output_gate = true;
    c.zero_centered_norms = true;
    c.mlp_only_layers = t.int_list("mlp_only_layers", {});
    c.decoder_sparse_step = 1;
  } else {  // Qwen3MoeConfig defaults
    c.vocab = t.positive_int("vocab_size", 151936);
    c.d_model = t.positive_int("hidden_size", 2048);
    c.n_layer = detail::layer_count(t, 24);
    c.n_head = t.positive_int("num_attention_heads", 32);
    c.n_head_kv = t.positive_int("num_key_value_heads", 4);
    // Qwen3MoeAttention: getattr(config, "head_dim", hidden_size // num_attention_heads)
    c.d_head = t.positive_int("head_dim", c.d_model / c.n_head);
    c.max_position_embeddings = t.positive_int("max_position_embeddings", 32768);
    c.n_expert = t.has("num_experts") || !t.has("num_local_experts")
                     ? t.positive_int("num_experts", 128)
                     : t.positive_int("num_local_experts");
    c.n_expert_used = t.positive_int("num_experts_per_tok", 8);
    c.d_ff_expert = t.positive_int("moe_intermediate_size", 768);
    c.d_ff_dense = t.positive_int("intermediate_size", 6144);
    c.norm_topk_prob = t.boolean("norm_topk_prob", false);
    c.attn_output_gate = false;
    c.layer_types.assign(static_cast<std::size_t>(c.n_layer), LayerKind::kFullAttention);
    c.mlp_only_layers = t.int_list("mlp_only_layers", {});
    c.decoder_sparse_step = t.positive_int("decoder_sparse_step", 1);
    if (t.boolean("use_sliding_window", false))
      QFLASH_FAIL(path, ": field '", t.field("use_sliding_window"),
                  "' is true; sliding-window attention is not supported");
  }
  // save_pretrained writes every size; an absent one is more likely a damaged file than a wish
  // for transformers' default (a full-size model's), so it is said without -v, and before a
  // check that the default may fail.
  std::string sizes;
  for (auto const& k : t.defaulted())
    if (detail::is_size_field(k, qwen35)) sizes += (sizes.empty() ? "" : ", ") + k;
  if (!sizes.empty())
    QFLASH_LOG_WARN(path, ": no ", sizes, "; taking the transformers defaults (save_pretrained writes every size: is "
                    "the file damaged?)");

  if (t.boolean("attention_bias", false))
    QFLASH_FAIL(path, ": field '", t.field("attention_bias"),
                "' is true; attention projections with bias are not supported");
  if (std::string act = t.string("hidden_act", "silu"); act != "silu")
    t.fail("hidden_act", "\"silu\" (the only activation supported)");
  c.rms_norm_eps = static_cast<float>(t.positive_number("rms_norm_eps", 1e-6));
  c.tie_word_embeddings = either("tie_word_embeddings").boolean("tie_word_embeddings", false);

  for (int l : c.mlp_only_layers)
    if (l >= c.n_layer)
      t.fail("mlp_only_layers", "layer indices below num_hidden_layers = " +
                                    std::to_string(c.n_layer));
  for (int i = 0; i < c.n_layer; ++i)
    if (!c.is_moe_layer(i))
      QFLASH_FAIL(path, ": layer ", i, " is a dense MLP (", t.field("mlp_only_layers"), " / ",
                  t.field("decoder_sparse_step"), "): dense MLP layers not supported yet");

  // RoPE.
  detail::Rope const rope = detail::parse_rope(t);
  c.rope_theta = static_cast<float>(rope.theta);
  // Qwen3_5MoeTextConfig defaults partial_rotary_factor to 0.25; elsewhere RoPE is full-width.
  c.partial_rotary_factor =
      static_cast<float>(rope.partial_rotary_factor.value_or(qwen35 ? 0.25 : 1.0));
  QFLASH_CHECK(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1, path,
               ": partial_rotary_factor must be in (0, 1], got ", c.partial_rotary_factor);
  c.rotary_dim = static_cast<int>(static_cast<double>(c.d_head) * c.partial_rotary_factor);
  QFLASH_CHECK(c.rotary_dim > 0 && c.rotary_dim % 2 == 0, path, ": rotary dim = head_dim ",
               c.d_head, " x partial_rotary_factor ", c.partial_rotary_factor, " = ",
               c.rotary_dim, " must be a positive even number");
  detail::check_mrope_section(t, c.rotary_dim);

  // dtype: newer configs say "dtype", older ones "torch_dtype".
  for (std::string_view key : {"dtype", "torch_dtype"}) {
    JsonFields const& f = either(key);
    if (f.has(key)) {
      c.dtype = detail::parse_torch_dtype(f, key);
      break;
    }
  }

  // Special tokens: the text config first, then the top level, then generation_config.json.
  c.eos_token_ids = either("eos_token_id").int_or_int_list("eos_token_id");
  c.bos_token_id = either("bos_token_id").optional_nonneg_int("bos_token_id");
  c.pad_token_id = either("pad_token_id").optional_nonneg_int("pad_token_id");
  std::string const gen_path = (fs::path(dir) / "generation_config.json").string();
  std::error_code ec;
  if (fs::exists(gen_path, ec)) {
    Json const g = read_json_file(gen_path);
    JsonFields const gf(g, gen_path);
    for (int id : gf.int_or_int_list("eos_token_id"))
      if (std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), id) == c.eos_token_ids.end())
        c.eos_token_ids.push_back(id);
    if (!c.bos_token_id) c.bos_token_id = gf.optional_nonneg_int("bos_token_id");
    if (!c.pad_token_id) c.pad_token_id = gf.optional_nonneg_int("pad_token_id");
    auto& gen = c.generation;
    if (gf.has("do_sample")) gen.do_sample = gf.boolean("do_sample", false);
    auto number = [&](std::string_view key, double lo, double hi, char const* expected, std::optional<float>& out) {
      if (!gf.has(key)) return;
      double const v = gf.number(key);
      if (!(v >= lo && v <= hi)) gf.fail(key, expected);
      out = static_cast<float>(v);
    };
    number("temperature", 0.0, 100.0, "a number in [0, 100]", gen.temperature);
    number("top_p", 1e-9, 1.0, "a number in (0, 1]", gen.top_p);
    number("min_p", 0.0, 1.0, "a number in [0, 1]", gen.min_p);
    number("repetition_penalty", 1e-3, 100.0, "a number in [0.001, 100]", gen.repetition_penalty);
    if (gf.has("top_k")) gen.top_k = static_cast<int>(gf.integer("top_k", 0, 1 << 24, "an integer in [0, 16777216]"));
  }
  // A special token the embedding does not have would index past it.
  auto check_id = [&](std::optional<int> id, std::string_view key) {
    if (id && *id >= c.vocab)
      QFLASH_FAIL(path, ": ", key, " ", *id, " (config.json or generation_config.json) is outside the vocabulary [0, ",
                  c.vocab, ") of ", t.field("vocab_size"));
  };
  for (int id : c.eos_token_ids) check_id(id, "eos_token_id");
  check_id(c.bos_token_id, "bos_token_id");
  check_id(c.pad_token_id, "pad_token_id");

  (void)c.spec(KvScheme::kAny, WeightFormat::kAny);  // why_invalid, naming the file
  std::string others;
  for (auto const& k : t.defaulted())
    if (!detail::is_size_field(k, qwen35)) others += (others.empty() ? "" : ", ") + k;
  if (!others.empty()) QFLASH_LOG_INFO(path, ": absent fields take the transformers defaults: ", others);
  return c;
}

}  // namespace qflash::io
