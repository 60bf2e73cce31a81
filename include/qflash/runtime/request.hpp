/// @file
/// What a serving engine takes and gives back: a generation request (token ids, sampling,
/// stops, n choices, logprobs, the prefix-cache salt) and the stream of events it answers with.
/// The server's threads submit requests and read their streams; the engine's thread writes them
/// (runtime/engine.hpp). Host only.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/model/routing.hpp"
#include "qflash/runtime/generate.hpp"
#include "qflash/runtime/sampler.hpp"

namespace qflash::runtime {

/// Most alternatives a request may ask for per token (OpenAI's top_logprobs limit).
inline constexpr int kMaxTopLogprobs = 20;

struct GenerationRequest {
  std::string id;                            ///< for logs and the router decision log
  std::vector<std::int32_t> prompt;          ///< token ids; not empty
  int n = 1;                                 ///< independent choices sampled from the one prompt
  int max_tokens = 16;                       ///< per choice, >= 1
  SamplingParams sampling;                   ///< choice i samples with seed sampling.seed + i
  float frequency_penalty = 0.0f;            ///< logit -= frequency_penalty * count in the choice's output
  float presence_penalty = 0.0f;             ///< logit -= presence_penalty when the count is > 0
  std::vector<std::string> stop;             ///< stop strings, not part of the text
  std::vector<std::int32_t> stop_token_ids;  ///< stop tokens besides the model's end-of-sequence ids
  bool ignore_eos = false;                   ///< keep generating past end-of-sequence ids
  int top_logprobs = -1;                     ///< -1: no logprobs; k >= 0: each token's, with k alternatives
  std::string cache_salt;                    ///< prefix blocks are shared only between equal salts
  int priority = 0;                          ///< smaller is scheduled first; first come, first served within
  std::optional<model::Routing> routing;     ///< experts per token (empty: the engine's); part of the prefix key
  std::string lora;                          ///< LoRA adapter by name (empty: the engine's default); part of the prefix key
  /// Prompt lengths where its structure ends (a shared system prompt, each chat turn): hybrid
  /// models also snapshot their DeltaNet states at the block boundary at or before each, so a
  /// later request sharing only that much of the prompt resumes there. Ascending, in (0, prompt).
  std::vector<std::int32_t> snapshot_hints;
};

/// A generated token's log-probability under the model's distribution (before temperature
/// and filters), with the most likely alternatives.
struct TokenLogprob {
  std::int32_t token = 0;
  float logprob = 0.0f;
  std::vector<std::pair<std::int32_t, float>> top;  ///< most likely first
};

/// What one choice produced since its previous event.
struct ChoiceEvent {
  int index = 0;                        ///< the choice, in [0, n)
  std::string text;                     ///< new text: whole UTF-8 characters, never part of a stop string
  std::vector<std::int32_t> tokens;     ///< the tokens generated since the previous event
  std::vector<TokenLogprob> logprobs;   ///< one per token, when the request asked for logprobs
  std::optional<FinishReason> finish;   ///< set on the choice's last event
};

struct RequestUsage {
  std::int64_t prompt_tokens = 0;
  std::int64_t completion_tokens = 0;  ///< all choices together
  std::int64_t cached_tokens = 0;      ///< prompt tokens read from the prefix cache instead of computed
};

/// When the request reached each stage (steady clock).
struct RequestTiming {
  using time_point = std::chrono::steady_clock::time_point;
  time_point arrival{};
  time_point scheduled{};    ///< first admitted to run
  time_point first_token{};  ///< first token of any choice
  time_point finished{};
};

/// Why a request was refused or failed; the server maps each to an HTTP status.
enum class RequestErrorKind {
  kInvalid,     ///< 400: the request cannot run (e.g. the prompt does not fit the context)
  kQueueFull,   ///< 429: too many requests waiting
  kDraining,    ///< 503: the engine is shutting down
  kInternal,    ///< 500: the engine failed while running it
};

class RequestError : public Error {
 public:
  RequestError(RequestErrorKind kind, std::string message, char const* file, int line)
      : Error(std::move(message), file, line), kind_(kind) {}
  [[nodiscard]] RequestErrorKind kind() const noexcept { return kind_; }

 private:
  RequestErrorKind kind_;
};

#define QFLASH_REQUEST_FAIL(kind, ...)                                                                       \
  throw ::qflash::runtime::RequestError(kind, ::qflash::detail::concat(__VA_ARGS__), __FILE__, __LINE__)

/// The events of one request, written by the engine and read by one reader. Thread-safe.
class RequestStream {
 public:
  // ---- reader side ----

  /// Moves every pending event into `out` (appending), waiting up to `timeout` for one when
  /// there is none. Returns false once the request has ended and `out` got its last events.
  bool wait(std::vector<ChoiceEvent>& out, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    ready_.wait_for(lock, timeout, [&] { return !events_.empty() || ended_; });
    while (!events_.empty()) {
      out.push_back(std::move(events_.front()));
      events_.pop_front();
    }
    return !ended_;
  }
  /// Asks the engine to stop the request (a client went away); its blocks are freed at the
  /// engine's next step. The stream then ends with whatever was produced.
  void cancel() {
    std::lock_guard lock(mutex_);
    cancelled_ = true;
  }
  [[nodiscard]] bool cancelled() const {
    std::lock_guard lock(mutex_);
    return cancelled_;
  }
  /// Set when the engine failed the request after accepting it.
  [[nodiscard]] std::optional<std::string> error() const {
    std::lock_guard lock(mutex_);
    return error_;
  }
  [[nodiscard]] RequestUsage usage() const {
    std::lock_guard lock(mutex_);
    return usage_;
  }
  [[nodiscard]] RequestTiming timing() const {
    std::lock_guard lock(mutex_);
    return timing_;
  }

  // ---- engine side ----

  void push(ChoiceEvent e) {
    {
      std::lock_guard lock(mutex_);
      events_.push_back(std::move(e));
    }
    ready_.notify_all();
  }
  /// Ends the stream after its events; usage and timing become final.
  void end(RequestUsage const& usage, RequestTiming const& timing) {
    {
      std::lock_guard lock(mutex_);
      usage_ = usage;
      timing_ = timing;
      ended_ = true;
    }
    ready_.notify_all();
  }
  /// Ends the stream with an error.
  void fail(std::string message, RequestUsage const& usage, RequestTiming const& timing) {
    {
      std::lock_guard lock(mutex_);
      error_ = std::move(message);
    }
    end(usage, timing);
  }
  [[nodiscard]] bool ended() const {
    std::lock_guard lock(mutex_);
    return ended_;
  }

 private:
  mutable std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<ChoiceEvent> events_;
  bool cancelled_ = false;
  bool ended_ = false;
  std::optional<std::string> error_;
  RequestUsage usage_;
  RequestTiming timing_;
};

}  // namespace qflash::runtime
