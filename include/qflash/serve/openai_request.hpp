/// @file
/// The requests of the HTTP API, parsed and checked into a runtime::GenerationRequest:
/// OpenAI's POST /v1/completions and /v1/chat/completions (messages rendered with the model's
/// chat template, io/chat_template.hpp) and the project's own POST /generate.
///
/// What is accepted follows OpenAI's API, with vLLM's sampling extensions (top_k, min_p,
/// repetition_penalty, ignore_eos, stop_token_ids, cache_salt, priority, chat_template_kwargs,
/// add_generation_prompt), the project's `routing` (experts per token, as `--routing` reads
/// it) and `lora` (a loaded LoRA adapter by name; `model` naming one picks it too, as in vLLM).
/// A field holding null counts as absent, as in OpenAI's API. Fields
/// OpenAI clients send that change nothing here (user, store, metadata, service_tier,
/// response_format of type text, ...) are accepted; fields that would change the output and
/// are not supported (tools that may be called, structured output, echo, best_of != n,
/// logit_bias, ...) are refused with a 400 naming them rather than ignored; unknown fields are
/// refused as OpenAI refuses them. Every refusal is an ApiError whose message names the field
/// and what was expected. Parsing allocates in proportion to the body and never recurses into
/// it deeper than kMaxJsonDepth. Host only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "qflash/io/chat_template.hpp"
#include "qflash/io/jinja.hpp"
#include "qflash/io/tokenizer.hpp"
#include "qflash/runtime/engine.hpp"
#include "qflash/runtime/request.hpp"
#include "qflash/runtime/sampler.hpp"
#include "qflash/serve/api_error.hpp"

