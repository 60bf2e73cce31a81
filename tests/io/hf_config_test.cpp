// HF config.json parsing for both families: the published Qwen3.6-35B-A3B and Qwen3-30B-A3B
// configs (exact values, parameter and memory arithmetic against MODELS.md §6), the defaults
// and key variants transformers accepts, the errors, and the generated tiny fixtures.
#include <doctest/doctest.h>

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "support/expect_error.hpp"
#include "support/temp_dir.hpp"
#include "qflash/core/error.hpp"
#include "qflash/core/log.hpp"
#include "qflash/io/checkpoint.hpp"
#include "qflash/io/hf_config.hpp"
#include "qflash/io/paths.hpp"
#include "qflash/spec/presets.hpp"

using namespace qflash;
using namespace qflash::io;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using qflash::test::TempDir;

using qflash::test::expect_error;

/// Qwen3.6-35B-A3B config.json as published (MODELS.md §1): nested text_config.
json qwen3_6_config() {
  json layer_types = json::array();
  for (int i = 0; i < 40; ++i)
    layer_types.push_back(i % 4 == 3 ? "full_attention" : "linear_attention");
  return json::parse(R"({
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "image_token_id": 248056,
    "video_token_id": 248057,
    "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
    "tie_word_embeddings": false,
    "transformers_version": "4.57.1",
    "text_config": {
      "model_type": "qwen3_5_moe_text",
      "attention_bias": false,
      "attention_dropout": 0.0,
      "attn_output_gate": true,
      "bos_token_id": 248044,
      "dtype": "bfloat16",
      "eos_token_id": 248044,
      "full_attention_interval": 4,
      "head_dim": 256,
      "hidden_act": "silu",
      "hidden_size": 2048,
      "initializer_range": 0.02,
      "linear_conv_kernel_dim": 4,
      "linear_key_head_dim": 128,
      "linear_num_key_heads": 16,
      "linear_num_value_heads": 32,
      "linear_value_head_dim": 128,
      "mamba_ssm_dtype": "float32",
      "max_position_embeddings": 262144,
      "mlp_only_layers": [],
      "moe_intermediate_size": 512,
      "mtp_num_hidden_layers": 1,
      "mtp_use_dedicated_embeddings": false,
      "num_attention_heads": 16,
      "num_experts": 256,
      "num_experts_per_tok": 8,
      "num_hidden_layers": 40,
      "num_key_value_heads": 2,
      "partial_rotary_factor": 0.25,
      "rms_norm_eps": 1e-06,
      "rope_parameters": {
        "mrope_interleaved": true,
        "mrope_section": [11, 11, 10],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rope_type": "default"
      },
      "router_aux_loss_coef": 0.001,
      "shared_expert_intermediate_size": 512,
      "tie_word_embeddings": false,
      "use_cache": true,
      "vocab_size": 248320
    },
    "vision_config": {
      "model_type": "qwen3_5_moe",
      "depth": 27,
      "hidden_size": 1152,
      "out_hidden_size": 2048
    }
  })")
      .patch(json::array({{{"op", "add"}, {"path", "/text_config/layer_types"},
                           {"value", layer_types}}}));
}

/// Qwen3-30B-A3B config.json as published (flat, old-style rope keys).
json qwen3_30b_config() {
  return json::parse(R"({
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": false,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": true,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": false,
    "rms_norm_eps": 1e-06,
    "rope_scaling": null,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": null,
    "tie_word_embeddings": false,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": true,
    "use_sliding_window": false,
    "vocab_size": 151936
  })");
}

ModelConfig load_json(TempDir const& tmp, json const& config) {
  tmp.write("config.json", config.dump(2));
  return load_config(tmp.dir());
}

}  // namespace

