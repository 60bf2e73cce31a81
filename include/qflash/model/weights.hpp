/// @file
/// Binding a Hugging Face checkpoint to the model's weights: name mapping for both model
/// families, both tensor prefixes (`model.` and `model.language_model.`), both expert layouts
/// (stacked `experts.gate_up_proj` / `experts.down_proj`, and per-expert), and the weight
/// dtype asked for. Matrices in the asked dtype are views into the mapped files; others are
/// converted once into owned buffers. Small vectors (norms, conv, gate parameters) are held
/// in fp32.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/core/log.hpp"
#include "qflash/io/checkpoint.hpp"
#include "qflash/io/hf_config.hpp"
#include "qflash/io/progress.hpp"
#include "qflash/kernels/expert_ffn/op.hpp"
#include "qflash/kernels/linear/op.hpp"
#include "qflash/numeric/bf16.hpp"

namespace qflash::model {

using kernels::ExpertWeights;
using kernels::WeightView;

struct AttentionWeights {
  WeightView q;  // [n_head * d_head * (gated ? 2 : 1), d_model]: per head [query | gate]
  WeightView k;  // [n_head_kv * d_head, d_model]
  WeightView v;  // [n_head_kv * d_head, d_model]
  WeightView o;  // [d_model, n_head * d_head]
  std::vector<float> q_norm;  // [d_head]
  std::vector<float> k_norm;  // [d_head]
};

struct LinearAttentionWeights {
  WeightView qkv;  // [2 * n_head_k * d_k + n_head_v * d_v, d_model]
  WeightView z;    // [n_head_v * d_v, d_model]
  WeightView b;    // [n_head_v, d_model]
  WeightView a;    // [n_head_v, d_model]
  WeightView out;  // [d_model, n_head_v * d_v]
  std::vector<float> conv;     // [conv_dim, d_conv]
  std::vector<float> dt_bias;  // [n_head_v]
  std::vector<float> neg_a;    // [n_head_v]: -exp(A_log)
  std::vector<float> norm;     // [d_v], plain weight
};

struct MoeWeights {
  WeightView router;                   // [n_expert, d_model]
  std::vector<ExpertWeights> experts;  // [n_expert]
  std::optional<ExpertWeights> shared;
  WeightView shared_gate;  // [1, d_model]
};

struct LayerWeights {
  io::LayerKind kind{};
  std::vector<float> input_norm;  // [d_model]
  std::vector<float> post_norm;   // [d_model]
  AttentionWeights attention;
  LinearAttentionWeights linear;
  MoeWeights moe;
};

struct ModelWeights {
  WeightView embed;    // [vocab, d_model]
  WeightView lm_head;  // [vocab, d_model]
  std::vector<float> final_norm;
  std::vector<LayerWeights> layers;
};

/// Owns the mapped checkpoint and any converted copies; hands out views.
class WeightBinder {
 public:
  WeightBinder(io::Checkpoint const& ckpt, DType want, io::Progress* progress)
      : ckpt_(ckpt), want_(want), progress_(progress) {
    QFLASH_CHECK(want == DType::kF32 || want == DType::kBF16,
                 "weights can be bound as f32 or bf16, not ", to_string(want));
    prefix_ = ckpt.find("model.language_model.embed_tokens.weight") ? "model.language_model."
                                                                     : "model.";
  }

  [[nodiscard]] std::string const& prefix() const { return prefix_; }
  [[nodiscard]] bool has(std::string const& name) const { return ckpt_.find(name) != nullptr; }

  /// A matrix [rows, cols]; `rows_begin` selects rows of a larger (e.g. stacked) tensor whose
  /// numel is checked against `expected`.
  WeightView matrix(std::string const& name, Shape const& expected, std::int64_t rows_begin,
                    std::int64_t rows, std::int64_t cols) {
    io::TensorRecord const& t = get(name, expected);
    std::size_t const esize = size_of(t.dtype);
    std::size_t const offset = static_cast<std::size_t>(rows_begin * cols) * esize;
    std::size_t const n = static_cast<std::size_t>(rows * cols);
    std::byte const* src = t.data.data() + offset;
    bool const aligned = reinterpret_cast<std::uintptr_t>(src) % size_of(want_) == 0;
    if (t.dtype == want_ && aligned) return {want_, src, rows, cols};
    std::vector<float> tmp(n);
    read_f32_range(t, offset / esize, tmp);
    auto& buf = owned_.emplace_back(std::make_unique<std::byte[]>(n * size_of(want_)));
    if (want_ == DType::kF32) {
      std::memcpy(buf.get(), tmp.data(), n * sizeof(float));
    } else {
      auto* dst = reinterpret_cast<std::uint16_t*>(buf.get());
      for (std::size_t i = 0; i < n; ++i) dst[i] = to_bf16(tmp[i]).bits;
    }
    return {want_, buf.get(), rows, cols};
  }

