// Request parsing (include/qflash/serve/openai_request.hpp): every field of /v1/completions,
// /v1/chat/completions and /generate, what each turns into in the GenerationRequest, and the
// message of every refusal.
#include <doctest/doctest.h>

#include <string>
#include <string_view>

#include "model_fixture.hpp"
#include "qflash/serve/openai_request.hpp"

namespace {

using namespace qflash;
using serve::Api;
using serve::ParsedRequest;
using test::expect_api_error;

ParsedRequest parse(Api api, std::string_view body, serve::ModelContext const& m = test::model_context()) {
  return serve::parse_request(api, serve::parse_body(body), m);
}

std::vector<std::int32_t> encode(std::string_view text) { return test::default_tokenizer().encode(text); }

/// A prompt of exactly n tokens: n copies of one token id.
std::string ids_prompt(int n) {
  std::string s = "[";
  for (int i = 0; i < n; ++i) s += i ? ",7" : "7";
  return s + "]";
}

}  // namespace

TEST_CASE("parse_body: JSON objects only, nested at most kMaxJsonDepth deep") {
  expect_api_error([] { (void)serve::parse_body("{\"prompt\": "); }, 400, "", {"not valid JSON"});
  expect_api_error([] { (void)serve::parse_body("[1, 2]"); }, 400, "", {"must be a JSON object, got a list"});
  expect_api_error([] { (void)serve::parse_body("\"x\""); }, 400, "", {"must be a JSON object, got \"x\""});
  expect_api_error([] { (void)serve::parse_body("{\"a\": \"\xff\"}"); }, 400, "", {"not valid JSON"});
  auto nested = [](int depth) {
    return "{\"a\": " + std::string(static_cast<std::size_t>(depth - 1), '[') +
           std::string(static_cast<std::size_t>(depth - 1), ']') + "}";
  };
  CHECK_NOTHROW((void)serve::parse_body(nested(serve::kMaxJsonDepth)));
  expect_api_error([&] { (void)serve::parse_body(nested(serve::kMaxJsonDepth + 1)); }, 400, "", {"nests deeper than 64"});
  expect_api_error([&] { (void)serve::parse_body(nested(100000)); }, 400, "", {"nests deeper"});
}

TEST_CASE("completions: the defaults") {
  auto const p = parse(Api::kCompletions, R"({"model": "micro", "prompt": "It was"})");
  auto const& g = p.generation;
  CHECK(g.prompt == encode("It was"));
  CHECK(g.max_tokens == 16);
  CHECK(g.n == 1);
  CHECK(g.top_logprobs == -1);
  CHECK(g.stop.empty());
  CHECK(g.stop_token_ids.empty());
  CHECK_FALSE(g.ignore_eos);
  CHECK(g.cache_salt.empty());
  CHECK(g.priority == 0);
  CHECK_FALSE(p.stream);
  CHECK_FALSE(p.seed_given);
  CHECK_FALSE(p.cache_salt_given);
  // No sampling field: the model's generation_config.
  CHECK(g.sampling.temperature == 0.25f);
  CHECK(g.sampling.top_p == 0.5f);
  CHECK(g.sampling.top_k == 7);
  // A null field is an absent one.
  CHECK(parse(Api::kCompletions, R"({"prompt": "x", "temperature": null, "stop": null})").generation.sampling.top_k == 7);
}

TEST_CASE("sampling: one field set means OpenAI's defaults for the others") {
  auto g = parse(Api::kCompletions, R"({"prompt": "x", "temperature": 0.5})").generation;
  CHECK(g.sampling.temperature == 0.5f);
  CHECK(g.sampling.top_p == 1.0f);
  CHECK(g.sampling.top_k == 0);
  CHECK(g.sampling.min_p == 0.0f);
  CHECK(g.sampling.repetition_penalty == 1.0f);
  g = parse(Api::kCompletions, R"({"prompt": "x", "top_k": 5})").generation;
  CHECK(g.sampling.temperature == 1.0f);
  CHECK(g.sampling.top_k == 5);
  g = parse(Api::kCompletions,
            R"({"prompt": "x", "top_p": 0.9, "top_k": -1, "min_p": 0.05, "repetition_penalty": 1.2,
                "frequency_penalty": -1.5, "presence_penalty": 2, "seed": 42})")
          .generation;
  CHECK(g.sampling.top_p == 0.9f);
  CHECK(g.sampling.top_k == 0);
  CHECK(g.sampling.min_p == 0.05f);
  CHECK(g.sampling.repetition_penalty == 1.2f);
  CHECK(g.frequency_penalty == -1.5f);
  CHECK(g.presence_penalty == 2.0f);
  CHECK(g.sampling.seed == 42);
  auto const p = parse(Api::kCompletions, R"({"prompt": "x", "seed": -1})");
  CHECK(p.seed_given);
  CHECK(p.generation.sampling.seed == ~std::uint64_t{0});
  // seed alone leaves the model's sampling.
  CHECK(parse(Api::kCompletions, R"({"prompt": "x", "seed": 3})").generation.sampling.temperature == 0.25f);
}

