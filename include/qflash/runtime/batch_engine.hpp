/// @file
/// The batch engine: runtime/engine.hpp's Engine over a compiled Model<S, Arch>, one thread
/// running steps. A step
///  1. drops cancelled requests (their blocks go back at once);
///  2. schedules: every running sequence's next token (decode) or next prompt chunk, oldest
///     first, then waiting sequences in priority order while max_num_seqs and the token budget
///     allow; a sequence that needs a block when the pool has none preempts the newest running
///     one, whose blocks are freed and whose tokens are recomputed when it is admitted again;
///  3. runs one ragged forward over all of them;
///  4. registers newly full blocks with the prefix cache (and, for hybrid models, snapshots the
///     Gated DeltaNet states at chosen block boundaries), samples each sequence whose input is
///     all computed, and streams the text.
/// A request's n choices share the prompt: the first is prefilled, the others fork its state.
/// Admission resumes from the longest cached prefix (for hybrid models: the deepest cached block
/// with a state snapshot), always leaving the prompt's last token to compute.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <fstream>
#include <functional>
#include <limits>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "qflash/core/log.hpp"
#include "qflash/core/parallel.hpp"
#include "qflash/io/tokenizer.hpp"
#include "qflash/kv/block_pool.hpp"
#include "qflash/kv/prefix_cache.hpp"
#include "qflash/model/model.hpp"
#include "qflash/runtime/dispatch.hpp"
#include "qflash/runtime/engine.hpp"
#include "qflash/runtime/generate.hpp"
#include "qflash/runtime/load_model.hpp"
#include "qflash/runtime/memory_plan.hpp"
#include "qflash/runtime/metrics.hpp"
#include "qflash/runtime/sampler.hpp"

namespace qflash::runtime {

namespace detail {

/// Mean of the last `capacity` observations.
class WindowMean {
 public:
  explicit WindowMean(std::size_t capacity = 1024) : values_(capacity, 0.0) {}
  void add(double v) {
    sum_ += v - values_[next_];
    values_[next_] = v;
    next_ = (next_ + 1) % values_.size();
    n_ = std::min(n_ + 1, values_.size());
  }
  [[nodiscard]] double mean() const { return n_ ? sum_ / static_cast<double>(n_) : 0.0; }

 private:
  std::vector<double> values_;
  std::size_t next_ = 0, n_ = 0;
  double sum_ = 0;
};

}  // namespace detail

/// Builds the engine's model from the loaded one and the engine's model options (make_model
/// on the CPU; runtime/cuda/engine.hpp's make_cuda_model on a device).
template <MoeSpec S, class Arch>
using ModelMaker = std::function<std::unique_ptr<model::Model<S, Arch>>(LoadedModel, model::ModelOptions const&)>;

template <MoeSpec S, class Arch = arch::Cpu>
class BatchEngine final : public Engine {
 public:
  /// Takes the loaded model and builds it with `make`; `info`'s spec fields are the caller's
  /// (make_engine_as).
  BatchEngine(LoadedModel loaded, io::Tokenizer tokenizer, EngineOptions opts, EngineInfo info,
              ModelMaker<S, Arch> const& make)
      : tok_(std::move(tokenizer)), opts_(std::move(opts)), info_(std::move(info)) {
    model::ModelOptions mo;
    mo.on_route = [this](model::RouteRecord const& r) { observe_routes(r); };
    mo.routing = opts_.routing;
    model_ = make(std::move(loaded), mo);
    info_.arch = Arch::name;
    cfg_ = &model_->config();
    check_tokenizer_fits(tok_, *cfg_);
    QFLASH_CHECK(opts_.max_num_seqs >= 1, "max_num_seqs must be >= 1, got ", opts_.max_num_seqs);
    QFLASH_CHECK(opts_.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1, got ",
                 opts_.max_num_batched_tokens);
    QFLASH_CHECK(opts_.max_queue >= 1, "max_queue must be >= 1, got ", opts_.max_queue);
    QFLASH_CHECK(opts_.sampling_candidates == 0 || (opts_.sampling_candidates >= kMaxTopLogprobs &&
                                                    opts_.sampling_candidates <= kernels::kMaxTokenCandidates),
                 "sampling_candidates must be 0 (whole rows) or in [", kMaxTopLogprobs, ", ",
                 kernels::kMaxTokenCandidates, "], got ", opts_.sampling_candidates);
    QFLASH_CHECK(opts_.max_context >= 0 && opts_.max_context <= cfg_->max_position_embeddings,
                 "max_context must be in [0, ", cfg_->max_position_embeddings, "] (0: the model's), got ",
                 opts_.max_context);
    max_context_ = opts_.max_context > 0 ? opts_.max_context : cfg_->max_position_embeddings;

    kv::KvMap map = opts_.kv.n_layer() == 0 ? kv::KvMap::uniform(*cfg_, {}) : opts_.kv;
    kv::KvLayout layout(*cfg_, std::move(map));
    hybrid_ = std::any_of(cfg_->layer_types.begin(), cfg_->layer_types.end(),
                          [](model::LayerKind k) { return k == model::LayerKind::kLinearAttention; });
    std::int64_t const per_block = std::max<std::int64_t>(1, layout.block_bytes());
    std::int64_t const blocks_per_seq = (max_context_ + layout.block_tokens() - 1) / layout.block_tokens();
    // Hybrid models keep a share of the budget for DeltaNet state snapshots; the default budget
    // holds max_num_seqs full contexts besides that share, so that one sequence reaches
    // max_context unless the host's 1 GiB or the device's memory caps the budget.
    double const snapshot_share = hybrid_ && opts_.prefix.enabled ? opts_.prefix.snapshot_share : 0.0;
    QFLASH_CHECK(snapshot_share >= 0.0 && snapshot_share < 1.0, "snapshot_share must be in [0, 1), got ",
                 snapshot_share);
    double const full_contexts = static_cast<double>(opts_.max_num_seqs * blocks_per_seq * per_block);
    std::int64_t const budget = kv_budget(static_cast<std::int64_t>(std::ceil(full_contexts / (1.0 - snapshot_share))));
    info_.kv_cache_bytes = budget;
    auto const snapshot_bytes = static_cast<std::int64_t>(static_cast<double>(budget) * snapshot_share);
    std::int64_t const blocks = (budget - snapshot_bytes) / per_block;
    QFLASH_CHECK(blocks >= 1, "the KV cache budget of ", budget, " bytes holds no block of ", per_block,
                 " bytes; give it more memory");
    QFLASH_CHECK(blocks <= kv::KvBlockPool::kMaxBlocks, "the KV cache budget of ", budget, " bytes is ", blocks,
                 " blocks of ", per_block, " bytes, more than the pool's ", kv::KvBlockPool::kMaxBlocks,
                 "; give it at most ",
                 static_cast<std::int64_t>(static_cast<double>(kv::KvBlockPool::kMaxBlocks * per_block) /
                                           (1.0 - snapshot_share)),
                 " bytes");
    pool_ = std::make_shared<kv::KvBlockPool>(std::move(layout), blocks, kv::KvBlockPool::Allocation::kOnDemand,
                                              model_->memory());
    if (opts_.prefix.enabled) {
      kv::PrefixCache::Options co;
      co.eviction = opts_.prefix.eviction;
      co.min_age = std::chrono::duration<double>(opts_.prefix.min_age_seconds);
      co.snapshot_bytes = snapshot_bytes;
      cache_ = std::make_unique<kv::PrefixCache>(*pool_, co);
    }
    for (std::int32_t id = 0; id < cfg_->vocab; ++id)
      if (!tok_.has(id) && std::find(cfg_->eos_token_ids.begin(), cfg_->eos_token_ids.end(), id) ==
                               cfg_->eos_token_ids.end())
        untokenizable_.push_back(id);
    metrics_.router_entropy.resize(cfg_->layer_types.size());
    metrics_.expert_load.assign(static_cast<std::size_t>(cfg_->n_expert), 0);
    if (!opts_.router_log_path.empty()) {
      router_log_.open(opts_.router_log_path, std::ios::out | std::ios::trunc);
      QFLASH_CHECK(router_log_.good(), opts_.router_log_path, ": cannot open the router decision log for writing");
    }
    info_.max_context = max_context_;
    info_.n_expert = cfg_->n_expert;
    info_.n_expert_used = cfg_->n_expert_used;
    for (auto const& a : opts_.adapters) {
      QFLASH_CHECK(a, "EngineOptions::adapters holds a null adapter");
      model::check_adapter_name(a->name);
      QFLASH_CHECK(!adapters_.contains(a->name), "two LoRA adapters are called '", a->name, "'");
      model_->check_lora(*a);
      adapters_.emplace(a->name, a);
      info_.adapters.push_back(a->name);
    }
    if (!opts_.default_lora.empty()) {
      QFLASH_CHECK(adapters_.contains(opts_.default_lora), "default LoRA adapter '", opts_.default_lora,
                   "' is not one of the engine's adapters");
      model_->set_lora(adapters_.at(opts_.default_lora));
    }
    info_.prefix_cache = cache_ != nullptr;
    info_.compressed_kv = pool_->layout().map().compressed();
    info_.eos_ids.assign(cfg_->eos_token_ids.begin(), cfg_->eos_token_ids.end());
    info_.default_sampling = default_sampling(*cfg_);
    worker_ = std::thread([this] { loop(); });
  }

