/// @file
/// The text model of both supported families, `Model<Spec, Arch, Fusion>`: qwen3_5_moe (Gated
/// DeltaNet and gated full attention, (1+w) norms, routed experts plus a sigmoid-gated shared
/// expert) and qwen3_moe (GQA attention, plain norms, routed experts), stacked from the layer
/// classes in model/layers/. Only kernels' op.hpp are included: every launcher takes `Arch`
/// from the template, and its instance comes from the generated instance TUs. `Fusion`
/// (model/fusion.hpp) picks which adjacent steps run as one pass.
///
/// `forward` takes a ragged batch: each entry is one sequence's new tokens (a prefill chunk or
/// one decode token) with its caches. Projections and experts run over all rows of the batch
/// at once; attention and the delta rule run per sequence on that sequence's caches. Weights
/// and caches are owned by the runtime (runtime/load_model.hpp); the model holds views.
///
/// On a CUDA arch the weights are device views (runtime/cuda/device_weights.hpp) and the
/// working state (scratch, the batch's token arrays, new sequences' KV and recurrent states)
/// lives in the device Memory given in ModelOptions; forward returns when the logits are on
/// the host.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "qflash/arch/arch.hpp"
#include "qflash/core/error.hpp"
#include "qflash/core/memory.hpp"
#include "qflash/core/step_recorder.hpp"
#include "qflash/kernels/add_rmsnorm/op.hpp"
#include "qflash/kernels/embedding/op.hpp"
#include "qflash/kernels/token_candidates/op.hpp"
#include "qflash/model/cache.hpp"
#include "qflash/model/config.hpp"
#include "qflash/model/fusion.hpp"
#include "qflash/model/layers/common.hpp"
#include "qflash/model/layers/gated_attention.hpp"
#include "qflash/model/layers/gated_deltanet.hpp"
#include "qflash/model/layers/moe.hpp"
#include "qflash/model/lora.hpp"
#include "qflash/model/weights.hpp"
#include "qflash/numeric/finite.hpp"
#include "qflash/spec/presets.hpp"

namespace qflash::model {

struct ModelOptions {
  DeltaRuleOptions delta;     ///< how prefill chunks run the delta rule
  stream_t stream = nullptr;  ///< the CUDA stream every kernel runs on (null: default; CPU ignores it)
  RouteObserver on_route;     ///< called by every MoE layer after routing (empty: not called)
  Routing routing;            ///< token-wise routing (default: the model's top-k)
  /// The LoRA adapter of every sequence that brings none (null: none); runtime/lora.hpp loads them.
  std::shared_ptr<LoraAdapter const> lora;
  /// Where scratch, batch arrays and new sequences' caches live (null: host memory); a CUDA
  /// arch's model needs its device's (runtime/cuda/memory.hpp).
  std::shared_ptr<Memory> memory;
  /// Records a step's kernels and launches them as one (null: each launched on its own). Used
  /// for a step of the same shape as the one before, when nothing observes the step.
  std::shared_ptr<StepRecorder> recorder;
};

enum class LogitsFor { kAllTokens, kLastToken };

/// What a forward brings back instead of its logits rows: each row's best tokens and sums
/// (kernels/token_candidates).
struct CandidateRequest {
  int k = 1;                               ///< candidates per row, in [1, kMaxTokenCandidates]
  std::span<float const> temperature;      ///< per row, the sums' temperature (empty: 1 for each)
  std::span<std::int32_t const> excluded;  ///< ids read as -inf: ascending, no repeats
};

/// A candidate forward's result, on the host: row r's candidates are [r * k, (r + 1) * k).
struct LogitCandidates {
  int k = 0;
  std::int64_t vocab = 0;
  std::vector<std::int32_t> ids;
  std::vector<float> values;
  std::vector<kernels::CandidateStats> stats;
  [[nodiscard]] std::int64_t rows() const { return static_cast<std::int64_t>(stats.size()); }
  [[nodiscard]] std::span<std::int32_t const> ids_of(std::int64_t r) const {
    return std::span(ids).subspan(static_cast<std::size_t>(r * k), static_cast<std::size_t>(k));
  }
  [[nodiscard]] std::span<float const> values_of(std::int64_t r) const {
    return std::span(values).subspan(static_cast<std::size_t>(r * k), static_cast<std::size_t>(k));
  }
};

/// Called with the residual stream [n_tokens, d_model] of the whole batch: index 0 after the
/// embedding, l + 1 after layer l, n_layer + 1 after the final norm.
using HiddenObserver = std::function<void(int index, std::span<float const> hidden)>;

/// The format all of a model's matrices share, or kAny when they differ: what a compiled
/// spec's `weights` field is matched against.
inline WeightFormat uniform_format(ModelWeights const& w) {
  WeightFormat f = w.embed.format;
  w.for_each_matrix([&](std::string const&, WeightView const& v) {
    if (v.format != f) f = WeightFormat::kAny;
  });
  return f;
}

/// @tparam S       the compiled spec; its static fields are the kernels' compile-time shapes
/// @tparam Arch    arch::Cpu, arch::Sm80 or arch::Sm90a
/// @tparam Fusion  which adjacent steps run fused (model/fusion.hpp); the same math either way
template <MoeSpec S = spec::generic, class Arch = arch::Cpu, fusion::FusionVariant Fusion = fusion::Default>
class Model {
  static_assert(valid(S), "Model: the spec is invalid (see why_invalid)");