TEST_CASE("sampling: out-of-range values name the field and the range") {
  auto bad = [](std::string_view field, std::string_view value, std::string_view want) {
    std::string const body = "{\"prompt\": \"x\", \"" + std::string(field) + "\": " + std::string(value) + "}";
    CAPTURE(body);
    expect_api_error([&] { (void)parse(Api::kCompletions, body); }, 400, field,
                     {"'" + std::string(field) + "' must be " + std::string(want) + ", got " + std::string(value)});
  };
  bad("temperature", "2.5", "a number in [0, 2]");
  bad("temperature", "-0.1", "a number in [0, 2]");
  bad("temperature", "\"hot\"", "a number in [0, 2]");
  bad("top_p", "0", "a number in (0, 1]");
  bad("top_p", "1.5", "a number in (0, 1]");
  bad("top_p", "1e-50", "a number in (0, 1]");
  bad("top_k", "-2", "an integer >= -1");
  bad("top_k", "2.5", "an integer >= -1");
  bad("min_p", "1.5", "a number in [0, 1]");
  bad("repetition_penalty", "0", "a number in (0, 100]");
  bad("repetition_penalty", "101", "a number in (0, 100]");
  bad("frequency_penalty", "2.5", "a number in [-2, 2]");
  bad("presence_penalty", "-3", "a number in [-2, 2]");
  bad("seed", "1.5", "a 64-bit integer");
  bad("seed", "18446744073709551615", "a 64-bit integer");
  bad("priority", "2147483648", "a 32-bit integer (smaller runs first)");
  bad("ignore_eos", "1", "true or false");
  bad("cache_salt", "5", "a string");
  bad("n", "0", "an integer in [1, 8]");
  bad("n", "9", "an integer in [1, 8]");
  bad("max_tokens", "0", "an integer in [1, 256]");
  bad("max_tokens", "257", "an integer in [1, 256]");
  bad("logprobs", "21", "an integer in [0, 20]");
  bad("logprobs", "true", "an integer in [0, 20]");
  bad("stream", "\"yes\"", "true or false");
  bad("user", "1", "a string");
}

TEST_CASE("budget: n, max_tokens and the server's limits") {
  serve::RequestLimits limits;
  limits.max_tokens = 10;
  limits.max_n = 3;
  auto const m = test::model_context(limits);
  auto g = parse(Api::kCompletions, R"({"prompt": "x", "n": 3, "max_tokens": 10})", m).generation;
  CHECK(g.n == 3);
  CHECK(g.max_tokens == 10);
  CHECK(parse(Api::kCompletions, R"({"prompt": "x"})", m).generation.max_tokens == 10);  // 16, cut to the limit
  expect_api_error([&] { (void)parse(Api::kCompletions, R"({"prompt": "x", "max_tokens": 11})", m); }, 400,
                   "max_tokens", {"an integer in [1, 10]"});
  expect_api_error([&] { (void)parse(Api::kCompletions, R"({"prompt": "x", "n": 4})", m); }, 400, "n",
                   {"an integer in [1, 3]"});
  // Chat: max_completion_tokens wins over max_tokens; without either, the rest of the context.
  g = parse(Api::kChat, R"({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                           "max_completion_tokens": 7})")
          .generation;
  CHECK(g.max_tokens == 7);
  g = parse(Api::kChat, R"({"messages": [{"role": "user", "content": "Hi"}]})").generation;
  CHECK(g.max_tokens == 256 - static_cast<int>(g.prompt.size()));
  CHECK(parse(Api::kChat, R"({"messages": [{"role": "user", "content": "Hi"}]})", m).generation.max_tokens == 10);
  expect_api_error([&] {
    (void)parse(Api::kChat, R"({"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 0})");
  }, 400, "max_completion_tokens", {"'max_completion_tokens' must be an integer in [1, 256]"});
}

