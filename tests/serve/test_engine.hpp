/// @file
/// A deterministic runtime::Engine for the HTTP server's tests (a test double of the engine
/// behind the HTTP plumbing; the real one is runtime/batch_engine.hpp). Each choice "generates"
/// the prompt's tokens again, one per step, with made-up log-probabilities; a scripted delay
/// per step, refusal at submit, failure after some steps, and cached-token count let the
/// tests reach every path of the server. It records each request it is sent and counts the
/// requests it saw cancelled.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "qflash/io/hf_config.hpp"
#include "qflash/io/tokenizer.hpp"
#include "qflash/runtime/engine.hpp"
#include "qflash/runtime/request.hpp"

namespace qflash::test {

struct TestEngineScript {
  std::chrono::milliseconds step_delay{0};          ///< between steps (one token of every choice)
  std::optional<runtime::RequestErrorKind> refuse;  ///< submit() throws this
  int fail_after = -1;                              ///< steps after which the request fails (-1: never)
  std::int64_t cached_tokens = 0;                   ///< reported as read from the prefix cache
};

class TestEngine final : public runtime::Engine {
 public:
  /// The tokenizer and config of the model in `dir`; `max_context` 0 keeps the config's.
  explicit TestEngine(std::string const& dir, int max_context = 0)
      : tok_(io::Tokenizer::from_file(dir + "/tokenizer.json")), cfg_(io::load_config(dir)) {
    info_.model_id = "test-model";
    info_.spec = "test";
    info_.max_context = max_context > 0 ? max_context : cfg_.max_position_embeddings;
    info_.default_sampling.temperature = 0.25f;  // unlike OpenAI's defaults, so tests see which applied
    info_.default_sampling.top_p = 0.5f;
    info_.default_sampling.top_k = 7;
    info_.eos_ids.assign(cfg_.eos_token_ids.begin(), cfg_.eos_token_ids.end());
  }
  ~TestEngine() override { drain(); }

  void set_script(TestEngineScript s) {
    std::lock_guard lock(mutex_);
    script_ = s;
  }
  void set_info(runtime::EngineInfo i) { info_ = std::move(i); }

  [[nodiscard]] std::vector<runtime::GenerationRequest> requests() const {
    std::lock_guard lock(mutex_);
    return requests_;
  }
  [[nodiscard]] int cancelled() const { return cancelled_.load(); }

  std::shared_ptr<runtime::RequestStream> submit(runtime::GenerationRequest request) override {
    std::lock_guard lock(mutex_);
    if (draining_) QFLASH_REQUEST_FAIL(runtime::RequestErrorKind::kDraining, "the engine is draining");
    if (script_.refuse) QFLASH_REQUEST_FAIL(*script_.refuse, "scripted refusal");
    requests_.push_back(request);
    auto stream = std::make_shared<runtime::RequestStream>();
    workers_.emplace_back([this, stream, r = std::move(request), s = script_] { run(*stream, r, s); });
    return stream;
  }

  [[nodiscard]] io::Tokenizer const& tokenizer() const override { return tok_; }
  [[nodiscard]] model::ModelConfig const& config() const override { return cfg_; }
  [[nodiscard]] runtime::EngineInfo info() const override { return info_; }
  void write_metrics(std::string& out) const override {
    std::lock_guard lock(mutex_);
    out += "qflash:test_engine_requests_total " + std::to_string(requests_.size()) + "\n";
  }
  void drain() override {
    std::vector<std::thread> workers;
    {
      std::lock_guard lock(mutex_);
      draining_ = true;
      workers.swap(workers_);
    }
    for (auto& w : workers) w.join();
  }

 private:
  void run(runtime::RequestStream& stream, runtime::GenerationRequest const& r, TestEngineScript const& s) {
    runtime::RequestTiming timing;
    timing.arrival = timing.scheduled = std::chrono::steady_clock::now();
    runtime::RequestUsage usage;
    usage.prompt_tokens = static_cast<std::int64_t>(r.prompt.size());
    usage.cached_tokens = s.cached_tokens;
    std::vector<io::StreamDecoder> decoders(static_cast<std::size_t>(r.n), io::StreamDecoder(tok_));
    std::vector<bool> done(static_cast<std::size_t>(r.n), false);
    for (int step = 0; step < r.max_tokens; ++step) {
      if (s.step_delay.count() > 0) std::this_thread::sleep_for(s.step_delay);
      if (stream.cancelled()) {
        ++cancelled_;
        break;
      }
      if (step == s.fail_after) {
        stream.fail("scripted failure", usage, timing);
        return;
      }
      std::int32_t const token = r.prompt[static_cast<std::size_t>(step) % r.prompt.size()];
      bool const eos = !r.ignore_eos && std::find(info_.eos_ids.begin(), info_.eos_ids.end(), token) != info_.eos_ids.end();
      for (int c = 0; c < r.n; ++c) {
        if (done[static_cast<std::size_t>(c)]) continue;
        runtime::ChoiceEvent e;
        e.index = c;
        if (eos) {
          e.finish = runtime::FinishReason::kEos;
        } else {
          e.tokens = {token};
          e.text = decoders[static_cast<std::size_t>(c)].push(token);
          if (r.top_logprobs >= 0) {
            runtime::TokenLogprob lp{token, -0.5f * static_cast<float>(step + 1), {}};
            for (int k = 0; k < r.top_logprobs; ++k)
              lp.top.emplace_back((token + k) % tok_.vocab_size(), -0.25f * static_cast<float>(k + 1));
            e.logprobs.push_back(std::move(lp));
          }
          ++usage.completion_tokens;
          if (step + 1 == r.max_tokens) e.finish = runtime::FinishReason::kLength;
        }
        if (e.finish) {
          e.text += decoders[static_cast<std::size_t>(c)].flush();
          done[static_cast<std::size_t>(c)] = true;
        }
        if (!timing.first_token.time_since_epoch().count()) timing.first_token = std::chrono::steady_clock::now();
        stream.push(std::move(e));
      }
      if (std::all_of(done.begin(), done.end(), [](bool d) { return d; })) break;
    }
    timing.finished = std::chrono::steady_clock::now();
    stream.end(usage, timing);
  }

  io::Tokenizer tok_;
  model::ModelConfig cfg_;
  runtime::EngineInfo info_;
  mutable std::mutex mutex_;
  TestEngineScript script_;
  std::vector<runtime::GenerationRequest> requests_;
  std::vector<std::thread> workers_;
  bool draining_ = false;
  std::atomic<int> cancelled_{0};
};

}  // namespace qflash::test
