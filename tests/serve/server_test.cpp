// The HTTP server (include/qflash/serve/server.hpp) over loopback, with httplib's client and a
// scripted engine (test_engine.hpp): every endpoint, streaming and its framing, the errors and
// their statuses, the API key, body limits, a client going away mid-stream (the request is
// cancelled), and draining.
#include <doctest/doctest.h>

#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "model_fixture.hpp"
#include "qflash/serve/server.hpp"
#include "test_engine.hpp"

namespace {

using namespace qflash;
using namespace std::chrono_literals;
using serve::Json;
using test::TestEngine;
using test::TestEngineScript;

/// A server on a free loopback port over a TestEngine, listening on its own thread.
struct Running {
  TestEngine engine;
  serve::Server server;
  int port = 0;
  std::thread listener;

  explicit Running(serve::ServerOptions o = {}, bool attach = true)
      : engine(test::default_model_dir(), 128), server(with_port0(std::move(o))) {
    port = server.bind();
    listener = std::thread([this] { server.listen(); });
    if (attach) server.attach(engine, &test::default_chat_template());
  }
  ~Running() {
    server.stop();
    listener.join();
  }

  [[nodiscard]] httplib::Client client() const {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(20, 0);
    return c;
  }
  httplib::Result post(std::string const& path, std::string const& body, httplib::Headers const& headers = {}) const {
    return client().Post(path.c_str(), headers, body, "application/json");
  }
  httplib::Result get(std::string const& path, httplib::Headers const& headers = {}) const {
    return client().Get(path.c_str(), headers);
  }

 private:
  static serve::ServerOptions with_port0(serve::ServerOptions o) {
    o.port = 0;
    return o;
  }
};

Json body_of(httplib::Result const& r) {
  REQUIRE(r);
  return Json::parse(r->body);
}

/// Checks an OpenAI-shaped error response.
void expect_error(httplib::Result const& r, int status, std::string_view part, std::string_view code = {}) {
  REQUIRE(r);
  CAPTURE(r->body);
  CHECK(r->status == status);
  CHECK(r->get_header_value("Content-Type") == "application/json");
  Json const j = Json::parse(r->body);
  REQUIRE(j.contains("error"));
  CHECK(j["error"]["message"].get<std::string>().find(part) != std::string::npos);
  CHECK(j["error"]["type"] == serve::error_type(status));
  if (!code.empty()) CHECK(j["error"]["code"] == code);
}

/// The JSON of each "data:" event of an SSE body (comments skipped); `done` tells whether it
/// ended with [DONE].
std::vector<Json> sse_events(std::string const& body, bool& done) {
  std::vector<Json> out;
  done = false;
  std::size_t at = 0;
  while (at < body.size()) {
    std::size_t const end = body.find("\n\n", at);
    REQUIRE(end != std::string::npos);
    std::string const event = body.substr(at, end - at);
    at = end + 2;
    if (event.starts_with(":")) continue;
    REQUIRE(event.starts_with("data: "));
    REQUIRE_FALSE(done);
    if (event == "data: [DONE]") done = true;
    else out.push_back(Json::parse(event.substr(6)));
  }
  return out;
}

std::string text_of(std::vector<std::int32_t> const& ids) { return test::default_tokenizer().decode(ids); }

template <class Pred>
bool eventually(Pred pred, std::chrono::milliseconds limit = 5000ms) {
  auto const t0 = std::chrono::steady_clock::now();
  while (!pred()) {
    if (std::chrono::steady_clock::now() - t0 > limit) return false;
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

/// Starts n non-blocking connections to 127.0.0.1:port; returns how many completed their
/// handshake within `limit`.
int connections_made(int port, int n, std::chrono::milliseconds limit) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::vector<pollfd> fds;
  for (int i = 0; i < n; ++i) {
    int const fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    REQUIRE(fd >= 0);
    int const rc = ::connect(fd, reinterpret_cast<sockaddr const*>(&addr), sizeof addr);
    REQUIRE((rc == 0 || errno == EINPROGRESS));
    fds.push_back({fd, POLLOUT, 0});
  }
  int made = 0;
  auto const deadline = std::chrono::steady_clock::now() + limit;
  std::vector<bool> done(fds.size(), false);
  while (made < n && std::chrono::steady_clock::now() < deadline) {
    for (pollfd& p : fds) p.revents = 0;
    ::poll(fds.data(), fds.size(), 10);
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if (done[i] || !(fds[i].revents & POLLOUT)) continue;
      int err = 0;
      socklen_t len = sizeof err;
      ::getsockopt(fds[i].fd, SOL_SOCKET, SO_ERROR, &err, &len);
      done[i] = true;
      if (err == 0) ++made;
    }
  }
  for (pollfd const& p : fds) ::close(p.fd);
  return made;
}

}  // namespace