TEST_CASE("prompt: a string, token ids, or a list of one of those") {
  CHECK(parse(Api::kCompletions, R"({"prompt": [1, 2, 3]})").generation.prompt == std::vector<std::int32_t>{1, 2, 3});
  CHECK(parse(Api::kCompletions, R"({"prompt": [[4, 5]]})").generation.prompt == std::vector<std::int32_t>{4, 5});
  CHECK(parse(Api::kCompletions, R"({"prompt": ["It was"]})").generation.prompt == encode("It was"));
  // Special tokens in the text are recognised, as vLLM tokenizes prompts.
  CHECK(parse(Api::kCompletions, R"({"prompt": "<|im_start|>"})").generation.prompt == std::vector<std::int32_t>{4094});
  expect_api_error([] { (void)parse(Api::kCompletions, R"({"prompt": ["a", "b"]})"); }, 400, "prompt",
                   {"holds 2 prompts", "one request per prompt"});
  expect_api_error([] { (void)parse(Api::kCompletions, R"({"prompt": [[1], [2]]})"); }, 400, "prompt",
                   {"holds 2 prompts"});
  expect_api_error([] { (void)parse(Api::kCompletions, R"({"prompt": [1, "a"]})"); }, 400, "prompt",
                   {"'prompt' must be a string or a list of token ids, got a list"});
  expect_api_error([] { (void)parse(Api::kCompletions, R"({"prompt": 5})"); }, 400, "prompt",
                   {"must be a string or a list of token ids, got 5"});
  expect_api_error([] { (void)parse(Api::kCompletions, R"({"prompt": [1, 4096]})"); }, 400, "prompt",
                   {"'prompt[1]' must be a token id in [0, 4096), got 4096"});
  expect_api_error([] { (void)parse(Api::kCompletions, R"({"prompt": [-1]})"); }, 400, "prompt",
                   {"'prompt[0]' must be a token id"});
  expect_api_error([] { (void)parse(Api::kCompletions, R"({"prompt": ""})"); }, 400, "prompt", {"encodes to no tokens"});
  expect_api_error([] { (void)parse(Api::kCompletions, R"({"prompt": []})"); }, 400, "prompt", {"encodes to no tokens"});
  expect_api_error([] { (void)parse(Api::kCompletions, R"({"max_tokens": 3})"); }, 400, "prompt",
                   {"missing field 'prompt'"});
}

TEST_CASE("prompt: the context and the server's prompt limit") {
  CHECK(parse(Api::kCompletions, "{\"prompt\": " + ids_prompt(255) + "}").generation.prompt.size() == 255);
  try {
    (void)parse(Api::kCompletions, "{\"prompt\": " + ids_prompt(256) + "}");
    FAIL("no error");
  } catch (serve::ApiError const& e) {
    CHECK(e.status() == 400);
    CHECK(e.code() == "context_length_exceeded");
    CHECK(std::string(e.what()) ==
          "this model's maximum context length is 256 tokens; the prompt has 256 tokens, which leaves no room to "
          "generate");
  }
  serve::RequestLimits limits;
  limits.max_prompt_tokens = 4;
  auto const m = test::model_context(limits);
  CHECK_NOTHROW((void)parse(Api::kCompletions, "{\"prompt\": " + ids_prompt(4) + "}", m));
  expect_api_error([&] { (void)parse(Api::kCompletions, "{\"prompt\": " + ids_prompt(5) + "}", m); }, 400, "prompt",
                   {"the prompt has 5 tokens, more than this server's limit of 4"});
  expect_api_error([&] {
    (void)parse(Api::kChat, R"({"messages": [{"role": "user", "content": "a long question"}]})", m);
  }, 400, "messages", {"more than this server's limit of 4"});
}