 public:
  static constexpr MoeSpec spec = S;
  using fusion_variant = Fusion;

  /// @param storage  keeps the bytes behind `weights` alive (mapped files, quantized buffers)
  Model(ModelConfig cfg, ModelWeights weights, std::shared_ptr<void const> storage, ModelOptions opts = {})
      : cfg_(std::move(cfg)), w_(std::move(weights)), storage_(std::move(storage)), opts_(opts) {
    if (!opts_.memory) opts_.memory = host_memory();
    QFLASH_CHECK(opts_.memory->on_device() == Arch::is_cuda, "a ", Arch::name, " model needs ",
                 Arch::is_cuda ? "a CUDA device's memory (runtime/cuda/memory.hpp)" : "host memory",
                 " for its working state");
    scratch_.place_in(opts_.memory.get());
    MemoryAllocator<float> const in_memory(opts_.memory.get());
    for (auto* v : {&h_, &xn_, &mix_, &logits_}) *v = MemoryVector<float>(in_memory);
    positions_ = MemoryVector<std::int64_t>(in_memory);
    tokens_ = MemoryVector<std::int32_t>(in_memory);
    token_policies_ = MemoryVector<kernels::RoutingPolicy>(in_memory);
    temperature_ = candidate_values_ = MemoryVector<float>(in_memory);
    excluded_ = candidate_ids_ = MemoryVector<std::int32_t>(in_memory);
    candidate_stats_ = MemoryVector<kernels::CandidateStats>(in_memory);
    MoeSpec const rt = cfg_.spec(S.kv == KvScheme::kAny ? KvScheme::kBf16 : S.kv, uniform_format(w_));
    QFLASH_CHECK(matches(S, rt), cfg_.source, ": the model ", to_string(rt),
                 " does not match the compiled spec ", to_string(S));
    check_routing(opts_.routing, cfg_.n_expert, cfg_.n_expert_used);
    if (opts_.lora) check_lora(*opts_.lora);
    QFLASH_CHECK(w_.layers.size() == static_cast<std::size_t>(cfg_.n_layer), cfg_.source,
                 ": weights for ", w_.layers.size(), " layers, the config has ", cfg_.n_layer);
    norm_kind_ = cfg_.zero_centered_norms ? kernels::NormWeight::kZeroCentered : kernels::NormWeight::kPlain;
    for (std::size_t l = 0; l < w_.layers.size(); ++l) {
      LayerWeights const& lw = w_.layers[l];
      if (lw.kind == LayerKind::kFullAttention)
        mixers_.emplace_back(std::in_place_type<Attention>, cfg_, lw.attention, l, norm_kind_);
      else
        mixers_.emplace_back(std::in_place_type<DeltaNet>, cfg_, lw.linear, l, opts_.delta);
      moe_.emplace_back(cfg_, lw.moe, l, &opts_.on_route, Arch::is_cuda ? &step_routes_ : nullptr,
                        static_cast<std::int64_t>(l), static_cast<std::int64_t>(w_.layers.size()));
    }
  }
  Model(Model const&) = delete;
  Model& operator=(Model const&) = delete;