TEST_CASE("server: a burst of connections waits in the listen queue; a port in use is refused") {
  serve::ServerOptions o;
  o.port = 0;
  serve::Server server(o);
  int const port = server.bind();
  // Nothing accepts before listen(), so every connection that completes its handshake waits in
  // the listen queue. At httplib's own backlog of 5, six would, however long one waited: the
  // others' SYNs are dropped, and so are their resends while the queue stays full. The count is
  // what is checked; the time only bounds the wait (loopback handshakes take microseconds).
  CHECK(connections_made(port, 64, 900ms) == 64);

  serve::ServerOptions same;
  same.port = port;
  serve::Server second(same);
  CHECK_THROWS_WITH_AS(second.bind(), doctest::Contains("is the port in use"), Error);
}

TEST_CASE("server: 503 while loading, then serving") {
  Running s({}, /*attach=*/false);
  auto r = s.get("/health");
  REQUIRE(r);
  CHECK(r->status == 503);
  CHECK(body_of(r) == Json::parse(R"({"status": "loading"})"));
  expect_error(s.post("/v1/completions", R"({"prompt": "x"})"), 503, "still loading", "loading");
  expect_error(s.get("/v1/models"), 503, "still loading");
  REQUIRE(s.get("/metrics"));
  CHECK(s.get("/metrics")->status == 200);
  CHECK(s.server.attach(s.engine, nullptr));
  CHECK_FALSE(s.server.attach(s.engine, nullptr));  // once
  r = s.get("/health");
  CHECK(r->status == 200);
  CHECK(body_of(r) == Json::parse(R"({"status": "ok"})"));
}

TEST_CASE("server: /v1/models lists the served model") {
  serve::ServerOptions o;
  o.served_model_name = "my-model";
  Running s(o);
  auto r = s.get("/v1/models");
  REQUIRE(r);
  CHECK(r->status == 200);
  Json const j = body_of(r);
  CHECK(j["object"] == "list");
  REQUIRE(j["data"].size() == 1);
  CHECK(j["data"][0]["id"] == "my-model");
  CHECK(j["data"][0]["object"] == "model");
  CHECK(j["data"][0]["owned_by"] == "qflash");
  CHECK(j["data"][0]["max_model_len"] == 128);
  CHECK(j["data"][0]["created"].is_number_integer());
  r = s.get("/v1/models/my-model");
  REQUIRE(r);
  CHECK(r->status == 200);
  CHECK(body_of(r)["id"] == "my-model");
  expect_error(s.get("/v1/models/other"), 404, "the model 'other' does not exist", "model_not_found");
  expect_error(s.post("/v1/completions", R"({"model": "test-model", "prompt": "x"})"), 404, "does not exist");
  CHECK(s.post("/v1/completions", R"({"model": "my-model", "prompt": "x"})")->status == 200);
}

TEST_CASE("server: /v1/models lists each LoRA adapter as a model whose parent is the base; responses name it") {
  Running s({}, /*attach=*/false);
  runtime::EngineInfo info = s.engine.info();
  info.adapters = {"austen"};
  s.engine.set_info(info);
  REQUIRE(s.server.attach(s.engine, &test::default_chat_template()));
  Json const j = body_of(s.get("/v1/models"));
  REQUIRE(j["data"].size() == 2);
  CHECK(j["data"][1]["id"] == "austen");
  CHECK(j["data"][1]["parent"] == j["data"][0]["id"]);
  CHECK(body_of(s.get("/v1/models/austen"))["parent"] == j["data"][0]["id"]);
  auto r = s.post("/v1/completions", R"({"model": "austen", "prompt": "x", "max_tokens": 2})");
  REQUIRE(r);
  CHECK(r->status == 200);
  CHECK(body_of(r)["model"] == "austen");
  expect_error(s.post("/v1/completions", R"({"prompt": "x", "lora": "other"})"), 400, "names no loaded adapter");
}