  ~BatchEngine() override {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    worker_.join();
  }

  std::shared_ptr<RequestStream> submit(GenerationRequest r) override {
    validate_request(r);
    auto req = std::make_unique<Request>();
    req->stream = std::make_shared<RequestStream>();
    req->timing.arrival = Clock::now();
    req->params = std::move(r);
    auto stream = req->stream;
    {
      std::lock_guard lock(mutex_);
      if (draining_ || stop_) QFLASH_REQUEST_FAIL(RequestErrorKind::kDraining, "the server is shutting down");
      if (static_cast<std::int64_t>(incoming_.size()) + waiting_requests_ >= opts_.max_queue)
        QFLASH_REQUEST_FAIL(RequestErrorKind::kQueueFull, "too many requests are waiting (", opts_.max_queue,
                            "); retry later");
      incoming_.push_back(std::move(req));
    }
    wake_.notify_all();
    return stream;
  }

  [[nodiscard]] io::Tokenizer const& tokenizer() const override { return tok_; }
  [[nodiscard]] model::ModelConfig const& config() const override { return *cfg_; }
  [[nodiscard]] EngineInfo info() const override { return info_; }

  void drain() override {
    std::unique_lock lock(mutex_);
    draining_ = true;
    idle_.wait(lock, [&] { return incoming_.empty() && !busy_; });
  }

  void write_metrics(std::string& out) const override {
    std::lock_guard lock(metrics_mutex_);
    Metrics const& m = metrics_;
    prom::single(out, "qflash:num_requests_running", "Sequences (request choices) running.", "gauge", m.running);
    prom::single(out, "qflash:num_requests_waiting", "Sequences (request choices) waiting to run.", "gauge",
                 m.waiting);
    m.ttft.write(out, "qflash:time_to_first_token_seconds", "Time from arrival to the first generated token.");
    m.itl.write(out, "qflash:inter_token_latency_seconds", "Time between consecutive tokens of a choice.");
    m.e2e.write(out, "qflash:e2e_request_latency_seconds", "Time from arrival to the request's end.");
    m.queue.write(out, "qflash:request_queue_time_seconds", "Time from arrival to first running.");
    m.seq_wait.write(out, "qflash:seq_group_waiting_time_seconds",
                     "Time sequences spend waiting each time they wait (preempted ones again).");
    prom::single(out, "qflash:prompt_tokens_total", "Prompt tokens of finished and running requests.", "counter",
                 static_cast<double>(m.prompt_tokens));
    prom::single(out, "qflash:generation_tokens_total", "Generated tokens.", "counter",
                 static_cast<double>(m.generation_tokens));
    prom::single(out, "qflash:prefill_tokens_total", "Tokens computed as prompt chunks.", "counter",
                 static_cast<double>(m.prefill_tokens));
    prom::single(out, "qflash:decode_tokens_total", "Tokens computed one per sequence and step.", "counter",
                 static_cast<double>(m.decode_tokens));
    prom::single(out, "qflash:prefill_decode_ratio", "Prefill over decode tokens in the last 256 steps.", "gauge",
                 m.decode_window.mean() > 0 ? m.prefill_window.mean() / m.decode_window.mean() : 0.0);
    prom::single(out, "qflash:sampling_full_row_draws_total",
                 "Tokens drawn from their whole logits row, where the row's best tokens did not decide.", "counter",
                 static_cast<double>(m.full_row_draws));
    prom::single(out, "qflash:num_preemptions_total", "Sequences preempted for want of KV blocks.", "counter",
                 static_cast<double>(m.preemptions));
    prom::single(out, "qflash:requests_finished_total", "Requests that ended.", "counter",
                 static_cast<double>(m.finished));
    prom::single(out, "qflash:kv_cache_usage_perc", "Fraction of KV blocks referenced by sequences.", "gauge",
                 m.kv_usage);
    prom::header(out, "qflash:kv_cache_blocks", "KV blocks by state.", "gauge");
    prom::sample(out, "qflash:kv_cache_blocks", static_cast<double>(m.blocks_used), "state=\"used\"");
    prom::sample(out, "qflash:kv_cache_blocks", static_cast<double>(m.blocks_cached), "state=\"cached\"");
    prom::sample(out, "qflash:kv_cache_blocks", static_cast<double>(m.blocks_free), "state=\"free\"");
    prom::single(out, "qflash:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", "counter",
                 static_cast<double>(m.prefix_queries));
    prom::single(out, "qflash:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", "counter",
                 static_cast<double>(m.prefix_hits));
    prom::single(out, "qflash:kv_shared_hit_rate", "Prefix cache hits over queries (tokens) since start.", "gauge",
                 m.prefix_queries ? static_cast<double>(m.prefix_hits) / static_cast<double>(m.prefix_queries) : 0.0);
    prom::single(out, "qflash:deltanet_snapshot_hits_total",
                 "Admissions that resumed from a cached Gated DeltaNet state.", "counter",
                 static_cast<double>(m.snapshot_hits));
    prom::single(out, "qflash:deltanet_snapshot_bytes", "Bytes of cached Gated DeltaNet state snapshots.", "gauge",
                 static_cast<double>(m.snapshot_bytes));
    prom::single(out, "qflash:tokens_per_second", "Tokens computed per second over the last 64 steps.", "gauge",
                 m.step_seconds.mean() > 0 ? m.step_tokens.mean() / m.step_seconds.mean() : 0.0);
    prom::header(out, "qflash:router_entropy", "Mean entropy (nats) of the routing distribution, last 1024 tokens.",
                 "gauge");
    for (std::size_t l = 0; l < m.router_entropy.size(); ++l)
      if (cfg_->is_moe_layer(static_cast<int>(l)))
        prom::sample(out, "qflash:router_entropy", m.router_entropy[l].mean(), "layer=\"" + std::to_string(l) + "\"");
    prom::header(out, "qflash:expert_load_total", "Tokens routed to each expert, summed over layers.", "counter");
    for (std::size_t e = 0; e < m.expert_load.size(); ++e)
      prom::sample(out, "qflash:expert_load_total", static_cast<double>(m.expert_load[e]),
                   "expert=\"" + std::to_string(e) + "\"");
    prom::single(out, "qflash:experts_per_token", "Mean routed experts per token and MoE layer, last 1024.", "gauge",
                 m.experts_per_token.mean());
  }