TEST_CASE("stop strings and stop ids") {
  CHECK(parse(Api::kCompletions, R"({"prompt": "x", "stop": "\n"})").generation.stop == std::vector<std::string>{"\n"});
  CHECK(parse(Api::kCompletions, R"({"prompt": "x", "stop": ["a", "bc"]})").generation.stop ==
        std::vector<std::string>{"a", "bc"});
  CHECK(parse(Api::kCompletions, R"({"prompt": "x", "stop": []})").generation.stop.empty());
  std::string const want = "'stop' must be a non-empty string of at most 256 bytes, or a list of at most 16 such strings";
  expect_api_error([&] { (void)parse(Api::kCompletions, R"({"prompt": "x", "stop": ""})"); }, 400, "stop",
                   {want + ", got \"\""});
  expect_api_error([&] { (void)parse(Api::kCompletions, R"({"prompt": "x", "stop": ["a", 1]})"); }, 400, "stop",
                   {want});
  expect_api_error([&] {
    (void)parse(Api::kCompletions, "{\"prompt\": \"x\", \"stop\": \"" + std::string(257, 'a') + "\"}");
  }, 400, "stop", {want, "..."});
  std::string many = "[";
  for (int i = 0; i < 17; ++i) many += i ? ",\"s\"" : "\"s\"";
  expect_api_error([&] { (void)parse(Api::kCompletions, "{\"prompt\": \"x\", \"stop\": " + many + "]}"); }, 400,
                   "stop", {want, "got a list"});

  CHECK(parse(Api::kCompletions, R"({"prompt": "x", "stop_token_ids": [4095, 0]})").generation.stop_token_ids ==
        std::vector<std::int32_t>{4095, 0});
  expect_api_error([] { (void)parse(Api::kCompletions, R"({"prompt": "x", "stop_token_ids": [4096]})"); }, 400,
                   "stop_token_ids", {"'stop_token_ids[0]' must be a token id in [0, 4096), got 4096"});
  expect_api_error([] { (void)parse(Api::kCompletions, R"({"prompt": "x", "stop_token_ids": 5})"); }, 400,
                   "stop_token_ids", {"must be a list of at most 64 token ids"});
}

TEST_CASE("ignore_eos, cache_salt, priority") {
  auto const p = parse(Api::kCompletions, R"({"prompt": "x", "ignore_eos": true, "cache_salt": "tenant-a",
                                             "priority": -3})");
  CHECK(p.generation.ignore_eos);
  CHECK(p.generation.cache_salt == "tenant-a");
  CHECK(p.cache_salt_given);
  CHECK(p.generation.priority == -3);
  expect_api_error([] {
    (void)parse(Api::kCompletions, "{\"prompt\": \"x\", \"cache_salt\": \"" + std::string(257, 's') + "\"}");
  }, 400, "cache_salt", {"a string of at most 256 bytes"});
}

TEST_CASE("routing: the project's per-request experts per token") {
  CHECK_FALSE(parse(Api::kCompletions, R"({"prompt": "x"})").generation.routing);
  auto const p = parse(Api::kChat, R"({"messages": [{"role": "user", "content": "Hi"}],
                                      "routing": "top_p=0.9,k_min=1,k_max=4"})");
  REQUIRE(p.generation.routing);
  CHECK(model::to_string(*p.generation.routing) == "top_p=0.9,k_max=4");
  CHECK(parse(Api::kGenerate, R"({"prompt": "x", "routing": "top_k=1"})").generation.routing->k_max == 1);
  expect_api_error([] { (void)parse(Api::kCompletions, R"({"prompt": "x", "routing": "top_p=2"})"); }, 400, "routing",
                   {"'routing' must be top_k", "top_p must be in (0, 1]"});
  expect_api_error([] { (void)parse(Api::kCompletions, R"({"prompt": "x", "routing": "top_k=17"})"); }, 400,
                   "routing", {"the model has 16"});
  expect_api_error([] { (void)parse(Api::kCompletions, R"({"prompt": "x", "routing": 0.9})"); }, 400, "routing",
                   {"must be a string"});
}