  [[nodiscard]] ModelConfig const& config() const { return cfg_; }
  /// Where the model's working state and new sequences' caches live.
  [[nodiscard]] std::shared_ptr<Memory> const& memory() const { return opts_.memory; }
  [[nodiscard]] Routing const& routing() const { return opts_.routing; }
  /// Calls `f` from every MoE layer of later forwards (empty: none).
  void set_route_observer(RouteObserver f) { opts_.on_route = std::move(f); }
  /// Routes every later forward with `r`; checked against the model first.
  void set_routing(Routing const& r) {
    check_routing(r, cfg_.n_expert, cfg_.n_expert_used);
    opts_.routing = r;
  }
  /// Runs every later sequence that brings no adapter with `a` (null: none); checked first.
  void set_lora(std::shared_ptr<LoraAdapter const> a) {
    if (a) check_lora(*a);
    opts_.lora = std::move(a);
  }
  [[nodiscard]] LoraAdapter const* lora() const { return opts_.lora.get(); }
  /// The recorder of this model's steps (ModelOptions::recorder), or null.
  [[nodiscard]] StepRecorder const* recorder() const { return opts_.recorder.get(); }
  /// Throws Error unless `a` fits this model and this instance can run it.
  void check_lora(LoraAdapter const& a) const {
    if constexpr (Arch::is_cuda) {
      QFLASH_CHECK(a.device >= 0, "LoRA adapter '", a.name, "' is in host memory; a ", Arch::name,
                   " model reads adapters uploaded to its device (runtime/cuda/lora.hpp: upload_lora)");
    } else {
      QFLASH_CHECK(a.device < 0, "LoRA adapter '", a.name, "' is on CUDA device ", a.device,
                   "; this model runs on the CPU");
    }
    QFLASH_CHECK(S.weights == WeightFormat::kAny || S.weights == WeightFormat::kF32,
                 "LoRA adapters need an instance compiled for f32 matrices (weights kAny); this one is ",
                 to_string(S.weights), "-only");
    check_adapter(a, w_);
  }
  [[nodiscard]] ModelWeights const& weights() const { return w_; }
  /// A sequence with its own KV pool, every head in `kv` (default: exact f32).
  [[nodiscard]] SequenceState new_sequence(kv::KvFormats kv = {}) const {
    return new_sequence(kv::KvMap::uniform(cfg_, kv));
  }
  /// ... with each head as `map` says (empty: every head f32).
  [[nodiscard]] SequenceState new_sequence(kv::KvMap map) const {
    if (map.n_layer() == 0) map = kv::KvMap::uniform(cfg_, {});
    return SequenceState(cfg_, private_kv_pool(cfg_, std::move(map), opts_.memory));
  }
  /// A sequence whose KV lives in `pool`, which other sequences may share: those decoding
  /// together attend in one call (a pool in this model's memory: kv_pool_for(config(), map,
  /// n, memory())).
  [[nodiscard]] SequenceState new_sequence(std::shared_ptr<kv::KvBlockPool> pool) const {
    QFLASH_CHECK(pool, "new_sequence: no KV pool");
    check_pool_memory(*pool, "new_sequence");
    return SequenceState(cfg_, std::move(pool));
  }