TEST_CASE("Qwen3.6-35B-A3B config: exact values, spec, parameter and memory arithmetic") {
  TempDir tmp;
  tmp.write("generation_config.json",
            R"({"bos_token_id": 248044, "eos_token_id": [248046, 248044], "pad_token_id": 248044,
                "do_sample": true, "temperature": 0.6})");
  ModelConfig c = load_json(tmp, qwen3_6_config());

  CHECK(c.model_type == "qwen3_5_moe");
  CHECK(c.family == ModelFamily::kQwen35Moe);
  CHECK(c.source == tmp.file("config.json"));
  CHECK(c.d_model == 2048);
  CHECK(c.n_layer == 40);
  CHECK(c.n_head == 16);
  CHECK(c.n_head_kv == 2);
  CHECK(c.d_head == 256);
  CHECK(c.vocab == 248320);
  CHECK(c.n_expert == 256);
  CHECK(c.n_expert_used == 8);
  CHECK(c.d_ff_expert == 512);
  CHECK(c.d_ff_shared == 512);
  CHECK(c.n_head_k_linear == 16);
  CHECK(c.n_head_v_linear == 32);
  CHECK(c.d_head_k_linear == 128);
  CHECK(c.d_head_v_linear == 128);
  CHECK(c.d_conv == 4);
  REQUIRE(c.layer_types.size() == 40);
  for (int i = 0; i < 40; ++i)
    CHECK(c.layer_types[static_cast<std::size_t>(i)] ==
          (i % 4 == 3 ? LayerKind::kFullAttention : LayerKind::kLinearAttention));
  CHECK(c.n_layer_of(LayerKind::kFullAttention) == 10);
  CHECK(c.rope_theta == 1e7f);
  CHECK(c.partial_rotary_factor == 0.25f);
  CHECK(c.rotary_dim == 64);
  CHECK(c.rms_norm_eps == 1e-6f);
  CHECK(c.norm_topk_prob);
  CHECK_FALSE(c.tie_word_embeddings);
  CHECK(c.attn_output_gate);
  CHECK(c.eos_token_ids == std::vector<int>{248044, 248046});
  CHECK(c.bos_token_id == 248044);
  CHECK(c.pad_token_id == 248044);
  CHECK(c.max_position_embeddings == 262144);
  CHECK(c.mlp_only_layers.empty());
  CHECK(c.dtype == DType::kBF16);

  CHECK(c.spec(KvScheme::kAny, WeightFormat::kAny) == spec::qwen3_6_35b_a3b);

  // MODELS.md §6, exact from the shapes in §2.
  CHECK(c.n_params_full_attention_layer() == 27'263'488);
  CHECK(c.n_params_linear_attention_layer() == 33'718'464);
  CHECK(c.n_params_total() == 34'660'610'688);  // 34.66B
  CHECK(c.n_params_active() == 2'946'429'568);  // 2.95B (incl. lm_head, excl. embedding)
  CHECK(c.kv_bytes_per_token(DType::kBF16) == 20'480);
  CHECK(c.kv_bytes_per_token(DType::kFp8E4m3) == 10'240);
  CHECK(c.linear_state_bytes_per_sequence(DType::kF32, DType::kF32) ==
        30 * (8192 * 3 + 32 * 128 * 128) * 4);  // 65,863,680 B = 65.9 MB
  CHECK(c.linear_state_bytes_per_sequence(DType::kBF16, DType::kF32) ==
        30 * (8192 * 3 * 2 + 32 * 128 * 128 * 4));  // 64.4 MB
}

TEST_CASE("Qwen3-30B-A3B config: exact values, spec, parameter and memory arithmetic") {
  TempDir tmp;
  ModelConfig c = load_json(tmp, qwen3_30b_config());
  CHECK(c.model_type == "qwen3_moe");
  CHECK(c.family == ModelFamily::kQwen3Moe);
  CHECK(c.d_model == 2048);
  CHECK(c.n_layer == 48);
  CHECK(c.n_head == 32);
  CHECK(c.n_head_kv == 4);
  CHECK(c.d_head == 128);
  CHECK(c.vocab == 151936);
  CHECK(c.n_expert == 128);
  CHECK(c.n_expert_used == 8);
  CHECK(c.d_ff_expert == 768);
  CHECK(c.d_ff_shared == 0);
  CHECK(c.n_head_k_linear == 0);
  CHECK(c.d_conv == 0);
  CHECK(c.n_layer_of(LayerKind::kFullAttention) == 48);
  CHECK(c.rope_theta == 1e6f);
  CHECK(c.partial_rotary_factor == 1.0f);
  CHECK(c.rotary_dim == 128);
  CHECK(c.norm_topk_prob);
  CHECK_FALSE(c.attn_output_gate);
  CHECK(c.eos_token_ids == std::vector<int>{151645});
  CHECK(c.bos_token_id == 151643);
  CHECK_FALSE(c.pad_token_id.has_value());
  CHECK(c.max_position_embeddings == 40960);
  CHECK(c.decoder_sparse_step == 1);
  CHECK(c.d_ff_dense == 6144);
  CHECK(c.dtype == DType::kBF16);
  CHECK(c.spec(KvScheme::kAny, WeightFormat::kAny) == spec::qwen3_30b_a3b);

  CHECK(c.n_params_total() == 30'532'122'624);  // 30.5B
  CHECK(c.n_params_active() == 3'041'867'776);  // 3.04B incl. lm_head (3.35B with the table)
  CHECK(c.kv_bytes_per_token(DType::kBF16) == 98'304);
  CHECK(c.linear_state_bytes_per_sequence(DType::kF32, DType::kF32) == 0);
}

TEST_CASE("flat qwen3_5_moe_text config and transformers defaults") {
  TempDir tmp;
  json j = qwen3_6_config()["text_config"];
  SUBCASE("flat config equals the nested one") {
    ModelConfig c = load_json(tmp, j);
    CHECK(c.model_type == "qwen3_5_moe");
    CHECK(c.n_params_total() == 34'660'610'688);
    CHECK(c.eos_token_ids == std::vector<int>{248044});
  }
  SUBCASE("absent keys take Qwen3_5MoeTextConfig defaults") {
    ModelConfig c = load_json(tmp, {{"model_type", "qwen3_5_moe_text"}});
    CHECK(c.spec(KvScheme::kAny, WeightFormat::kAny) == spec::qwen3_6_35b_a3b);
    CHECK(c.max_position_embeddings == 32768);  // the class default, not the published 262144
    CHECK(c.rope_theta == 10000.0f);            // RotaryEmbeddingConfigMixin.default_theta
    CHECK(c.partial_rotary_factor == 0.25f);
    CHECK(c.n_layer_of(LayerKind::kFullAttention) == 10);
    CHECK(c.eos_token_ids.empty());
    CHECK_FALSE(c.bos_token_id.has_value());
    CHECK(c.dtype == DType::kF32);
  }
  SUBCASE("absent keys take Qwen3MoeConfig defaults") {
    ModelConfig c = load_json(tmp, {{"model_type", "qwen3_moe"}});
    CHECK(c.n_layer == 24);
    CHECK(c.d_head == 2048 / 32);  // hidden_size // num_attention_heads
    CHECK_FALSE(c.norm_topk_prob);
    CHECK(c.rope_theta == 10000.0f);
    CHECK(c.partial_rotary_factor == 1.0f);
  }
  SUBCASE("norm_topk_prob is ignored for qwen3_5_moe, as in transformers (with a warning)") {
    j["norm_topk_prob"] = false;
    std::vector<std::string> warnings;
    set_log_sink([&](LogLevel l, std::string_view m) {
      if (l == LogLevel::kWarn) warnings.emplace_back(m);
    });
    bool const renorm = load_json(tmp, j).norm_topk_prob;
    set_log_sink(qflash::detail::default_log_sink);
    CHECK(renorm);
    REQUIRE(warnings.size() == 1);
    CHECK(warnings[0].find("norm_topk_prob") != std::string::npos);
  }
  SUBCASE("num_local_experts is accepted for qwen3_moe") {
    json q = qwen3_30b_config();
    q.erase("num_experts");
    q["num_local_experts"] = 64;
    CHECK(load_json(tmp, q).n_expert == 64);
  }
}

TEST_CASE("layer_types versus full_attention_interval") {
  TempDir tmp;
  json j = qwen3_6_config()["text_config"];
  j["num_hidden_layers"] = 6;
  j.erase("layer_types");
  using K = LayerKind;
  SUBCASE("interval 4 (also the default)") {
    CHECK(load_json(tmp, j).layer_types ==
          std::vector<K>{K::kLinearAttention, K::kLinearAttention, K::kLinearAttention,
                         K::kFullAttention, K::kLinearAttention, K::kLinearAttention});
    j.erase("full_attention_interval");
    CHECK(load_json(tmp, j).n_layer_of(K::kFullAttention) == 1);
  }
  SUBCASE("interval 2") {
    j["full_attention_interval"] = 2;
    CHECK(load_json(tmp, j).layer_types ==
          std::vector<K>{K::kLinearAttention, K::kFullAttention, K::kLinearAttention,
                         K::kFullAttention, K::kLinearAttention, K::kFullAttention});
  }
  SUBCASE("an explicit layer_types wins over the interval, legacy names remapped") {
    j["full_attention_interval"] = 2;
    j["layer_types"] = {"full_attention", "linear_attention", "attention", "mamba",
                        "linear_attention", "full_attention"};
    ModelConfig c = load_json(tmp, j);
    CHECK(c.layer_types == std::vector<K>{K::kFullAttention, K::kLinearAttention,
                                          K::kFullAttention, K::kLinearAttention,
                                          K::kLinearAttention, K::kFullAttention});
    CHECK(c.kv_bytes_per_token(DType::kBF16) == 3 * 2 * 2 * 256 * 2);
    CHECK(c.linear_state_bytes_per_sequence(DType::kF32, DType::kF32) ==
          3 * (8192 * 3 + 32 * 128 * 128) * 4);
  }
  SUBCASE("wrong length") {
    j["layer_types"] = {"full_attention", "linear_attention"};
    expect_error([&] { load_json(tmp, j); },
                 {"config.json", "field 'layer_types'", "6 entries"});
  }
  SUBCASE("unknown entry") {
    j["layer_types"] = {"full_attention", "sliding_attention", "full_attention",
                        "full_attention", "full_attention", "full_attention"};
    expect_error([&] { load_json(tmp, j); }, {"config.json", "field 'layer_types'", "sliding"});
  }
  SUBCASE("bad interval") {
    j["full_attention_interval"] = 0;
    expect_error([&] { load_json(tmp, j); },
                 {"field 'full_attention_interval' must be a positive integer, got 0"});
  }
}

TEST_CASE("eos_token_id as an int or a list, merged with generation_config.json") {
  TempDir tmp;
  json j = qwen3_30b_config();
  SUBCASE("int") { CHECK(load_json(tmp, j).eos_token_ids == std::vector<int>{151645}); }
  SUBCASE("list") {
    j["eos_token_id"] = {151645, 151643};
    CHECK(load_json(tmp, j).eos_token_ids == std::vector<int>{151645, 151643});
  }
  SUBCASE("null") {
    j["eos_token_id"] = nullptr;
    CHECK(load_json(tmp, j).eos_token_ids.empty());
  }
  SUBCASE("merged with generation_config, without repeats") {
    tmp.write("generation_config.json", R"({"eos_token_id": [151645, 151643], "pad_token_id": 151643})");
    ModelConfig c = load_json(tmp, j);
    CHECK(c.eos_token_ids == std::vector<int>{151645, 151643});
    CHECK(c.pad_token_id == 151643);
  }
  SUBCASE("generation_config int") {
    tmp.write("generation_config.json", R"({"eos_token_id": 7})");
    CHECK(load_json(tmp, j).eos_token_ids == std::vector<int>{151645, 7});
  }
  SUBCASE("bad eos") {
    j["eos_token_id"] = "x";
    expect_error([&] { load_json(tmp, j); }, {"config.json", "field 'eos_token_id'", "\"x\""});
    j["eos_token_id"] = {1, -2};
    expect_error([&] { load_json(tmp, j); }, {"config.json", "field 'eos_token_id'", "[1,-2]"});
  }
  SUBCASE("bad generation_config") {
    tmp.write("generation_config.json", R"({"eos_token_id": [1, 2.5]})");
    expect_error([&] { load_json(tmp, j); }, {"generation_config.json", "field 'eos_token_id'"});
    tmp.write("generation_config.json", "{oops");
    expect_error([&] { load_json(tmp, j); }, {"generation_config.json", "invalid JSON"});
  }
}

TEST_CASE("RoPE keys: new and old layouts, unsupported types") {
  TempDir tmp;
  json q = qwen3_30b_config();
  json t = qwen3_6_config()["text_config"];
  SUBCASE("rope_parameters (new) for qwen3_moe") {
    q.erase("rope_theta");
    q.erase("rope_scaling");
    q["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5e5}};
    CHECK(load_json(tmp, q).rope_theta == 5e5f);
  }
  SUBCASE("rope_parameters wins over a top-level rope_theta") {
    q["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5e5}};
    CHECK(load_json(tmp, q).rope_theta == 5e5f);
  }
  SUBCASE("old layout for qwen3_5_moe: top-level rope_theta and partial_rotary_factor") {
    t.erase("rope_parameters");
    t["rope_theta"] = 1e7;
    t["partial_rotary_factor"] = 0.5;
    ModelConfig c = load_json(tmp, t);
    CHECK(c.rope_theta == 1e7f);
    CHECK(c.rotary_dim == 128);
  }
  SUBCASE("legacy rope_scaling with type mrope is plain RoPE for text") {
    t.erase("rope_parameters");
    t["rope_scaling"] = {{"type", "mrope"}, {"mrope_section", {11, 11, 10}}};
    t["rope_theta"] = 1e7;
    CHECK(load_json(tmp, t).rotary_dim == 64);
  }
  SUBCASE("yarn is rejected") {
    q["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0},
                         {"original_max_position_embeddings", 32768}};
    expect_error([&] { load_json(tmp, q); },
                 {"config.json", "rope type 'yarn'", "rope_scaling.rope_type", "default"});
  }
  SUBCASE("old key 'type' is read too") {
    t["rope_parameters"]["type"] = "linear";
    t["rope_parameters"].erase("rope_type");
    expect_error([&] { load_json(tmp, t); },
                 {"config.json", "rope type 'linear'", "field 'rope_parameters.type'"});
  }
  SUBCASE("mrope_section must sum to rotary_dim / 2") {
    json c = qwen3_6_config();
    c["text_config"]["rope_parameters"]["mrope_section"] = {11, 11, 11};
    expect_error([&] { load_json(tmp, c); },
                 {"config.json", "field 'text_config.rope_parameters.mrope_section'", "32",
                  "[11,11,11]"});
  }
  SUBCASE("odd rotary dim") {
    t["head_dim"] = 36;  // 36 * 0.25 = 9
    t["rope_parameters"].erase("mrope_section");
    expect_error([&] { load_json(tmp, t); }, {"config.json", "rotary dim", "= 9 must be"});
  }
  SUBCASE("rope_theta not a number") {
    q["rope_theta"] = "1e6";
    expect_error([&] { load_json(tmp, q); },
                 {"config.json", "field 'rope_theta' must be a number, got \"1e6\""});
  }
}

TEST_CASE("config errors name the file, the field and what was expected") {
  TempDir tmp;
  std::string const path = tmp.file("config.json");
  SUBCASE("missing config.json") {
    expect_error([&] { (void)load_config(tmp.dir()); }, {path, "cannot open"});
  }
  SUBCASE("bad JSON") {
    tmp.write("config.json", "{\"model_type\": \"qwen3_moe\",,}");
    expect_error([&] { (void)load_config(tmp.dir()); }, {path, "invalid JSON"});
  }
  SUBCASE("top level not an object") {
    tmp.write("config.json", "[]");
    expect_error([&] { (void)load_config(tmp.dir()); }, {path, "must be a JSON object"});
  }
  SUBCASE("missing model_type") {
    expect_error([&] { load_json(tmp, {{"hidden_size", 8}}); },
                 {path, "missing field 'model_type'"});
  }
  SUBCASE("unknown model_type") {
    expect_error([&] { load_json(tmp, {{"model_type", "llama"}}); },
                 {path, "model_type 'llama' is not supported",
                  "qwen3_5_moe, qwen3_5_moe_text, qwen3_moe"});
  }
  SUBCASE("wrong type, nested") {
    json c = qwen3_6_config();
    c["text_config"]["hidden_size"] = "abc";
    expect_error([&] { load_json(tmp, c); },
                 {path + ": field 'text_config.hidden_size' must be a positive integer, got \"abc\""});
  }
  SUBCASE("wrong type, flat") {
    json c = qwen3_30b_config();
    c["num_experts_per_tok"] = 2.5;
    expect_error([&] { load_json(tmp, c); },
                 {path + ": field 'num_experts_per_tok' must be a positive integer, got 2.5"});
    c["num_experts_per_tok"] = -8;
    expect_error([&] { load_json(tmp, c); }, {"field 'num_experts_per_tok'", "got -8"});
    c["num_experts_per_tok"] = true;
    expect_error([&] { load_json(tmp, c); }, {"field 'num_experts_per_tok'", "got true"});
  }
  SUBCASE("text_config not an object") {
    expect_error([&] { load_json(tmp, {{"model_type", "qwen3_5_moe"}, {"text_config", 3}}); },
                 {path, "field 'text_config' must be a JSON object, got 3"});
  }
  SUBCASE("spec invariants (why_invalid) name the file") {
    json c = qwen3_30b_config();
    c["num_experts_per_tok"] = 200;
    expect_error([&] { load_json(tmp, c); },
                 {path, "n_expert_used must not exceed n_expert"});
    c = qwen3_30b_config();
    c["num_key_value_heads"] = 5;
    expect_error([&] { load_json(tmp, c); }, {path, "multiple of n_head_kv"});
  }
  SUBCASE("bad booleans and strings") {
    json c = qwen3_30b_config();
    c["tie_word_embeddings"] = "no";
    expect_error([&] { load_json(tmp, c); },
                 {path, "field 'tie_word_embeddings' must be true or false, got \"no\""});
    c = qwen3_30b_config();
    c["torch_dtype"] = "int8";
    expect_error([&] { load_json(tmp, c); }, {path, "field 'torch_dtype'", "bfloat16", "\"int8\""});
    c = qwen3_30b_config();
    c["hidden_act"] = "gelu";
    expect_error([&] { load_json(tmp, c); }, {path, "field 'hidden_act'", "silu", "\"gelu\""});
  }
  SUBCASE("features the runtime lacks") {
    json c = qwen3_30b_config();
    c["attention_bias"] = true;
    expect_error([&] { load_json(tmp, c); }, {path, "'attention_bias'", "not supported"});
    c = qwen3_30b_config();
    c["use_sliding_window"] = true;
    expect_error([&] { load_json(tmp, c); }, {path, "'use_sliding_window'", "not supported"});
    c = qwen3_30b_config();
    c["mlp_only_layers"] = {0, 47};
    expect_error([&] { load_json(tmp, c); },
                 {path, "layer 0", "dense MLP layers not supported yet"});
    c = qwen3_30b_config();
    c["decoder_sparse_step"] = 2;
    expect_error([&] { load_json(tmp, c); },
                 {path, "layer 0", "dense MLP layers not supported yet"});
    c = qwen3_30b_config();
    c["mlp_only_layers"] = {48};
    expect_error([&] { load_json(tmp, c); }, {path, "field 'mlp_only_layers'"});
    json t = qwen3_6_config();
    t["text_config"]["attn_output_gate"] = false;
    expect_error([&] { load_json(tmp, t); },
                 {path, "'text_config.attn_output_gate'", "not supported"});
  }
}

TEST_CASE("dtype keys and tie_word_embeddings placement") {
  TempDir tmp;
  json c = qwen3_6_config();
  SUBCASE("torch_dtype (older key)") {
    c["text_config"].erase("dtype");
    c["text_config"]["torch_dtype"] = "float16";
    CHECK(load_json(tmp, c).dtype == DType::kF16);
  }
  SUBCASE("top-level dtype of a nested config") {
    c["text_config"].erase("dtype");
    c["dtype"] = "float32";
    CHECK(load_json(tmp, c).dtype == DType::kF32);
  }
  SUBCASE("tied embeddings: lm_head is not counted twice, but is active") {
    c["text_config"]["tie_word_embeddings"] = true;
    c.erase("tie_word_embeddings");
    ModelConfig m = load_json(tmp, c);
    CHECK(m.tie_word_embeddings);
    CHECK(m.n_params_total() == 34'660'610'688 - 248320ll * 2048);
    CHECK(m.n_params_active() == 2'946'429'568);
  }
}

// --- The tiny HF fixtures written by tools/make_fixtures.py -------------------------------

namespace {
std::string fixture(char const* name) { return std::string(QFLASH_FIXTURES_DIR) + "/" + name; }
bool have_fixture(char const* name) {
  REQUIRE_MESSAGE(fs::exists(fixture(name) + "/config.json"), "fixture ", name,
                  " is missing: run tools/make_fixtures.py");
  return true;
}
}  // namespace

TEST_CASE("fixture qwen3_5_moe_tiny: config and checkpoint agree") {
  if (!have_fixture("qwen3_5_moe_tiny")) return;
  std::string const dir = fixture("qwen3_5_moe_tiny");
  ModelConfig c = load_config(dir);
  CHECK(c.family == ModelFamily::kQwen35Moe);
  CHECK(c.d_model == 32);
  CHECK(c.n_layer == 4);
  CHECK(c.n_head == 4);
  CHECK(c.n_head_kv == 2);
  CHECK(c.d_head == 32);
  CHECK(c.vocab == 256);
  CHECK(c.n_expert == 8);
  CHECK(c.n_expert_used == 2);
  CHECK(c.d_ff_expert == 16);
  CHECK(c.d_ff_shared == 32);
  CHECK(c.n_head_k_linear == 2);
  CHECK(c.n_head_v_linear == 4);
  CHECK(c.d_head_k_linear == 16);
  CHECK(c.d_head_v_linear == 16);
  CHECK(c.d_conv == 4);
  using K = LayerKind;
  CHECK(c.layer_types == std::vector<K>{K::kLinearAttention, K::kLinearAttention,
                                        K::kLinearAttention, K::kFullAttention});
  CHECK(c.rope_theta == 1e7f);
  CHECK(c.rotary_dim == 8);
  CHECK(c.max_position_embeddings == 256);
  CHECK(c.eos_token_ids.front() == 255);
  CHECK(c.attn_output_gate);

  Checkpoint ck = Checkpoint::open(dir);
  REQUIRE(ck.has_weights());
  // save_pretrained of the text model writes model.* names (MODELS.md §7).
  std::string const p = ck.find("model.embed_tokens.weight") ? "model." : "model.language_model.";
  std::int64_t const d = c.d_model, v = c.vocab;
  CHECK(ck.get(p + "embed_tokens.weight", Shape{v, d}).dtype == DType::kF32);
  (void)ck.get(p + "norm.weight", Shape{d});
  (void)ck.get("lm_head.weight", Shape{v, d});
  std::int64_t const conv_dim = 2 * c.n_head_k_linear * c.d_head_k_linear +
                                c.n_head_v_linear * c.d_head_v_linear;
  std::string const l0 = p + "layers.0.";
  (void)ck.get(l0 + "linear_attn.in_proj_qkv.weight", Shape{conv_dim, d});
  (void)ck.get(l0 + "linear_attn.conv1d.weight", Shape{conv_dim, 1, c.d_conv});
  (void)ck.get(l0 + "linear_attn.A_log", Shape{c.n_head_v_linear});
  std::string const l3 = p + "layers.3.";
  (void)ck.get(l3 + "self_attn.q_proj.weight", Shape{2 * c.n_head * c.d_head, d});
  (void)ck.get(l3 + "self_attn.k_proj.weight", Shape{c.n_head_kv * c.d_head, d});
  (void)ck.get(l3 + "mlp.gate.weight", Shape{c.n_expert, d});
  (void)ck.get(l3 + "mlp.shared_expert_gate.weight", Shape{1, d});
  // The total over the checkpoint's text tensors equals the config's arithmetic.
  std::int64_t n = 0;
  for (auto const& name : ck.names())
    if (name.rfind("mtp.", 0) != 0 && name.rfind("model.visual.", 0) != 0)
      n += ck.get(name).numel();
  CHECK(n == c.n_params_total());
}

TEST_CASE("fixture qwen3_moe_tiny: config and checkpoint agree") {
  if (!have_fixture("qwen3_moe_tiny")) return;
  std::string const dir = fixture("qwen3_moe_tiny");
  ModelConfig c = load_config(dir);
  CHECK(c.family == ModelFamily::kQwen3Moe);
  CHECK(c.d_model == 32);
  CHECK(c.n_layer == 4);
  CHECK(c.n_head == 4);
  CHECK(c.n_head_kv == 2);
  CHECK(c.d_head == 16);
  CHECK(c.n_expert == 8);
  CHECK(c.n_expert_used == 2);
  CHECK(c.d_ff_expert == 16);
  CHECK(c.norm_topk_prob);
  CHECK(c.rope_theta == 1e6f);
  CHECK(c.rotary_dim == 16);
  CHECK(c.bos_token_id == 254);
  CHECK(c.eos_token_ids.front() == 255);
  CHECK_FALSE(c.attn_output_gate);

  Checkpoint ck = Checkpoint::open(dir);
  REQUIRE(ck.has_weights());
  std::int64_t const d = c.d_model;
  (void)ck.get("model.embed_tokens.weight", Shape{c.vocab, d});
  (void)ck.get("model.layers.0.self_attn.q_proj.weight", Shape{c.n_head * c.d_head, d});
  (void)ck.get("model.layers.0.self_attn.q_norm.weight", Shape{c.d_head});
  (void)ck.get("model.layers.0.mlp.gate.weight", Shape{c.n_expert, d});
  std::int64_t n = 0;
  for (auto const& name : ck.names()) n += ck.get(name).numel();
  CHECK(n == c.n_params_total());
}

TEST_CASE("fixture qwen3_5_moe_tiny_vl: nested config, sharded BF16 checkpoint") {
  if (!have_fixture("qwen3_5_moe_tiny_vl")) return;
  std::string const dir = fixture("qwen3_5_moe_tiny_vl");
  ModelConfig c = load_config(dir);
  CHECK(c.family == ModelFamily::kQwen35Moe);
  CHECK(c.d_model == 32);
  CHECK(c.n_layer == 4);
  CHECK(c.dtype == DType::kBF16);
  CHECK(c.rotary_dim == 8);

  Checkpoint ck = Checkpoint::open(dir);
  REQUIRE(ck.has_weights());
  CHECK(ck.files().size() == 2);
  std::string const p = "model.language_model.";
  std::int64_t const d = c.d_model;
  CHECK(ck.get(p + "embed_tokens.weight", Shape{c.vocab, d}).dtype == DType::kBF16);
  CHECK(ck.get(p + "layers.0.linear_attn.A_log", Shape{c.n_head_v_linear}).dtype == DType::kF32);
  (void)ck.get(p + "layers.0.mlp.experts.gate_up_proj",
               Shape{c.n_expert, 2 * c.d_ff_expert, d});
  (void)ck.get(p + "layers.0.mlp.experts.down_proj", Shape{c.n_expert, d, c.d_ff_expert});
  bool visual = false, mtp = false;
  std::int64_t n = 0;
  for (auto const& name : ck.names()) {
    visual = visual || name.rfind("model.visual.", 0) == 0;
    mtp = mtp || name.rfind("mtp.", 0) == 0;
    if (name.rfind("mtp.", 0) != 0 && name.rfind("model.visual.", 0) != 0)
      n += ck.get(name).numel();
  }
  CHECK(visual);
  CHECK(mtp);
  CHECK(n == c.n_params_total());
  // BF16 converts exactly to f32 and reads the same through both paths.
  auto const& w = ck.get(p + "layers.0.input_layernorm.weight");
  std::vector<float> f = read_f32(w);
  CHECK(f[3] == read_scalar_f32(w, 3));
}

TEST_CASE("null fields: an error where transformers would fail, absent where it reads None") {
  TempDir tmp;
  std::string const path = tmp.file("config.json");
  for (char const* key : {"vocab_size", "hidden_size", "rms_norm_eps", "hidden_act", "head_dim"}) {
    CAPTURE(key);
    json c = qwen3_30b_config();
    c[key] = nullptr;
    expect_error([&] { load_json(tmp, c); }, {path, std::string("field '") + key + "' must be", "got null"});
  }
  json c = qwen3_30b_config();
  c["eos_token_id"] = nullptr;
  c["mlp_only_layers"] = nullptr;
  c["attention_bias"] = nullptr;
  ModelConfig const cfg = load_json(tmp, c);
  CHECK(cfg.eos_token_ids.empty());
  CHECK(cfg.mlp_only_layers.empty());
}

TEST_CASE("special token ids and the layer count are bounded") {
  TempDir tmp;
  std::string const path = tmp.file("config.json");
  json c = qwen3_30b_config();
  c["eos_token_id"] = 151936;  // == vocab_size
  expect_error([&] { load_json(tmp, c); }, {path, "eos_token_id 151936", "outside the vocabulary [0, 151936)"});
  c = qwen3_30b_config();
  c["bos_token_id"] = 2000000;
  expect_error([&] { load_json(tmp, c); }, {path, "bos_token_id 2000000"});
  c = qwen3_30b_config();
  tmp.write("generation_config.json", R"({"eos_token_id": [151645, 999999]})");
  expect_error([&] { load_json(tmp, c); }, {path, "eos_token_id 999999"});
  fs::remove(tmp.file("generation_config.json"));
  c["num_hidden_layers"] = 2147483647;  // would size per-layer tables before any weight is read
  expect_error([&] { load_json(tmp, c); }, {path, "num_hidden_layers", "up to 4096"});
  // Sizes whose products would overflow the parameter and byte counts (found by config_fuzz).
  c = qwen3_30b_config();
  c["hidden_size"] = 2147483646;
  c["head_dim"] = 1073741824;
  c["num_attention_heads"] = 2;
  c["num_key_value_heads"] = 2;
  expect_error([&] { load_json(tmp, c); }, {path, "hidden size = 2147483646 is above 131072"});
  c = qwen3_30b_config();
  c["num_experts"] = 1 << 20;
  expect_error([&] { load_json(tmp, c); }, {path, "experts = 1048576 is above 16384"});
}

TEST_CASE("deeply nested JSON gives a short error, not a stack overflow") {
  TempDir tmp;
  std::string const depth(200000, '[');
  std::string const close(200000, ']');
  tmp.write("config.json", R"({"model_type": )" + depth + close + "}");
  expect_error([&] { (void)load_config(tmp.dir()); },
               {"field 'model_type' must be a string, got [[[[", "..."});
  Json const nested = parse_json(depth + close, "nested");
  std::string const e = json_excerpt(nested);
  CHECK(e.size() <= 80);
  CHECK(e.starts_with("[[[["));
  CHECK(json_excerpt(Json::parse(R"({"a": [1, 2], "b": "x"})")) == R"({"a":[1,2],"b":"x"})");
  CHECK(json_excerpt(Json(std::string(200, 'x'))).size() == 80);
}

TEST_CASE("path_inside keeps metadata file names inside the model directory") {
  CHECK(path_inside("/m", "model-00001.safetensors", "/m/SHA256SUMS") == "/m/model-00001.safetensors");
  CHECK(path_inside("/m", "sub/tokenizer.json", "/m/SHA256SUMS") == "/m/sub/tokenizer.json");
  expect_error([] { (void)path_inside("/m", "../../etc/passwd", "/m/SHA256SUMS"); },
               {"/m/SHA256SUMS", "'../../etc/passwd' leaves the model directory"});
  expect_error([] { (void)path_inside("/m", "a/../../x", "/m/SHA256SUMS"); }, {"leaves the model directory"});
  expect_error([] { (void)path_inside("/m", "/etc/passwd", "/m/SHA256SUMS"); }, {"'/etc/passwd' is absolute"});
  expect_error([] { (void)path_inside("/m", "", "/m/SHA256SUMS"); }, {"empty file name"});
}
