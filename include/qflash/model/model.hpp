/// @file
/// The text model of both supported families on the CPU: qwen3_5_moe (Gated DeltaNet and
/// gated full attention, (1+w) norms, routed experts plus a sigmoid-gated shared expert) and
/// qwen3_moe (GQA attention, plain norms, routed experts).
///
/// `forward` takes a ragged batch: each entry is one sequence's new tokens (a prefill chunk or
/// one decode token) with its caches. Projections and experts run over all rows of the batch
/// at once; attention and the delta rule run per sequence on that sequence's caches.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <unistd.h>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/io/checkpoint.hpp"
#include "qflash/io/checksums.hpp"
#include "qflash/io/hf_config.hpp"
#include "qflash/io/progress.hpp"
#include "qflash/kernels/add_rmsnorm/cpu.hpp"
#include "qflash/kernels/attention/cpu.hpp"
#include "qflash/kernels/causal_conv1d/cpu.hpp"
#include "qflash/kernels/expert_ffn/cpu.hpp"
#include "qflash/kernels/gated_delta/cpu.hpp"
#include "qflash/kernels/gated_rmsnorm/cpu.hpp"
#include "qflash/kernels/linear/cpu.hpp"
#include "qflash/kernels/rope/cpu.hpp"
#include "qflash/kernels/router_topk/cpu.hpp"
#include "qflash/model/cache.hpp"
#include "qflash/model/weights.hpp"
#include "qflash/spec/presets.hpp"

namespace qflash::model {

struct ModelOptions {
  DType weight_dtype = DType::kF32;  ///< kF32 or kBF16; converted on load when stored otherwise
  kernels::DeltaRuleForm prefill_form = kernels::DeltaRuleForm::kChunked;  ///< for chunks of > 1 token
  int delta_chunk = 64;
  bool progress = ::isatty(2) != 0;  ///< load progress bar on stderr
  bool verify_checksums = true;       ///< check SHA256SUMS when the directory has one
};

/// One sequence's new tokens in a batch.
struct SequenceChunk {
  std::span<std::int32_t const> tokens;
  SequenceState* state = nullptr;
};

enum class LogitsFor { kAllTokens, kLastToken };

/// Called with the residual stream [n_tokens, d_model] of the whole batch: index 0 after the
/// embedding, l + 1 after layer l, n_layer + 1 after the final norm.
using HiddenObserver = std::function<void(int index, std::span<float const> hidden)>;

template <MoeSpec S = spec::generic>
class Model {
 public:
  /// Loads a Hugging Face model directory; throws Error naming the file and field/tensor.
  static std::unique_ptr<Model> load(std::string const& dir, ModelOptions const& opts = {}) {
    if (opts.verify_checksums && io::has_checksums(dir)) io::verify_checksums(dir);
    auto cfg = io::load_config(dir);
    auto ckpt = std::make_unique<io::Checkpoint>(io::Checkpoint::open(dir));
    QFLASH_CHECK(ckpt->has_weights(), dir, ": no weights (model.safetensors or its index) found");
    return std::unique_ptr<Model>(new Model(std::move(cfg), std::move(ckpt), opts));
  }

  [[nodiscard]] io::ModelConfig const& config() const { return cfg_; }
  [[nodiscard]] ModelWeights const& weights() const { return w_; }
  [[nodiscard]] SequenceState new_sequence() const { return SequenceState(cfg_); }

