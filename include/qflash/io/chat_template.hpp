/// @file
/// A model's chat template: found in its directory as transformers finds it, and rendered
/// from OpenAI-style messages into the prompt text `tokenizer.apply_chat_template(messages,
/// tools=..., add_generation_prompt=..., tokenize=False, **kwargs)` returns (transformers
/// 5.24: messages prepared by tokenization_utils_base.py and chat_template_utils.py).
/// Host only; the engine is jinja.hpp.
#pragma once

#include <cstddef>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "qflash/core/error.hpp"
#include "qflash/core/mapped_file.hpp"
#include "qflash/io/jinja.hpp"
#include "qflash/io/json.hpp"

namespace qflash::io {

/// What a template is rendered with, besides the special tokens.
struct ChatInput {
  /// `[{"role": ..., "content": ..., "tool_calls"?, "reasoning_content"?, ...}, ...]`; content
  /// is a string or a list of content parts. Keys whose value is null are dropped first.
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  std::optional<nlohmann::ordered_json> tools;      ///< tool definitions (JSON schemas); none: None
  std::optional<nlohmann::ordered_json> documents;  ///< RAG documents; none: None
  bool add_generation_prompt = false;
  /// More variables for the template, e.g. {"enable_thinking": false}; they override special
  /// tokens of the same name, as keyword arguments of apply_chat_template do.
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();
};

/// A model's chat template with the special tokens it may use. Immutable; render() may run on
/// many threads at once.
class ChatTemplate {
 public:
  /// The named special tokens transformers gives templates (special_tokens_map).
  static constexpr std::string_view kSpecialTokenNames[] = {
      "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"};

  /// `source` parsed under `name` (errors start with it); `special_tokens` maps names from
  /// kSpecialTokenNames to token strings. Throws Error on a malformed template.
  ChatTemplate(std::string_view source, std::string name,
               std::vector<std::pair<std::string, std::string>> special_tokens = {})
      : default_(source, std::move(name)), special_tokens_(std::move(special_tokens)) {}

  /// The chat template of a Hugging Face model directory: `chat_template.jinja` when present,
  /// else tokenizer_config.json's "chat_template", a string or a list of {"name", "template"}
  /// (the one named "default" is used, and "tool_use", when present, for requests with tools).
  /// Special tokens come from tokenizer_config.json. Returns nullopt when the model has no
  /// chat template; throws Error naming the file when one is malformed.
  static std::optional<ChatTemplate> load(std::string const& dir) {
    namespace fs = std::filesystem;
    std::string const config_path = (fs::path(dir) / "tokenizer_config.json").string();
    std::string const jinja_path = (fs::path(dir) / "chat_template.jinja").string();
    std::optional<Json> config;
    if (fs::exists(config_path)) config = read_json_file(config_path);
    if (config && !config->is_object())
      QFLASH_FAIL(config_path, ": the top level must be a JSON object, got ", json_excerpt(*config));
    std::vector<std::pair<std::string, std::string>> tokens;
    if (config) tokens = special_tokens_of(*config, config_path);

    if (fs::exists(jinja_path)) {
      MappedFile const file(jinja_path);
      return ChatTemplate(text_of(file), jinja_path, std::move(tokens));
    }
    if (!config) return std::nullopt;
    auto const it = config->find("chat_template");
    if (it == config->end() || it->is_null()) return std::nullopt;
    std::string const field = config_path + ": chat_template";
    if (it->is_string()) return ChatTemplate(it->get_ref<std::string const&>(), field, std::move(tokens));
    QFLASH_CHECK(it->is_array(), config_path,
                 ": field 'chat_template' must be a string or a list of {\"name\", \"template\"}, got ",
                 json_excerpt(*it));
    std::optional<ChatTemplate> chosen;
    std::optional<jinja::Template> tool_use;
    std::string names;
    for (std::size_t i = 0; i < it->size(); ++i) {
      Json const& entry = (*it)[i];
      std::string const at = "chat_template[" + std::to_string(i) + "]";
      QFLASH_CHECK(entry.is_object() && entry.contains("name") && entry["name"].is_string() &&
                       entry.contains("template") && entry["template"].is_string(),
                   config_path, ": field '", at, "' must be {\"name\": string, \"template\": string}, got ",
                   json_excerpt(entry));
      std::string const& name = entry["name"].get_ref<std::string const&>();
      std::string const& source = entry["template"].get_ref<std::string const&>();
      names += (names.empty() ? "'" : ", '") + name + "'";
      if (name == "default") chosen.emplace(source, field + " '" + name + "'", tokens);
      else if (name == "tool_use") tool_use.emplace(source, field + " '" + name + "'");
    }
    QFLASH_CHECK(chosen.has_value(), config_path, ": field 'chat_template' has no template named 'default' (",
                 names.empty() ? std::string("it is empty") : "it has " + names, ")");
    chosen->tool_use_ = std::move(tool_use);
    return chosen;
  }