  /// Runs the batch's new tokens, advancing each sequence's state, and writes logits
  /// [rows, vocab]: one row per token (kAllTokens) or per sequence (kLastToken).
  void forward(std::span<SequenceChunk const> seqs, LogitsFor which, std::vector<float>& logits,
               HiddenObserver const& observe = {}) {
    Memory& mem = *opts_.memory;
    begin_step(seqs);
    logits.resize(static_cast<std::size_t>(rows_of(seqs, which) * cfg_.vocab));
    // A device model projects into its memory, then brings the logits to the host.
    float const* const out = step(seqs, which, observe, Arch::is_cuda ? nullptr : logits.data(), nullptr);
    if (out != logits.data()) mem.copy(logits.data(), out, logits.size() * sizeof(float), opts_.stream);
    mem.synchronize(opts_.stream);
    // Garbage in the weights shows here first; the scan costs far less than the lm_head GEMV.
    std::size_t const bad = first_non_finite(logits);
    if (bad != logits.size()) throw_non_finite(static_cast<std::int64_t>(bad) / cfg_.vocab);
    end_step(seqs);
  }

  /// forward, bringing back each logits row's candidates (kernels/token_candidates) instead
  /// of the row; logits_row gives a row in full until the next forward.
  void forward(std::span<SequenceChunk const> seqs, LogitsFor which, CandidateRequest const& req,
               LogitCandidates& out, HiddenObserver const& observe = {}) {
    Memory& mem = *opts_.memory;
    std::int64_t const rows = rows_of(seqs, which);
    QFLASH_CHECK(req.k >= 1 && req.k <= kernels::kMaxTokenCandidates, "forward: ", req.k,
                 " candidates per row; expected 1 to ", kernels::kMaxTokenCandidates);
    QFLASH_CHECK(req.temperature.empty() || static_cast<std::int64_t>(req.temperature.size()) == rows,
                 "forward: ", req.temperature.size(), " temperatures for ", rows, " logits rows");
    for (std::size_t i = 0; i < req.excluded.size(); ++i)
      QFLASH_CHECK(req.excluded[i] >= 0 && req.excluded[i] < cfg_.vocab && (i == 0 || req.excluded[i] > req.excluded[i - 1]),
                   "forward: the excluded token ids must be ascending ids in [0, ", cfg_.vocab, "); id ",
                   req.excluded[i], " at ", i, " is not");
    begin_step(seqs);
    out.k = req.k;
    out.vocab = cfg_.vocab;
    out.ids.resize(static_cast<std::size_t>(rows * req.k));
    out.values.resize(out.ids.size());
    out.stats.resize(static_cast<std::size_t>(rows));
    kernels::TokenCandidatesArgs c{};
    c.rows = rows;
    c.vocab = static_cast<int>(cfg_.vocab);
    c.k = req.k;
    c.n_excluded = static_cast<int>(req.excluded.size());
    if constexpr (Arch::is_cuda) {
      c.temperature = req.temperature.empty() ? nullptr : put(req.temperature, temperature_);
      c.excluded = put(req.excluded, excluded_);
      c.ids = scratch_.sized(candidate_ids_, rows * req.k);
      c.values = scratch_.sized(candidate_values_, rows * req.k);
      c.stats = scratch_.sized(candidate_stats_, rows);
    } else {
      c.temperature = req.temperature.empty() ? nullptr : req.temperature.data();
      c.excluded = req.excluded.data();
      c.ids = out.ids.data();
      c.values = out.values.data();
      c.stats = out.stats.data();
    }
    step(seqs, which, observe, nullptr, &c);
    candidate_rows_ = rows;
    if constexpr (Arch::is_cuda) {
      mem.copy(out.ids.data(), c.ids, out.ids.size() * sizeof(std::int32_t), opts_.stream);
      mem.copy(out.values.data(), c.values, out.values.size() * sizeof(float), opts_.stream);
      mem.copy(out.stats.data(), c.stats, out.stats.size() * sizeof(kernels::CandidateStats), opts_.stream);
    }
    mem.synchronize(opts_.stream);
    for (std::int64_t r = 0; r < rows; ++r)
      if (out.stats[static_cast<std::size_t>(r)].non_finite > 0) throw_non_finite(r);
    end_step(seqs);
  }