 private:
  using Clock = std::chrono::steady_clock;

  struct Sequence;
  struct Request {
    GenerationRequest params;
    std::shared_ptr<RequestStream> stream;
    RequestTiming timing;
    RequestUsage usage;
    std::vector<std::unique_ptr<Sequence>> choices;
    int open = 0;            ///< choices not finished
    bool forked = false;     ///< choices 1..n-1 exist
    bool counted_waiting = true;  ///< counts against max_queue (leave_queue)
  };

  struct Sequence {
    Request* req = nullptr;
    int choice = 0;
    std::vector<std::int32_t> tokens;  ///< prompt, then generated
    std::int64_t n_prompt = 0;
    std::optional<model::SequenceState> state;  ///< while admitted
    std::int64_t computed = 0;                  ///< tokens in the state
    std::vector<kv::BlockHash> hashes;          ///< of the state's first blocks, as cached
    std::optional<Sampler> sampler;
    std::optional<io::StreamDecoder> decoder;
    std::string text;         ///< generated text, cut at a stop string
    std::size_t emitted = 0;  ///< bytes of text already streamed
    int generated = 0;
    Clock::time_point waiting_since{}, last_token{};
    bool done = false;
  };

  /// What a step runs for one sequence.
  struct Scheduled {
    Sequence* seq;
    std::int64_t n;  ///< tokens from seq->computed
  };

  struct Metrics {
    double running = 0, waiting = 0, kv_usage = 0;
    std::int64_t blocks_used = 0, blocks_cached = 0, blocks_free = 0;
    prom::Histogram ttft{prom::latency_buckets()}, itl{prom::latency_buckets()}, e2e{prom::latency_buckets()},
        queue{prom::latency_buckets()}, seq_wait{prom::latency_buckets()};
    std::int64_t prompt_tokens = 0, generation_tokens = 0, prefill_tokens = 0, decode_tokens = 0;
    std::int64_t full_row_draws = 0;
    std::int64_t preemptions = 0, finished = 0;
    std::int64_t prefix_queries = 0, prefix_hits = 0, snapshot_hits = 0, snapshot_bytes = 0;
    detail::WindowMean prefill_window{256}, decode_window{256}, step_tokens{64}, step_seconds{64};
    std::vector<detail::WindowMean> router_entropy;  ///< per layer
    std::vector<std::int64_t> expert_load;
    detail::WindowMean experts_per_token{1024};  ///< routed experts per token-layer (dynamic routing)
  };

  // ---- memory ---------------------------------------------------------------------------

  /// Bytes for the KV pool and state snapshots: kv_cache_bytes when given; else
  /// `full_contexts` (max_num_seqs full contexts and the snapshots' share), at most 1 GiB on the
  /// host, and on a device at most what its memory utilization leaves (all of that when
  /// gpu_memory_utilization is given).
  std::int64_t kv_budget(std::int64_t full_contexts) {
    double const util = opts_.gpu_memory_utilization;
    std::optional<Memory::DeviceUse> const use = model_->memory()->device_use();
    QFLASH_CHECK(util == 0 || use, "gpu_memory_utilization applies to a model on a GPU; this one runs on the ",
                 Arch::name, " (give kv_cache_bytes)");
    QFLASH_CHECK(util == 0 || opts_.kv_cache_bytes == 0, "give kv_cache_bytes or gpu_memory_utilization, not both");
    if (!use) return opts_.kv_cache_bytes > 0 ? opts_.kv_cache_bytes : std::min(std::int64_t{1} << 30, full_contexts);
    std::int64_t const within = kv_bytes_within(util > 0 ? util : kDefaultGpuMemoryUtilization, *use,
                                                device_step_reserve(*cfg_, opts_.max_num_batched_tokens));
    if (opts_.kv_cache_bytes > 0) {
      if (opts_.kv_cache_bytes > within)
        QFLASH_LOG_WARN("the KV cache's ", opts_.kv_cache_bytes, " bytes are more than the device has left (",
                        within, "): once they are used, its memory pages out to the host and steps slow down");
      return opts_.kv_cache_bytes;
    }
    return util > 0 ? within : std::min(full_contexts, within);
  }

  // ---- requests -------------------------------------------------------------------------

  void validate_request(GenerationRequest const& r) const {
    auto invalid = [](auto const&... parts) { QFLASH_REQUEST_FAIL(RequestErrorKind::kInvalid, parts...); };
    if (r.prompt.empty()) invalid("the prompt has no tokens");
    for (std::int32_t t : r.prompt)
      if (t < 0 || t >= cfg_->vocab) invalid("prompt token id ", t, " is outside the vocabulary [0, ", cfg_->vocab, ")");
    if (static_cast<std::int64_t>(r.prompt.size()) >= max_context_)
      invalid("the prompt has ", r.prompt.size(), " tokens, which leaves no room to generate in a context of ",
              max_context_, " tokens");
    if (pool_->blocks_for(static_cast<std::int64_t>(r.prompt.size()) + 1) > pool_->capacity())
      invalid("the prompt has ", r.prompt.size(), " tokens; the KV cache holds ",
              pool_->capacity() * pool_->layout().block_tokens(), " positions in all (give it more memory)");
    if (r.n < 1 || r.n > 128) invalid("n must be in [1, 128], got ", r.n);
    if (r.max_tokens < 1) invalid("max_tokens must be >= 1, got ", r.max_tokens);
    if (r.top_logprobs < -1 || r.top_logprobs > kMaxTopLogprobs)
      invalid("top_logprobs must be in [0, ", kMaxTopLogprobs, "], got ", r.top_logprobs);
    if (!(std::fabs(r.frequency_penalty) <= 2)) invalid("frequency_penalty must be in [-2, 2], got ", r.frequency_penalty);
    if (!(std::fabs(r.presence_penalty) <= 2)) invalid("presence_penalty must be in [-2, 2], got ", r.presence_penalty);
    for (auto const& s : r.stop)
      if (s.empty()) invalid("a stop string is empty");
    for (std::int32_t t : r.stop_token_ids)
      if (t < 0 || t >= cfg_->vocab) invalid("stop token id ", t, " is outside the vocabulary [0, ", cfg_->vocab, ")");
    try {
      validate(r.sampling);
      if (r.routing) model::check_routing(*r.routing, cfg_->n_expert, cfg_->n_expert_used);
      for (std::size_t i = 0; i < r.snapshot_hints.size(); ++i)
        if (r.snapshot_hints[i] <= 0 || static_cast<std::size_t>(r.snapshot_hints[i]) >= r.prompt.size() ||
            (i > 0 && r.snapshot_hints[i] <= r.snapshot_hints[i - 1]))
          invalid("snapshot_hints must ascend within (0, ", r.prompt.size(), "), got ", r.snapshot_hints[i]);
      if (!r.lora.empty() && !adapters_.contains(r.lora))
        invalid("unknown LoRA adapter '", r.lora, "' (loaded: ", adapters_.empty() ? "none" : names(info_.adapters), ")");
    } catch (Error const& e) {
      invalid(e.what());
    }
  }

