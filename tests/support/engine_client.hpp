/// @file
/// What engine tests do as a client of runtime::Engine: the default model they serve and its
/// prompts, a greedy request, everything a request streamed, one metric from the Prometheus text.
#pragma once

#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "qflash/io/tokenizer.hpp"
#include "qflash/runtime/engine.hpp"
#include "qflash/runtime/load_model.hpp"
#include "qflash/runtime/request.hpp"

namespace qflash::test {

/// The embedded default model the engine tests serve.
inline std::string const kMicroDir = std::string(QFLASH_SOURCE_DIR) + "/models/qwen3_5_moe-micro";

inline runtime::LoadedModel load_micro() {
  runtime::LoadOptions o;
  o.progress = false;
  return runtime::load_model(kMicroDir, o);
}
inline io::Tokenizer micro_tokenizer() { return io::Tokenizer::from_file(kMicroDir + "/tokenizer.json"); }
inline std::vector<std::int32_t> encode_micro(std::string const& s) { return micro_tokenizer().encode(s); }

/// Prompts of several lengths (one longer than a KV block).
inline std::vector<std::string> const kEnginePrompts{
    "It was a truth universally acknowledged",
    "Mr. Darcy",
    "She was",
    "The morning was fine, and Elizabeth walked out to the garden where her sister sat reading a letter",
    "\"My dear Jane,\" said she,",
    "Emma",
};

/// Everything a request streamed, per choice.
struct EngineResult {
  std::vector<std::string> text;
  std::vector<std::vector<std::int32_t>> tokens;
  std::vector<std::vector<runtime::TokenLogprob>> logprobs;
  std::vector<std::optional<runtime::FinishReason>> finish;
  runtime::RequestUsage usage;
  std::optional<std::string> error;
};

/// Reads `s` to its end (at most two minutes) for a request of `n` choices.
inline EngineResult collect(runtime::RequestStream& s, int n = 1) {
  EngineResult r;
  r.text.resize(static_cast<std::size_t>(n));
  r.tokens.resize(static_cast<std::size_t>(n));
  r.logprobs.resize(static_cast<std::size_t>(n));
  r.finish.resize(static_cast<std::size_t>(n));
  std::vector<runtime::ChoiceEvent> events;
  auto const deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  bool open = true;
  while (open) {
    REQUIRE(std::chrono::steady_clock::now() < deadline);
    events.clear();
    open = s.wait(events, std::chrono::milliseconds(200));
    for (auto& e : events) {
      auto const i = static_cast<std::size_t>(e.index);
      REQUIRE(i < r.text.size());
      CHECK_FALSE(r.finish[i].has_value());  // nothing after a choice's last event
      r.text[i] += e.text;
      r.tokens[i].insert(r.tokens[i].end(), e.tokens.begin(), e.tokens.end());
      for (auto& lp : e.logprobs) r.logprobs[i].push_back(lp);
      if (e.finish) r.finish[i] = e.finish;
    }
  }
  r.usage = s.usage();
  r.error = s.error();
  return r;
}

/// A greedy request for `max_tokens` tokens after `prompt`.
inline runtime::GenerationRequest greedy(std::vector<std::int32_t> prompt, int max_tokens) {
  runtime::GenerationRequest r;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  return r;
}

/// A metric's value from the engine's Prometheus text (the first sample with that name and
/// labels).
inline double metric(runtime::Engine const& e, std::string const& name_and_labels) {
  std::string text;
  e.write_metrics(text);
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(name_and_labels + " ", 0) == 0) return std::stod(line.substr(name_and_labels.size() + 1));
  FAIL("metric ", name_and_labels, " not found");
  return 0;
}

}  // namespace qflash::test