  /// Row r of the logits of the last forward that brought back candidates.
  void logits_row(std::int64_t r, std::span<float> out) const {
    std::size_t const vocab = static_cast<std::size_t>(cfg_.vocab);
    QFLASH_CHECK(out.size() == vocab && r >= 0 && r < candidate_rows_, "logits_row: no row ", r, " of ", vocab,
                 " logits from the last forward (", candidate_rows_, " rows of candidates)");
    opts_.memory->copy(out.data(), logits_.data() + static_cast<std::size_t>(r) * vocab, vocab * sizeof(float),
                       opts_.stream);
    opts_.memory->synchronize(opts_.stream);
  }

 private:
  /// Rows of logits a forward of `seqs` computes.
  static std::int64_t rows_of(std::span<SequenceChunk const> seqs, LogitsFor which) {
    if (which == LogitsFor::kLastToken) return static_cast<std::int64_t>(seqs.size());
    std::int64_t n = 0;
    for (auto const& c : seqs) n += static_cast<std::int64_t>(c.tokens.size());
    return n;
  }

  [[noreturn]] static void throw_non_finite(std::int64_t row) {
    QFLASH_FAIL("the logits of batch row ", row,
                " are not finite (NaN or Inf): the model's weights or activations overflowed or hold NaN/Inf "
                "(qflash inspect --check-weights scans the weights)");
  }

  /// A copy of `host` in the device buffer `dev` (one small copy, queued on the stream).
  template <class T>
  T* put(std::span<T const> host, MemoryVector<T>& dev) {
    T* d = scratch_.sized(dev, std::max<std::int64_t>(1, static_cast<std::int64_t>(host.size())));
    if (!host.empty()) opts_.memory->copy(d, host.data(), host.size() * sizeof(T), opts_.stream);
    return d;
  }

  void begin_step(std::span<SequenceChunk const> seqs) {
    candidate_rows_ = 0;
    opts_.memory->activate();
    // Work a failed forward left queued must not race the host's writes below (free otherwise).
    if constexpr (Arch::is_cuda) opts_.memory->synchronize(opts_.stream);
    layout(seqs);
  }

  /// After a step's results are on the host: the route observer, then the sequences advance.
  void end_step(std::span<SequenceChunk const> seqs) {
    for (RouteRecord const& r : step_routes_) opts_.on_route(r);
    for (auto const& c : seqs) c.state->advance(static_cast<std::int64_t>(c.tokens.size()));
  }