  /// The prefix cache's salt for s: its routing when that differs from the engine's (KV
  /// computed under other routing is other KV), then its cache_salt. Routing text never holds
  /// a newline and the salt's length is spelled out, so no two (routing, salt) pairs meet.
  [[nodiscard]] std::string prefix_salt(Sequence const& s) const {
    auto const& p = s.req->params;
    std::string const routing = p.routing && *p.routing != opts_.routing ? model::to_string(*p.routing) : "";
    model::LoraAdapter const* ad = adapter_of(p);
    return routing + "\n" + (ad ? ad->name : "") + "\n" + std::to_string(p.cache_salt.size()) + ":" + p.cache_salt;
  }

  /// The adapter a request runs with: the one it names, else the engine's default (null: none).
  [[nodiscard]] model::LoraAdapter const* adapter_of(GenerationRequest const& p) const {
    if (p.lora.empty()) return model_->lora();
    auto it = adapters_.find(p.lora);
    return it == adapters_.end() ? nullptr : it->second.get();
  }
  static std::string names(std::vector<std::string> const& v) {
    std::string out;
    for (auto const& n : v) out += (out.empty() ? "" : ", ") + n;
    return out;
  }

  /// A choice's sequence before it runs.
  std::unique_ptr<Sequence> new_sequence(Request& req, int choice) {
    auto s = std::make_unique<Sequence>();
    s->req = &req;
    s->choice = choice;
    s->tokens = req.params.prompt;
    s->n_prompt = static_cast<std::int64_t>(s->tokens.size());
    SamplingParams sp = req.params.sampling;
    sp.seed += static_cast<std::uint64_t>(choice);
    s->sampler.emplace(sp);
    s->decoder.emplace(tok_);
    s->waiting_since = Clock::now();
    return s;
  }

  // ---- the engine thread ------------------------------------------------------------------

  void loop() {
    for (;;) {
      {
        std::unique_lock lock(mutex_);
        busy_ = !waiting_.empty() || !running_.empty();
        if (!busy_ && incoming_.empty()) idle_.notify_all();
        wake_.wait(lock, [&] { return stop_ || !incoming_.empty() || busy_; });
        if (stop_) break;
        for (auto& r : incoming_) {
          Request& req = *r;
          req.open = req.params.n;
          req.choices.push_back(new_sequence(req, 0));
          enqueue(req.choices[0].get(), /*front=*/false);
          requests_.push_back(std::move(r));
          ++waiting_requests_;
        }
        incoming_.clear();
      }
      try {
        step();
      } catch (std::exception const& e) {  // a bug: fail everything rather than hang clients
        QFLASH_LOG_WARN("engine step failed: ", e.what());
        for (auto& r : requests_) fail(*r, std::string("the engine failed: ") + e.what());
        reap();
      }
    }
    for (auto& r : requests_) fail(*r, "the engine stopped");
    std::lock_guard lock(mutex_);
    for (auto& r : incoming_) r->stream->fail("the engine stopped", {}, r->timing);
  }

