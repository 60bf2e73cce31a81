// Response rendering (include/qflash/serve/openai_response.hpp): OpenAI's response objects,
// usage, both log-probability formats, streamed chunks and their SSE framing; and the API key
// check (auth.hpp) and the server's Prometheus counters (metrics.hpp).
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "model_fixture.hpp"
#include "qflash/io/detail/utf8.hpp"
#include "qflash/serve/auth.hpp"
#include "qflash/serve/metrics.hpp"
#include "qflash/serve/openai_response.hpp"

namespace {

using namespace qflash;
using serve::Json;
using runtime::ChoiceEvent;
using runtime::FinishReason;
using runtime::TokenLogprob;

io::Tokenizer const& tok() { return test::default_tokenizer(); }

std::int32_t id_of(std::string_view text) {
  auto const ids = tok().encode(text);
  REQUIRE(ids.size() == 1);
  return ids[0];
}

/// A token whose bytes are a cut UTF-8 character (the byte-level vocabulary has all 256 bytes).
std::int32_t partial_token() {
  for (std::int32_t id = 0; id < tok().vocab_size(); ++id)
    if (!tok().token_bytes(id).empty() && !io::detail::is_valid_utf8(tok().token_bytes(id))) return id;
  FAIL("no token of the default tokenizer is a cut character");
  return -1;
}

/// The JSON objects of an SSE body, checking its framing: "data: <json>\n\n" events, then
/// exactly one "data: [DONE]\n\n" at the end.
std::vector<Json> sse_events(std::string const& body) {
  std::vector<Json> out;
  std::size_t at = 0;
  bool done = false;
  while (at < body.size()) {
    std::size_t const end = body.find("\n\n", at);
    REQUIRE_MESSAGE(end != std::string::npos, "an event without its blank line: ", body.substr(at));
    std::string const event = body.substr(at, end - at);
    at = end + 2;
    REQUIRE_MESSAGE(event.starts_with("data: "), "not a data event: ", event);
    REQUIRE_FALSE(done);
    if (event == "data: [DONE]") done = true;
    else out.push_back(Json::parse(event.substr(6)));
  }
  CHECK(done);
  return out;
}

ChoiceEvent event(int index, std::string text, std::vector<std::int32_t> tokens = {},
                  std::optional<FinishReason> finish = std::nullopt) {
  ChoiceEvent e;
  e.index = index;
  e.text = std::move(text);
  e.tokens = std::move(tokens);
  e.finish = finish;
  return e;
}

serve::ResponseMeta meta() { return {"cmpl-1", 1700000000, "micro"}; }

}  // namespace

TEST_CASE("usage and finish_reason as OpenAI has them") {
  runtime::RequestUsage u;
  u.prompt_tokens = 7;
  u.completion_tokens = 5;
  u.cached_tokens = 4;
  CHECK(serve::usage_json(u) == Json::parse(R"({"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
                                                "prompt_tokens_details": {"cached_tokens": 4}})"));
  CHECK(serve::finish_json(FinishReason::kLength) == "length");
  CHECK(serve::finish_json(FinishReason::kEos) == "stop");
  CHECK(serve::finish_json(FinishReason::kStopString) == "stop");
  CHECK(serve::finish_json(std::nullopt).is_null());
}

TEST_CASE("tokens as OpenAI shows them: text, or bytes:\\xNN for part of a character") {
  std::int32_t const the = id_of(" the");
  CHECK(serve::token_string(tok(), the) == " the");
  CHECK(serve::token_bytes_json(tok(), the) == Json::array({32, 116, 104, 101}));
  std::int32_t const cut = partial_token();
  std::string const s = serve::token_string(tok(), cut);
  CAPTURE(s);
  CHECK(s.starts_with("bytes:\\x"));
  CHECK(s.size() == 6 + 4 * tok().token_bytes(cut).size());
  CHECK(serve::token_bytes_json(tok(), cut).size() == tok().token_bytes(cut).size());
  CHECK(serve::logprob_value(-INFINITY) == -9999.0);
  CHECK(serve::logprob_value(NAN) == -9999.0);
  CHECK(serve::logprob_value(-0.5f) == -0.5);
}

TEST_CASE("completions logprobs: tokens, token_logprobs, top_logprobs with the sampled token, text_offset") {
  std::int32_t const a = id_of(" the"), b = id_of(" of"), c = id_of(" and");
  std::vector<TokenLogprob> lps = {{a, -0.5f, {{b, -0.25f}, {a, -0.5f}}}, {c, -INFINITY, {{b, -1.0f}}}};
  std::int64_t offset = 10;
  Json const j = serve::completion_logprobs(tok(), lps, offset);
  CHECK(j == Json::parse(R"({"tokens": [" the", " and"], "token_logprobs": [-0.5, -9999.0],
                             "top_logprobs": [{" of": -0.25, " the": -0.5}, {" of": -1.0, " and": -9999.0}],
                             "text_offset": [10, 14]})"));
  CHECK(offset == 18);
  // Offsets count characters: a cut character is counted by the token that starts it.
  std::int32_t const cut = partial_token();
  offset = 0;
  std::vector<TokenLogprob> one = {{cut, -1.0f, {}}, {a, -1.0f, {}}};
  Json const k = serve::completion_logprobs(tok(), one, offset);
  std::int64_t const starts = (static_cast<unsigned char>(tok().token_bytes(cut)[0]) & 0xc0) != 0x80;
  CHECK(k["text_offset"] == Json::array({0, starts}));
}