  WeightView matrix(std::string const& name, std::int64_t rows, std::int64_t cols) {
    return matrix(name, Shape{rows, cols}, 0, rows, cols);
  }

  /// A whole tensor as fp32, shape checked. With bf16 weights its values are rounded to bf16
  /// as well (what casting the whole model to bf16 gives), unless `keep_precision`: Qwen3.6
  /// checkpoints keep A_log in f32.
  std::vector<float> vector(std::string const& name, Shape const& expected, bool keep_precision = false) {
    io::TensorRecord const& t = get(name, expected);
    std::vector<float> out(static_cast<std::size_t>(t.shape.numel()));
    io::read_f32(t, out);
    if (want_ == DType::kBF16 && !keep_precision)
      for (float& x : out) x = round_to_bf16(x);
    return out;
  }

  /// Names of checkpoint tensors no binding asked for.
  [[nodiscard]] std::vector<std::string> unused() const {
    std::vector<std::string> out;
    for (auto const& n : ckpt_.names())
      if (!used_.count(n)) out.push_back(n);
    return out;
  }

  std::deque<std::unique_ptr<std::byte[]>>& owned() { return owned_; }

 private:
  io::TensorRecord const& get(std::string const& name, Shape const& expected) {
    io::TensorRecord const& t = ckpt_.get(name, expected);
    if (used_.insert(name).second && progress_) progress_->advance(t.data.size());
    return t;
  }

  static void read_f32_range(io::TensorRecord const& t, std::size_t first, std::vector<float>& out) {
    if (first == 0 && static_cast<std::int64_t>(out.size()) == t.shape.numel()) {
      io::read_f32(t, out);
      return;
    }
    for (std::size_t i = 0; i < out.size(); ++i)
      out[i] = io::read_scalar_f32(t, static_cast<std::int64_t>(first + i));
  }