  void step() {
    auto const t0 = Clock::now();
    drop_cancelled();
    schedule();
    if (!batch_.empty()) {
      chunks_.clear();
      for (Scheduled const& b : batch_)
        chunks_.push_back({std::span<std::int32_t const>(b.seq->tokens).subspan(static_cast<std::size_t>(b.seq->computed),
                                                                             static_cast<std::size_t>(b.n)),
                           &*b.seq->state, b.seq->req->params.routing ? &*b.seq->req->params.routing : nullptr,
                           adapter_of(b.seq->req->params)});
      temperatures_.clear();
      for (Scheduled const& b : batch_) temperatures_.push_back(b.seq->sampler->params().temperature);
      // Candidates when some draw of the step may be decided by them.
      whole_rows_ = std::none_of(batch_.begin(), batch_.end(), [&](Scheduled const& b) {
        return opts_.sampling_candidates > 0 &&
               b.seq->computed + b.n == static_cast<std::int64_t>(b.seq->tokens.size()) &&
               may_decide_from_candidates(*b.seq);
      });
      try {
        if (!whole_rows_)
          model_->forward(chunks_, model::LogitsFor::kLastToken,
                          model::CandidateRequest{opts_.sampling_candidates, temperatures_, untokenizable_},
                          candidates_);
        else
          model_->forward(chunks_, model::LogitsFor::kLastToken, full_logits_);
      } catch (std::exception const& e) {
        std::vector<Request*> hit;
        for (Scheduled const& b : batch_) hit.push_back(b.seq->req);
        for (Request* r : hit) fail(*r, std::string("the model failed on this request: ") + e.what());
        reap();
        return;
      }
      // Counted before any event of the step is sent: a client that reads /metrics after its
      // response ends finds its tokens there.
      std::int64_t prefill = 0, decode = 0;
      for (Scheduled const& b : batch_) (b.seq->computed >= b.seq->n_prompt ? decode : prefill) += b.n;
      {
        std::lock_guard lock(metrics_mutex_);
        metrics_.prefill_tokens += prefill;
        metrics_.decode_tokens += decode;
        metrics_.prefill_window.add(static_cast<double>(prefill));
        metrics_.decode_window.add(static_cast<double>(decode));
        metrics_.step_tokens.add(static_cast<double>(prefill + decode));
      }
      draws_.clear();
      for (std::size_t i = 0; i < batch_.size(); ++i) {
        Sequence& s = *batch_[i].seq;
        s.computed += batch_[i].n;
        cache_blocks(s);
        if (s.computed == static_cast<std::int64_t>(s.tokens.size()))
          add_draws(s, static_cast<std::int64_t>(i));
      }
      pick_tokens();
      for (Draw& d : draws_) emit_token(d);
      std::lock_guard lock(metrics_mutex_);
      metrics_.step_seconds.add(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    reap();
    update_gauges();
  }

  void drop_cancelled() {
    for (auto& r : requests_)
      if (r->open > 0 && r->stream->cancelled()) {
        for (auto& s : r->choices)
          if (!s->done) retire(*s);
        r->open = 0;
        end(*r);
      }
  }

  // ---- scheduling ---------------------------------------------------------------------------

  void schedule() {
    batch_.clear();
    std::int64_t budget = opts_.max_num_batched_tokens;
    for (std::size_t i = 0; i < running_.size() && budget > 0;) {
      Sequence* s = running_[i];
      std::int64_t const n = make_room(*s, chunk(*s, budget));
      if (n == 0) continue;  // s left running_ (preempted, or ended): running_[i] is the next one
      batch_.push_back({s, n});
      budget -= n;
      ++i;
    }
    while (!waiting_.empty() && budget > 0 && static_cast<int>(running_.size()) < opts_.max_num_seqs) {
      Sequence* s = waiting_.front();
      std::int64_t const n = admit(*s, budget);
      if (n == 0) break;
      waiting_.pop_front();
      running_.push_back(s);
      batch_.push_back({s, n});
      budget -= n;
    }
  }

  /// Tokens of s to compute next: what is left of its input, within the budget, cut at the next
  /// snapshot boundary.
  std::int64_t chunk(Sequence const& s, std::int64_t budget) const {
    std::int64_t n = std::min<std::int64_t>(static_cast<std::int64_t>(s.tokens.size()) - s.computed, budget);
    if (std::int64_t const cut = next_snapshot(s); cut > s.computed) n = std::min(n, cut - s.computed);
    return n;
  }

  /// Positions s can reach with the blocks it holds and every free one.
  [[nodiscard]] std::int64_t reachable(Sequence const& s) const {
    return (static_cast<std::int64_t>(s.state->blocks().size()) + pool_->free_blocks()) *
           pool_->layout().block_tokens();
  }

  /// Blocks for up to `n` more tokens of running sequence s: a prefill chunk shrinks to what is
  /// free; when not one token fits, the newest running sequences are preempted. Returns the
  /// tokens s may compute, or 0 when s left running_: preempted itself, or ended because it
  /// alone outgrew the whole pool.
  std::int64_t make_room(Sequence& s, std::int64_t n) {
    while (reachable(s) <= s.computed) {
      if (running_.size() == 1) {
        QFLASH_LOG_WARN("request '", s.req->params.id, "': the KV cache (", pool_->capacity(), " blocks of ",
                        pool_->layout().block_tokens(), " tokens) is full with this sequence alone; it ends here");
        ChoiceEvent ev;
        ev.index = s.choice;
        s.text += s.decoder->flush();
        finish(s, FinishReason::kLength, ev);
        return 0;
      }
      Sequence* victim = running_.back();  // running_ is in admission order
      preempt(*victim);
      if (victim == &s) return 0;
    }
    n = std::min(n, reachable(s) - s.computed);
    s.state->reserve(s.computed + n);
    return n;
  }

  void preempt(Sequence& s) {
    s.state.reset();
    s.computed = 0;
    s.hashes.clear();
    running_.erase(std::find(running_.begin(), running_.end(), &s));
    enqueue(&s, /*front=*/true);
    std::lock_guard lock(metrics_mutex_);
    ++metrics_.preemptions;
  }

  void enqueue(Sequence* s, bool front) {
    s->waiting_since = Clock::now();
    if (front) {
      waiting_.push_front(s);
      return;
    }
    auto const at = std::find_if(waiting_.begin(), waiting_.end(),
                                 [&](Sequence const* w) { return w->req->params.priority > s->req->params.priority; });
    waiting_.insert(at, s);
  }

  /// Gives s a state, resumed from the prefix cache when it can, and blocks for its first
  /// chunk; returns the chunk's tokens, or 0 (s unchanged) when no block is free for it.
  std::int64_t admit(Sequence& s, std::int64_t budget) {
    s.state.emplace(*cfg_, pool_);
    std::int64_t const bt = pool_->layout().block_tokens();
    std::int64_t adopted = 0;
    if (cache_) {
      std::int64_t const max_blocks = (static_cast<std::int64_t>(s.tokens.size()) - 1) / bt;
      kv::PrefixCache::Match m = cache_->match(s.tokens, prefix_salt(s), max_blocks);
      std::size_t keep = m.blocks.size();
      if (hybrid_) {  // resume only where the linear state is known
        while (keep > 0 && !m.snapshots[keep - 1]) --keep;
        if (keep > 0) {
          s.state->restore_linear(*m.snapshots[keep - 1]);
          cache_->note_snapshot_hit();
        }
      }
      pool_->release(std::span<std::int32_t const>(m.blocks).subspan(keep));
      m.blocks.resize(keep);
      m.hashes.resize(keep);
      adopted = static_cast<std::int64_t>(keep) * bt;
      s.state->adopt_prefix(m.blocks, adopted);
      s.hashes = std::move(m.hashes);
    }
    s.computed = adopted;
    std::int64_t const n = std::min(chunk(s, budget), reachable(s) - s.computed);
    if (n < 1) {
      s.state.reset();
      s.computed = 0;
      s.hashes.clear();
      return 0;
    }
    s.state->reserve(s.computed + n);
    Request& r = *s.req;
    auto const now = Clock::now();
    leave_queue(r);
    std::lock_guard lock(metrics_mutex_);
    if (r.timing.scheduled == RequestTiming::time_point{}) {
      r.timing.scheduled = now;
      r.usage.cached_tokens = adopted;
      metrics_.queue.observe(std::chrono::duration<double>(now - r.timing.arrival).count());
    }
    metrics_.seq_wait.observe(std::chrono::duration<double>(now - s.waiting_since).count());
    metrics_.prefix_queries += (static_cast<std::int64_t>(s.tokens.size()) - 1) / bt * bt;
    metrics_.prefix_hits += adopted;
    return n;
  }

  // ---- prefix cache ---------------------------------------------------------------------------

  /// The next block boundary after s.computed where a hybrid model keeps a state snapshot
  /// (0: none): every snapshot_every_blocks blocks, the last full block before each of the
  /// request's snapshot hints, and the prompt's last full block.
  [[nodiscard]] std::int64_t next_snapshot(Sequence const& s) const {
    if (!cache_ || !hybrid_) return 0;
    std::int64_t const bt = pool_->layout().block_tokens();
    std::int64_t const every = std::max(1, opts_.prefix.snapshot_every_blocks) * bt;
    std::int64_t cut = (s.computed / every + 1) * every;
    for_each_prompt_boundary(s, [&](std::int64_t end) {
      if (end > s.computed) cut = std::min(cut, end);
    });
    return cut;
  }

  /// Calls f with each block boundary of s's prompt structure: each hint's, then the prompt's end.
  template <class F>
  void for_each_prompt_boundary(Sequence const& s, F&& f) const {
    std::int64_t const bt = pool_->layout().block_tokens();
    for (std::int32_t const h : s.req->params.snapshot_hints) f(h / bt * bt);
    f(s.n_prompt / bt * bt);
  }

  /// Registers s's newly full blocks with the cache, and snapshots its state at a boundary.
  void cache_blocks(Sequence& s) {
    if (!cache_) return;
    std::int64_t const bt = pool_->layout().block_tokens();
    std::int64_t const full = s.computed / bt;
    std::string const salt = prefix_salt(s);
    while (static_cast<std::int64_t>(s.hashes.size()) < full) {
      std::size_t const i = s.hashes.size();
      kv::BlockHash const parent = i == 0 ? kv::PrefixCache::root(salt) : s.hashes[i - 1];
      auto const toks = std::span<std::int32_t const>(s.tokens).subspan(i * static_cast<std::size_t>(bt),
                                                                        static_cast<std::size_t>(bt));
      s.hashes.push_back(cache_->insert(parent, toks, salt, s.state->blocks()[i]));
    }
    if (!hybrid_ || full == 0 || s.computed % bt != 0) return;
    bool at_prompt_boundary = false;
    for_each_prompt_boundary(s, [&](std::int64_t end) { at_prompt_boundary = at_prompt_boundary || end == s.computed; });
    if (full % std::max(1, opts_.prefix.snapshot_every_blocks) != 0 && !at_prompt_boundary) return;
    kv::BlockHash const h = s.hashes[static_cast<std::size_t>(full - 1)];
    if (!cache_->has_snapshot(h)) cache_->attach_snapshot(h, s.state->snapshot_linear(opts_.prefix.snapshot_bf16));
  }

  // ---- sampling and streaming -------------------------------------------------------------

  /// A next token to draw for s from batch row `row`'s logits (computed in pick_tokens, sent
  /// in emit_token).
  struct Draw {
    Sequence* seq;
    std::int64_t row;
    std::int32_t token = -1;
    std::optional<TokenLogprob> logprob;
    std::span<float const> logits;  ///< the row in full, for a draw its candidates did not decide
  };

  /// Scratch of one pick_tokens slot.
  struct DrawScratch {
    std::vector<float> work, logprobs, lowered;
    std::vector<std::int32_t> order;
    std::vector<int> counts;
  };

  /// Queues s's next token; after a prompt's first token, forks its other choices, which share
  /// these logits. A sequence gets one draw a step (a fork may also have computed its prompt).
  void add_draws(Sequence& s, std::int64_t row) {
    Request& r = *s.req;
    if (s.choice == 0 && !r.forked && s.tokens.size() == static_cast<std::size_t>(s.n_prompt)) fork_choices(r);
    auto const add = [&](Sequence& q) {
      if (std::none_of(draws_.begin(), draws_.end(), [&](Draw const& d) { return d.seq == &q; }))
        draws_.push_back(Draw{&q, row, -1, std::nullopt, {}});
    };
    add(s);
    if (s.choice == 0 && r.forked && s.generated == 0)
      for (auto& c : r.choices)
        if (c->choice > 0 && c->generated == 0 && c->state && c->computed == c->n_prompt) add(*c);
  }

  /// Every draw's token (and log-probabilities), over the threads: each sequence has its own
  /// sampler, and each slot its scratch (the penalties and log-probabilities of a vocabulary).
  /// First from the candidates; the draws they leave undecided then read their rows in full.
  void pick_tokens() {
    draw_scratch_.resize(static_cast<std::size_t>(max_threads()));
    auto const n_draws = static_cast<std::int64_t>(draws_.size());
    auto const vocab = static_cast<std::size_t>(cfg_->vocab);
    bool const whole_rows = whole_rows_;  // full_logits_ holds every row
    if (!whole_rows)
      parallel_for(0, n_draws, opts_.sampling_candidates * 64, [&](std::int64_t i) {
        pick_from_candidates(draws_[static_cast<std::size_t>(i)],
                             draw_scratch_[static_cast<std::size_t>(parallel_slot())]);
      });
    full_rows_.clear();
    for (Draw const& d : draws_)
      if (d.token < 0 && std::find(full_rows_.begin(), full_rows_.end(), d.row) == full_rows_.end())
        full_rows_.push_back(d.row);
    std::int64_t const full = std::count_if(draws_.begin(), draws_.end(), [](Draw const& d) { return d.token < 0; });
    {
      std::lock_guard lock(metrics_mutex_);
      metrics_.full_row_draws += full;
    }
    if (full == 0) return;
    if (!whole_rows) {
      full_logits_.resize(full_rows_.size() * vocab);
      for (std::size_t j = 0; j < full_rows_.size(); ++j)
        model_->logits_row(full_rows_[j], std::span(full_logits_).subspan(j * vocab, vocab));
    }
    for (Draw& d : draws_)
      if (d.token < 0) {
        auto const j = whole_rows ? static_cast<std::size_t>(d.row)
                                  : static_cast<std::size_t>(std::find(full_rows_.begin(), full_rows_.end(), d.row) -
                                                             full_rows_.begin());
        d.logits = std::span<float const>(full_logits_).subspan(j * vocab, vocab);
      }
    parallel_for(0, n_draws, cfg_->vocab, [&](std::int64_t i) {
      Draw& d = draws_[static_cast<std::size_t>(i)];
      if (d.token < 0) pick_token(d, draw_scratch_[static_cast<std::size_t>(parallel_slot())]);
    });
  }

  /// Whether s's draws may be decided by its rows' candidates.
  static bool may_decide_from_candidates(Sequence const& s) {
    GenerationRequest const& p = s.req->params;
    if (p.frequency_penalty < 0 || p.presence_penalty < 0) return false;  // raise tokens outside
    return s.sampler->may_decide_from_candidates();
  }

  /// d's token and log-probabilities from its row's candidates, where they decide them; else
  /// d is left as it was (token -1), its sampler untouched.
  void pick_from_candidates(Draw& d, DrawScratch& sc) const {
    Sequence& s = *d.seq;
    GenerationRequest const& p = s.req->params;
    CandidateRow const row{candidates_.ids_of(d.row), candidates_.values_of(d.row),
                           candidates_.stats[static_cast<std::size_t>(d.row)], cfg_->vocab};
    if (!may_decide_from_candidates(s)) return;
    Lowered lowered;
    if (p.frequency_penalty != 0 || p.presence_penalty != 0) {
      // Each candidate's count in the generated tokens: one pass, candidates found by id.
      std::vector<std::int32_t>& by_id = sc.order;
      by_id.resize(row.ids.size());
      for (std::size_t i = 0; i < by_id.size(); ++i) by_id[i] = static_cast<std::int32_t>(i);
      std::sort(by_id.begin(), by_id.end(), [&](std::int32_t a, std::int32_t b) {
        return row.ids[static_cast<std::size_t>(a)] < row.ids[static_cast<std::size_t>(b)];
      });
      sc.counts.assign(row.ids.size(), 0);
      for (std::size_t t = static_cast<std::size_t>(s.n_prompt); t < s.tokens.size(); ++t) {
        auto const at = std::lower_bound(by_id.begin(), by_id.end(), s.tokens[t], [&](std::int32_t i, std::int32_t id) {
          return row.ids[static_cast<std::size_t>(i)] < id;
        });
        if (at != by_id.end() && row.ids[static_cast<std::size_t>(*at)] == s.tokens[t])
          ++sc.counts[static_cast<std::size_t>(*at)];
        else
          ++lowered.outside;  // once per occurrence: an upper bound on the tokens
      }
      sc.lowered.assign(row.ids.size(), 0.0f);
      for (std::size_t i = 0; i < row.ids.size(); ++i)
        if (sc.counts[i] > 0) sc.lowered[i] = p.frequency_penalty * static_cast<float>(sc.counts[i]) + p.presence_penalty;
      lowered.candidates = sc.lowered;
    }
    std::optional<TokenLogprob> lp;
    if (p.top_logprobs >= 0 && !(lp = candidate_logprobs(row, p.top_logprobs, sc))) return;
    std::optional<std::int32_t> const token = s.sampler->sample(row, s.tokens, lowered);
    if (!token) return;
    d.token = *token;
    if (lp) {
      lp->token = d.token;
      auto const at = std::find(row.ids.begin(), row.ids.end(), d.token) - row.ids.begin();
      lp->logprob = row.logits[static_cast<std::size_t>(at)] - row.stats.log_norm;
      d.logprob = std::move(lp);
    }
  }

  void pick_token(Draw& d, DrawScratch& sc) const {
    Sequence& s = *d.seq;
    GenerationRequest const& p = s.req->params;
    sc.work.assign(d.logits.begin(), d.logits.end());
    for (std::int32_t id : untokenizable_) sc.work[static_cast<std::size_t>(id)] = -INFINITY;
    if (p.top_logprobs >= 0) d.logprob = logprobs(sc, p.top_logprobs);
    if (p.frequency_penalty != 0 || p.presence_penalty != 0) {
      sc.counts.assign(sc.work.size(), 0);
      for (std::size_t i = static_cast<std::size_t>(s.n_prompt); i < s.tokens.size(); ++i)
        ++sc.counts[static_cast<std::size_t>(s.tokens[i])];
      for (std::size_t t = 0; t < sc.work.size(); ++t)
        if (sc.counts[t] > 0)
          sc.work[t] -= p.frequency_penalty * static_cast<float>(sc.counts[t]) + p.presence_penalty;
    }
    d.token = s.sampler->sample(sc.work, s.tokens);
    if (d.logprob) {
      d.logprob->token = d.token;
      d.logprob->logprob = sc.logprobs[static_cast<std::size_t>(d.token)];
    }
  }

  /// Choices 1..n-1 of r from choice 0's state after the prompt; those that cannot fork now
  /// (no room) wait and compute the prompt themselves, from the prefix cache where they can.
  void fork_choices(Request& r) {
    r.forked = true;
    Sequence& first = *r.choices[0];
    for (int c = 1; c < r.params.n; ++c) {
      auto s = new_sequence(r, c);
      Sequence* p = s.get();
      r.choices.push_back(std::move(s));
      bool forked = false;
      if (static_cast<int>(running_.size()) < opts_.max_num_seqs) {
        try {
          p->state.emplace(first.state->fork());
          p->computed = first.computed;
          p->hashes = first.hashes;
          running_.push_back(p);
          forked = true;
        } catch (Error const&) {
          p->state.reset();
        }
      }
      if (!forked) enqueue(p, /*front=*/true);
    }
  }

  /// Sends d's token: metrics, the end of the choice (EOS, a stop, the length), or its text.
  void emit_token(Draw& d) {
    Sequence& s = *d.seq;
    Request& r = *s.req;
    GenerationRequest const& p = r.params;
    std::int32_t const next = d.token;
    std::optional<TokenLogprob>& lp = d.logprob;
    auto const now = Clock::now();
    {
      std::lock_guard lock(metrics_mutex_);
      ++metrics_.generation_tokens;
      if (r.timing.first_token == RequestTiming::time_point{}) {
        r.timing.first_token = now;
        metrics_.ttft.observe(std::chrono::duration<double>(now - r.timing.arrival).count());
      } else if (s.last_token != Clock::time_point{}) {
        metrics_.itl.observe(std::chrono::duration<double>(now - s.last_token).count());
      }
    }
    s.last_token = now;
    ++s.generated;
    ++r.usage.completion_tokens;
    bool const eos = !p.ignore_eos && (std::find(info_.eos_ids.begin(), info_.eos_ids.end(), next) != info_.eos_ids.end() ||
                                       std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), next) !=
                                           p.stop_token_ids.end());
    ChoiceEvent ev;
    ev.index = s.choice;
    if (eos) {
      finish(s, FinishReason::kEos, ev);
      return;
    }
    s.tokens.push_back(next);
    ev.tokens.push_back(next);
    if (lp) ev.logprobs.push_back(std::move(*lp));
    std::size_t const before = s.text.size();
    s.text += s.decoder->push(next);
    std::size_t stop_len = 0;
    if (std::size_t at = find_stop(s.text, before, p.stop, stop_len); at != std::string::npos) {
      s.text.resize(at);
      finish(s, FinishReason::kStopString, ev);
      return;
    }
    if (s.generated >= p.max_tokens || static_cast<std::int64_t>(s.tokens.size()) >= max_context_) {
      s.text += s.decoder->flush();
      finish(s, FinishReason::kLength, ev);
      return;
    }
    std::size_t const ready = s.text.size() - held_back(s.text, p.stop);
    if (ready > s.emitted) {
      ev.text = s.text.substr(s.emitted, ready - s.emitted);
      s.emitted = ready;
    }
    r.stream->push(std::move(ev));
  }