  /// Runs the batch's new tokens, advancing each sequence's state, and writes logits
  /// [rows, vocab]: one row per token (kAllTokens) or per sequence (kLastToken).
  void forward(std::span<SequenceChunk const> batch, LogitsFor which, std::vector<float>& logits,
               HiddenObserver const& observe = {}) {
    std::int64_t const d = cfg_.d_model;
    // Row ranges and positions of each sequence in the batch.
    begin_.assign(1, 0);
    positions_.clear();
    tokens_.clear();
    for (auto const& c : batch) {
      QFLASH_CHECK(c.state, "forward: a batch entry has no sequence state");
      QFLASH_CHECK(!c.tokens.empty(), "forward: a batch entry has no tokens");
      QFLASH_CHECK(c.state->n_past() + static_cast<std::int64_t>(c.tokens.size()) <= c.state->max_positions(),
                   "sequence of ", c.state->n_past() + c.tokens.size(),
                   " tokens exceeds max_position_embeddings ", c.state->max_positions());
      for (std::size_t t = 0; t < c.tokens.size(); ++t) {
        QFLASH_CHECK(c.tokens[t] >= 0 && c.tokens[t] < cfg_.vocab, "token id ", c.tokens[t],
                     " is outside the vocabulary [0, ", cfg_.vocab, ")");
        positions_.push_back(c.state->n_past() + static_cast<std::int64_t>(t));
        tokens_.push_back(c.tokens[t]);
      }
      begin_.push_back(static_cast<std::int64_t>(tokens_.size()));
    }
    std::int64_t const T = static_cast<std::int64_t>(tokens_.size());
    resize(h_, T * d);
    resize(xn_, T * d);
    resize(mix_, T * d);

    for (std::int64_t t = 0; t < T; ++t) embed_row(tokens_[static_cast<std::size_t>(t)], h_.data() + t * d);
    if (observe) observe(0, {h_.data(), static_cast<std::size_t>(T * d)});

    for (std::size_t l = 0; l < w_.layers.size(); ++l) {
      LayerWeights const& lw = w_.layers[l];
      norm(h_.data(), nullptr, lw.input_norm, xn_.data(), T);
      if (lw.kind == io::LayerKind::kFullAttention)
        attention_block(l, lw.attention, batch, T);
      else
        linear_attention_block(l, lw.linear, batch, T);
      norm(mix_.data(), h_.data(), lw.post_norm, xn_.data(), T);  // h += mix; xn = norm(h)
      moe_block(lw.moe, T);
      for (std::int64_t i = 0; i < T * d; ++i) h_[static_cast<std::size_t>(i)] += mix_[static_cast<std::size_t>(i)];
      if (observe) observe(static_cast<int>(l) + 1, {h_.data(), static_cast<std::size_t>(T * d)});
    }
    norm(h_.data(), nullptr, w_.final_norm, xn_.data(), T);
    if (observe) observe(cfg_.n_layer + 1, {xn_.data(), static_cast<std::size_t>(T * d)});

    // Logits of the rows asked for.
    float const* rows = xn_.data();
    std::int64_t n_rows = T;
    if (which == LogitsFor::kLastToken) {
      n_rows = static_cast<std::int64_t>(batch.size());
      resize(mix_, n_rows * d);
      for (std::int64_t i = 0; i < n_rows; ++i)
        std::copy_n(xn_.data() + (begin_[static_cast<std::size_t>(i) + 1] - 1) * d, d, mix_.data() + i * d);
      rows = mix_.data();
    }
    logits.resize(static_cast<std::size_t>(n_rows * cfg_.vocab));
    project(w_.lm_head, rows, n_rows, logits.data());

    for (auto const& c : batch) c.state->advance(static_cast<std::int64_t>(c.tokens.size()));
  }

 private:
  Model(io::ModelConfig cfg, std::unique_ptr<io::Checkpoint> ckpt, ModelOptions const& opts)
      : cfg_(std::move(cfg)), ckpt_(std::move(ckpt)), opts_(opts) {
    MoeSpec const rt = cfg_.spec(KvScheme::kBf16, opts.weight_dtype == DType::kF32 ? WeightFormat::kF32 : WeightFormat::kBf16);
    MoeSpec structural = S;  // the KV scheme and weight format are checked by their own kernels
    structural.kv = KvScheme::kAny;
    structural.weights = WeightFormat::kAny;
    QFLASH_CHECK(matches(structural, rt), cfg_.source, ": the model's shape ", to_string(rt),
                 " does not match the compiled spec ", to_string(S));
    io::Progress progress("loading " + ckpt_->dir(), ckpt_->weight_bytes(), opts.progress);
    binder_ = std::make_unique<WeightBinder>(*ckpt_, opts.weight_dtype, &progress);
    w_ = bind_weights(cfg_, *binder_);
    progress.finish();
    kind_ = cfg_.family == ModelFamily::kQwen35Moe ? kernels::NormWeight::kZeroCentered
                                                   : kernels::NormWeight::kPlain;
  }