TEST_CASE("lora: a loaded adapter by name, through 'lora' or 'model'; unknown names refused") {
  auto m = test::model_context();
  m.info.adapters = {"austen", "legal"};
  CHECK(parse(Api::kCompletions, R"({"prompt": "x"})", m).generation.lora.empty());
  CHECK(parse(Api::kCompletions, R"({"model": "micro", "prompt": "x"})", m).generation.lora.empty());
  CHECK(parse(Api::kCompletions, R"({"model": "austen", "prompt": "x"})", m).generation.lora == "austen");
  CHECK(parse(Api::kChat, R"({"messages": [{"role": "user", "content": "hi"}], "lora": "legal"})", m).generation.lora ==
        "legal");
  CHECK(parse(Api::kGenerate, R"({"prompt": "x", "lora": "austen"})", m).generation.lora == "austen");
  CHECK(parse(Api::kCompletions, R"({"model": "austen", "prompt": "x", "lora": "legal"})", m).generation.lora == "legal");
  expect_api_error([&] { (void)parse(Api::kCompletions, R"({"prompt": "x", "lora": "nope"})", m); }, 400, "lora",
                   {"'lora' names no loaded adapter: 'nope'", "'austen', 'legal'"});
  expect_api_error([&] { (void)parse(Api::kCompletions, R"({"model": "nope", "prompt": "x"})", m); }, 404, "model",
                   {"'micro', 'austen', 'legal'"});
  expect_api_error([] { (void)parse(Api::kCompletions, R"({"prompt": "x", "lora": "austen"})"); }, 400, "lora",
                   {"none; start the server with --lora NAME=DIR"});
  expect_api_error([&] { (void)parse(Api::kCompletions, R"({"prompt": "x", "lora": 3})", m); }, 400, "lora",
                   {"must be a string"});
}

TEST_CASE("chat: snapshot hints mark where the system prompt and the last turns end") {
  auto const p = parse(Api::kChat, R"({"messages": [
      {"role": "system", "content": "You are a helpful assistant who answers in the manner of Jane Austen."},
      {"role": "user", "content": "Who is Mr. Darcy?"},
      {"role": "assistant", "content": "A gentleman of Derbyshire."},
      {"role": "user", "content": "And Elizabeth?"}]})");
  auto const& g = p.generation;
  REQUIRE(g.snapshot_hints.size() == 3);  // after the system prompt, the first question and its answer
  for (std::size_t i = 0; i < g.snapshot_hints.size(); ++i) {
    CHECK(g.snapshot_hints[i] > (i ? g.snapshot_hints[i - 1] : 0));
    CHECK(static_cast<std::size_t>(g.snapshot_hints[i]) < g.prompt.size());
  }
  // The first hint is the system message alone, rendered and tokenized.
  io::ChatInput sys;
  sys.messages = nlohmann::ordered_json::parse(
      R"([{"role": "system", "content": "You are a helpful assistant who answers in the manner of Jane Austen."}])");
  auto const ids = test::default_tokenizer().encode(test::default_chat_template().render(sys));
  CHECK(g.snapshot_hints[0] == static_cast<std::int32_t>(ids.size()));
  CHECK(std::equal(ids.begin(), ids.end(), g.prompt.begin()));
  // One message: nothing to hint; completions: none.
  CHECK(parse(Api::kChat, R"({"messages": [{"role": "user", "content": "Hi"}]})").generation.snapshot_hints.empty());
  CHECK(parse(Api::kCompletions, R"({"prompt": "x"})").generation.snapshot_hints.empty());
}

TEST_CASE("model, stream and stream_options") {
  expect_api_error([] { (void)parse(Api::kCompletions, R"({"model": "gpt-4", "prompt": "x"})"); }, 404, "model",
                   {"the model 'gpt-4' does not exist; this server serves 'micro'"});
  auto p = parse(Api::kChat, R"({"model": "micro", "messages": [{"role": "user", "content": "Hi"}], "stream": true,
                                "stream_options": {"include_usage": true}})");
  CHECK(p.stream);
  CHECK(p.include_usage);
  p = parse(Api::kCompletions, R"({"prompt": "x", "stream": true, "stream_options": {"include_obfuscation": false}})");
  CHECK(p.stream);
  CHECK_FALSE(p.include_usage);
  CHECK_FALSE(parse(Api::kCompletions, R"({"prompt": "x", "stream_options": null})").stream);
  expect_api_error([] { (void)parse(Api::kCompletions, R"({"prompt": "x", "stream_options": {"include_usage": true}})"); },
                   400, "stream_options", {"'stream_options' is only allowed when 'stream' is true"});
  expect_api_error([] {
    (void)parse(Api::kCompletions, R"({"prompt": "x", "stream": true, "stream_options": {"continuous": true}})");
  }, 400, "stream_options.continuous", {"unrecognized request argument 'stream_options.continuous'"});
  expect_api_error([] {
    (void)parse(Api::kCompletions, R"({"prompt": "x", "stream": true, "stream_options": {"include_usage": 1}})");
  }, 400, "stream_options.include_usage", {"'stream_options.include_usage' must be true or false, got 1"});
}

