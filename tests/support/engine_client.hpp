/// @file
/// What engine tests do as a client of runtime::Engine: submit a greedy request, collect
/// everything a request streamed, read one metric from the Prometheus text.
#pragma once

#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "qflash/runtime/engine.hpp"
#include "qflash/runtime/request.hpp"

namespace qflash::test {

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