  /// Queues the step's device work, from the embedding to the logits (into `host_logits`, or
  /// the model's logits_ when null) and, when `candidates` is given, their candidates; returns
  /// where the logits are.
  float const* step(std::span<SequenceChunk const> seqs, LogitsFor which, HiddenObserver const& observe,
                    float* host_logits, kernels::TokenCandidatesArgs* candidates) {
    Memory& mem = *opts_.memory;
    stream_t const stream = opts_.stream;
    std::int64_t const d = dim<S.d_model>(cfg_.d_model);
    std::int64_t const T = batch_.n_tokens();
    float* h = scratch_.sized(h_, T * d);
    float* xn = scratch_.sized(xn_, T * d);
    float* mix = scratch_.sized(mix_, T * d);
    auto seen = [&](int index, float const* rows) {
      if (!observe) return;
      mem.synchronize(stream);  // the observer reads the rows on the host
      observe(index, {rows, static_cast<std::size_t>(T * d)});
    };

    // Logits of the rows asked for: every row, or each sequence's last (gathered into mix when
    // some sequence has more than one).
    std::int64_t const n_rows = rows_of(seqs, which);
    float* const out_logits = host_logits ? host_logits : scratch_.sized(logits_, n_rows * cfg_.vocab);
    if (candidates) candidates->logits = out_logits;

    // The step's device work, from the embedding to the logits: recorded and launched as one
    // when it has the shape of the step before (scratch sized already) and nothing observes it.
    auto enqueue = [&] {
      step_routes_.clear();
      kernels::EmbeddingArgs e{};
      e.table = w_.embed;
      e.tokens = batch_.on_device.tokens;
      e.y = h;
      e.n_tokens = T;
      check_launch(kernels::launch_embedding<S>(Arch{}, e, stream), "embedding");
      for (std::size_t i = 0; i < seqs.size(); ++i)  // adapters that replace the embedding table
        if (LoraAdapter const* ad = batch_.seq_adapter[i]; ad && ad->embed) {
          e.table = *ad->embed;
          e.tokens = batch_.on_device.tokens + batch_.begin[i];
          e.y = h + batch_.begin[i] * d;
          e.n_tokens = batch_.rows_of(i);
          check_launch(kernels::launch_embedding<S>(Arch{}, e, stream), "embedding (LoRA modules_to_save)");
        }
      seen(0, h);

      // AddInNorm: each residual add (h += mixer, h += moe) is fused into the norm after it.
      // AddInProjection: the mixer's output projection and the experts' combine add into h.
      constexpr bool in_norm = Fusion::add_in_norm;
      float* const out = in_norm ? mix : h;
      for (std::size_t l = 0; l < w_.layers.size(); ++l) {
        LayerWeights const& lw = w_.layers[l];
        if (l == 0 || !in_norm)
          norm(h, nullptr, lw.input_norm, xn, T);
        else
          norm(mix, h, lw.input_norm, xn, T);  // h += moe of layer l - 1; xn = norm(h)
        if (l > 0) seen(static_cast<int>(l), h);
        std::visit([&](auto const& mixer) { mixer.forward(batch_, xn, out, scratch_, stream, !in_norm); }, mixers_[l]);
        norm(in_norm ? mix : h, in_norm ? h : nullptr, lw.post_norm, xn, T);  // (h += mixer;) xn = norm(h)
        moe_[l].forward(batch_, xn, out, scratch_, stream, !in_norm, Fusion::fused_swiglu);
      }
      norm(in_norm ? mix : h, in_norm ? h : nullptr, w_.final_norm, xn, T);
      seen(cfg_.n_layer, h);
      seen(cfg_.n_layer + 1, xn);

      float const* rows = xn;
      if (which == LogitsFor::kLastToken && n_rows != T) {
        for (std::size_t i = 0; i < seqs.size(); ++i)
          mem.copy(mix + static_cast<std::int64_t>(i) * d, xn + (batch_.begin[i + 1] - 1) * d,
                   static_cast<std::size_t>(d) * sizeof(float), stream);
        rows = mix;
      }
      project<S, Arch>(w_.lm_head, rows, n_rows, out_logits, stream, "lm_head");
      for (std::size_t i = 0; i < seqs.size(); ++i)  // adapters that replace lm_head: their rows again
        if (LoraAdapter const* ad = batch_.seq_adapter[i]; ad && ad->lm_head) {
          bool const all = which == LogitsFor::kAllTokens;
          std::int64_t const r0 = all ? batch_.begin[i] : static_cast<std::int64_t>(i);
          project<S, Arch>(*ad->lm_head, rows + r0 * d, all ? batch_.rows_of(i) : 1, out_logits + r0 * cfg_.vocab,
                           stream, "lm_head (LoRA modules_to_save)");
        }
      if (candidates)
        check_launch(kernels::launch_token_candidates<S>(Arch{}, *candidates, stream), "token_candidates");
    };
    StepShape const shape{T, static_cast<std::int64_t>(seqs.size()), which, candidates ? candidates->k : 0,
                          candidates ? candidates->n_excluded : 0, candidates && candidates->temperature};
    // A device model's route observer runs after the step (step_routes_), so it records too.
    bool const recordable = opts_.recorder && !observe && (Arch::is_cuda || !opts_.on_route) && shape == last_shape_;
    last_shape_ = shape;
    if (!recordable || !opts_.recorder->run(stream, enqueue)) enqueue();
    return out_logits;
  }