TEST_CASE("fields clients send that change nothing are accepted; unknown ones are refused") {
  CHECK_NOTHROW((void)parse(Api::kCompletions,
                            R"({"prompt": "x", "user": "u1", "store": false, "metadata": {"k": "v"},
                                "service_tier": "auto", "logit_bias": {}, "min_tokens": 0, "echo": false,
                                "best_of": 1, "suffix": "", "prompt_cache_key": "k", "safety_identifier": "s"})"));
  CHECK_NOTHROW((void)parse(Api::kChat, R"({"messages": [{"role": "user", "content": "Hi"}],
                                           "response_format": {"type": "text"}, "modalities": ["text"],
                                           "parallel_tool_calls": false, "tool_choice": "auto", "tools": [],
                                           "logit_bias": null})"));
  expect_api_error([] { (void)parse(Api::kCompletions, R"({"prompt": "x", "foo": 1})"); }, 400, "foo",
                   {"unrecognized request argument 'foo'"});
  expect_api_error([] { (void)parse(Api::kCompletions, R"({"prompt": "x", "messages": []})"); }, 400, "messages",
                   {"unrecognized request argument 'messages'"});
  expect_api_error([] { (void)parse(Api::kChat, R"({"messages": [{"role": "user", "content": "Hi"}], "prompt": "x"})"); },
                   400, "prompt", {"unrecognized request argument 'prompt'"});
  expect_api_error([] { (void)parse(Api::kGenerate, R"({"prompt": "x", "n": 2})"); }, 400, "n",
                   {"unrecognized request argument 'n'"});
  expect_api_error([] { (void)parse(Api::kGenerate, R"({"prompt": "x", "stream": true})"); }, 400, "stream",
                   {"unrecognized request argument 'stream'"});
  // A control character in an unknown key comes back escaped.
  expect_api_error([] { (void)parse(Api::kCompletions, "{\"prompt\": \"x\", \"a\\u001b[31m\": 1}"); }, 400,
                   "a\x1b[31m", {"'a\\x1b[31m'"});
  expect_api_error([] { (void)parse(Api::kCompletions, R"({"prompt": "x", "metadata": 1})"); }, 400, "metadata",
                   {"must be an object"});
}

