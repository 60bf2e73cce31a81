/// @file
/// What the serve tests share: the embedded default model's tokenizer and chat template (loaded
/// once), a ModelContext over them, and a check that a call throws the ApiError it should.
#pragma once

#include <doctest/doctest.h>

#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

#include "qflash/io/chat_template.hpp"
#include "qflash/io/tokenizer.hpp"
#include "qflash/serve/api_error.hpp"
#include "qflash/serve/openai_request.hpp"

namespace qflash::test {

inline std::string default_model_dir() { return std::string(QFLASH_SOURCE_DIR) + "/models/qwen3_5_moe-micro"; }

inline io::Tokenizer const& default_tokenizer() {
  static io::Tokenizer const tok = io::Tokenizer::from_file(default_model_dir() + "/tokenizer.json");
  return tok;
}

inline io::ChatTemplate const& default_chat_template() {
  static std::optional<io::ChatTemplate> const t = io::ChatTemplate::load(default_model_dir());
  REQUIRE_MESSAGE(t.has_value(), "the default model has no chat_template.jinja");
  return *t;
}

/// The default model's tokenizer and template, a 256-token context and the given limits; its
/// generation_config samples at temperature 0.25, top_p 0.5, top_k 7.
inline serve::ModelContext model_context(serve::RequestLimits limits = {}) {
  serve::ModelContext m;
  m.tokenizer = &default_tokenizer();
  m.chat_template = &default_chat_template();
  m.info.model_id = "micro";
  m.info.max_context = 256;
  m.info.n_expert = 16;
  m.info.n_expert_used = 2;
  m.info.default_sampling.temperature = 0.25f;
  m.info.default_sampling.top_p = 0.5f;
  m.info.default_sampling.top_k = 7;
  m.served_name = "micro";
  m.vocab = 4096;
  m.limits = limits;
  return m;
}

/// Runs `f`, which must throw ApiError with `status`, `param`, and a message holding every part.
template <class F>
void expect_api_error(F&& f, int status, std::string_view param, std::initializer_list<std::string_view> parts) {
  try {
    f();
  } catch (serve::ApiError const& e) {
    std::string const msg = e.what();
    INFO("message: ", msg);
    CHECK(e.status() == status);
    CHECK(e.param() == param);
    for (auto p : parts) CHECK_MESSAGE(msg.find(p) != std::string::npos, "message lacks '", p, "'");
    return;
  } catch (std::exception const& e) {
    FAIL("threw another exception: ", e.what());
  }
  FAIL("no ApiError thrown (expected one mentioning '", *parts.begin(), "')");
}

}  // namespace qflash::test