TEST_CASE("server: completions, not streamed") {
  Running s;
  TestEngineScript script;
  script.cached_tokens = 2;
  s.engine.set_script(script);
  auto r = s.post("/v1/completions", R"({"model": "test-model", "prompt": "It was a truth", "max_tokens": 3, "n": 2,
                                        "seed": 11, "stop": ["\n"], "logprobs": 1})");
  REQUIRE(r);
  CAPTURE(r->body);
  CHECK(r->status == 200);
  CHECK(r->get_header_value("Content-Type") == "application/json");
  Json const j = body_of(r);
  auto const prompt = test::default_tokenizer().encode("It was a truth");
  REQUIRE(prompt.size() >= 3);
  CHECK(j["id"].get<std::string>().starts_with("cmpl-"));
  CHECK(j["object"] == "text_completion");
  CHECK(j["model"] == "test-model");
  REQUIRE(j["choices"].size() == 2);
  for (int i = 0; i < 2; ++i) {
    Json const& c = j["choices"][static_cast<std::size_t>(i)];
    CHECK(c["index"] == i);
    CHECK(c["text"] == text_of({prompt[0], prompt[1], prompt[2]}));
    CHECK(c["finish_reason"] == "length");
    CHECK(c["logprobs"]["token_logprobs"] == Json::array({-0.5, -1.0, -1.5}));
    CHECK(c["logprobs"]["tokens"].size() == 3);
  }
  CHECK(j["usage"] == Json::parse(R"({"prompt_tokens": )" + std::to_string(prompt.size()) +
                                  R"(, "completion_tokens": 6, "total_tokens": )" + std::to_string(prompt.size() + 6) +
                                  R"(, "prompt_tokens_details": {"cached_tokens": 2}})"));
  auto const sent = s.engine.requests();
  REQUIRE(sent.size() == 1);
  CHECK(sent[0].prompt == prompt);
  CHECK(sent[0].n == 2);
  CHECK(sent[0].max_tokens == 3);
  CHECK(sent[0].sampling.seed == 11);
  CHECK(sent[0].stop == std::vector<std::string>{"\n"});
  CHECK(sent[0].top_logprobs == 1);
  CHECK(sent[0].id == j["id"]);
}

TEST_CASE("server: sampling defaults, seeds and the cache salt header") {
  Running s;
  REQUIRE(s.post("/v1/completions", R"({"prompt": "x"})")->status == 200);
  REQUIRE(s.post("/v1/completions", R"({"prompt": "x"})")->status == 200);
  REQUIRE(s.post("/v1/completions", R"({"prompt": "x", "temperature": 0.7})", {{"X-Cache-Salt", "tenant-b"}})->status ==
          200);
  expect_error(s.post("/v1/completions", R"({"prompt": "x", "cache_salt": "a"})", {{"X-Cache-Salt", "b"}}), 400,
               "'cache_salt' and the X-Cache-Salt header differ");
  REQUIRE(s.post("/v1/completions", R"({"prompt": "x", "cache_salt": "a"})", {{"X-Cache-Salt", "a"}})->status == 200);
  auto const sent = s.engine.requests();
  REQUIRE(sent.size() == 4);
  CHECK(sent[0].sampling.temperature == 0.25f);  // the engine's default_sampling
  CHECK(sent[0].sampling.top_k == 7);
  CHECK(sent[0].sampling.seed != sent[1].sampling.seed);  // unseeded: a random seed each
  CHECK(sent[2].sampling.temperature == 0.7f);
  CHECK(sent[2].sampling.top_k == 0);
  CHECK(sent[2].cache_salt == "tenant-b");
  CHECK(sent[3].cache_salt == "a");
  CHECK(sent[0].id != sent[1].id);
}