  static void resize(std::vector<float>& v, std::int64_t n) { v.resize(static_cast<std::size_t>(n)); }

  static void check(Status s, char const* what) { QFLASH_CHECK_STATUS(s, what); }

  void embed_row(std::int32_t token, float* out) const {
    WeightView const& e = w_.embed;
    if (e.dtype == DType::kF32) {
      std::copy_n(static_cast<float const*>(e.data) + token * e.cols, e.cols, out);
    } else {
      auto const* src = static_cast<std::uint16_t const*>(e.data) + token * e.cols;
      for (std::int64_t i = 0; i < e.cols; ++i) out[i] = to_float(Bf16{src[i]});
    }
  }

  /// y = RMSNorm(x + residual) with the family's weight kind; residual += x when given.
  void norm(float const* x, float* residual, std::vector<float> const& weight, float* y,
            std::int64_t rows) const {
    kernels::AddRmsNormArgs a{};
    a.x = x;
    a.residual = residual;
    a.weight = weight.data();
    a.y = y;
    a.n_rows = rows;
    a.n_cols = static_cast<int>(weight.size());
    a.eps = cfg_.rms_norm_eps;
    a.weight_kind = kind_;
    if (static_cast<int>(weight.size()) == cfg_.d_model)
      check(kernels::launch_add_rmsnorm<S>(arch::Cpu{}, a), "add_rmsnorm");
    else
      check(kernels::launch_add_rmsnorm<spec::generic>(arch::Cpu{}, a), "rmsnorm (head)");
  }

  void project(WeightView const& w, float const* x, std::int64_t rows, float* y,
               std::int64_t x_stride = 0) const {
    kernels::LinearArgs a{};
    a.w = w;
    a.x = x;
    a.y = y;
    a.n_tokens = rows;
    a.x_stride = x_stride;
    check(kernels::launch_linear<S>(arch::Cpu{}, a), "linear");
  }

  void attention_block(std::size_t layer, AttentionWeights const& w,
                       std::span<SequenceChunk const> batch, std::int64_t T) {
    int const nh = cfg_.n_head, nkv = cfg_.n_head_kv, dh = cfg_.d_head;
    bool const gated = cfg_.attn_output_gate;
    std::int64_t const q_width = std::int64_t{nh} * dh, kv_width = std::int64_t{nkv} * dh;
    resize(qg_, T * w.q.rows);
    resize(q_, T * q_width);
    resize(k_, T * kv_width);
    resize(v_, T * kv_width);
    resize(o_, T * q_width);
    project(w.q, xn_.data(), T, qg_.data());
    project(w.k, xn_.data(), T, k_.data());
    project(w.v, xn_.data(), T, v_.data());
    // Per head, the projection holds [query | gate] when gated.
    int const stride = gated ? 2 * dh : dh;
    for (std::int64_t t = 0; t < T; ++t)
      for (int h = 0; h < nh; ++h)
        std::copy_n(qg_.data() + t * w.q.rows + h * stride, dh, q_.data() + (t * nh + h) * dh);

    head_norm(q_.data(), w.q_norm, T * nh);
    head_norm(k_.data(), w.k_norm, T * nkv);
    rope(q_.data(), T, nh);
    rope(k_.data(), T, nkv);

    for (std::size_t i = 0; i < batch.size(); ++i) {
      std::int64_t const b = begin_[i], n = begin_[i + 1] - b;
      AttentionCache& cache = batch[i].state->attention(layer);
      std::size_t const width = static_cast<std::size_t>(kv_width);
      cache.k.insert(cache.k.end(), k_.begin() + b * kv_width, k_.begin() + (b + n) * kv_width);
      cache.v.insert(cache.v.end(), v_.begin() + b * kv_width, v_.begin() + (b + n) * kv_width);
      kernels::AttentionArgs a{};
      a.q = q_.data() + b * q_width;
      a.k = cache.k.data();
      a.v = cache.v.data();
      a.out = o_.data() + b * q_width;
      a.n_tokens = n;
      a.n_ctx = static_cast<std::int64_t>(cache.k.size() / width);
      a.n_head = nh;
      a.n_head_kv = nkv;
      a.d_head = dh;
      a.scale = 1.0f / std::sqrt(static_cast<float>(dh));
      check(kernels::launch_attention<S>(arch::Cpu{}, a), "attention");
    }
    if (gated)
      for (std::int64_t t = 0; t < T; ++t)
        for (int h = 0; h < nh; ++h) {
          float const* g = qg_.data() + t * w.q.rows + h * stride + dh;
          float* o = o_.data() + (t * nh + h) * dh;
          for (int i = 0; i < dh; ++i) o[i] *= 1.0f / (1.0f + std::exp(-g[i]));
        }
    project(w.o, o_.data(), T, mix_.data());
  }

