/// @file
/// The response bodies of the HTTP API, built from what the engine streams back
/// (runtime::ChoiceEvent): OpenAI's text_completion and chat.completion objects, their
/// streamed chunks framed as server-sent events, usage, and log-probabilities in OpenAI's two
/// formats (completions: `{tokens, token_logprobs, top_logprobs, text_offset}`; chat:
/// `{content: [{token, logprob, bytes, top_logprobs}]}`), and the project's /generate answer.
/// Host only.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "qflash/io/detail/utf8.hpp"
#include "qflash/io/tokenizer.hpp"
#include "qflash/runtime/generate.hpp"
#include "qflash/runtime/request.hpp"
#include "qflash/serve/openai_request.hpp"

namespace qflash::serve {

/// What every object of one response shares.
struct ResponseMeta {
  std::string id;            ///< "cmpl-...", "chatcmpl-..."
  std::int64_t created = 0;  ///< Unix seconds
  std::string model;         ///< the served model's name
};

/// One choice of a non-streamed response, gathered from its events.
struct ChoiceOutput {
  std::string text;
  std::vector<runtime::TokenLogprob> logprobs;
  std::optional<runtime::FinishReason> finish;
};

/// The JSON text of a body. Text is valid UTF-8 by construction; a stray invalid byte would
/// become U+FFFD rather than fail the response.
inline std::string dump(Json const& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

/// One server-sent event carrying `j`; a stream ends with kSseDone.
inline std::string sse_event(Json const& j) { return "data: " + dump(j) + "\n\n"; }
inline constexpr std::string_view kSseDone = "data: [DONE]\n\n";

/// OpenAI's finish_reason: "stop" (end of sequence or a stop string), "length", or null.
inline Json finish_json(std::optional<runtime::FinishReason> f) {
  return f ? Json(runtime::to_string(*f)) : Json(nullptr);
}

inline Json usage_json(runtime::RequestUsage const& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
}

/// A log-probability as JSON, which has no infinity: -inf (and NaN) become -9999, as in vLLM.
inline double logprob_value(float x) { return std::isfinite(x) ? static_cast<double>(x) : -9999.0; }

/// A token as OpenAI shows it: its text, or, when its bytes are not UTF-8 on their own (part
/// of a character), "bytes:" followed by them as \xNN.
inline std::string token_string(io::Tokenizer const& tok, std::int32_t id) {
  std::string_view const b = tok.token_bytes(id);
  if (io::detail::is_valid_utf8(b)) return std::string(b);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s = "bytes:";
  for (unsigned char c : b) {
    s += "\\x";
    s += kHex[c >> 4];
    s += kHex[c & 15];
  }
  return s;
}

/// The token's bytes as a list of integers (chat logprobs' `bytes`).
inline Json token_bytes_json(io::Tokenizer const& tok, std::int32_t id) {
  Json out = Json::array();
  for (unsigned char c : tok.token_bytes(id)) out.push_back(static_cast<int>(c));
  return out;
}

/// Characters (code points) the token's bytes start: its bytes that are not UTF-8 continuation
/// bytes, so that the sum over a choice's tokens is the length of its text.
inline std::int64_t token_chars(io::Tokenizer const& tok, std::int32_t id) {
  std::int64_t n = 0;
  for (unsigned char c : tok.token_bytes(id)) n += (c & 0xc0) != 0x80;
  return n;
}

/// Completions' logprobs for `lps`. `text_offset` is the characters of the choice's text
/// before the first of them, and is advanced past them. top_logprobs holds the k alternatives
/// and the sampled token (up to k + 1 entries, as OpenAI documents).
inline Json completion_logprobs(io::Tokenizer const& tok, std::span<runtime::TokenLogprob const> lps,
                                std::int64_t& text_offset) {
  Json tokens = Json::array(), values = Json::array(), tops = Json::array(), offsets = Json::array();
  for (auto const& lp : lps) {
    tokens.push_back(token_string(tok, lp.token));
    values.push_back(logprob_value(lp.logprob));
    Json top = Json::object();
    for (auto const& [id, v] : lp.top) {
      std::string s = token_string(tok, id);
      if (!top.contains(s)) top[s] = logprob_value(v);
    }
    if (std::string s = token_string(tok, lp.token); !top.contains(s)) top[s] = logprob_value(lp.logprob);
    tops.push_back(std::move(top));
    offsets.push_back(text_offset);
    text_offset += token_chars(tok, lp.token);
  }
  return {{"tokens", std::move(tokens)},
          {"token_logprobs", std::move(values)},
          {"top_logprobs", std::move(tops)},
          {"text_offset", std::move(offsets)}};
}

/// Chat's logprobs for `lps`: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}.
inline Json chat_logprobs(io::Tokenizer const& tok, std::span<runtime::TokenLogprob const> lps) {
  auto entry = [&](std::int32_t id, float v) {
    return Json{{"token", token_string(tok, id)}, {"logprob", logprob_value(v)}, {"bytes", token_bytes_json(tok, id)}};
  };
  Json content = Json::array();
  for (auto const& lp : lps) {
    Json e = entry(lp.token, lp.logprob);
    Json top = Json::array();
    for (auto const& [id, v] : lp.top) top.push_back(entry(id, v));
    e["top_logprobs"] = std::move(top);
    content.push_back(std::move(e));
  }
  return {{"content", std::move(content)}, {"refusal", nullptr}};
}

/// Adds `events` to the choices they belong to. Throws Error when an event names a choice
/// the request does not have (the engine broke its contract).
inline void gather(std::vector<ChoiceOutput>& choices, std::vector<runtime::ChoiceEvent>& events) {
  for (auto& e : events) {
    QFLASH_CHECK(e.index >= 0 && static_cast<std::size_t>(e.index) < choices.size(), "the engine sent choice ",
                 e.index, " of a request with ", choices.size());
    ChoiceOutput& c = choices[static_cast<std::size_t>(e.index)];
    c.text += e.text;
    c.logprobs.insert(c.logprobs.end(), std::make_move_iterator(e.logprobs.begin()),
                      std::make_move_iterator(e.logprobs.end()));
    if (e.finish) c.finish = e.finish;
  }
  events.clear();
}

/// The head every response object and chunk of a request starts with.
inline Json response_head(ResponseMeta const& meta, std::string_view object) {
  return {{"id", meta.id}, {"object", object}, {"created", meta.created}, {"model", meta.model}};
}

/// A non-streamed /v1/completions response.
inline Json completion_response(ResponseMeta const& meta, std::vector<ChoiceOutput> const& choices,
                                runtime::RequestUsage const& usage, io::Tokenizer const& tok, bool logprobs) {
  Json j = response_head(meta, "text_completion");
  Json cs = Json::array();
  for (std::size_t i = 0; i < choices.size(); ++i) {
    std::int64_t offset = 0;
    cs.push_back({{"index", i},
                  {"text", choices[i].text},
                  {"logprobs", logprobs ? completion_logprobs(tok, choices[i].logprobs, offset) : Json(nullptr)},
                  {"finish_reason", finish_json(choices[i].finish)}});
  }
  j["choices"] = std::move(cs);
  j["usage"] = usage_json(usage);
  return j;
}

/// A non-streamed /v1/chat/completions response.
inline Json chat_response(ResponseMeta const& meta, std::vector<ChoiceOutput> const& choices,
                          runtime::RequestUsage const& usage, io::Tokenizer const& tok, bool logprobs) {
  Json j = response_head(meta, "chat.completion");
  Json cs = Json::array();
  for (std::size_t i = 0; i < choices.size(); ++i)
    cs.push_back({{"index", i},
                  {"message", {{"role", "assistant"}, {"content", choices[i].text}, {"refusal", nullptr}}},
                  {"logprobs", logprobs ? chat_logprobs(tok, choices[i].logprobs) : Json(nullptr)},
                  {"finish_reason", finish_json(choices[i].finish)}});
  j["choices"] = std::move(cs);
  j["usage"] = usage_json(usage);
  return j;
}

/// The /generate answer.
inline Json generate_response(ChoiceOutput const& choice, runtime::RequestUsage const& usage, bool flash_used) {
  return {{"text", choice.text},
          {"finish_reason", finish_json(choice.finish)},
          {"usage", usage_json(usage)},
          {"flash_used", flash_used}};
}

/// Builds the chunks of one streamed request. With include_usage every chunk carries
/// "usage": null and a last chunk with no choices carries the usage, as OpenAI streams it.
class ChunkBuilder {
 public:
  ChunkBuilder(Api api, ResponseMeta meta, io::Tokenizer const& tok, int n, bool logprobs, bool include_usage)
      : api_(api), meta_(std::move(meta)), tok_(&tok), logprobs_(logprobs), include_usage_(include_usage),
        offsets_(static_cast<std::size_t>(n), 0) {}

  /// Chat's first chunk of each choice: the assistant role with empty content.
  [[nodiscard]] std::string role_chunks() const {
    std::string out;
    if (api_ != Api::kChat) return out;
    for (std::size_t i = 0; i < offsets_.size(); ++i)
      out += sse_event(chunk({{"index", i},
                              {"delta", {{"role", "assistant"}, {"content", ""}}},
                              {"logprobs", nullptr},
                              {"finish_reason", nullptr}}));
    return out;
  }

  /// The chunk of one event; empty when it carries nothing (text held back by a stop string).
  /// Throws Error when the event names a choice the request does not have.
  [[nodiscard]] std::string event(runtime::ChoiceEvent const& e) {
    QFLASH_CHECK(e.index >= 0 && static_cast<std::size_t>(e.index) < offsets_.size(), "the engine sent choice ",
                 e.index, " of a request with ", offsets_.size());
    bool const lp = logprobs_ && !e.logprobs.empty();
    if (e.text.empty() && !lp && !e.finish) return {};
    Json c = {{"index", e.index}};
    if (api_ == Api::kChat) {
      c["delta"] = e.text.empty() && e.finish ? Json::object() : Json{{"content", e.text}};
      c["logprobs"] = lp ? chat_logprobs(*tok_, e.logprobs) : Json(nullptr);
    } else {
      c["text"] = e.text;
      c["logprobs"] = lp ? completion_logprobs(*tok_, e.logprobs, offsets_[static_cast<std::size_t>(e.index)])
                         : Json(nullptr);
    }
    c["finish_reason"] = finish_json(e.finish);
    return sse_event(chunk(std::move(c)));
  }

  /// What ends the stream: the usage chunk when asked for, then [DONE].
  [[nodiscard]] std::string end(runtime::RequestUsage const& usage) const {
    std::string out;
    if (include_usage_) {
      Json j = response_head(meta_, object());
      j["choices"] = Json::array();
      j["usage"] = usage_json(usage);
      out += sse_event(j);
    }
    out += kSseDone;
    return out;
  }

  /// An error after the stream started (its status is already 200): an event with the
  /// error object, which OpenAI clients raise, then [DONE].
  [[nodiscard]] static std::string error(int status, std::string_view message) {
    return sse_event(error_body(status, message)) + std::string(kSseDone);
  }

 private:
  [[nodiscard]] std::string_view object() const {
    return api_ == Api::kChat ? "chat.completion.chunk" : "text_completion";
  }
  [[nodiscard]] Json chunk(Json choice) const {
    Json j = response_head(meta_, object());
    j["choices"] = Json::array({std::move(choice)});
    if (include_usage_) j["usage"] = nullptr;
    return j;
  }

  Api api_;
  ResponseMeta meta_;
  io::Tokenizer const* tok_;
  bool logprobs_;
  bool include_usage_;
  std::vector<std::int64_t> offsets_;  // per choice: characters before its next token (text_offset)
};

}  // namespace qflash::serve