  /// logprobs(sc, k) from a row's candidates, where they decide the top k; else nullopt.
  static std::optional<TokenLogprob> candidate_logprobs(CandidateRow const& row, int k, DrawScratch& sc) {
    TokenLogprob out;
    if (k == 0) return out;
    std::size_t const n_cand = std::min(row.ids.size(), static_cast<std::size_t>(row.vocab));
    auto const kk = std::min<std::size_t>(static_cast<std::size_t>(k), static_cast<std::size_t>(row.vocab));
    if (kk > n_cand) return std::nullopt;
    float const lse = row.stats.log_norm;
    std::vector<float>& lp = sc.logprobs;
    lp.resize(n_cand);
    for (std::size_t i = 0; i < n_cand; ++i) lp[i] = row.logits[i] - lse;
    std::vector<std::int32_t>& order = sc.order;  // candidate indices, as logprobs() ranks ids
    order.resize(n_cand);
    for (std::size_t i = 0; i < n_cand; ++i) order[i] = static_cast<std::int32_t>(i);
    std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
      return lp[static_cast<std::size_t>(a)] > lp[static_cast<std::size_t>(b)] ||
             (lp[static_cast<std::size_t>(a)] == lp[static_cast<std::size_t>(b)] &&
              row.ids[static_cast<std::size_t>(a)] < row.ids[static_cast<std::size_t>(b)]);
    });
    // A token outside has a log-probability of at most the last candidate's logit's; one equal
    // to the k-th's might have a lower id.
    if (n_cand < static_cast<std::size_t>(row.vocab) &&
        !(lp[static_cast<std::size_t>(order[kk - 1])] > row.logits[n_cand - 1] - lse))
      return std::nullopt;
    for (std::size_t i = 0; i < kk; ++i) {
      auto const c = static_cast<std::size_t>(order[i]);
      out.top.emplace_back(row.ids[c], lp[c]);
    }
    return out;
  }

  /// The top k tokens' log-probabilities from sc.work (the logits as the model gives them,
  /// before penalties and temperature); keeps every token's in sc.logprobs.
  static TokenLogprob logprobs(DrawScratch& sc, int k) {
    std::vector<float> const& logits = sc.work;
    float const mx = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (float v : logits) sum += std::exp(static_cast<double>(v - mx));
    float const lse = mx + static_cast<float>(std::log(sum));
    std::vector<float>& lp = sc.logprobs;
    lp.resize(logits.size());
    for (std::size_t i = 0; i < logits.size(); ++i) lp[i] = logits[i] - lse;
    TokenLogprob out;
    if (k > 0) {
      std::vector<std::int32_t>& order = sc.order;
      order.resize(logits.size());
      for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<std::int32_t>(i);
      auto const kk = std::min<std::size_t>(static_cast<std::size_t>(k), order.size());
      std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(kk), order.end(),
                        [&](std::int32_t a, std::int32_t b) {
                          return lp[static_cast<std::size_t>(a)] > lp[static_cast<std::size_t>(b)] ||
                                 (lp[static_cast<std::size_t>(a)] == lp[static_cast<std::size_t>(b)] && a < b);
                        });
      for (std::size_t i = 0; i < kk; ++i) out.top.emplace_back(order[i], lp[static_cast<std::size_t>(order[i])]);
    }
    return out;
  }

  /// Ends choice s with `ev` as its last event (the rest of its text appended).
  void finish(Sequence& s, FinishReason why, ChoiceEvent& ev) {
    if (why != FinishReason::kStopString && why != FinishReason::kLength) s.text += s.decoder->flush();
    if (s.text.size() > s.emitted) ev.text = s.text.substr(s.emitted);
    s.emitted = s.text.size();
    ev.finish = why;
    s.req->stream->push(std::move(ev));
    retire(s);
    if (--s.req->open == 0) end(*s.req);
  }

  /// Takes s out of the running and waiting sets; its blocks go back (cached ones stay cached).
  void retire(Sequence& s) {
    s.done = true;
    s.state.reset();
    if (auto it = std::find(running_.begin(), running_.end(), &s); it != running_.end()) running_.erase(it);
    if (auto it = std::find(waiting_.begin(), waiting_.end(), &s); it != waiting_.end()) waiting_.erase(it);
  }

  void end(Request& r) {
    update_gauges();  // a reader that sees the stream end sees its blocks back
    r.usage.prompt_tokens = static_cast<std::int64_t>(r.params.prompt.size());
    r.timing.finished = Clock::now();
    leave_queue(r);
    {
      std::lock_guard lock(metrics_mutex_);
      metrics_.prompt_tokens += r.usage.prompt_tokens;
      ++metrics_.finished;
      metrics_.e2e.observe(std::chrono::duration<double>(r.timing.finished - r.timing.arrival).count());
    }
    r.stream->end(r.usage, r.timing);
  }

  /// Ends r with an error (its choices retired).
  void fail(Request& r, std::string const& message) {
    if (r.stream->ended()) return;
    for (auto& s : r.choices)
      if (!s->done) retire(*s);
    r.open = 0;
    leave_queue(r);
    r.timing.finished = Clock::now();
    r.stream->fail(message, r.usage, r.timing);
  }

  /// r no longer counts against max_queue (it runs, or it ended while waiting).
  void leave_queue(Request& r) {
    if (!r.counted_waiting) return;
    r.counted_waiting = false;
    std::lock_guard lock(mutex_);
    --waiting_requests_;
  }

  /// Forgets requests whose streams have ended.
  void reap() {
    requests_.remove_if([](std::unique_ptr<Request> const& r) { return r->stream->ended(); });
  }

  // ---- metrics -----------------------------------------------------------------------------

  void update_gauges() {
    std::lock_guard lock(metrics_mutex_);
    metrics_.running = static_cast<double>(running_.size());
    metrics_.waiting = static_cast<double>(waiting_.size());
    metrics_.blocks_used = pool_->used_blocks();
    metrics_.blocks_cached = cache_ ? cache_->reclaimable() : 0;
    metrics_.blocks_free = pool_->capacity() - metrics_.blocks_used - metrics_.blocks_cached;
    metrics_.kv_usage = pool_->capacity() ? static_cast<double>(metrics_.blocks_used) / static_cast<double>(pool_->capacity()) : 0.0;
    if (cache_) {
      metrics_.snapshot_hits = cache_->stats().snapshot_hits;
      metrics_.snapshot_bytes = cache_->stats().snapshot_bytes;
    }
  }

  /// Per MoE layer: the routing entropy of every token, the experts' load, and (when asked)
  /// the decode tokens' decisions in the log.
  void observe_routes(model::RouteRecord const& r) {
    std::unique_lock lock(metrics_mutex_);
    auto& load = metrics_.expert_load;
    for (std::int64_t t = 0; t < r.n_tokens; ++t) {
      metrics_.router_entropy[r.layer].add(r.entropy(t));
      auto const used = r.used(t);
      for (std::int32_t e : used)
        if (static_cast<std::size_t>(e) < load.size()) ++load[static_cast<std::size_t>(e)];
      metrics_.experts_per_token.add(static_cast<double>(used.size()));
    }
    lock.unlock();
    if (router_log_.is_open() && router_log_bytes_ < opts_.router_log_max_bytes) log_routes(r);
  }

  void log_routes(model::RouteRecord const& r) {
    std::int64_t row = 0;
    std::string line;
    for (Scheduled const& b : batch_) {
      Sequence const& s = *b.seq;
      if (s.computed >= s.n_prompt && b.n == 1 && row < r.n_tokens) {
        line = "{\"request\":" + io::Json(s.req->params.id).dump() + ",\"choice\":" + std::to_string(s.choice) +
               ",\"position\":" + std::to_string(s.computed) + ",\"layer\":" + std::to_string(r.layer) + ",\"experts\":[";
        auto const used = r.used(row);
        for (std::size_t j = 0; j < used.size(); ++j) line += (j ? "," : "") + std::to_string(used[j]);
        line += "],\"weights\":[";
        for (std::size_t j = 0; j < used.size(); ++j)
          line += (j ? "," : "") + prom::number(r.weights[row * r.n_expert_used + static_cast<std::int64_t>(j)]);
        line += "]}\n";
        router_log_ << line;
        router_log_bytes_ += static_cast<std::int64_t>(line.size());
      }
      row += b.n;
    }
    router_log_.flush();
  }

  io::Tokenizer tok_;
  EngineOptions opts_;
  EngineInfo info_;
  std::unique_ptr<model::Model<S, Arch>> model_;
  std::map<std::string, std::shared_ptr<model::LoraAdapter const>, std::less<>> adapters_;  ///< by name
  model::ModelConfig const* cfg_ = nullptr;
  std::int64_t max_context_ = 0;
  bool hybrid_ = false;
  std::shared_ptr<kv::KvBlockPool> pool_;
  std::unique_ptr<kv::PrefixCache> cache_;
  std::vector<std::int32_t> untokenizable_;

  // Shared with submitting threads (mutex_).
  std::mutex mutex_;
  std::condition_variable wake_, idle_;
  std::vector<std::unique_ptr<Request>> incoming_;
  std::int64_t waiting_requests_ = 0;  ///< accepted requests not yet admitted
  bool stop_ = false, draining_ = false, busy_ = false;

  // The engine thread's.
  std::list<std::unique_ptr<Request>> requests_;
  std::deque<Sequence*> waiting_;
  std::vector<Sequence*> running_;
  std::vector<Scheduled> batch_;
  std::vector<model::SequenceChunk> chunks_;
  std::vector<float> temperatures_;  ///< of the batch's rows
  model::LogitCandidates candidates_;
  std::vector<std::int64_t> full_rows_;  ///< rows read in full this step, and their logits
  std::vector<float> full_logits_;       ///< (every row when whole_rows_)
  bool whole_rows_ = false;              ///< the step brought back whole logits rows, not candidates
  std::vector<Draw> draws_;
  std::vector<DrawScratch> draw_scratch_;  ///< by parallel_slot()
  std::ofstream router_log_;
  std::int64_t router_log_bytes_ = 0;

  mutable std::mutex metrics_mutex_;
  Metrics metrics_;

  std::thread worker_;  // last: starts after everything above is built
};

