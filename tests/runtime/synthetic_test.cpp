// Synthetic models (runtime/synthetic.hpp) and the decode roofline (runtime/roofline.hpp,
// runtime/bandwidth.hpp): the presets' exact shapes and formats, valid blocks that decode to
// small finite values, finite logits through runtime::with_model, and bytes per token equal to
// a count by hand. No timing is asserted.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "qflash/runtime/bandwidth.hpp"
#include "qflash/runtime/roofline.hpp"
#include "qflash/runtime/synthetic.hpp"
#include "qflash/runtime/with_model.hpp"
#include "support/expect_error.hpp"

using namespace qflash;
using model::LayerKind;
using runtime::WeightRole;
using runtime::WeightScheme;

namespace {

/// Every matrix has the shape and the format bind_weights gives a bf16 checkpoint of `c` under
/// `scheme`; its first and last rows decode to finite values within the generator's range.
void check_weights(model::ModelConfig const& c, runtime::LoadedModel const& m, WeightScheme scheme) {
  auto expect = [&](WeightView const& v, WeightRole role, std::int64_t rows, std::int64_t cols, char const* what) {
    CAPTURE(what);
    CHECK(v.rows == rows);
    CHECK(v.cols == cols);
    CHECK(v.format == runtime::format_for(scheme, role, cols, WeightFormat::kBf16));
    std::vector<float> row(static_cast<std::size_t>(cols));
    for (std::int64_t r : {std::int64_t{0}, rows - 1}) {
      dequantize_row(v, r, row.data());
      float amax = 0;  // a NaN or Inf makes it Inf, which fails the range check
      for (float x : row) amax = std::isfinite(x) ? std::max(amax, std::fabs(x)) : INFINITY;
      CHECK(amax > 0);
      CHECK(amax <= 0.035f);  // uniform weights of standard deviation 0.02
    }
  };
  auto const& w = m.weights;
  std::int64_t const d = c.d_model;
  REQUIRE(w.layers.size() == static_cast<std::size_t>(c.n_layer));
  expect(w.embed, WeightRole::kEmbedding, c.vocab, d, "embed");
  expect(w.lm_head, WeightRole::kLmHead, c.vocab, d, "lm_head");
  CHECK(w.lm_head.data != w.embed.data);
  CHECK(w.final_norm.size() == static_cast<std::size_t>(d));
  for (int l = 0; l < c.n_layer; ++l) {
    CAPTURE(l);
    auto const& lw = w.layers[static_cast<std::size_t>(l)];
    CHECK(lw.kind == c.layer_types[static_cast<std::size_t>(l)]);
    CHECK(lw.input_norm.size() == static_cast<std::size_t>(d));
    if (lw.kind == LayerKind::kFullAttention) {
      std::int64_t const q = std::int64_t{c.n_head} * c.d_head, kv = std::int64_t{c.n_head_kv} * c.d_head;
      expect(lw.attention.q, WeightRole::kAttentionQkv, q * (c.attn_output_gate ? 2 : 1), d, "q");
      expect(lw.attention.k, WeightRole::kAttentionQkv, kv, d, "k");
      expect(lw.attention.v, WeightRole::kAttentionV, kv, d, "v");
      expect(lw.attention.o, WeightRole::kAttentionOut, d, q, "o");
      CHECK(lw.attention.q_norm.size() == static_cast<std::size_t>(c.d_head));
    } else {
      expect(lw.linear.qkv, WeightRole::kDeltaNetIn, c.linear_conv_dim(), d, "qkv");
      expect(lw.linear.z, WeightRole::kDeltaNetIn, c.linear_value_dim(), d, "z");
      expect(lw.linear.b, WeightRole::kDeltaNetIn, c.n_head_v_linear, d, "b");
      expect(lw.linear.a, WeightRole::kDeltaNetIn, c.n_head_v_linear, d, "a");
      expect(lw.linear.out, WeightRole::kDeltaNetOut, d, c.linear_value_dim(), "out");
      CHECK(lw.linear.conv.size() == static_cast<std::size_t>(c.linear_conv_dim() * c.d_conv));
      for (float x : lw.linear.neg_a) CHECK((x < 0 && std::isfinite(x)));
    }
    bool const shared = c.d_ff_shared > 0;
    expect(lw.moe.router, WeightRole::kRouter, c.n_expert + (shared ? 1 : 0), d, "router");
    REQUIRE(lw.moe.experts.size() == static_cast<std::size_t>(c.n_expert));
    for (int e : {0, c.n_expert - 1}) {
      auto const& x = lw.moe.experts[static_cast<std::size_t>(e)];
      expect(x.gate, WeightRole::kExpert, c.d_ff_expert, d, "expert gate");
      expect(x.up, WeightRole::kExpert, c.d_ff_expert, d, "expert up");
      expect(x.down, WeightRole::kExpert, d, c.d_ff_expert, "expert down");
    }
    CHECK(lw.moe.shared.has_value() == shared);
    if (shared) {
      expect(lw.moe.shared->gate, WeightRole::kSharedExpert, c.d_ff_shared, d, "shared gate");
      expect(lw.moe.shared->down, WeightRole::kSharedExpert, d, c.d_ff_shared, "shared down");
    }
  }
  // The resident bytes are what the loader's plan says a checkpoint of this config takes.
  CHECK(m.bytes_per_format() == runtime::plan_weights(c, scheme, WeightFormat::kBf16).bytes);
}

/// Prefill of 5 tokens, then one decode step, through the compiled instance with_model picks:
/// every logit finite, and not all equal.
void check_forward(runtime::LoadedModel m) {
  runtime::with_model(std::move(m), {}, [](auto& model) {
    auto state = model.new_sequence();
    std::vector<std::int32_t> const prompt{1, 7, 300, 42, 511};
    std::vector<float> logits;
    model::SequenceChunk const c{prompt, &state};
    model.forward(std::span(&c, 1), model::LogitsFor::kAllTokens, logits);
    std::int32_t const next = 3;
    model::SequenceChunk const step{std::span(&next, 1), &state};
    std::vector<float> last;
    model.forward(std::span(&step, 1), model::LogitsFor::kLastToken, last);
    logits.insert(logits.end(), last.begin(), last.end());
    REQUIRE(logits.size() == 6u * static_cast<std::size_t>(model.config().vocab));
    float lo = logits[0], hi = logits[0];
    std::size_t non_finite = 0;
    for (float x : logits) {
      non_finite += !std::isfinite(x);
      lo = std::min(lo, x);
      hi = std::max(hi, x);
    }
    CHECK(non_finite == 0);
    CHECK(hi > lo);
  });
}

/// bytes of a [rows, cols] matrix stored as format f
std::int64_t mat(WeightFormat f, std::int64_t rows, std::int64_t cols) { return rows * row_bytes(f, cols); }

/// decode_weight_bytes of synthetic_config("qwen3_6_35b_a3b", 2, 512) (a Gated DeltaNet and
/// a gated attention layer) under bf16 or q4_k (blocks of 256 values in 144 bytes; the router
/// keeps bf16), counted by hand.
void check_decode_bytes_qwen36_2_layers(runtime::DecodeWeightBytes const& b, WeightScheme scheme) {
  using F = WeightFormat;
  if (scheme == WeightScheme::kBf16) {
    CHECK(b.embedding_row == 2048 * 2);
    CHECK(b.lm_head == 512 * 2048 * 2);
    // in_proj_qkv 8192, z 4096, b 32, a 32 rows of 2048; out_proj 2048 rows of 4096; then
    // q (with the gate) 8192, k 512, v 512 rows of 2048, o 2048 rows of 4096.
    CHECK(b.mixers == (8192 + 4096 + 32 + 32) * 2048 * 2 + 2048 * 4096 * 2 + (8192 + 512 + 512) * 2048 * 2 +
                          2048 * 4096 * 2);
    CHECK(b.routers == 2 * 257 * 2048 * 2);                 // 256 experts + the shared gate
    CHECK(b.routed_experts == 2 * 8 * 3 * 512 * 2048 * 2);  // top-8 of gate, up, down
    CHECK(b.shared_experts == 2 * 3 * 512 * 2048 * 2);
  } else {
    CHECK(b.embedding_row == 2048 / 256 * 144);
    CHECK(b.lm_head == mat(F::kQ4K, 512, 2048));
    CHECK(b.mixers == mat(F::kQ4K, 8192 + 4096 + 32 + 32, 2048) + mat(F::kQ4K, 2048, 4096) +
                          mat(F::kQ4K, 8192 + 512 + 512, 2048) + mat(F::kQ4K, 2048, 4096));
    CHECK(b.routers == 2 * mat(F::kBf16, 257, 2048));
    CHECK(b.routed_experts == 2 * 8 * (2 * mat(F::kQ4K, 512, 2048) + mat(F::kQ4K, 2048, 512)));
    CHECK(b.shared_experts == 2 * (2 * mat(F::kQ4K, 512, 2048) + mat(F::kQ4K, 2048, 512)));
  }
  CHECK(b.total() == b.embedding_row + b.lm_head + b.mixers + b.routers + b.routed_experts + b.shared_experts);
}

}  // namespace