  io::Checkpoint const& ckpt_;
  DType want_;
  io::Progress* progress_;
  std::string prefix_;
  std::set<std::string> used_;
  std::deque<std::unique_ptr<std::byte[]>> owned_;
};

/// Binds every weight the forward pass needs; throws Error naming the file and tensor on a
/// missing tensor or a wrong shape. Vision and MTP tensors are skipped with one log line.
inline ModelWeights bind_weights(io::ModelConfig const& c, WeightBinder& wb) {
  std::int64_t const d = c.d_model;
  std::string const& P = wb.prefix();
  ModelWeights m;
  m.embed = wb.matrix(P + "embed_tokens.weight", c.vocab, d);
  m.final_norm = wb.vector(P + "norm.weight", Shape{d});
  if (c.tie_word_embeddings && !wb.has("lm_head.weight"))
    m.lm_head = m.embed;
  else
    m.lm_head = wb.matrix("lm_head.weight", c.vocab, d);

  std::int64_t const n_expert = c.n_expert, d_ff = c.d_ff_expert;
  for (int l = 0; l < c.n_layer; ++l) {
    std::string const L = P + "layers." + std::to_string(l) + ".";
    LayerWeights& w = m.layers.emplace_back();
    w.kind = c.layer_types[static_cast<std::size_t>(l)];
    w.input_norm = wb.vector(L + "input_layernorm.weight", Shape{d});
    w.post_norm = wb.vector(L + "post_attention_layernorm.weight", Shape{d});
    if (w.kind == io::LayerKind::kFullAttention) {
      std::string const A = L + "self_attn.";
      std::int64_t const q_rows = std::int64_t{c.n_head} * c.d_head * (c.attn_output_gate ? 2 : 1);
      std::int64_t const kv_rows = std::int64_t{c.n_head_kv} * c.d_head;
      w.attention.q = wb.matrix(A + "q_proj.weight", q_rows, d);
      w.attention.k = wb.matrix(A + "k_proj.weight", kv_rows, d);
      w.attention.v = wb.matrix(A + "v_proj.weight", kv_rows, d);
      w.attention.o = wb.matrix(A + "o_proj.weight", d, std::int64_t{c.n_head} * c.d_head);
      w.attention.q_norm = wb.vector(A + "q_norm.weight", Shape{c.d_head});
      w.attention.k_norm = wb.vector(A + "k_norm.weight", Shape{c.d_head});
    } else {
      std::string const A = L + "linear_attn.";
      std::int64_t const key_dim = std::int64_t{c.n_head_k_linear} * c.d_head_k_linear;
      std::int64_t const value_dim = std::int64_t{c.n_head_v_linear} * c.d_head_v_linear;
      std::int64_t const conv_dim = 2 * key_dim + value_dim;
      w.linear.qkv = wb.matrix(A + "in_proj_qkv.weight", conv_dim, d);
      w.linear.z = wb.matrix(A + "in_proj_z.weight", value_dim, d);
      w.linear.b = wb.matrix(A + "in_proj_b.weight", c.n_head_v_linear, d);
      w.linear.a = wb.matrix(A + "in_proj_a.weight", c.n_head_v_linear, d);
      w.linear.out = wb.matrix(A + "out_proj.weight", d, value_dim);
      w.linear.conv = wb.vector(A + "conv1d.weight", Shape{conv_dim, 1, c.d_conv});
      w.linear.dt_bias = wb.vector(A + "dt_bias", Shape{c.n_head_v_linear});
      w.linear.neg_a = wb.vector(A + "A_log", Shape{c.n_head_v_linear}, /*keep_precision=*/true);
      for (float& x : w.linear.neg_a) x = -std::exp(x);
      w.linear.norm = wb.vector(A + "norm.weight", Shape{c.d_head_v_linear});
    }
    std::string const M = L + "mlp.";
    w.moe.router = wb.matrix(M + "gate.weight", n_expert, d);
    if (wb.has(M + "experts.gate_up_proj")) {
      Shape const gu{n_expert, 2 * d_ff, d}, dn{n_expert, d, d_ff};
      for (std::int64_t e = 0; e < n_expert; ++e)
        w.moe.experts.push_back(
            {wb.matrix(M + "experts.gate_up_proj", gu, e * 2 * d_ff, d_ff, d),
             wb.matrix(M + "experts.gate_up_proj", gu, e * 2 * d_ff + d_ff, d_ff, d),
             wb.matrix(M + "experts.down_proj", dn, e * d, d, d_ff)});
    } else {
      for (std::int64_t e = 0; e < n_expert; ++e) {
        std::string const E = M + "experts." + std::to_string(e) + ".";
        w.moe.experts.push_back({wb.matrix(E + "gate_proj.weight", d_ff, d),
                                 wb.matrix(E + "up_proj.weight", d_ff, d),
                                 wb.matrix(E + "down_proj.weight", d, d_ff)});
      }
    }
    if (c.d_ff_shared > 0) {
      std::string const S = M + "shared_expert.";
      w.moe.shared = ExpertWeights{wb.matrix(S + "gate_proj.weight", c.d_ff_shared, d),
                                   wb.matrix(S + "up_proj.weight", c.d_ff_shared, d),
                                   wb.matrix(S + "down_proj.weight", d, c.d_ff_shared)};
      w.moe.shared_gate = wb.matrix(M + "shared_expert_gate.weight", 1, d);
    }
  }

  std::size_t skipped = 0;
  std::vector<std::string> unknown;
  for (auto const& n : wb.unused()) {
    if (n.starts_with("mtp.") || n.starts_with("model.visual.") || n.starts_with("visual."))
      ++skipped;
    else
      unknown.push_back(n);
  }
  if (skipped) QFLASH_LOG_INFO("skipped ", skipped, " vision/MTP tensors (not used by the text model)");
  if (!unknown.empty())
    QFLASH_LOG_WARN(unknown.size(), " checkpoint tensors are not used, e.g. '", unknown.front(), "'");
  return m;
}

}  // namespace qflash::model