TEST_CASE("server: chat completions, with the template and logprobs") {
  Running s;
  auto r = s.post("/v1/chat/completions", R"({"model": "test-model", "max_tokens": 2, "logprobs": true,
      "top_logprobs": 2, "messages": [{"role": "user", "content": "Hi"}]})");
  REQUIRE(r);
  CAPTURE(r->body);
  CHECK(r->status == 200);
  Json const j = body_of(r);
  auto const prompt = test::default_tokenizer().encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  CHECK(j["id"].get<std::string>().starts_with("chatcmpl-"));
  CHECK(j["object"] == "chat.completion");
  Json const& c = j["choices"][0];
  CHECK(c["message"]["role"] == "assistant");
  CHECK(c["message"]["content"] == text_of({prompt[0], prompt[1]}));
  CHECK(c["finish_reason"] == "length");
  REQUIRE(c["logprobs"]["content"].size() == 2);
  CHECK(c["logprobs"]["content"][0]["logprob"] == -0.5);
  CHECK(c["logprobs"]["content"][0]["top_logprobs"].size() == 2);
  CHECK(c["logprobs"]["content"][0]["bytes"].is_array());
  CHECK(s.engine.requests().at(0).prompt == prompt);
  // Without max_tokens, the rest of the context.
  REQUIRE(s.post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "Hi"}]})")->status == 200);
  CHECK(s.engine.requests().at(1).max_tokens == 128 - static_cast<int>(prompt.size()));
}

TEST_CASE("server: a model without a chat template") {
  Running s({}, /*attach=*/false);
  s.server.attach(s.engine, nullptr);
  expect_error(s.post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "Hi"}]})"), 400,
               "this model has no chat template; use /v1/completions", "no_chat_template");
}

TEST_CASE("server: /generate") {
  Running s;
  auto r = s.post("/generate", R"({"prompt": "It was", "max_tokens": 2, "temperature": 0})");
  REQUIRE(r);
  CAPTURE(r->body);
  CHECK(r->status == 200);
  Json const j = body_of(r);
  auto const prompt = test::default_tokenizer().encode("It was");
  CHECK(j["text"] == text_of({prompt[0], prompt[1]}));
  CHECK(j["finish_reason"] == "length");
  CHECK(j["usage"]["completion_tokens"] == 2);
  CHECK(j["flash_used"] == false);
}

TEST_CASE("server: streamed completions and chat, with usage") {
  Running s;
  auto r = s.post("/v1/completions", R"({"prompt": "It was a truth", "max_tokens": 4, "stream": true,
                                        "stream_options": {"include_usage": true}, "logprobs": 0})");
  REQUIRE(r);
  CHECK(r->status == 200);
  CHECK(r->get_header_value("Content-Type") == "text/event-stream");
  bool done = false;
  auto ev = sse_events(r->body, done);
  CHECK(done);
  REQUIRE(ev.size() == 5);  // 4 tokens, then the usage
  std::string text;
  std::vector<std::int64_t> offsets;
  for (std::size_t i = 0; i < 4; ++i) {
    CHECK(ev[i]["object"] == "text_completion");
    CHECK(ev[i]["usage"].is_null());
    text += ev[i]["choices"][0]["text"].get<std::string>();
    offsets.push_back(ev[i]["choices"][0]["logprobs"]["text_offset"][0]);
    CHECK(ev[i]["choices"][0]["finish_reason"] == (i == 3 ? Json("length") : Json(nullptr)));
  }
  auto const prompt = test::default_tokenizer().encode("It was a truth");
  CHECK(text == text_of({prompt.begin(), prompt.begin() + 4}));
  CHECK(offsets[0] == 0);
  CHECK(offsets[3] > offsets[2]);
  CHECK(ev[4]["choices"] == Json::array());
  CHECK(ev[4]["usage"]["completion_tokens"] == 4);

  r = s.post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": 2,
                                        "stream": true})");
  REQUIRE(r);
  ev = sse_events(r->body, done);
  CHECK(done);
  REQUIRE(ev.size() == 6);  // a role chunk per choice, then 2 tokens of 2 choices
  CHECK(ev[0]["choices"][0]["delta"] == Json::parse(R"({"role": "assistant", "content": ""})"));
  CHECK(ev[1]["choices"][0]["index"] == 1);
  int finished = 0;
  for (auto const& e : ev) {
    CHECK(e["object"] == "chat.completion.chunk");
    CHECK_FALSE(e.contains("usage"));
    finished += e["choices"][0]["finish_reason"] == "length";
  }
  CHECK(finished == 2);
}