  void head_norm(float* x, std::vector<float> const& weight, std::int64_t rows) const {
    norm(x, nullptr, weight, x, rows);
  }

  void rope(float* x, std::int64_t T, int n_head) const {
    kernels::RopeArgs a{};
    a.x = x;
    a.positions = positions_.data();
    a.n_tokens = T;
    a.n_head = n_head;
    a.d_head = cfg_.d_head;
    a.rotary_dim = cfg_.rotary_dim;
    a.theta = cfg_.rope_theta;
    check(kernels::launch_rope<S>(arch::Cpu{}, a), "rope");
  }

  void linear_attention_block(std::size_t layer, LinearAttentionWeights const& w,
                              std::span<SequenceChunk const> batch, std::int64_t T) {
    int const hk = cfg_.n_head_k_linear, hv = cfg_.n_head_v_linear;
    int const dk = cfg_.d_head_k_linear, dv = cfg_.d_head_v_linear;
    std::int64_t const key_dim = std::int64_t{hk} * dk, value_dim = std::int64_t{hv} * dv;
    std::int64_t const conv_dim = 2 * key_dim + value_dim;
    resize(qg_, T * conv_dim);   // pre-conv q|k|v
    resize(conv_out_, T * conv_dim);
    resize(z_, T * value_dim);
    resize(beta_, T * hv);
    resize(g_, T * hv);
    resize(o_, T * value_dim);
    project(w.qkv, xn_.data(), T, qg_.data());
    project(w.z, xn_.data(), T, z_.data());
    project(w.b, xn_.data(), T, beta_.data());
    project(w.a, xn_.data(), T, g_.data());
    for (std::int64_t t = 0; t < T; ++t)
      for (int h = 0; h < hv; ++h) {
        std::size_t const i = static_cast<std::size_t>(t * hv + h);
        beta_[i] = 1.0f / (1.0f + std::exp(-beta_[i]));
        float const x = g_[i] + w.dt_bias[static_cast<std::size_t>(h)];
        float const softplus = x > 20.0f ? x : std::log1p(std::exp(x));
        g_[i] = w.neg_a[static_cast<std::size_t>(h)] * softplus;
      }

    for (std::size_t i = 0; i < batch.size(); ++i) {
      std::int64_t const b = begin_[i], n = begin_[i + 1] - b;
      LinearState& st = batch[i].state->linear(layer);
      kernels::CausalConv1dArgs c{};
      c.x = qg_.data() + b * conv_dim;
      c.weight = w.conv.data();
      c.state = st.conv.data();
      c.y = conv_out_.data() + b * conv_dim;
      c.n_tokens = n;
      c.n_channels = static_cast<int>(conv_dim);
      c.d_conv = cfg_.d_conv;
      check(kernels::launch_causal_conv1d<S>(arch::Cpu{}, c), "causal_conv1d");
    }
    for (std::size_t i = 0; i < batch.size(); ++i) {
      std::int64_t const b = begin_[i], n = begin_[i + 1] - b;
      kernels::GatedDeltaArgs a{};
      // q, k and v are read in place from the conv output rows [q | k | v].
      float const* rows = conv_out_.data() + b * conv_dim;
      a.q = rows;
      a.k = rows + key_dim;
      a.v = rows + 2 * key_dim;
      a.q_stride = a.k_stride = a.v_stride = conv_dim;
      a.g = g_.data() + b * hv;
      a.beta = beta_.data() + b * hv;
      a.state = batch[i].state->linear(layer).recurrent.data();
      a.out = o_.data() + b * value_dim;
      a.n_tokens = n;
      a.n_head_k = hk;
      a.n_head_v = hv;
      a.d_k = dk;
      a.d_v = dv;
      auto const form = n == 1 ? kernels::DeltaRuleForm::kRecurrent : opts_.prefill_form;
      check(kernels::launch_gated_delta<S>(arch::Cpu{}, a, form, opts_.delta_chunk), "gated_delta");
    }
    kernels::GatedRmsNormArgs gn{};
    gn.x = o_.data();
    gn.z = z_.data();
    gn.weight = w.norm.data();
    gn.y = o_.data();
    gn.n_rows = T * hv;
    gn.n_cols = dv;
    gn.eps = cfg_.rms_norm_eps;
    check(kernels::launch_gated_rmsnorm<S>(arch::Cpu{}, gn), "gated_rmsnorm");
    project(w.out, o_.data(), T, mix_.data());
  }