TEST_CASE("chat logprobs: content entries with token, logprob, bytes and top_logprobs") {
  std::int32_t const a = id_of(" the"), b = id_of(" of");
  std::vector<TokenLogprob> lps = {{a, -0.5f, {{a, -0.5f}, {b, -2.0f}}}};
  CHECK(serve::chat_logprobs(tok(), lps) == Json::parse(R"({"content": [
      {"token": " the", "logprob": -0.5, "bytes": [32, 116, 104, 101],
       "top_logprobs": [{"token": " the", "logprob": -0.5, "bytes": [32, 116, 104, 101]},
                        {"token": " of", "logprob": -2.0, "bytes": [32, 111, 102]}]}],
      "refusal": null})"));
  CHECK(serve::chat_logprobs(tok(), {})["content"] == Json::array());
}

TEST_CASE("non-streamed responses") {
  std::vector<serve::ChoiceOutput> choices(2);
  std::vector<ChoiceEvent> events;
  events.push_back(event(1, "B"));
  events.push_back(event(0, "A", {}, FinishReason::kEos));
  events.push_back(event(1, "b", {}, FinishReason::kLength));
  serve::gather(choices, events);
  CHECK(events.empty());
  runtime::RequestUsage u;
  u.prompt_tokens = 3;
  u.completion_tokens = 2;
  Json const c = serve::completion_response(meta(), choices, u, tok(), false);
  CHECK(c == Json::parse(R"({"id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "micro",
      "choices": [{"index": 0, "text": "A", "logprobs": null, "finish_reason": "stop"},
                  {"index": 1, "text": "Bb", "logprobs": null, "finish_reason": "length"}],
      "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                "prompt_tokens_details": {"cached_tokens": 0}}})"));
  Json const h = serve::chat_response({"chatcmpl-1", 1700000000, "micro"}, choices, u, tok(), true);
  CHECK(h["object"] == "chat.completion");
  CHECK(h["choices"][1] == Json::parse(R"({"index": 1,
      "message": {"role": "assistant", "content": "Bb", "refusal": null},
      "logprobs": {"content": [], "refusal": null}, "finish_reason": "length"})"));
  CHECK(serve::generate_response(choices[1], u, true) ==
        Json::parse(R"({"text": "Bb", "finish_reason": "length",
                        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                  "prompt_tokens_details": {"cached_tokens": 0}},
                        "flash_used": true})"));
  events.push_back(event(2, "x"));
  CHECK_THROWS_AS(serve::gather(choices, events), Error);
}

TEST_CASE("streamed completions: one chunk per event, offsets carried across chunks, usage last") {
  std::int32_t const a = id_of(" the"), b = id_of(" of");
  serve::ChunkBuilder chunks(serve::Api::kCompletions, meta(), tok(), 1, true, true);
  CHECK(chunks.role_chunks().empty());
  ChoiceEvent e1 = event(0, " the", {a});
  e1.logprobs = {{a, -0.5f, {}}};
  ChoiceEvent e2 = event(0, " of", {b}, FinishReason::kLength);
  e2.logprobs = {{b, -1.0f, {}}};
  runtime::RequestUsage u;
  u.prompt_tokens = 2;
  u.completion_tokens = 2;
  std::string body = chunks.event(e1);  // in order: each event advances the choice's text_offset
  body += chunks.event(event(0, ""));
  body += chunks.event(e2);
  body += chunks.end(u);
  auto const ev = sse_events(body);
  REQUIRE(ev.size() == 3);
  CHECK(ev[0] == Json::parse(R"({"id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "micro",
      "choices": [{"index": 0, "text": " the",
                   "logprobs": {"tokens": [" the"], "token_logprobs": [-0.5], "top_logprobs": [{" the": -0.5}],
                                "text_offset": [0]},
                   "finish_reason": null}],
      "usage": null})"));
  CHECK(ev[1]["choices"][0]["logprobs"]["text_offset"] == Json::array({4}));
  CHECK(ev[1]["choices"][0]["finish_reason"] == "length");
  CHECK(ev[2] == Json::parse(R"({"id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "micro",
      "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4,
                               "prompt_tokens_details": {"cached_tokens": 0}}})"));
  CHECK_THROWS_AS((void)chunks.event(event(1, "x")), Error);
}