TEST_CASE("synthetic_config: the presets' fields, layer patterns and bounds") {
  SUBCASE("qwen3_6_35b_a3b") {
    auto const c = runtime::synthetic_config("qwen3_6_35b_a3b");  // 4 layers, the real vocabulary
    CHECK(c.model_type == "qwen3_5_moe");
    CHECK(c.family == ModelFamily::kQwen35Moe);
    CHECK(c.n_layer == 4);
    CHECK(c.vocab == 248320);
    CHECK(c.layer_types == std::vector{LayerKind::kLinearAttention, LayerKind::kLinearAttention,
                                       LayerKind::kLinearAttention, LayerKind::kFullAttention});
    CHECK(c.spec(KvScheme::kAny, WeightFormat::kAny) == spec::qwen3_6_35b_a3b);
    CHECK(c.rope_theta == 1e7f);
    CHECK(c.partial_rotary_factor == 0.25f);
    CHECK(c.rotary_dim == 64);
    CHECK(c.rms_norm_eps == 1e-6f);
    CHECK(c.norm_topk_prob);
    CHECK(c.attn_output_gate);
    CHECK(c.zero_centered_norms);
    CHECK_FALSE(c.tie_word_embeddings);
    CHECK_FALSE(c.tiled_value_heads);
    CHECK(c.max_position_embeddings == 262144);
    CHECK(c.eos_token_ids == std::vector{248044, 248046});
    CHECK(c.bos_token_id == 248044);
    CHECK(c.n_params_active() > 0);
    // 8 layers: the real pattern; 2 layers: the cut's last becomes full attention.
    CHECK(runtime::synthetic_config("qwen3_6_35b_a3b", 8).n_layer_of(LayerKind::kFullAttention) == 2);
    auto const two = runtime::synthetic_config("qwen3_6_35b_a3b", 2, 512);
    CHECK(two.layer_types == std::vector{LayerKind::kLinearAttention, LayerKind::kFullAttention});
    CHECK(two.eos_token_ids.empty());  // outside the cut vocabulary
    CHECK_FALSE(two.bos_token_id.has_value());
    // All 40 layers: 10 full attention, as MODELS.md says.
    CHECK(runtime::synthetic_config("qwen3_6_35b_a3b", 40).n_layer_of(LayerKind::kFullAttention) == 10);
  }
  SUBCASE("qwen3_30b_a3b") {
    auto const c = runtime::synthetic_config("qwen3_30b_a3b", 0, 1000);
    CHECK(c.model_type == "qwen3_moe");
    CHECK(c.n_layer == 4);
    CHECK(c.vocab == 1000);
    CHECK(c.n_layer_of(LayerKind::kFullAttention) == 4);
    CHECK(c.spec(KvScheme::kAny, WeightFormat::kAny) == spec::qwen3_30b_a3b);
    CHECK(c.rope_theta == 1e6f);
    CHECK(c.rotary_dim == 128);
    CHECK(c.norm_topk_prob);
    CHECK_FALSE(c.attn_output_gate);
    CHECK_FALSE(c.zero_centered_norms);
    CHECK(c.max_position_embeddings == 40960);
    CHECK(runtime::synthetic_config("qwen3_30b_a3b").vocab == 151936);
    CHECK(runtime::synthetic_config("qwen3_30b_a3b").eos_token_ids == std::vector{151645});
  }
  SUBCASE("bad presets and sizes") {
    test::expect_error([] { (void)runtime::synthetic_config("qwen3_8b"); },
                       {"unknown synthetic preset 'qwen3_8b'", "qwen3_6_35b_a3b, qwen3_30b_a3b"});
    test::expect_error([] { (void)runtime::synthetic_config("qwen3_6_35b_a3b", 41); }, {"41 layers", "[1, 40]"});
    test::expect_error([] { (void)runtime::synthetic_config("qwen3_30b_a3b", -1); }, {"[1, 48]"});
    test::expect_error([] { (void)runtime::synthetic_config("qwen3_30b_a3b", 1, 151937); }, {"vocabulary 151937"});
  }
}