TEST_CASE("server: errors in OpenAI's shape, each with its status") {
  serve::ServerOptions o;
  o.limits.max_body_bytes = 2000;
  Running s(o);
  expect_error(s.post("/v1/completions", "{not json"), 400, "not valid JSON");
  expect_error(s.post("/v1/completions", R"({"prompt": "x", "temperature": 9})"), 400,
               "'temperature' must be a number in [0, 2], got 9");
  auto r = s.post("/v1/completions", R"({"prompt": "x", "foo": 1})");
  CHECK(body_of(r)["error"]["param"] == "foo");
  expect_error(s.post("/v1/nothing", "{}"), 404, "Invalid URL (POST /v1/nothing)");
  expect_error(s.get("/"), 404, "Invalid URL (GET /)");
  r = s.get("/v1/completions");
  expect_error(r, 405, "method GET is not allowed for /v1/completions (use POST)");
  CHECK(r->get_header_value("Allow") == "POST");
  expect_error(s.post("/health", "{}"), 405, "(use GET)");
  // Too large, with a Content-Length and chunked.
  std::string const big = R"({"prompt": ")" + std::string(3000, 'a') + R"("})";
  expect_error(s.post("/v1/completions", big), 413, "larger than this server's limit of 2000 bytes");
  r = s.client().Post(
      "/v1/completions",
      [&](std::size_t offset, httplib::DataSink& sink) {
        if (offset < big.size()) sink.write(big.data() + offset, std::min<std::size_t>(500, big.size() - offset));
        else sink.done();
        return true;
      },
      "application/json");
  expect_error(r, 413, "larger than this server's limit", "request_too_large");
  // A request within the limit still works afterwards.
  CHECK(s.post("/v1/completions", R"({"prompt": "x", "max_tokens": 1})")->status == 200);
  // A hostile path reaches the log and the body escaped.
  expect_error(s.get("/v1/%1b%5b31m"), 404, "Invalid URL (GET /v1/\\x1b[31m)");
}

TEST_CASE("server: engine refusals and failures map to 400, 429, 503 and 500") {
  Running s;
  auto refuse = [&](runtime::RequestErrorKind k) {
    TestEngineScript sc;
    sc.refuse = k;
    s.engine.set_script(sc);
    return s.post("/v1/completions", R"({"prompt": "x"})");
  };
  expect_error(refuse(runtime::RequestErrorKind::kInvalid), 400, "scripted refusal");
  expect_error(refuse(runtime::RequestErrorKind::kQueueFull), 429, "the server is busy", "queue_full");
  expect_error(refuse(runtime::RequestErrorKind::kDraining), 503, "shutting down", "draining");
  expect_error(refuse(runtime::RequestErrorKind::kInternal), 500, "the engine failed");

  TestEngineScript sc;
  sc.fail_after = 2;
  s.engine.set_script(sc);
  expect_error(s.post("/v1/completions", R"({"prompt": "It was a truth", "max_tokens": 5})"), 500,
               "the engine failed: scripted failure");
  auto r = s.post("/v1/completions", R"({"prompt": "It was a truth", "max_tokens": 5, "stream": true})");
  REQUIRE(r);
  CHECK(r->status == 200);  // the failure comes after the headers: an error event
  bool done = false;
  auto const ev = sse_events(r->body, done);
  CHECK(done);
  REQUIRE(ev.size() == 3);
  CHECK(ev[2]["error"]["message"] == "the engine failed: scripted failure");
  CHECK(ev[2]["error"]["type"] == "server_error");
}

TEST_CASE("server: the API key guards the API, not the probes") {
  serve::ServerOptions o;
  o.api_key = "sk-test";
  Running s(o);
  expect_error(s.post("/v1/completions", R"({"prompt": "x"})"), 401, "missing or incorrect API key", "invalid_api_key");
  expect_error(s.post("/v1/completions", R"({"prompt": "x"})", {{"Authorization", "Bearer sk-wrong"}}), 401,
               "incorrect API key");
  expect_error(s.get("/v1/models"), 401, "API key");
  expect_error(s.post("/generate", R"({"prompt": "x"})"), 401, "API key");
  CHECK(s.post("/v1/completions", R"({"prompt": "x", "max_tokens": 1})", {{"Authorization", "Bearer sk-test"}})->status ==
        200);
  CHECK(s.get("/v1/models", {{"Authorization", "Bearer sk-test"}})->status == 200);
  CHECK(s.get("/health")->status == 200);
  CHECK(s.get("/metrics")->status == 200);
  CHECK(s.engine.requests().size() == 1);
}

