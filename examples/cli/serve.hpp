/// @file
/// `qflash serve`: the OpenAI-compatible HTTP server (serve/server.hpp) over the batch engine
/// (runtime/batch_engine.hpp). The port is bound before the model loads, so /health answers
/// 503 until it is ready; then one line on standard output says where it serves. SIGINT or
/// SIGTERM drains (health and new requests answer 503, running requests finish and stream to
/// their end) and the program exits 0; a second signal exits at once.
#pragma once

#include <CLI/CLI.hpp>

#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "args.hpp"
#include "bench.hpp"
#include "budget.hpp"
#include "engine.hpp"
#include "qflash/core/log.hpp"
#include "qflash/io/chat_template.hpp"
#include "qflash/io/gguf.hpp"
#include "qflash/io/tokenizer.hpp"
#include "qflash/runtime/engine.hpp"
#include "qflash/runtime/load_model.hpp"
#include "qflash/runtime/memory_plan.hpp"
#include "qflash/serve/server.hpp"

namespace qflash::cli {

struct ServeOptions {
  serve::ServerOptions server;
  runtime::EngineOptions engine;
  std::string kv_cache_memory;  ///< --kv-cache-memory as given (empty: the engine's default)
  std::string max_body = "4MiB";
  std::string eviction = "lru";
  bool no_prefix_cache = false;
  std::string flash_config;    ///< --flash-config (empty: flash_config.json beside the model, if any)
  bool kernel_fallback = true; ///< flash_config.json's flash_kernel_fallback: false refuses the generic instance
};

/// Connections served at once when --http-threads is not given: one for every request the
/// engine may hold (running or queued), and some for probes.
inline int default_http_threads(runtime::EngineOptions const& e) {
  return static_cast<int>(std::min<long long>(4096, static_cast<long long>(e.max_num_seqs) + e.max_queue + 16));
}

/// What main.cpp's common flags load: the model, its tokenizer and the KV formats, and where
/// it runs (a CUDA device, or the CPU).
struct ServedModel {
  std::optional<int> device;
  runtime::LoadedModel model;
  io::Tokenizer tokenizer;
  kv::KvMap kv;
  model::Routing routing;
  std::vector<std::shared_ptr<model::LoraAdapter const>> adapters;  ///< requests pick them by name
};

inline void add_serve_options(CLI::App* cmd, ServeOptions& o) {
  auto& s = o.server;
  auto& e = o.engine;
  cmd->add_option("--host", s.host, "address to listen on")->capture_default_str();
  cmd->add_option("--port", s.port, "port to listen on (0: a free one, printed when ready)")
      ->check(integer_in(0, 65535))
      ->capture_default_str();
  cmd->add_option("--api-key", s.api_key,
                  "require 'Authorization: Bearer KEY' on /v1/* and /generate (/health and /metrics stay open)")
      ->envname("QFLASH_API_KEY");
  cmd->add_option("--served-model-name", s.served_model_name,
                  "the model's name in requests and responses (default: the model's directory or file name)")
      ->check(not_empty());
  cmd->add_option("--max-num-seqs", e.max_num_seqs, "sequences running at once")
      ->check(integer_in(1))
      ->capture_default_str();
  cmd->add_option("--max-num-batched-tokens", e.max_num_batched_tokens,
                  "tokens one engine step computes (decode tokens + prefill chunks)")
      ->check(integer_in(1))
      ->capture_default_str();
  cmd->add_option("--kv-cache-memory", o.kv_cache_memory,
                  "bytes for the KV cache and state snapshots, e.g. 2GiB (default: enough for --max-num-seqs full "
                  "contexts, and on a hybrid model with the prefix cache a third more for Gated DeltaNet state "
                  "snapshots (a quarter of the whole); at most 1 GiB on the CPU, and on a GPU at most what "
                  "--gpu-memory-utilization's default leaves)");
  cmd->add_option("--gpu-memory-utilization", e.gpu_memory_utilization,
                  "with --device cuda: the share of the GPU's memory to fill, weights included; the KV cache takes "
                  "what is left (default: " +
                      std::to_string(runtime::kDefaultGpuMemoryUtilization).substr(0, 4) +
                      ", and no more KV cache than --kv-cache-memory's default)")
      ->check(number_in(0, 1, /*lo_open=*/true))
      ->excludes("--kv-cache-memory");
  cmd->add_option("--max-model-len", e.max_context,
                  "prompt + generated tokens per sequence (0: the model's max_position_embeddings)")
      ->check(integer_in(0));
  cmd->add_option("--max-queue", e.max_queue, "requests waiting beyond this are refused with 429")
      ->check(integer_in(1))
      ->capture_default_str();
  cmd->add_option("--sampling-candidates", e.sampling_candidates,
                  "each logits row comes back from the model as its N best tokens to sample from (a draw they do not "
                  "decide reads the whole row); 0: whole rows")
      ->check(integer_in(0, kernels::kMaxTokenCandidates))
      ->check(CLI::Validator(
          [](std::string& s) -> std::string {
            return s == "0" || std::stoi(s) >= runtime::kMaxTopLogprobs
                       ? std::string()
                       : "must be 0 or at least " + std::to_string(runtime::kMaxTopLogprobs) +
                             " (the most top_logprobs a request may ask for), got " + s;
          },
          "", "sampling_candidates"))
      ->capture_default_str();
  cmd->add_flag("--no-prefix-cache", o.no_prefix_cache, "do not share KV blocks between requests with a common prefix");
  cmd->add_option("--eviction", o.eviction,
                  "which cached prefix blocks go first when the pool is full: lru, or lru_with_age (blocks used in "
                  "the last 30 s are kept while older ones are left)")
      ->check(CLI::IsMember({"lru", "lru_with_age"}))
      ->capture_default_str();
  cmd->add_option("--log-router-decisions", e.router_log_path,
                  "write each generated token's expert routing to FILE (JSON lines, at most 64 MiB)");
  cmd->add_option("--max-body-bytes", o.max_body, "largest request body, e.g. 1MiB (larger ones get 413)")
      ->capture_default_str();
  cmd->add_option("--max-prompt-tokens", s.limits.max_prompt_tokens,
                  "longest prompt a request may send, in tokens (0: up to the context)")
      ->check(integer_in(0));
  cmd->add_option("--max-tokens-limit", s.limits.max_tokens,
                  "largest max_tokens a request may ask for (0: the context)")
      ->check(integer_in(0));
  cmd->add_option("--max-n", s.limits.max_n, "most choices (n) per request")->check(integer_in(1))->capture_default_str();
  s.http_threads = 0;
  cmd->add_option("--http-threads", s.http_threads,
                  "connections served at once; a request holds one while it waits and runs (0: --max-num-seqs + "
                  "--max-queue + 16, so that every request the engine may hold has one and probes still get one)")
      ->check(integer_in(0, 4096))
      ->capture_default_str();
  cmd->add_option("--flash-config", o.flash_config,
                  "settings in a JSON file (default: flash_config.json beside the model, if any); flags win over it")
      ->check(CLI::ExistingFile);
  cmd->footer(
      "Endpoints: POST /v1/completions, POST /v1/chat/completions (the model's chat template), GET /v1/models, "
      "POST /generate ({prompt, max_tokens, temperature, ...} -> {text, finish_reason, usage, flash_used}), "
      "GET /health (503 while loading or draining), GET /metrics (Prometheus). SIGINT/SIGTERM drain and exit 0.");
}

/// Checks what the command line alone decides (before any model is read) and completes the
/// options from it. Throws UsageError.
inline void check_serve_options(ServeOptions& o) {
  if (!o.kv_cache_memory.empty()) o.engine.kv_cache_bytes = parse_byte_size(o.kv_cache_memory, "--kv-cache-memory");
  o.server.limits.max_body_bytes = parse_byte_size(o.max_body, "--max-body-bytes");
  if (o.server.http_threads == 0) o.server.http_threads = default_http_threads(o.engine);
  o.engine.prefix.enabled = !o.no_prefix_cache;
  o.engine.prefix.eviction = o.eviction == "lru_with_age" ? runtime::EvictionPolicy::kLruWithAge
                                                          : runtime::EvictionPolicy::kLru;
  if (o.server.api_key.find_first_of(" \t\r\n") != std::string::npos)
    throw UsageError("--api-key: the key must not hold spaces or line breaks");
  if (!o.engine.router_log_path.empty()) {
    auto const dir = std::filesystem::path(o.engine.router_log_path).parent_path();
    std::error_code ec;
    if (!dir.empty() && !std::filesystem::is_directory(dir, ec))
      throw UsageError("--log-router-decisions: directory '" + printable(dir.string()) + "' does not exist");
  }
}

/// The name a model goes by when --served-model-name is not given: its directory's or file's.
inline std::string model_name_of(std::string const& path) {
  std::filesystem::path p(path);
  if (!p.has_filename()) p = p.parent_path();  // "dir/"
  return runtime::is_gguf_file(path) ? p.stem().string() : p.filename().string();
}

/// The model's chat template: a directory's (chat_template.jinja or tokenizer_config.json), or a
/// GGUF file's tokenizer.chat_template; nullopt when it has none.
inline std::optional<io::ChatTemplate> load_chat_template(std::string const& path, io::Tokenizer const& tok,
                                                         model::ModelConfig const& cfg) {
  if (!runtime::is_gguf_file(path)) return io::ChatTemplate::load(path);
  io::GgufFile const file(path);
  auto const source = file.find_string("tokenizer.chat_template");
  if (!source) return std::nullopt;
  std::vector<std::pair<std::string, std::string>> special;
  if (!cfg.eos_token_ids.empty() && tok.has(cfg.eos_token_ids.front()))
    special.emplace_back("eos_token", tok.decode(std::vector<std::int32_t>{cfg.eos_token_ids.front()}));
  return io::ChatTemplate(*source, path + ": tokenizer.chat_template", std::move(special));
}

/// Takes SIGINT and SIGTERM on a thread of its own (they are blocked in every other thread
/// started after it): the first drains the server, a second exits at once.
class DrainOnSignal {
 public:
  explicit DrainOnSignal(serve::Server& server) : server_(&server) {
    sigemptyset(&set_);
    sigaddset(&set_, SIGINT);
    sigaddset(&set_, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set_, &previous_);
    waiter_ = std::thread([this] { wait(); });
  }
  DrainOnSignal(DrainOnSignal const&) = delete;
  DrainOnSignal& operator=(DrainOnSignal const&) = delete;
  ~DrainOnSignal() {
    closing_ = true;
    pthread_kill(waiter_.native_handle(), SIGTERM);  // wakes sigwait(); closing_ tells it to return
    waiter_.join();
    if (drainer_.joinable()) drainer_.join();
    pthread_sigmask(SIG_SETMASK, &previous_, nullptr);
  }