TEST_CASE("streamed chat: the role first, content deltas, an empty delta with the finish reason") {
  serve::ChunkBuilder chunks(serve::Api::kChat, {"chatcmpl-1", 5, "micro"}, tok(), 2, false, false);
  std::string body = chunks.role_chunks();
  body += chunks.event(event(1, "Hi"));
  body += chunks.event(event(0, "", {}, FinishReason::kEos));
  body += chunks.event(event(1, "!", {}, FinishReason::kLength));
  body += chunks.end({});
  auto const ev = sse_events(body);
  REQUIRE(ev.size() == 5);
  CHECK(ev[0] == Json::parse(R"({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "micro",
      "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null,
                   "finish_reason": null}]})"));
  CHECK(ev[1]["choices"][0]["index"] == 1);
  CHECK(ev[2]["choices"][0] == Json::parse(R"({"index": 1, "delta": {"content": "Hi"}, "logprobs": null,
                                               "finish_reason": null})"));
  CHECK(ev[3]["choices"][0] == Json::parse(R"({"index": 0, "delta": {}, "logprobs": null, "finish_reason": "stop"})"));
  CHECK(ev[4]["choices"][0]["delta"] == Json::parse(R"({"content": "!"})"));
  CHECK(ev[4]["choices"][0]["finish_reason"] == "length");
  CHECK_FALSE(ev[4].contains("usage"));
}

TEST_CASE("an error after the stream started is an event OpenAI clients raise, then [DONE]") {
  auto const ev = sse_events(serve::ChunkBuilder::error(500, "the engine failed: out of blocks"));
  REQUIRE(ev.size() == 1);
  CHECK(ev[0] == Json::parse(R"({"error": {"message": "the engine failed: out of blocks", "type": "server_error",
                                           "param": null, "code": null}})"));
  CHECK(serve::error_body(429, "busy", "", "queue_full")["error"]["type"] == "rate_limit_error");
  CHECK(serve::error_body(401, "no", "", "invalid_api_key")["error"]["type"] == "invalid_request_error");
}

TEST_CASE("API keys: Bearer tokens compared as digests") {
  CHECK(serve::constant_time_equal("secret", "secret"));
  CHECK_FALSE(serve::constant_time_equal("secret", "secreT"));
  CHECK_FALSE(serve::constant_time_equal("secret", "Secret"));
  CHECK_FALSE(serve::constant_time_equal("secret", "secret2"));
  CHECK_FALSE(serve::constant_time_equal("secret", ""));
  CHECK(serve::constant_time_equal("", ""));
  CHECK(serve::bearer_token("Bearer abc") == "abc");
  CHECK(serve::bearer_token("bearer   abc  ") == "abc");
  CHECK(serve::bearer_token("Basic abc").empty());
  CHECK(serve::bearer_token("Bearer").empty());
  CHECK(serve::bearer_token("").empty());
  serve::ApiKey const key("sk-test");
  CHECK(key.enabled());
  CHECK(key.authorizes("Bearer sk-test"));
  CHECK_FALSE(key.authorizes("Bearer sk-tesT"));
  CHECK_FALSE(key.authorizes("Bearer sk-test2"));
  CHECK_FALSE(key.authorizes("Bearer "));
  CHECK_FALSE(key.authorizes(""));
  CHECK_FALSE(key.authorizes("sk-test"));
  serve::ApiKey const none;
  CHECK_FALSE(none.enabled());
  CHECK(none.authorizes(""));
}

TEST_CASE("HTTP metrics in the Prometheus text format") {
  serve::HttpMetrics m;
  m.started();
  m.started();
  CHECK(m.in_flight() == 2);
  m.finished(serve::Route::kCompletions, 200, 0.02);
  m.finished(serve::Route::kCompletions, 429, 3.0);
  m.stream_disconnected();
  CHECK(m.in_flight() == 0);
  std::string out;
  m.write(out);
  CAPTURE(out);
  for (char const* line : {"# TYPE qflash:http_requests_total counter\n",
                           "qflash:http_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 1\n",
                           "qflash:http_requests_total{endpoint=\"/v1/completions\",status=\"429\"} 1\n",
                           "# TYPE qflash:http_request_duration_seconds histogram\n",
                           "qflash:http_request_duration_seconds_bucket{endpoint=\"/v1/completions\",le=\"0.01\"} 0\n",
                           "qflash:http_request_duration_seconds_bucket{endpoint=\"/v1/completions\",le=\"0.025\"} 1\n",
                           "qflash:http_request_duration_seconds_bucket{endpoint=\"/v1/completions\",le=\"5\"} 2\n",
                           "qflash:http_request_duration_seconds_bucket{endpoint=\"/v1/completions\",le=\"+Inf\"} 2\n",
                           "qflash:http_request_duration_seconds_sum{endpoint=\"/v1/completions\"} 3.02\n",
                           "qflash:http_request_duration_seconds_count{endpoint=\"/v1/completions\"} 2\n",
                           "qflash:http_requests_in_flight 0\n", "qflash:http_stream_disconnects_total 1\n"})
    CHECK_MESSAGE(out.find(line) != std::string::npos, "missing: ", line);
  CHECK(out.find("endpoint=\"/health\"") == std::string::npos);  // no observations, no series
}