TEST_CASE("server: /metrics holds the engine's metrics and the server's counters") {
  Running s;
  REQUIRE(s.post("/v1/completions", R"({"prompt": "x", "max_tokens": 1})")->status == 200);
  REQUIRE(s.post("/v1/completions", "{")->status == 400);
  REQUIRE(s.get("/nowhere")->status == 404);
  auto r = s.get("/metrics");
  REQUIRE(r);
  CHECK(r->status == 200);
  CHECK(r->get_header_value("Content-Type").starts_with("text/plain; version=0.0.4"));
  CAPTURE(r->body);
  for (char const* line : {"qflash:test_engine_requests_total 1\n",
                           "qflash:http_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 1\n",
                           "qflash:http_requests_total{endpoint=\"/v1/completions\",status=\"400\"} 1\n",
                           "qflash:http_requests_total{endpoint=\"other\",status=\"404\"} 1\n",
                           "qflash:http_requests_in_flight 1\n"})  // the /metrics request itself
    CHECK_MESSAGE(r->body.find(line) != std::string::npos, "missing: ", line);
}

TEST_CASE("server: a client that goes away mid-stream cancels its request") {
  Running s;
  TestEngineScript sc;
  sc.step_delay = 20ms;
  s.engine.set_script(sc);
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = R"({"prompt": "It was a truth universally acknowledged", "max_tokens": 100, "stream": true,
                 "ignore_eos": true})";
  req.set_header("Content-Type", "application/json");
  int chunks = 0;
  req.content_receiver = [&](char const*, std::size_t, std::uint64_t, std::uint64_t) { return ++chunks < 3; };
  auto cli = s.client();
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  CHECK_FALSE(cli.send(req, res, err));  // the receiver gave up
  cli.stop();
  CHECK(eventually([&] { return s.engine.cancelled() == 1; }));
  CHECK(eventually([&] { return s.server.metrics().in_flight() == 0; }));
  std::string metrics;
  s.server.metrics().write(metrics);
  CHECK(metrics.find("qflash:http_stream_disconnects_total 1\n") != std::string::npos);
}

TEST_CASE("server: a client that went away while the engine is silent is found by the keep-alive comments") {
  serve::ServerOptions o;
  o.keepalive = 50ms;
  Running s(o);
  TestEngineScript sc;
  sc.step_delay = 2500ms;  // no token for longer than the disconnect takes to be found
  s.engine.set_script(sc);
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = R"({"prompt": "It was", "max_tokens": 50, "stream": true, "ignore_eos": true})";
  req.set_header("Content-Type", "application/json");
  req.content_receiver = [&](char const* data, std::size_t n, std::uint64_t, std::uint64_t) {
    CHECK(std::string_view(data, n).starts_with(": keep-alive\n\n"));
    return false;  // gone after the first comment, before any token
  };
  auto cli = s.client();
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  CHECK_FALSE(cli.send(req, res, err));
  cli.stop();
  std::string metrics;
  CHECK(eventually([&] {
    metrics.clear();
    s.server.metrics().write(metrics);
    return metrics.find("qflash:http_stream_disconnects_total 1\n") != std::string::npos;
  }, 2000ms));
  CHECK(eventually([&] { return s.engine.cancelled() == 1; }));
}

TEST_CASE("server: drain lets running streams finish, refuses new requests, then stops") {
  Running s;
  TestEngineScript sc;
  sc.step_delay = 20ms;
  s.engine.set_script(sc);
  auto stream = std::async(std::launch::async, [&] {
    return s.post("/v1/completions", R"({"prompt": "It was a truth", "max_tokens": 100, "stream": true,
                                        "ignore_eos": true})");  // 2 s, while the checks below run
  });
  REQUIRE(eventually([&] { return s.engine.requests().size() == 1; }));
  auto drained = std::async(std::launch::async, [&] { s.server.drain(); });
  REQUIRE(eventually([&] { return s.server.state() == serve::Server::State::kDraining; }));
  auto r = s.get("/health");
  REQUIRE(r);
  CHECK(r->status == 503);
  CHECK(body_of(r)["status"] == "draining");
  expect_error(s.post("/v1/completions", R"({"prompt": "x"})"), 503, "shutting down", "draining");
  auto const streamed = stream.get();
  REQUIRE(streamed);
  bool done = false;
  auto const ev = sse_events(streamed->body, done);
  CHECK(done);
  CHECK(ev.size() == 100);
  CHECK(drained.wait_for(10s) == std::future_status::ready);
  s.listener.join();  // listen() has returned
  s.listener = std::thread([] {});
  CHECK_FALSE(s.client().Get("/health"));  // nothing listens any more
}