TEST_CASE("fields that would change the output and are not supported are refused, naming them") {
  auto refused = [](Api api, std::string_view extra, std::string_view param, std::string_view part) {
    std::string const body = std::string(api == Api::kChat ? R"({"messages": [{"role": "user", "content": "Hi"}], )"
                                                           : R"({"prompt": "x", )") +
                             std::string(extra) + "}";
    CAPTURE(body);
    expect_api_error([&] { (void)parse(api, body); }, 400, param, {part});
  };
  refused(Api::kCompletions, R"("logit_bias": {"5": 10})", "logit_bias", "'logit_bias' is not supported");
  refused(Api::kChat, R"("logit_bias": {"5": 10})", "logit_bias", "'logit_bias' is not supported");
  refused(Api::kCompletions, R"("min_tokens": 4)", "min_tokens", "'min_tokens' is not supported");
  refused(Api::kCompletions, R"("echo": true)", "echo", "'echo' is not supported");
  refused(Api::kCompletions, R"("best_of": 3)", "best_of", "'best_of' must equal n (1), got 3");
  refused(Api::kCompletions, R"("n": 2, "best_of": 1)", "best_of", "'best_of' must equal n (2), got 1");
  refused(Api::kCompletions, R"("suffix": "end")", "suffix", "'suffix' is not supported");
  std::string const tools = R"("tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}])";
  refused(Api::kChat, tools, "tools", "tool calls are not supported");
  refused(Api::kChat, tools + R"(, "tool_choice": "required")", "tools", "tool calls are not supported");
  refused(Api::kChat, R"("tool_choice": "required")", "tool_choice", "'tool_choice' asks for a tool call (required)");
  refused(Api::kChat, R"("tool_choice": {"type": "function", "function": {"name": "f"}})", "tool_choice",
          "'tool_choice' asks for a tool call (a named function)");
  refused(Api::kChat, R"("tool_choice": "sometimes")", "tool_choice",
          R"('tool_choice' must be "none", "auto", "required" or an object naming a function, got "sometimes")");
  refused(Api::kChat, R"("tools": {})", "tools", "'tools' must be a list of tools, got an object");
  refused(Api::kChat, R"("functions": [{"name": "f"}])", "functions", "'functions' is not supported");
  refused(Api::kChat, R"("function_call": "auto")", "function_call", "'function_call' is not supported");
  refused(Api::kChat, R"("response_format": {"type": "json_schema", "json_schema": {}})", "response_format",
          "'response_format' of type \"json_schema\" is not supported");
  refused(Api::kChat, R"("response_format": {"type": "json_object"})", "response_format", "only {\"type\": \"text\"}");
  refused(Api::kChat, R"("response_format": "text")", "response_format", "must be an object {\"type\": ...}");
  refused(Api::kChat, R"("modalities": ["text", "audio"])", "modalities", "may only hold \"text\", got \"audio\"");
  refused(Api::kChat, R"("audio": {"voice": "alloy"})", "audio", "'audio' is not supported");
  refused(Api::kChat, R"("prediction": {"type": "content"})", "prediction", "'prediction' is not supported");
  refused(Api::kChat, R"("reasoning_effort": "low")", "reasoning_effort", "'reasoning_effort' is not supported");
  refused(Api::kChat, R"("web_search_options": {})", "web_search_options", "is not supported");
  // tools the model must not call are accepted, and not shown to it.
  auto const with = parse(Api::kChat, R"({"messages": [{"role": "user", "content": "Hi"}], "tool_choice": "none", )" +
                                          tools + "}");
  auto const without = parse(Api::kChat, R"({"messages": [{"role": "user", "content": "Hi"}]})");
  CHECK(with.generation.prompt == without.generation.prompt);
}

TEST_CASE("logprobs: completions' count and chat's flag with top_logprobs") {
  CHECK(parse(Api::kCompletions, R"({"prompt": "x", "logprobs": 0})").generation.top_logprobs == 0);
  CHECK(parse(Api::kCompletions, R"({"prompt": "x", "logprobs": 20})").generation.top_logprobs == 20);
  std::string const hi = R"({"messages": [{"role": "user", "content": "Hi"}], )";
  CHECK(parse(Api::kChat, hi + R"("logprobs": true})").generation.top_logprobs == 0);
  CHECK(parse(Api::kChat, hi + R"("logprobs": true, "top_logprobs": 3})").generation.top_logprobs == 3);
  CHECK(parse(Api::kChat, hi + R"("logprobs": false})").generation.top_logprobs == -1);
  expect_api_error([&] { (void)parse(Api::kChat, hi + R"("top_logprobs": 3})"); }, 400, "top_logprobs",
                   {"'top_logprobs' needs 'logprobs' set to true"});
  expect_api_error([&] { (void)parse(Api::kChat, hi + R"("logprobs": true, "top_logprobs": 21})"); }, 400,
                   "top_logprobs", {"an integer in [0, 20]"});
  expect_api_error([&] { (void)parse(Api::kChat, hi + R"("logprobs": 2})"); }, 400, "logprobs", {"true or false"});
}