  /// Throws Error, naming `who`, unless this model can read KV in `pool`'s memory: its own
  /// device memory for a CUDA model, host memory for a CPU one.
  void check_pool_memory(kv::KvBlockPool const& pool, char const* who) const {
    if constexpr (Arch::is_cuda)
      QFLASH_CHECK(pool.memory() == opts_.memory, who, ": a sequence's KV pool is not in this ", Arch::name,
                   " model's device memory (make sequences with the model's new_sequence, or pools with its "
                   "memory())");
    else
      QFLASH_CHECK(!pool.memory()->on_device(), who,
                   ": a sequence's KV pool is in a device's memory; this model runs on the CPU");
  }

  using Attention = GatedAttention<S, Arch>;
  using DeltaNet = GatedDeltaNet<S, Arch>;

  void layout(std::span<SequenceChunk const> seqs) {
    batch_.seqs = seqs;
    batch_.begin.assign(1, 0);
    batch_.positions.clear();
    batch_.tokens.clear();
    layout_routing(seqs);
    layout_adapters(seqs);
    for (auto const& c : seqs) {
      QFLASH_CHECK(c.state, "forward: a batch entry has no sequence state");
      check_pool_memory(c.state->pool(), "forward");
      QFLASH_CHECK(!c.tokens.empty(), "forward: a batch entry has no tokens");
      QFLASH_CHECK(c.state->n_past() + static_cast<std::int64_t>(c.tokens.size()) <= c.state->max_positions(),
                   "sequence of ", c.state->n_past() + c.tokens.size(),
                   " tokens exceeds max_position_embeddings ", c.state->max_positions());
      if constexpr (S.kv != KvScheme::kAny && S.kv != KvScheme::kMixed)
        QFLASH_CHECK(c.state->pool().layout().map().scheme() == S.kv, "this model instance is compiled for ",
                     to_string(S.kv), " KV only; the sequence's KV pool holds ",
                     to_string(c.state->pool().layout().map().scheme()));
      c.state->reserve(c.state->n_past() + static_cast<std::int64_t>(c.tokens.size()));
      for (std::size_t t = 0; t < c.tokens.size(); ++t) {
        QFLASH_CHECK(c.tokens[t] >= 0 && c.tokens[t] < cfg_.vocab, "token id ", c.tokens[t],
                     " is outside the vocabulary [0, ", cfg_.vocab, ")");
        batch_.positions.push_back(c.state->n_past() + static_cast<std::int64_t>(t));
        batch_.tokens.push_back(c.tokens[t]);
      }
      batch_.begin.push_back(static_cast<std::int64_t>(batch_.tokens.size()));
    }
    publish_batch();
  }

  /// Points the kernels at the batch's arrays: the host's (a CPU model), or copies in device
  /// memory (one small copy each, where writing managed memory would fault pages over).
  void publish_batch() {
    Batch::KernelArrays& k = batch_.on_device;
    bool const policies = !batch_.token_policies.empty();
    if constexpr (!Arch::is_cuda) {
      k = {batch_.positions.data(), batch_.tokens.data(), policies ? batch_.token_policies.data() : nullptr};
    } else {
      k.positions = put(std::span<std::int64_t const>(batch_.positions), positions_);
      k.tokens = put(std::span<std::int32_t const>(batch_.tokens), tokens_);
      k.token_policies = policies ? put(std::span<kernels::RoutingPolicy const>(batch_.token_policies), token_policies_)
                                  : nullptr;
    }
  }

  /// The batch's routing: the model's for every token, or, when a sequence brings its own,
  /// each token its sequence's policy in the widest sequence's route slots.
  void layout_routing(std::span<SequenceChunk const> seqs) {
    int const model_k = cfg_.n_expert_used;
    batch_.route_slots = opts_.routing.slots(model_k);
    batch_.policy = opts_.routing.policy;
    batch_.token_policies.clear();
    bool const own = std::any_of(seqs.begin(), seqs.end(),
                                 [&](SequenceChunk const& c) { return c.routing && *c.routing != opts_.routing; });
    if (!own) return;
    for (auto const& c : seqs) {
      Routing const& r = c.routing ? *c.routing : opts_.routing;
      check_routing(r, cfg_.n_expert, model_k);
      batch_.route_slots = std::max(batch_.route_slots, r.slots(model_k));
    }
    for (auto const& c : seqs) {
      Routing const& r = c.routing ? *c.routing : opts_.routing;
      kernels::RoutingPolicy p = r.policy;
      p.k_max = r.slots(model_k);  // within the batch's wider slots
      batch_.token_policies.insert(batch_.token_policies.end(), c.tokens.size(), p);
    }
  }