/// The engine over the compiled instance that runs `model` (as runtime::with_model chooses it)
/// on Arch, the model built by `make(spec, loaded, model_options)` (spec a SpecConstant).
/// @param model_id  the name /v1/models reports
template <class Arch, class MakeModel>
std::unique_ptr<Engine> make_engine_as(LoadedModel model, io::Tokenizer tokenizer, EngineOptions options,
                                       std::string model_id, MakeModel const& make) {
  MoeSpec const rt = model.spec();
  std::string const source = model.config.source;
  std::unique_ptr<Engine> engine;
  int const chosen = select_spec(instances::kSpecs, rt);
  Status const s = dispatch_spec(rt, [&](auto spec) {
    constexpr MoeSpec kSpec = decltype(spec)::value;
    EngineInfo info;
    info.model_id = model_id;
    info.spec = std::string(instances::kSpecNames[static_cast<std::size_t>(chosen)]);
    info.specialised = is_static(kSpec);
    ModelMaker<kSpec, Arch> const maker = [&make, spec](LoadedModel m, model::ModelOptions const& o) {
      return make(spec, std::move(m), o);
    };
    engine = std::make_unique<BatchEngine<kSpec, Arch>>(std::move(model), std::move(tokenizer), std::move(options),
                                                        std::move(info), maker);
    return Status::kSuccess;
  });
  QFLASH_CHECK(s == Status::kSuccess, source, ": no compiled instance runs this model (", to_string(s),
               "); compiled specs: ", compiled_spec_names());
  return engine;
}

/// make_engine_as on the CPU.
inline std::unique_ptr<Engine> make_engine(LoadedModel model, io::Tokenizer tokenizer, EngineOptions options,
                                           std::string model_id) {
  return make_engine_as<arch::Cpu>(std::move(model), std::move(tokenizer), std::move(options), std::move(model_id),
                                   [](auto spec, LoadedModel m, model::ModelOptions const& o) {
                                     return make_model<decltype(spec)::value>(std::move(m), o);
                                   });
}

}  // namespace qflash::runtime