TEST_CASE("chat: messages rendered with the model's template") {
  auto const& tmpl = test::default_chat_template();
  auto render = [&](std::string_view messages, bool generation_prompt = true) {
    io::ChatInput in;
    in.messages = serve::Json::parse(messages);
    in.add_generation_prompt = generation_prompt;
    return encode(tmpl.render(in));
  };
  auto const p = parse(Api::kChat, R"({"messages": [{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "Hi"}]})");
  CHECK(p.generation.prompt ==
        encode("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"));
  // Text parts are joined by newlines; add_generation_prompt and chat_template_kwargs pass through.
  CHECK(parse(Api::kChat, R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                        {"type": "text", "text": "b"}]}]})")
            .generation.prompt == render(R"([{"role": "user", "content": "a\nb"}])"));
  CHECK(parse(Api::kChat, R"({"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": false})")
            .generation.prompt == render(R"([{"role": "user", "content": "Hi"}])", false));
  CHECK_NOTHROW((void)parse(Api::kChat, R"({"messages": [{"role": "user", "content": "Hi"}],
                                           "chat_template_kwargs": {"enable_thinking": false}})"));

  expect_api_error([] { (void)parse(Api::kChat, R"({"messages": []})"); }, 400, "messages",
                   {"'messages' must be a non-empty list of messages, got a list"});
  expect_api_error([] { (void)parse(Api::kChat, R"({"model": "micro"})"); }, 400, "messages",
                   {"missing field 'messages'"});
  expect_api_error([] { (void)parse(Api::kChat, R"({"messages": ["hi"]})"); }, 400, "messages[0]",
                   {"'messages[0]' must be an object, got \"hi\""});
  expect_api_error([] { (void)parse(Api::kChat, R"({"messages": [{"content": "hi"}]})"); }, 400, "messages[0].role",
                   {"'messages[0].role' must be a string"});
  expect_api_error([] { (void)parse(Api::kChat, R"({"messages": [{"role": "user", "content": 5}]})"); }, 400,
                   "messages[0].content", {"must be a string or a list of content parts, got 5"});
  expect_api_error([] {
    (void)parse(Api::kChat, R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})");
  }, 400, "messages[0].content[0]", {"content parts of type 'image_url' are not supported"});
  expect_api_error([] {
    (void)parse(Api::kChat, R"({"messages": [{"role": "user", "content": [{"type": "text"}]}]})");
  }, 400, "messages[0].content[0].text", {"must be a string"});
  expect_api_error([] {
    (void)parse(Api::kChat, R"({"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": 1})");
  }, 400, "chat_template_kwargs", {"must be an object"});
  // The ChatML template concatenates content: a message without one fails to render.
  expect_api_error([] { (void)parse(Api::kChat, R"({"messages": [{"role": "assistant", "content": null}]})"); }, 400,
                   "messages", {"the model's chat template could not render the messages"});
  expect_api_error([] {
    (void)parse(Api::kChat, R"({"messages": [{"role": "user", "content": "Hi"}],
                               "chat_template_kwargs": {"messages": []}})");
  }, 400, "messages", {"would replace the argument of that name"});

  auto m = test::model_context();
  m.chat_template = nullptr;
  expect_api_error([&] { (void)parse(Api::kChat, R"({"messages": [{"role": "user", "content": "Hi"}]})", m); }, 400,
                   "messages", {"this model has no chat template; use /v1/completions"});
}

TEST_CASE("chat: a template's raise_exception() is the client's message") {
  io::ChatTemplate const t("{{ raise_exception('roles must alternate') }}", "test.jinja");
  auto m = test::model_context();
  m.chat_template = &t;
  expect_api_error([&] { (void)parse(Api::kChat, R"({"messages": [{"role": "user", "content": "Hi"}]})", m); }, 400,
                   "messages", {"the model's chat template refused the messages: roles must alternate"});
}

TEST_CASE("generate: prompt and sampling, nothing OpenAI-only") {
  auto const p = parse(Api::kGenerate, R"({"prompt": "It was", "max_tokens": 8, "temperature": 0, "stop": ["."],
                                          "cache_salt": "s", "seed": 1})");
  CHECK(p.generation.prompt == encode("It was"));
  CHECK(p.generation.max_tokens == 8);
  CHECK(p.generation.sampling.temperature == 0.0f);
  CHECK(p.generation.stop == std::vector<std::string>{"."});
  CHECK(p.generation.cache_salt == "s");
  CHECK(p.seed_given);
  CHECK(parse(Api::kGenerate, R"({"prompt": [5, 6]})").generation.max_tokens == 16);
  expect_api_error([] { (void)parse(Api::kGenerate, R"({"prompt": "x", "model": "micro"})"); }, 400, "model",
                   {"unrecognized request argument 'model'"});
}