  void moe_block(MoeWeights const& w, std::int64_t T) {
    int const n_expert = cfg_.n_expert, k = cfg_.n_expert_used;
    std::int64_t const d = cfg_.d_model;
    resize(router_logits_, T * n_expert);
    routes_.resize(static_cast<std::size_t>(T * k));
    resize(route_weights_, T * k);
    project(w.router, xn_.data(), T, router_logits_.data());
    kernels::RouterTopkArgs r{};
    r.logits = router_logits_.data();
    r.experts = routes_.data();
    r.weights = route_weights_.data();
    r.n_tokens = T;
    r.n_expert = n_expert;
    r.n_expert_used = k;
    r.renormalize = cfg_.norm_topk_prob;
    check(kernels::launch_router_topk<S>(arch::Cpu{}, r), "router_topk");

    std::fill_n(mix_.data(), T * d, 0.0f);
    kernels::ExpertFfnArgs e{};
    e.experts = w.experts;
    e.x = xn_.data();
    e.routes = routes_.data();
    e.route_weights = route_weights_.data();
    e.out = mix_.data();
    e.n_tokens = T;
    e.n_expert_used = k;
    check(kernels::launch_expert_ffn<S>(arch::Cpu{}, e), "expert_ffn");

    if (w.shared) {
      // The shared expert: every token, weighted by sigmoid(shared_expert_gate . x).
      resize(route_weights_, T);
      project(w.shared_gate, xn_.data(), T, route_weights_.data());
      for (auto& g : route_weights_) g = 1.0f / (1.0f + std::exp(-g));
      routes_.assign(static_cast<std::size_t>(T), 0);
      e.experts = std::span<ExpertWeights const>(&*w.shared, 1);
      e.routes = routes_.data();
      e.route_weights = route_weights_.data();
      e.n_expert_used = 1;
      check(kernels::launch_expert_ffn<S>(arch::Cpu{}, e), "shared expert");
    }
  }

  io::ModelConfig cfg_;
  std::unique_ptr<io::Checkpoint> ckpt_;
  std::unique_ptr<WeightBinder> binder_;
  ModelOptions opts_;
  ModelWeights w_;
  kernels::NormWeight kind_ = kernels::NormWeight::kPlain;

  // Per-call scratch, reused across calls.
  std::vector<std::int64_t> begin_, positions_;
  std::vector<std::int32_t> tokens_, routes_;
  std::vector<float> h_, xn_, mix_, qg_, q_, k_, v_, o_, conv_out_, z_, beta_, g_, router_logits_,
      route_weights_;
};

}  // namespace qflash::model