TEST_CASE("spec_config: a spec's own shapes, laid out as its family's models; dynamic specs refused") {
  auto const c = runtime::spec_config(spec::qwen3_5_moe_micro, 6, 300);
  CHECK(c.spec(KvScheme::kAny, spec::qwen3_5_moe_micro.weights) == spec::qwen3_5_moe_micro);
  CHECK(c.n_layer == 6);
  CHECK(c.vocab == 300);
  CHECK(c.layer_types == std::vector{LayerKind::kLinearAttention, LayerKind::kLinearAttention,
                                     LayerKind::kLinearAttention, LayerKind::kFullAttention,
                                     LayerKind::kLinearAttention, LayerKind::kLinearAttention});
  CHECK(c.attn_output_gate);
  CHECK(c.zero_centered_norms);
  auto const q = runtime::spec_config(spec::qwen3_30b_a3b, 2, 64);
  CHECK(q.n_layer_of(LayerKind::kFullAttention) == 2);
  CHECK_FALSE(q.zero_centered_norms);
  test::expect_error([] { (void)runtime::spec_config(spec::generic, 2, 64); }, {"family"});
  test::expect_error([] {
    MoeSpec s = spec::qwen3_30b_a3b;
    s.d_model = kDynamic;
    (void)runtime::spec_config(s, 2, 64);
  }, {"dynamic shape field"});
  test::expect_error([] { (void)runtime::spec_config(spec::qwen3_30b_a3b, 0, 64); }, {"at least 1 layer"});
}