  /// The prompt for `in`. Throws Error when the messages are malformed (naming the message and
  /// field), when the template fails (naming its line and column), and jinja::RaisedError when
  /// the template refuses the conversation with raise_exception().
  [[nodiscard]] std::string render(ChatInput const& in) const {
    nlohmann::ordered_json vars = nlohmann::ordered_json::object();
    vars["messages"] = prepare_messages(in.messages);
    vars["tools"] = in.tools ? checked_list(*in.tools, "tools") : nullptr;
    vars["documents"] = in.documents ? checked_list(*in.documents, "documents") : nullptr;
    vars["add_generation_prompt"] = in.add_generation_prompt;
    for (auto const& [name, token] : special_tokens_) vars[name] = token;
    QFLASH_CHECK(in.extra.is_object(), "chat template: extra variables must be a JSON object, got ",
                 json_excerpt(in.extra));
    for (auto const& [key, value] : in.extra.items()) {
      QFLASH_CHECK(key != "messages" && key != "tools" && key != "documents" && key != "add_generation_prompt",
                   "chat template: extra variable '", key, "' would replace the argument of that name");
      vars[key] = value;
    }
    jinja::Template const& t = in.tools && tool_use_ ? *tool_use_ : default_;
    return t.render(vars);
  }

  /// A special token ("bos_token", "eos_token", ...) as tokenizer_config.json gives it.
  [[nodiscard]] std::optional<std::string> special_token(std::string_view name) const {
    for (auto const& [k, v] : special_tokens_)
      if (k == name) return v;
    return std::nullopt;
  }
  [[nodiscard]] std::optional<std::string> bos_token() const { return special_token("bos_token"); }
  [[nodiscard]] std::optional<std::string> eos_token() const { return special_token("eos_token"); }
  [[nodiscard]] std::string const& name() const { return default_.name(); }

 private:
  static std::string_view text_of(MappedFile const& f) {
    return {reinterpret_cast<char const*>(f.data()), f.bytes().size()};
  }

  /// A special token is a string, an AddedToken object {"content": string, ...}, or null.
  static std::vector<std::pair<std::string, std::string>> special_tokens_of(Json const& config,
                                                                            std::string const& path) {
    std::vector<std::pair<std::string, std::string>> out;
    for (std::string_view name : kSpecialTokenNames) {
      auto const it = config.find(name);
      if (it == config.end() || it->is_null()) continue;
      if (it->is_string()) {
        out.emplace_back(name, it->get<std::string>());
      } else if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
        out.emplace_back(name, (*it)["content"].get<std::string>());
      } else {
        QFLASH_FAIL(path, ": field '", name, "' must be a string, {\"content\": string, ...} or null, got ",
                    json_excerpt(*it));
      }
    }
    return out;
  }

  static nlohmann::ordered_json checked_list(nlohmann::ordered_json const& v, std::string_view what) {
    QFLASH_CHECK(v.is_array(), "chat template: ", what, " must be a list, got ", json_excerpt(v));
    for (std::size_t i = 0; i < v.size(); ++i)
      QFLASH_CHECK(v[i].is_object(), "chat template: ", what, "[", i, "] must be an object, got ", json_excerpt(v[i]));
    return v;
  }

  /// transformers' preparation: keys holding null dropped; the reasoning, under any of
  /// "reasoning_content", "thinking" or "reasoning", also given as "thinking" (first) and
  /// "reasoning_content", which is what templates read.
  static nlohmann::ordered_json prepare_messages(nlohmann::ordered_json const& messages) {
    QFLASH_CHECK(messages.is_array() && !messages.empty(),
                 "chat template: messages must be a non-empty list, got ", json_excerpt(messages));
    nlohmann::ordered_json out = nlohmann::ordered_json::array();
    for (std::size_t i = 0; i < messages.size(); ++i) {
      auto const& m = messages[i];
      std::string const at = "chat template: messages[" + std::to_string(i) + "]";
      QFLASH_CHECK(m.is_object(), at, " must be an object, got ", json_excerpt(m));
      nlohmann::ordered_json msg = nlohmann::ordered_json::object();
      for (auto const& [key, value] : m.items())
        if (!value.is_null()) msg[key] = value;
      QFLASH_CHECK(msg.contains("role") && msg["role"].is_string(), at, ".role must be a string, got ",
                   msg.contains("role") ? json_excerpt(msg["role"]) : std::string("nothing"));
      if (msg.contains("content"))
        QFLASH_CHECK(msg["content"].is_string() || msg["content"].is_array(), at,
                     ".content must be a string or a list of content parts, got ", json_excerpt(msg["content"]));
      if (msg.contains("tool_calls"))
        QFLASH_CHECK(msg["tool_calls"].is_array(), at, ".tool_calls must be a list, got ",
                     json_excerpt(msg["tool_calls"]));
      nlohmann::ordered_json const* reasoning = nullptr;
      for (char const* key : {"reasoning_content", "thinking", "reasoning"})
        if (msg.contains(key)) {
          reasoning = &msg[key];
          break;
        }
      if (reasoning) {
        nlohmann::ordered_json aliased = nlohmann::ordered_json::object();
        aliased["thinking"] = *reasoning;
        for (auto const& [key, value] : msg.items()) aliased[key] = value;
        aliased["reasoning_content"] = *reasoning;
        msg = std::move(aliased);
      }
      out.push_back(std::move(msg));
    }
    return out;
  }

  jinja::Template default_;
  std::optional<jinja::Template> tool_use_;
  std::vector<std::pair<std::string, std::string>> special_tokens_;
};

}  // namespace qflash::io
