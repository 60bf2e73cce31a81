/// @file
/// The serving engine: one thread runs steps over every request at once (continuous batching).
/// Each step packs the running sequences' decode tokens and chunks of waiting prompts (chunked
/// prefill) under a token budget and max_num_seqs, runs one ragged forward, samples, and streams
/// text to each request's RequestStream (runtime/request.hpp). KV lives in one shared paged
/// pool sized from a byte budget, with a prefix cache of full blocks keyed by a chained hash
/// of their tokens and the request's salt (kv/prefix_cache.hpp); Gated DeltaNet states are
/// snapshotted at cached block boundaries so a prefix hit skips the prefix in hybrid models too.
/// When blocks run out, the newest sequence is preempted and recomputed later, never dropped.
///
/// `Engine` is the model-independent interface the HTTP server (serve/) talks to;
/// runtime/batch_engine.hpp implements it over the compiled instance that runs the model
/// (make_engine). Host only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "qflash/io/tokenizer.hpp"
#include "qflash/kv/map.hpp"
#include "qflash/kv/prefix_cache.hpp"
#include "qflash/model/config.hpp"
#include "qflash/model/lora.hpp"
#include "qflash/model/routing.hpp"
#include "qflash/runtime/request.hpp"
#include "qflash/runtime/sampler.hpp"

namespace qflash::runtime {

using kv::EvictionPolicy;

struct PrefixCacheOptions {
  bool enabled = true;
  EvictionPolicy eviction = EvictionPolicy::kLru;
  double min_age_seconds = 30.0;  ///< kLruWithAge only
  /// Hybrid models: a DeltaNet state snapshot is kept every this many full blocks of a sequence
  /// (and at its prompt's last full block), so that a hit resumes at the last snapshot.
  int snapshot_every_blocks = 4;
  double snapshot_share = 0.25;  ///< hybrid models: the part of kv_cache_bytes kept for snapshots
  bool snapshot_bf16 = true;     ///< snapshots in bf16 (half the bytes; restoring rounds the state) or fp32
};

struct EngineOptions {
  int max_num_seqs = 16;               ///< sequences running at once
  int max_num_batched_tokens = 512;    ///< tokens one step computes (decode tokens + prefill chunks)
  /// KV pool and state snapshots. 0: max_num_seqs full contexts, plus, for a hybrid model with
  /// the prefix cache, prefix.snapshot_share of the whole for state snapshots; at most 1 GiB on
  /// the host, and on a device at most what kDefaultGpuMemoryUtilization leaves.
  std::int64_t kv_cache_bytes = 0;
  /// A model on a device: the share of the device's memory the process fills, weights
  /// included; the KV cache takes what is left (0: see kv_cache_bytes). Not with kv_cache_bytes.
  double gpu_memory_utilization = 0;
  int max_context = 0;                 ///< prompt + generated tokens per sequence (0: the model's limit)
  int max_queue = 256;                 ///< waiting requests beyond this are refused (kQueueFull)
  kv::KvMap kv;                        ///< per-head KV formats (empty: f32)
  model::Routing routing;              ///< experts per token (default: the model's top-k)
  /// LoRA adapters requests may name (GenerationRequest::lora), loaded by runtime/lora.hpp.
  std::vector<std::shared_ptr<model::LoraAdapter const>> adapters;
  std::string default_lora;            ///< the adapter of requests that name none (empty: none)
  PrefixCacheOptions prefix;
  std::string router_log_path;         ///< JSONL of routing decisions per generated token (empty: off)
  std::int64_t router_log_max_bytes = 64 << 20;  ///< the log stops growing past this
  /// The best tokens of each logits row the model brings back to sample from (0: every row in
  /// full, as a check of them); at least 20 (top_logprobs), at most 256. The draws are the same
  /// either way: one these do not decide reads its row in full.
  int sampling_candidates = kSamplingCandidates;
};

/// What the server reports about the engine.
struct EngineInfo {
  std::string model_id;           ///< the served model's name (/v1/models)
  std::string spec;               ///< the compiled instance running it
  std::string arch;               ///< where it runs (arch::Cpu::name, sm80, sm90a)
  std::int64_t kv_cache_bytes = 0;  ///< the KV pool's and state snapshots' budget
  bool specialised = false;       ///< a fully static instance (not the generic fallback)
  bool compressed_kv = false;     ///< some KV head is stored in fewer than 16 bits (fp8, int8, int6)
  bool prefix_cache = false;      ///< the shared prefix pool is on
  int max_context = 0;            ///< tokens per sequence
  int n_expert = 0, n_expert_used = 0;  ///< the MoE layers' experts and top-k (what a request's routing is checked against)
  std::vector<std::string> adapters;    ///< the LoRA adapters requests may name
  SamplingParams default_sampling;  ///< from generation_config.json, for requests that set nothing
  std::vector<std::int32_t> eos_ids;
};

/// The Flash design's `flash_used`: the specialised instance, compressed KV and the shared
/// prefix pool are all active.
inline bool flash_used(EngineInfo const& i) { return i.specialised && i.compressed_kv && i.prefix_cache; }

class Engine {
 public:
  virtual ~Engine() = default;

  /// Queues a request and returns its stream. Throws RequestError: kInvalid when it can never
  /// run (empty prompt, prompt + 1 token beyond the context, bad parameters), kQueueFull,
  /// kDraining.
  virtual std::shared_ptr<RequestStream> submit(GenerationRequest request) = 0;

  [[nodiscard]] virtual io::Tokenizer const& tokenizer() const = 0;
  [[nodiscard]] virtual model::ModelConfig const& config() const = 0;
  [[nodiscard]] virtual EngineInfo info() const = 0;

  /// Appends the engine's metrics in the Prometheus text format (names under `qflash:`).
  virtual void write_metrics(std::string& out) const = 0;

  /// Refuses new requests (kDraining) and returns once every accepted one has ended.
  virtual void drain() = 0;
};

}  // namespace qflash::runtime