TEST_CASE("synthetic_model: every weight of the preset's shapes, in the scheme's formats; bytes per token") {
  // Qwen3.6 with 2 layers (one Gated DeltaNet, one gated attention); Qwen3-30B's layers are
  // all alike, so 1 layer covers them. bf16 takes 3.3 GB for the former.
  for (WeightScheme scheme : {WeightScheme::kBf16, WeightScheme::kQ4K}) {
    for (auto [preset, layers] : {std::pair{"qwen3_6_35b_a3b", 2}, std::pair{"qwen3_30b_a3b", 1}}) {
      CAPTURE(preset);
      CAPTURE(runtime::to_string(scheme));
      auto const c = runtime::synthetic_config(preset, layers, 512);
      auto m = runtime::synthetic_model(c, scheme, 7, false);
      check_weights(c, m, scheme);
      if (c.family == ModelFamily::kQwen35Moe)
        check_decode_bytes_qwen36_2_layers(runtime::decode_weight_bytes(c, m.weights), scheme);
      CHECK(m.config.source == std::string("synthetic ") + preset);
      check_forward(std::move(m));
    }
  }
}

TEST_CASE("synthetic_model: every scheme's blocks decode to finite values; the seed decides them") {
  // The blocks are the same whatever the expert count: 8 experts keep this light.
  auto c = runtime::synthetic_config("qwen3_30b_a3b", 1, 256);
  c.n_expert = 8;
  c.n_expert_used = 2;
  for (auto [scheme, name] : runtime::kWeightSchemes) {
    CAPTURE(name);
    auto const m = runtime::synthetic_model(c, scheme, 1, false);
    // The shared layout of every format: check one attention and one expert matrix whole.
    for (WeightView const& v : {m.weights.layers[0].attention.o, m.weights.layers[0].moe.experts[5].down}) {
      std::vector<float> row(static_cast<std::size_t>(v.cols));
      double sum_sq = 0;
      std::int64_t out_of_range = 0;  // NaN, Inf, or beyond the generator's range
      for (std::int64_t r = 0; r < v.rows; ++r) {
        dequantize_row(v, r, row.data());
        for (float x : row) {
          out_of_range += !(std::fabs(x) <= 0.035f);
          sum_sq += static_cast<double>(x) * x;
        }
      }
      CHECK(out_of_range == 0);
      double const rms = std::sqrt(sum_sq / static_cast<double>(v.rows * v.cols));
      CHECK(rms > 0.005);  // about 0.02 for bf16, a little less where block scales vary
      CHECK(rms < 0.025);
    }
  }
  auto bytes_of = [](runtime::LoadedModel const& m) {
    WeightView const& v = m.weights.layers[0].moe.experts[6].up;
    auto const* p = static_cast<std::byte const*>(v.data);
    return std::vector<std::byte>(p, p + v.bytes());
  };
  auto const a = runtime::synthetic_model(c, WeightScheme::kQ4K, 11, false);
  auto const b = runtime::synthetic_model(c, WeightScheme::kQ4K, 11, false);
  auto const other = runtime::synthetic_model(c, WeightScheme::kQ4K, 12, false);
  CHECK(bytes_of(a) == bytes_of(b));
  CHECK(bytes_of(a) != bytes_of(other));
  auto const& na = a.weights.layers[0].input_norm;
  auto const& nb = b.weights.layers[0].input_norm;
  CHECK(std::vector<float>(na.begin(), na.end()) == std::vector<float>(nb.begin(), nb.end()));
}

TEST_CASE("measure_read_bandwidth: a positive rate over the buffer it was given; roofline_fraction") {
  auto const bw = runtime::measure_read_bandwidth(2, std::int64_t{64} << 20);
  CHECK(bw.gbs > 0);
  CHECK(bw.threads == max_threads());
  CHECK(bw.buffer_bytes <= std::int64_t{64} << 20);
  CHECK(bw.buffer_bytes > std::int64_t{63} << 20);
  CHECK(runtime::read_bandwidth_buffer_bytes() >= std::int64_t{1} << 30);
  CHECK(runtime::roofline_fraction(100.0, 300'000'000, 50.0) == doctest::Approx(0.6));
}