 private:
  void wait() {
    for (;;) {
      int sig = 0;
      if (sigwait(&set_, &sig) != 0) continue;
      if (closing_) return;
      if (drainer_.joinable()) {
        QFLASH_LOG_WARN("second ", sig == SIGINT ? "SIGINT" : "SIGTERM", ": exiting without draining");
        std::fflush(stdout);
        std::_Exit(kExitRuntimeError);
      }
      QFLASH_LOG_INFO(sig == SIGINT ? "SIGINT" : "SIGTERM",
                      ": draining (requests in progress finish; a second signal exits at once)");
      drainer_ = std::thread([this] { server_->drain(); });
    }
  }

  serve::Server* server_;
  sigset_t set_{}, previous_{};
  std::atomic<bool> closing_{false};
  std::thread drainer_;
  std::thread waiter_;  // last: starts once the members above are built
};

/// Runs `qflash serve` for the model at `path` (whose config is `cfg`); `load` loads it (main.cpp's
/// common flags) once the port is bound. Returns the exit status once the server has drained.
inline int cmd_serve(ServeOptions o, std::string const& path, model::ModelConfig const& cfg,
                     std::function<ServedModel()> const& load) {
  if (o.engine.max_context > cfg.max_position_embeddings)
    throw UsageError("--max-model-len " + std::to_string(o.engine.max_context) + " is above the model's limit of " +
                     std::to_string(cfg.max_position_embeddings) + " tokens (max_position_embeddings)");
  std::string const name = o.server.served_model_name.empty() ? model_name_of(path) : o.server.served_model_name;
  std::string const host = o.server.host.find(':') != std::string::npos ? "[" + o.server.host + "]" : o.server.host;

  // Declared before the server, so that they outlive it: handlers use them until it stops.
  std::unique_ptr<runtime::Engine> engine;
  std::optional<io::ChatTemplate> chat_template;
  serve::Server server(o.server);
  int const port = server.bind();
  DrainOnSignal signals(server);
  std::exception_ptr failed;
  std::thread listener([&] {
    try {
      server.listen();
    } catch (...) {
      failed = std::current_exception();
    }
  });
  struct StopOnExit {  // a failed load must not leave the listener running
    serve::Server& server;
    std::thread& listener;
    ~StopOnExit() {
      if (listener.joinable()) {
        server.stop();
        listener.join();
      }
    }
  } stop_on_exit{server, listener};

  QFLASH_LOG_INFO("listening on http://", host, ":", port, " while ", name,
                  " loads (/health answers 503 until it is ready)");
  ServedModel m = load();
  chat_template = load_chat_template(path, m.tokenizer, cfg);
  if (!chat_template) QFLASH_LOG_INFO(path, " has no chat template: /v1/chat/completions answers 400");
  o.engine.kv = std::move(m.kv);
  o.engine.routing = m.routing;
  o.engine.adapters = std::move(m.adapters);
  engine = make_engine_on(m.device, std::move(m.model), std::move(m.tokenizer), o.engine, name);
  runtime::EngineInfo const info = engine->info();
  QFLASH_CHECK(info.specialised || o.kernel_fallback, "flash_kernel_fallback is false, but no specialised instance "
               "runs this model: the ", info.spec, " one would (add its spec to QFLASH_SPECS and rebuild)");
  QFLASH_LOG_INFO("engine: spec ", info.spec, info.specialised ? "" : " (generic)", " on ", info.arch, ", context ",
                  info.max_context, " tokens, KV cache ", human_bytes(static_cast<double>(info.kv_cache_bytes)),
                  ", prefix cache ", info.prefix_cache ? "on" : "off", ", compressed KV ",
                  info.compressed_kv ? "yes" : "no", ", flash_used ", runtime::flash_used(info) ? "true" : "false");
  if (server.attach(*engine, chat_template ? &*chat_template : nullptr)) {
    std::printf("serving %s on http://%s:%d\n", printable(name).c_str(), host.c_str(), port);
    std::fflush(stdout);
  }
  listener.join();
  if (failed) std::rethrow_exception(failed);
  return kExitOk;
}

}  // namespace qflash::cli
