// libFuzzer target for qflash/serve/openai_request.hpp and openai_response.hpp: the input is an
// HTTP request body, parsed and checked as a request to /v1/completions, /v1/chat/completions
// (rendered with the default model's chat template) and /generate, with the default model's
// tokenizer. Any input must parse or throw serve::ApiError, which the server answers with a 4xx;
// what parses is rendered back as a response and as streamed chunks, with logprobs of its
// prompt's tokens. A crash, hang, leak or sanitizer report is a bug. Built and run by
// scripts/fuzz (QFLASH_SOURCE_DIR locates the model).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "qflash/core/log.hpp"
#include "qflash/io/chat_template.hpp"
#include "qflash/io/tokenizer.hpp"
#include "qflash/serve/api_error.hpp"
#include "qflash/serve/openai_request.hpp"
#include "qflash/serve/openai_response.hpp"

namespace {

using namespace qflash;

struct Model {
  io::Tokenizer tokenizer = io::Tokenizer::from_file(QFLASH_SOURCE_DIR "/models/qwen3_5_moe-micro/tokenizer.json");
  std::optional<io::ChatTemplate> chat_template = io::ChatTemplate::load(QFLASH_SOURCE_DIR "/models/qwen3_5_moe-micro");
  serve::ModelContext context;

  Model() {
    set_log_sink({});
    context.tokenizer = &tokenizer;
    context.chat_template = chat_template ? &*chat_template : nullptr;
    context.info.max_context = 1024;
    context.served_name = "micro";
    context.vocab = 4096;
  }
};

/// Renders what a parsed request could get back: every prompt token as generated text with
/// logprobs, in each response format.
std::size_t render(serve::Api api, serve::ParsedRequest const& p, io::Tokenizer const& tok) {
  runtime::GenerationRequest const& g = p.generation;
  std::size_t const n = std::min<std::size_t>(g.prompt.size(), 64);
  runtime::ChoiceEvent e;
  e.index = g.n - 1;
  e.text = tok.decode(std::span(g.prompt.data(), n));
  e.tokens.assign(g.prompt.begin(), g.prompt.begin() + static_cast<std::ptrdiff_t>(n));
  for (std::int32_t id : e.tokens) e.logprobs.push_back({id, -1.0f, {{id, -1.0f}, {(id + 1) % 4096, -2.0f}}});
  e.finish = runtime::FinishReason::kLength;
  serve::ChunkBuilder chunks(api, {"id", 0, "micro"}, tok, g.n, g.top_logprobs >= 0, p.include_usage);
  std::size_t sum = chunks.role_chunks().size() + chunks.event(e).size() + chunks.end({}).size();
  std::vector<serve::ChoiceOutput> choices(static_cast<std::size_t>(g.n));
  std::vector<runtime::ChoiceEvent> events{e};
  serve::gather(choices, events);
  sum += serve::dump(serve::completion_response({}, choices, {}, tok, true)).size();
  sum += serve::dump(serve::chat_response({}, choices, {}, tok, true)).size();
  return sum;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  static Model const model;
  std::string_view const body(reinterpret_cast<char const*>(data), size);
  serve::Json json;
  try {
    json = serve::parse_body(body);
  } catch (serve::ApiError const&) {
    return 0;
  }
  for (serve::Api api : {serve::Api::kCompletions, serve::Api::kChat, serve::Api::kGenerate}) {
    try {
      volatile std::size_t sink = render(api, serve::parse_request(api, json, model.context), model.tokenizer);
      (void)sink;
    } catch (serve::ApiError const&) {
    }
  }
  return 0;
}