  /// Each sequence's adapter (its own, else the model's) and the runs of rows sharing one.
  void layout_adapters(std::span<SequenceChunk const> seqs) {
    batch_.seq_adapter.clear();
    batch_.adapter_runs.clear();
    std::int64_t row = 0;
    for (auto const& c : seqs) {
      LoraAdapter const* ad = c.adapter ? c.adapter : opts_.lora.get();
      if constexpr (Arch::is_cuda)
        QFLASH_CHECK(!ad || ad->device >= 0, "forward: LoRA adapter '", ad->name, "' is in host memory; a ",
                     Arch::name, " model reads adapters uploaded to its device (upload_lora)");
      batch_.seq_adapter.push_back(ad);
      std::int64_t const n = static_cast<std::int64_t>(c.tokens.size());
      if (ad && !batch_.adapter_runs.empty() && batch_.adapter_runs.back().adapter == ad &&
          batch_.adapter_runs.back().end == row)
        batch_.adapter_runs.back().end += n;
      else if (ad)
        batch_.adapter_runs.push_back({row, row + n, ad});
      row += n;
    }
  }

  /// y = RMSNorm(x + residual) with the family's weight kind; residual += x when given.
  void norm(float const* x, float* residual, FloatView weight, float* y,
            std::int64_t rows) const {
    kernels::AddRmsNormArgs a{};
    a.x = x;
    a.residual = residual;
    a.weight = weight.data();
    a.y = y;
    a.n_rows = rows;
    a.n_cols = static_cast<int>(weight.size());
    a.eps = cfg_.rms_norm_eps;
    a.weight_kind = norm_kind_;
    check_launch(kernels::launch_add_rmsnorm<S>(Arch{}, a, opts_.stream), "add_rmsnorm");
  }

  ModelConfig cfg_;
  ModelWeights w_;
  std::shared_ptr<void const> storage_;
  ModelOptions opts_;
  kernels::NormWeight norm_kind_ = kernels::NormWeight::kPlain;
  std::vector<std::variant<Attention, DeltaNet>> mixers_;
  std::vector<MoeBlock<S, Arch>> moe_;

  /// What decides a step's launches besides its data: a step of the shape of the one before
  /// reuses the scratch sized by it.
  struct StepShape {
    std::int64_t n_tokens = -1, n_seqs = 0;
    LogitsFor which = LogitsFor::kAllTokens;
    int candidates = 0, excluded = 0;  ///< the candidates' k and excluded ids (0: none asked)
    bool temperatures = false;
    bool operator==(StepShape const&) const = default;
  };

  // Per-call state, reused across calls.
  StepShape last_shape_;
  std::vector<RouteRecord> step_routes_;  ///< a device model's routing in the step, for on_route after it
  Batch batch_;
  Scratch scratch_;
  MemoryVector<float> h_, xn_, mix_, logits_;
  // A CUDA model's copies of the batch's arrays.
  MemoryVector<std::int64_t> positions_;
  MemoryVector<std::int32_t> tokens_;
  MemoryVector<kernels::RoutingPolicy> token_policies_;
  std::int64_t candidate_rows_ = 0;  ///< logits rows of the last forward, when it brought back candidates
  // A CUDA model's candidate requests and results.
  MemoryVector<float> temperature_, candidate_values_;
  MemoryVector<std::int32_t> excluded_, candidate_ids_;
  MemoryVector<kernels::CandidateStats> candidate_stats_;
};

}  // namespace qflash::model