namespace qflash::serve {

/// Request and response bodies keep their keys in order (tool schemas are rendered as sent).
using Json = nlohmann::ordered_json;

enum class Api { kCompletions, kChat, kGenerate };

/// Bounds the server puts on every request (flags of `qflash serve`).
struct RequestLimits {
  std::int64_t max_body_bytes = 4 << 20;  ///< larger bodies get 413
  int max_prompt_tokens = 0;              ///< 0: up to the context less one token
  int max_tokens = 0;                     ///< most tokens a choice may ask for (0: the context)
  int max_n = 8;                          ///< most choices per request
};

/// The engine checks every stop string against the text of every token it generates, so the
/// count and length of stop strings (and stop ids) bound what one request costs the others.
inline constexpr std::size_t kMaxStops = 16;
inline constexpr std::size_t kMaxStopBytes = 256;
inline constexpr std::size_t kMaxStopTokenIds = 64;
inline constexpr std::size_t kMaxCacheSaltBytes = 256;
/// Deepest nesting of a request body: requests nest a few levels, tool schemas a few more.
inline constexpr int kMaxJsonDepth = 64;
/// OpenAI's default max_tokens for /v1/completions (and here for /generate).
inline constexpr int kDefaultCompletionTokens = 16;

/// What parsing needs to know of the served model.
struct ModelContext {
  io::Tokenizer const* tokenizer = nullptr;
  io::ChatTemplate const* chat_template = nullptr;  ///< null: the model has none
  runtime::EngineInfo info;                         ///< max_context, default_sampling
  std::string served_name;                          ///< what a request's `model` must say
  std::int32_t vocab = 0;                           ///< prompt token ids are below it
  RequestLimits limits;
};

struct ParsedRequest {
  runtime::GenerationRequest generation;  ///< the server sets id, and the seed unless seed_given
  bool seed_given = false;
  bool cache_salt_given = false;
  bool stream = false;
  bool include_usage = false;  ///< stream_options.include_usage: a last chunk with the usage
};

namespace detail {

/// A value's kind and, for a scalar, its JSON (cut to 60 characters), for error messages.
inline std::string describe(Json const& v) {
  if (v.is_array()) return "a list";
  if (v.is_object()) return "an object";
  std::string s = v.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

inline bool contains(std::initializer_list<std::string_view> keys, std::string_view key) {
  return std::find(keys.begin(), keys.end(), key) != keys.end();
}

/// Typed reads of one JSON object's fields. A null field reads as absent; every failure is a
/// 400 whose param is the field's path ("stream_options.include_usage").
class Fields {
 public:
  Fields(Json const& object, std::string path = {}) : j_(&object), path_(std::move(path)) {}

  [[nodiscard]] std::string name(std::string_view key) const {
    return path_.empty() ? std::string(key) : path_ + "." + std::string(key);
  }
  /// The field, or nullptr when it is absent or null.
  [[nodiscard]] Json const* find(std::string_view key) const {
    auto it = j_->find(std::string(key));
    return it == j_->end() || it->is_null() ? nullptr : &*it;
  }
  [[nodiscard]] bool has(std::string_view key) const { return find(key) != nullptr; }

  [[noreturn]] void fail(std::string_view key, std::string_view expected) const {
    Json const* v = find(key);
    QFLASH_API_FAIL(400, name(key), "", "'", name(key), "' must be ", expected, ", got ",
                    v ? describe(*v) : std::string("null"));
  }
  /// Refuses every key not in `known`, as OpenAI does ("unrecognized request argument").
  void only(std::initializer_list<std::string_view> known) const {
    for (auto it = j_->begin(); it != j_->end(); ++it)
      if (!contains(known, it.key()))
        QFLASH_API_FAIL(400, name(it.key()), "", "unrecognized request argument '", name(it.key()), "'");
  }

  [[nodiscard]] std::optional<bool> boolean(std::string_view key) const {
    Json const* v = find(key);
    if (!v) return std::nullopt;
    if (!v->is_boolean()) fail(key, "true or false");
    return v->get<bool>();
  }
  [[nodiscard]] std::optional<std::string> string(std::string_view key) const {
    Json const* v = find(key);
    if (!v) return std::nullopt;
    if (!v->is_string()) fail(key, "a string");
    return v->get<std::string>();
  }
  /// An integer (JSON without a fraction or exponent) in [lo, hi]; `expected` says so in
  /// errors (default: "an integer in [lo, hi]", or "an integer >= lo" when hi is int32's
  /// maximum or above).
  [[nodiscard]] std::optional<std::int64_t> integer(std::string_view key, std::int64_t lo, std::int64_t hi,
                                                    std::string_view expected = {}) const {
    Json const* v = find(key);
    if (!v) return std::nullopt;
    auto x = as_integer(*v);
    if (!x || *x < lo || *x > hi) {
      if (!expected.empty()) fail(key, expected);
      fail(key, hi >= std::numeric_limits<std::int32_t>::max()
                    ? "an integer >= " + std::to_string(lo)
                    : "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    }
    return x;
  }
  /// A number x, as a float, with lo <= x (lo < x when `lo_open`) and x <= hi.
  [[nodiscard]] std::optional<float> number(std::string_view key, float lo, float hi, bool lo_open = false) const {
    Json const* v = find(key);
    if (!v) return std::nullopt;
    float const x = v->is_number() ? static_cast<float>(v->get<double>()) : NAN;
    if (!(x >= lo && x <= hi && (!lo_open || x > lo)))
      fail(key, std::string("a number in ") + (lo_open ? "(" : "[") + format(lo) + ", " + format(hi) + "]");
    return x;
  }
  [[nodiscard]] Json const& json() const { return *j_; }

  static std::optional<std::int64_t> as_integer(Json const& v) {
    if (v.is_number_unsigned()) {
      auto const u = v.get<std::uint64_t>();
      if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) return std::nullopt;
      return static_cast<std::int64_t>(u);
    }
    if (v.is_number_integer()) return v.get<std::int64_t>();
    return std::nullopt;
  }

 private:
  static std::string format(float x) {
    std::string s = std::to_string(x);
    s.erase(s.find_last_not_of('0') + 1);
    if (s.back() == '.') s.pop_back();
    return s;
  }

  Json const* j_;
  std::string path_;
};

/// Token ids in [0, vocab), from a JSON list already known to be one.
inline std::vector<std::int32_t> token_ids(Json const& list, std::string const& param, std::int32_t vocab) {
  std::vector<std::int32_t> ids;
  ids.reserve(list.size());
  for (std::size_t i = 0; i < list.size(); ++i) {
    auto const x = Fields::as_integer(list[i]);
    if (!x || *x < 0 || *x >= vocab)
      QFLASH_API_FAIL(400, param, "", "'", param, "[", i, "]' must be a token id in [0, ", vocab, "), got ",
                      describe(list[i]));
    ids.push_back(static_cast<std::int32_t>(*x));
  }
  return ids;
}

inline bool all_integers(Json const& list) {
  return std::all_of(list.begin(), list.end(), [](Json const& e) { return e.is_number_integer(); });
}

/// The prompt of /v1/completions and /generate: a string, a list of token ids, or a list
/// holding one of those (a batch of several prompts is refused).
inline std::vector<std::int32_t> prompt_tokens(Fields const& f, ModelContext const& m) {
  Json const* p = f.find("prompt");
  if (!p) QFLASH_API_FAIL(400, "prompt", "", "missing field 'prompt' (a string or a list of token ids)");
  Json const* one = p;
  if (p->is_array() && !p->empty() && (p->front().is_string() || p->front().is_array())) {
    if (p->size() > 1)
      QFLASH_API_FAIL(400, "prompt", "", "'prompt' holds ", p->size(),
                      " prompts; this server takes one prompt per request (send one request per prompt)");
    one = &p->front();
  }
  if (one->is_string()) return m.tokenizer->encode(one->get_ref<std::string const&>());
  if (one->is_array() && all_integers(*one)) return token_ids(*one, "prompt", m.vocab);
  f.fail("prompt", "a string or a list of token ids");
}

/// The sampling fields. A request that sets none of temperature, top_p, top_k, min_p and
/// repetition_penalty samples as the model's generation_config.json says; one that sets any
/// starts from OpenAI's defaults (temperature 1, top_p 1, no other filter).
inline runtime::SamplingParams sampling(Fields const& f, runtime::SamplingParams const& model_defaults) {
  bool any = false;
  for (std::string_view key : {"temperature", "top_p", "top_k", "min_p", "repetition_penalty"}) any = any || f.has(key);
  runtime::SamplingParams p;
  if (any) {
    p.temperature = 1.0f;
  } else {
    p = model_defaults;
  }
  if (auto x = f.number("temperature", 0.0f, 2.0f)) p.temperature = *x;
  if (auto x = f.number("top_p", 0.0f, 1.0f, /*lo_open=*/true)) p.top_p = *x;
  if (auto x = f.integer("top_k", -1, std::numeric_limits<std::int32_t>::max())) p.top_k = *x > 0 ? static_cast<int>(*x) : 0;
  if (auto x = f.number("min_p", 0.0f, 1.0f)) p.min_p = *x;
  if (auto x = f.number("repetition_penalty", 0.0f, 100.0f, /*lo_open=*/true)) p.repetition_penalty = *x;
  return p;
}

/// `stop`: a string or a list of them, each non-empty.
inline std::vector<std::string> stop_strings(Fields const& f) {
  Json const* v = f.find("stop");
  if (!v) return {};
  std::string const expected = "a non-empty string of at most " + std::to_string(kMaxStopBytes) +
                               " bytes, or a list of at most " + std::to_string(kMaxStops) + " such strings";
  std::vector<std::string> out;
  auto add = [&](Json const& s) {
    if (!s.is_string() || s.get_ref<std::string const&>().empty() || s.get_ref<std::string const&>().size() > kMaxStopBytes)
      f.fail("stop", expected);
    out.push_back(s.get<std::string>());
  };
  if (v->is_array()) {
    if (v->size() > kMaxStops) f.fail("stop", expected);
    for (auto const& s : *v) add(s);
  } else {
    add(*v);
  }
  return out;
}

/// The project's `lora`: a loaded adapter by name (400 otherwise); it wins over `model`'s.
inline void lora_field(Fields const& f, ModelContext const& m, runtime::GenerationRequest& g) {
  auto name = f.string("lora");
  if (!name) return;
  auto const& a = m.info.adapters;
  if (std::find(a.begin(), a.end(), *name) == a.end()) {
    std::string loaded;
    for (auto const& n : a) loaded += (loaded.empty() ? "'" : ", '") + n + "'";
    QFLASH_API_FAIL(400, "lora", "", "'lora' names no loaded adapter: '", *name, "' (loaded: ",
                    loaded.empty() ? "none; start the server with --lora NAME=DIR" : loaded, ")");
  }
  g.lora = *name;
}

/// The fields /v1/completions, /v1/chat/completions and /generate share: the token budget
/// (the prompt decides the rest), sampling, penalties, stops, salt, priority, routing and adapter.
inline void common_fields(Fields const& f, ModelContext const& m, ParsedRequest& r) {
  runtime::GenerationRequest& g = r.generation;
  g.sampling = sampling(f, m.info.default_sampling);
  if (auto s = f.integer("seed", std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max(),
                         "a 64-bit integer")) {
    g.sampling.seed = static_cast<std::uint64_t>(*s);
    r.seed_given = true;
  }
  if (auto x = f.number("frequency_penalty", -2.0f, 2.0f)) g.frequency_penalty = *x;
  if (auto x = f.number("presence_penalty", -2.0f, 2.0f)) g.presence_penalty = *x;
  g.stop = stop_strings(f);
  if (Json const* ids = f.find("stop_token_ids")) {
    if (!ids->is_array() || ids->size() > kMaxStopTokenIds)
      f.fail("stop_token_ids", "a list of at most " + std::to_string(kMaxStopTokenIds) + " token ids");
    g.stop_token_ids = token_ids(*ids, "stop_token_ids", m.vocab);
  }
  g.ignore_eos = f.boolean("ignore_eos").value_or(false);
  if (auto salt = f.string("cache_salt")) {
    if (salt->size() > kMaxCacheSaltBytes)
      f.fail("cache_salt", "a string of at most " + std::to_string(kMaxCacheSaltBytes) + " bytes");
    g.cache_salt = std::move(*salt);
    r.cache_salt_given = true;
  }
  if (auto p = f.integer("priority", std::numeric_limits<std::int32_t>::min(), std::numeric_limits<std::int32_t>::max(),
                         "a 32-bit integer (smaller runs first)"))
    g.priority = static_cast<int>(*p);
  lora_field(f, m, g);
  if (auto text = f.string("routing")) {
    try {
      g.routing = model::parse_routing(*text);
      if (m.info.n_expert > 0) model::check_routing(*g.routing, m.info.n_expert, m.info.n_expert_used);
    } catch (Error const& e) {
      QFLASH_API_FAIL(400, "routing", "", "'routing' must be top_k, top_k=K, top_p=P[,k_min=A][,k_max=B] or "
                                          "threshold=T[,k_min=A][,k_max=B]: ", e.what());
    }
  }
}

/// The most tokens a choice may ask for: the server's limit, else the context.
inline int max_tokens_limit(ModelContext const& m) {
  return m.limits.max_tokens > 0 ? std::min(m.limits.max_tokens, m.info.max_context) : m.info.max_context;
}

/// Checks the prompt's length against the context and the server's limit.
inline void check_prompt(std::size_t n, ModelContext const& m, std::string const& param) {
  if (n == 0) QFLASH_API_FAIL(400, param, "", "'", param, "' encodes to no tokens; there is nothing to continue");
  auto const context = static_cast<std::size_t>(m.info.max_context);
  if (n >= context)
    QFLASH_API_FAIL(400, param, "context_length_exceeded", "this model's maximum context length is ", context,
                    " tokens; the prompt has ", n, " tokens, which leaves no room to generate");
  if (m.limits.max_prompt_tokens > 0 && n > static_cast<std::size_t>(m.limits.max_prompt_tokens))
    QFLASH_API_FAIL(400, param, "", "the prompt has ", n, " tokens, more than this server's limit of ",
                    m.limits.max_prompt_tokens);
}

/// `model`, when given, must name the served model or one of its LoRA adapters (which it then
/// picks, as vLLM's LoRA serving does); 404 otherwise, as OpenAI answers.
inline void check_model(Fields const& f, ModelContext const& m, runtime::GenerationRequest& g) {
  auto name = f.string("model");
  if (!name || *name == m.served_name) return;
  auto const& a = m.info.adapters;
  if (std::find(a.begin(), a.end(), *name) != a.end()) {
    g.lora = *name;
    return;
  }
  std::string served = "'" + m.served_name + "'";
  for (auto const& n : a) served += ", '" + n + "'";
  QFLASH_API_FAIL(404, "model", "model_not_found", "the model '", *name, "' does not exist; this server serves ", served);
}


/// stream and stream_options (which OpenAI allows only with stream: true).
inline void stream_fields(Fields const& f, ParsedRequest& r) {
  r.stream = f.boolean("stream").value_or(false);
  Json const* so = f.find("stream_options");
  if (!so) return;
  if (!so->is_object()) f.fail("stream_options", "an object");
  if (!r.stream)
    QFLASH_API_FAIL(400, "stream_options", "", "'stream_options' is only allowed when 'stream' is true");
  Fields const o(*so, "stream_options");
  o.only({"include_usage", "include_obfuscation"});
  r.include_usage = o.boolean("include_usage").value_or(false);
  (void)o.boolean("include_obfuscation");  // obfuscation pads chunks against side channels; none here
}

/// Fields OpenAI clients send that change nothing here, checked for their type only.
inline void accepted_fields(Fields const& f) {
  for (std::string_view key : {"user", "service_tier", "prompt_cache_key", "safety_identifier"}) (void)f.string(key);
  (void)f.boolean("store");  // nothing is stored
  if (Json const* md = f.find("metadata"); md && !md->is_object()) f.fail("metadata", "an object");
}

/// Fields that would change the output and that this server does not implement: refused
/// unless they hold their no-op value.
inline void refused_fields(Fields const& f) {
  if (Json const* lb = f.find("logit_bias"); lb && !(lb->is_object() && lb->empty()))
    QFLASH_API_FAIL(400, "logit_bias", "", "'logit_bias' is not supported");
  if (auto n = f.integer("min_tokens", 0, std::numeric_limits<std::int64_t>::max()); n && *n > 0)
    QFLASH_API_FAIL(400, "min_tokens", "", "'min_tokens' is not supported (only 0)");
}

/// `n` and max_tokens (chat: max_completion_tokens first, else max_tokens). Without either,
/// kDefaultCompletionTokens; parse_request gives chat requests the rest of the context instead.
inline void budget_fields(Fields const& f, ModelContext const& m, ParsedRequest& r, bool chat) {
  r.generation.n = static_cast<int>(f.integer("n", 1, m.limits.max_n).value_or(1));
  int const limit = max_tokens_limit(m);
  std::string_view const key = chat && f.has("max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  r.generation.max_tokens = static_cast<int>(f.integer(key, 1, limit).value_or(std::min(kDefaultCompletionTokens, limit)));
}

/// A message's content as the template takes it: a string (text parts joined by newlines, as
/// vLLM joins them), or absent/null (an assistant message with tool calls).
inline Json message_content(Json const& content, std::string const& at) {
  if (content.is_null() || content.is_string()) return content;
  if (!content.is_array())
    QFLASH_API_FAIL(400, at, "", "'", at, "' must be a string or a list of content parts, got ", describe(content));
  std::string text;
  for (std::size_t j = 0; j < content.size(); ++j) {
    Json const& part = content[j];
    std::string const where = at + "[" + std::to_string(j) + "]";
    if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
      QFLASH_API_FAIL(400, where, "", "'", where, "' must be a content part {\"type\": \"text\", \"text\": ...}, got ",
                      describe(part));
    std::string const& type = part["type"].get_ref<std::string const&>();
    if (type != "text")
      QFLASH_API_FAIL(400, where, "", "'", where, "': content parts of type '", type,
                      "' are not supported (this model takes text only)");
    if (!part.contains("text") || !part["text"].is_string())
      QFLASH_API_FAIL(400, where + ".text", "", "'", where, ".text' must be a string");
    if (j > 0) text += '\n';
    text += part["text"].get_ref<std::string const&>();
  }
  return text;
}

/// The messages with their content made strings; other keys (name, tool_calls, ...) pass to
/// the template as sent.
inline Json chat_messages(Fields const& f) {
  Json const* ms = f.find("messages");
  if (!ms) QFLASH_API_FAIL(400, "messages", "", "missing field 'messages' (a non-empty list of messages)");
  if (!ms->is_array() || ms->empty()) f.fail("messages", "a non-empty list of messages");
  Json out = Json::array();
  for (std::size_t i = 0; i < ms->size(); ++i) {
    Json const& msg = (*ms)[i];
    std::string const at = "messages[" + std::to_string(i) + "]";
    if (!msg.is_object()) QFLASH_API_FAIL(400, at, "", "'", at, "' must be an object, got ", describe(msg));
    if (!msg.contains("role") || !msg["role"].is_string())
      QFLASH_API_FAIL(400, at + ".role", "", "'", at, ".role' must be a string");
    Json m = msg;
    if (msg.contains("content")) m["content"] = message_content(msg["content"], at + ".content");
    out.push_back(std::move(m));
  }
  return out;
}

/// Tools: tool calls are never parsed out of the output here, so a request whose tools the
/// model may call is refused; tools with tool_choice "none" are not shown to the model, whose
/// answer is then plain text, as OpenAI promises for "none".
inline void tool_fields(Fields const& f) {
  Json const* tools = f.find("tools");
  if (tools && !tools->is_array()) f.fail("tools", "a list of tools");
  bool const has_tools = tools && !tools->empty();
  std::string choice = "auto";
  if (Json const* tc = f.find("tool_choice")) {
    if (tc->is_string()) choice = tc->get<std::string>();
    else if (tc->is_object()) choice = "a named function";
    else f.fail("tool_choice", "\"none\", \"auto\", \"required\" or an object naming a function");
    if (choice != "none" && choice != "auto" && choice != "required" && choice != "a named function")
      f.fail("tool_choice", "\"none\", \"auto\", \"required\" or an object naming a function");
  }
  if (has_tools && choice != "none")
    QFLASH_API_FAIL(400, "tools", "", "tool calls are not supported by this server (the output is not parsed into "
                    "tool_calls); leave out 'tools' or set 'tool_choice' to \"none\"");
  if (!has_tools && choice != "none" && choice != "auto")
    QFLASH_API_FAIL(400, "tool_choice", "", "'tool_choice' asks for a tool call (", choice,
                    "), but tool calls are not supported by this server");
  (void)f.boolean("parallel_tool_calls");
  for (std::string_view key : {"functions", "function_call"})
    if (f.has(key)) QFLASH_API_FAIL(400, std::string(key), "", "'", key, "' is not supported (no tool calls)");
}

/// Chat fields that would change the output and are not supported here.
inline void chat_refused_fields(Fields const& f) {
  if (Json const* rf = f.find("response_format")) {
    if (!rf->is_object() || !rf->contains("type") || !(*rf)["type"].is_string())
      f.fail("response_format", "an object {\"type\": ...}");
    if ((*rf)["type"] != "text")
      QFLASH_API_FAIL(400, "response_format", "", "'response_format' of type ", describe((*rf)["type"]),
                      " is not supported: structured output is not implemented; only {\"type\": \"text\"}");
  }
  if (Json const* mod = f.find("modalities")) {
    if (!mod->is_array()) f.fail("modalities", "[\"text\"]");
    for (auto const& x : *mod)
      if (x != "text") QFLASH_API_FAIL(400, "modalities", "", "'modalities' may only hold \"text\", got ", describe(x));
  }
  for (std::string_view key : {"audio", "prediction", "web_search_options", "reasoning_effort", "verbosity"})
    if (f.has(key)) QFLASH_API_FAIL(400, std::string(key), "", "'", key, "' is not supported by this server");
}

/// The snapshot hints of a chat prompt (runtime::GenerationRequest::snapshot_hints): where the
/// first message (the system prompt, usually shared) and each of the last few messages end in
/// `prompt`, found by rendering the conversation up to each; a prefix the template renders
/// otherwise, or whose tokens are not the prompt's first ones, gives none.
inline std::vector<std::int32_t> chat_snapshot_hints(io::ChatInput const& full, std::vector<std::int32_t> const& prompt,
                                                     ModelContext const& m) {
  constexpr std::size_t kLastTurns = 3;
  std::size_t const n = full.messages.size();
  std::vector<std::int32_t> hints;
  for (std::size_t k = 1; k < n; ++k) {
    if (k != 1 && k + kLastTurns < n) continue;
    io::ChatInput part = full;
    part.messages = nlohmann::ordered_json(full.messages.begin(), full.messages.begin() + static_cast<std::ptrdiff_t>(k));
    part.add_generation_prompt = false;
    std::vector<std::int32_t> ids;
    try {
      ids = m.tokenizer->encode(m.chat_template->render(part));
    } catch (std::exception const&) {
      continue;  // templates may refuse a partial conversation (e.g. one without a user turn)
    }
    if (ids.empty() || ids.size() >= prompt.size() || !std::equal(ids.begin(), ids.end(), prompt.begin())) continue;
    if (hints.empty() || static_cast<std::int32_t>(ids.size()) > hints.back())
      hints.push_back(static_cast<std::int32_t>(ids.size()));
  }
  return hints;
}

/// The prompt of a chat request: the messages rendered with the model's template; `hints`
/// gets where its messages end (chat_snapshot_hints).
inline std::vector<std::int32_t> chat_prompt(Fields const& f, ModelContext const& m, std::vector<std::int32_t>& hints) {
  if (!m.chat_template)
    QFLASH_API_FAIL(400, "messages", "no_chat_template", "this model has no chat template; use /v1/completions");
  io::ChatInput in;
  in.messages = chat_messages(f);
  in.add_generation_prompt = f.boolean("add_generation_prompt").value_or(true);
  if (Json const* kw = f.find("chat_template_kwargs")) {
    if (!kw->is_object()) f.fail("chat_template_kwargs", "an object");
    in.extra = *kw;
  }
  std::string text;
  try {
    text = m.chat_template->render(in);
  } catch (io::jinja::RaisedError const& e) {
    QFLASH_API_FAIL(400, "messages", "", "the model's chat template refused the messages: ", e.template_message());
  } catch (Error const& e) {
    QFLASH_API_FAIL(400, "messages", "", "the model's chat template could not render the messages: ", e.what());
  }
  std::vector<std::int32_t> prompt = m.tokenizer->encode(text);
  hints = chat_snapshot_hints(in, prompt, m);
  return prompt;
}

}  // namespace detail

/// Parses a request body: a JSON object nested at most kMaxJsonDepth deep (400 otherwise).
inline Json parse_body(std::string_view body) {
  Json j;
  try {
    j = Json::parse(body.begin(), body.end(), [](int depth, Json::parse_event_t, Json&) {
      if (depth >= kMaxJsonDepth)  // depth 0 is the top-level object
        QFLASH_API_FAIL(400, "", "", "the request body nests deeper than ", kMaxJsonDepth, " levels");
      return true;
    });
  } catch (Json::exception const& e) {
    QFLASH_API_FAIL(400, "", "", "the request body is not valid JSON: ", e.what());
  }
  if (!j.is_object())
    QFLASH_API_FAIL(400, "", "", "the request body must be a JSON object, got ", detail::describe(j));
  return j;
}

/// Checks `body` (from parse_body) as a request to `api` and turns it into what the engine
/// runs. Throws ApiError (400; 404 for another model's name).
inline ParsedRequest parse_request(Api api, Json const& body, ModelContext const& m) {
  detail::Fields const f(body);
  ParsedRequest r;
  runtime::GenerationRequest& g = r.generation;
  switch (api) {
    case Api::kCompletions:
      f.only({"model", "prompt", "stream", "stream_options", "max_tokens", "n", "temperature", "top_p", "top_k",
              "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "seed", "stop",
              "stop_token_ids", "ignore_eos", "cache_salt", "priority", "routing", "lora", "logprobs", "echo", "best_of",
              "suffix", "logit_bias", "min_tokens", "user", "service_tier", "store", "metadata", "prompt_cache_key",
              "safety_identifier"});
      break;
    case Api::kChat:
      f.only({"model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "n",
              "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
              "presence_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "cache_salt", "priority",
              "routing", "lora", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "functions",
              "function_call", "response_format", "modalities", "audio", "prediction", "web_search_options",
              "reasoning_effort", "verbosity", "chat_template_kwargs", "add_generation_prompt", "logit_bias",
              "min_tokens", "user", "service_tier", "store", "metadata", "prompt_cache_key", "safety_identifier"});
      break;
    case Api::kGenerate:
      f.only({"prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
              "frequency_penalty", "presence_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "cache_salt",
              "priority", "routing", "lora"});
      break;
  }

  if (api != Api::kGenerate) {
    detail::check_model(f, m, g);
    detail::stream_fields(f, r);
    detail::accepted_fields(f);
    detail::refused_fields(f);
  }
  detail::common_fields(f, m, r);
  detail::budget_fields(f, m, r, api == Api::kChat);

  if (api == Api::kCompletions) {
    if (auto lp = f.integer("logprobs", 0, runtime::kMaxTopLogprobs)) g.top_logprobs = static_cast<int>(*lp);
    if (f.boolean("echo").value_or(false))
      QFLASH_API_FAIL(400, "echo", "", "'echo' is not supported (the prompt is not returned with the completion)");
    if (auto b = f.integer("best_of", 1, std::numeric_limits<std::int64_t>::max()); b && *b != g.n)
      QFLASH_API_FAIL(400, "best_of", "", "'best_of' must equal n (", g.n, "), got ", *b,
                      ": choosing the best of several completions is not supported");
    if (auto s = f.string("suffix"); s && !s->empty())
      QFLASH_API_FAIL(400, "suffix", "", "'suffix' is not supported (no insertion)");
  }
  if (api == Api::kChat) {
    bool const logprobs = f.boolean("logprobs").value_or(false);
    auto const top = f.integer("top_logprobs", 0, runtime::kMaxTopLogprobs);
    if (top && !logprobs)
      QFLASH_API_FAIL(400, "top_logprobs", "", "'top_logprobs' needs 'logprobs' set to true");
    g.top_logprobs = logprobs ? static_cast<int>(top.value_or(0)) : -1;
    detail::tool_fields(f);
    detail::chat_refused_fields(f);
  }

  // The prompt last: tokenizing and rendering cost the most.
  std::string const param = api == Api::kChat ? "messages" : "prompt";
  g.prompt = api == Api::kChat ? detail::chat_prompt(f, m, g.snapshot_hints) : detail::prompt_tokens(f, m);
  detail::check_prompt(g.prompt.size(), m, param);
  bool const explicit_budget = f.has("max_tokens") || (api == Api::kChat && f.has("max_completion_tokens"));
  if (api == Api::kChat && !explicit_budget)  // OpenAI's chat default: up to the end of the context
    g.max_tokens = std::min(detail::max_tokens_limit(m), m.info.max_context - static_cast<int>(g.prompt.size()));
  return r;
}

}  // namespace qflash::serve
