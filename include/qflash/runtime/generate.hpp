/// @file
/// Single-sequence generation: prefill the prompt, then decode token by token with a sampler,
/// streaming text as complete UTF-8 and stopping on an eos id, a stop string, or the token
/// limit. Text that could be the start of a stop string is held back until it is decided.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "qflash/io/tokenizer.hpp"
#include "qflash/kv/map.hpp"
#include "qflash/model/model.hpp"
#include "qflash/runtime/sampler.hpp"

namespace qflash::runtime {

/// kLength: max_tokens were generated, or the sequence filled the context.
enum class FinishReason { kLength, kEos, kStopString };

constexpr std::string_view to_string(FinishReason r) {
  switch (r) {
    case FinishReason::kLength: return "length";
    case FinishReason::kEos: return "stop";
    case FinishReason::kStopString: return "stop";
  }
  return "unknown";
}

struct GenerateOptions {
  int max_tokens = 128;
  SamplingParams sampling;
  std::vector<std::string> stop;          ///< stop strings; not included in the output
  std::vector<std::int32_t> eos_ids;      ///< stop tokens; not included in the output
  int max_context = 0;                    ///< prompt + generated tokens at most (0: the model's max positions)
  kv::KvMap kv;                           ///< KV formats per head (empty: every head f32)
};

struct GenerateResult {
  std::vector<std::int32_t> tokens;  ///< generated ids (eos excluded)
  std::string text;                  ///< generated text up to any stop string
  FinishReason finish = FinishReason::kLength;
  std::int64_t n_prompt = 0;
  double prefill_seconds = 0;
  double decode_seconds = 0;
};

/// Finds the first stop string in `text` at or after `from`; npos if none.
inline std::size_t find_stop(std::string_view text, std::size_t from, std::vector<std::string> const& stop,
                             std::size_t& stop_len) {
  std::size_t best = std::string_view::npos;
  for (auto const& s : stop) {
    if (s.empty()) continue;
    std::size_t const start = from >= s.size() - 1 ? from - (s.size() - 1) : 0;
    std::size_t const at = text.find(s, start);
    if (at < best) {
      best = at;
      stop_len = s.size();
    }
  }
  return best;
}

/// Length of the longest suffix of `text` that is a proper prefix of some stop string.
inline std::size_t held_back(std::string_view text, std::vector<std::string> const& stop) {
  std::size_t hold = 0;
  for (auto const& s : stop)
    for (std::size_t n = std::min(s.size() - 1, text.size()); n > hold; --n)
      if (text.substr(text.size() - n) == std::string_view(s).substr(0, n)) {
        hold = n;
        break;
      }
  return hold;
}

/// The sampling a request gets when it sets none: generation_config.json's, greedy when it
/// does not ask to sample (as transformers does).
inline SamplingParams default_sampling(model::ModelConfig const& cfg) {
  SamplingParams p;
  auto const& g = cfg.generation;
  if (!g.do_sample.value_or(false)) return p;
  p.temperature = g.temperature.value_or(1.0f);
  p.top_k = g.top_k.value_or(0);
  p.top_p = g.top_p.value_or(1.0f);
  p.min_p = g.min_p.value_or(0.0f);
  p.repetition_penalty = g.repetition_penalty.value_or(1.0f);
  return p;
}

/// Throws Error unless the tokenizer can only produce ids the model embeds. A
/// tokenizer with fewer ids than the model is normal (checkpoints pad the vocabulary):
/// generate() never samples the ids it lacks.
inline void check_tokenizer_fits(io::Tokenizer const& tok, model::ModelConfig const& cfg) {
  QFLASH_CHECK(tok.vocab_size() <= cfg.vocab, tok.source(), ": the tokenizer has ids up to ", tok.vocab_size() - 1,
               ", but the model's vocabulary is ", cfg.vocab, " (", cfg.source,
               "): the tokenizer belongs to another model");
}

template <class Model>
GenerateResult generate(Model& model, io::Tokenizer const& tok, std::span<std::int32_t const> prompt,
                        GenerateOptions const& opt,
                        std::function<void(std::string_view)> const& on_text = {}) {
  QFLASH_CHECK(!prompt.empty(), "generate: the prompt has no tokens");
  QFLASH_CHECK(opt.max_tokens >= 0, "max_tokens must be >= 0, got ", opt.max_tokens);
  std::int64_t const model_limit = model.config().max_position_embeddings;
  QFLASH_CHECK(opt.max_context >= 0 && opt.max_context <= model_limit, "the context size must be in [0, ",
               model_limit, "] (max_position_embeddings; 0: all of it), got ", opt.max_context);
  std::int64_t const context = opt.max_context > 0 ? opt.max_context : model_limit;
  QFLASH_CHECK(static_cast<std::int64_t>(prompt.size()) < context, "the prompt has ", prompt.size(),
               " tokens, which leaves no room to generate in a context of ", context, " tokens");
  using clock = std::chrono::steady_clock;
  GenerateResult res;
  res.n_prompt = static_cast<std::int64_t>(prompt.size());
  Sampler sampler(opt.sampling);
  auto state = model.new_sequence(opt.kv);
  state.reserve(std::min<std::int64_t>(context, res.n_prompt + opt.max_tokens));
  std::vector<std::int32_t> history(prompt.begin(), prompt.end());
  io::StreamDecoder decoder(tok);
  // Ids the tokenizer has no token for (the padding of the vocabulary) are never sampled;
  // end-of-sequence ids are, even when the tokenizer lacks them.
  std::vector<std::int32_t> untokenizable;
  for (std::int32_t id = 0; id < model.config().vocab; ++id)
    if (!tok.has(id) && std::find(opt.eos_ids.begin(), opt.eos_ids.end(), id) == opt.eos_ids.end())
      untokenizable.push_back(id);
  // Each step brings back the logits' best tokens where they may decide the draw; one they do
  // not decide reads the row.
  bool const use_candidates = sampler.may_decide_from_candidates();
  float const temperature = opt.sampling.temperature;
  model::CandidateRequest const want{kSamplingCandidates, std::span(&temperature, 1), untokenizable};
  model::LogitCandidates candidates;
  std::vector<float> logits;
  model::SequenceChunk chunk{prompt, &state};
  auto forward = [&] {
    if (use_candidates)
      model.forward(std::span(&chunk, 1), model::LogitsFor::kLastToken, want, candidates);
    else
      model.forward(std::span(&chunk, 1), model::LogitsFor::kLastToken, logits);
  };
  auto next_token = [&] {
    if (use_candidates) {
      CandidateRow const row{candidates.ids_of(0), candidates.values_of(0), candidates.stats[0], model.config().vocab};
      if (std::optional<std::int32_t> t = sampler.sample(row, history)) return *t;
      logits.resize(static_cast<std::size_t>(model.config().vocab));
      model.logits_row(0, logits);
    }
    for (std::int32_t id : untokenizable) logits[static_cast<std::size_t>(id)] = -INFINITY;
    return sampler.sample(logits, history);
  };
  std::size_t emitted = 0;  // bytes of res.text already passed to on_text

  auto const t0 = clock::now();
  forward();
  auto t1 = clock::now();
  res.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();

  for (int i = 0; i < opt.max_tokens; ++i) {
    std::int32_t const next = next_token();
    if (std::find(opt.eos_ids.begin(), opt.eos_ids.end(), next) != opt.eos_ids.end()) {
      res.finish = FinishReason::kEos;
      break;
    }
    res.tokens.push_back(next);
    history.push_back(next);
    std::size_t const before = res.text.size();
    res.text += decoder.push(next);
    std::size_t stop_len = 0;
    if (std::size_t at = find_stop(res.text, before, opt.stop, stop_len); at != std::string::npos) {
      res.text.resize(at);
      res.finish = FinishReason::kStopString;
      break;
    }
    std::size_t const ready = res.text.size() - held_back(res.text, opt.stop);
    if (on_text && ready > emitted) on_text(std::string_view(res.text).substr(emitted, ready - emitted));
    emitted = std::max(emitted, ready);
    if (i + 1 == opt.max_tokens || static_cast<std::int64_t>(history.size()) == context) break;
    chunk = {std::span(&res.tokens.back(), 1), &state};
    forward();
  }
  if (res.finish != FinishReason::kStopString) res.text += decoder.flush();
  if (on_text && res.text.size() > emitted) on_text(std::string_view(res.text).substr(emitted));
  res.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  return res;
}

}  // namespace qflash::runtime
