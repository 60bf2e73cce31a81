/// @file
/// The HTTP server of `qflash serve` (cpp-httplib), between the socket and a runtime::Engine:
/// OpenAI's POST /v1/completions, POST /v1/chat/completions and GET /v1/models[/{id}], the
/// project's POST /generate, GET /health and GET /metrics.
///
/// Each connection is served by one thread of a pool; a handler reads the body (at most
/// RequestLimits::max_body_bytes, whatever the transfer encoding), parses and checks it
/// (openai_request.hpp), submits it to the engine and either waits for the whole answer or
/// streams it as server-sent events (openai_response.hpp). A streamed request whose client
/// stops reading is cancelled, so the engine frees its KV at its next step; while the engine
/// is silent (the request is queued) a comment line every few seconds finds out. Every failure
/// is answered in OpenAI's error shape (api_error.hpp) and stays within its request.
///
/// Life cycle: bind() (the port), listen() on a thread of the caller's, attach() once the
/// model is loaded (until then /health and the API answer 503), drain() on SIGTERM (/health
/// and new requests answer 503, running requests finish and stream to their end, then
/// listen() returns). With an API key, /v1/* and /generate need `Authorization: Bearer
/// <key>`; /health and /metrics stay open for probes and scrapers. One log line per request
/// (method, path, status, tokens, milliseconds), never its body.
///
/// Needs cpp-httplib 0.11 as Debian ships it (libcpp-httplib-dev: link -lcpp-httplib and
/// compile with the flags of its pkg-config file, which CMake's qflash::serve target carries).
/// Host only.
#pragma once

#include <httplib.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/core/log.hpp"
#include "qflash/io/chat_template.hpp"
#include "qflash/runtime/engine.hpp"
#include "qflash/runtime/request.hpp"
#include "qflash/serve/api_error.hpp"
#include "qflash/serve/auth.hpp"
#include "qflash/serve/metrics.hpp"
#include "qflash/serve/openai_request.hpp"
#include "qflash/serve/openai_response.hpp"

namespace qflash::serve {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                ///< 0: a free port, which bind() returns
  std::string api_key;            ///< empty: no key is required
  std::string served_model_name;  ///< the name requests and responses use (empty: the engine's model_id)
  RequestLimits limits;
  int http_threads = 32;          ///< connections served at once; a streamed response holds one throughout
  /// Silence after which a streamed response sends an SSE comment, to find out whether its
  /// client is still there.
  std::chrono::milliseconds keepalive{2000};
};

class Server {
 public:
  enum class State { kLoading, kServing, kDraining };

  explicit Server(ServerOptions options) : opt_(std::move(options)), key_(opt_.api_key), rng_(std::random_device{}()) {
    QFLASH_CHECK(opt_.http_threads >= 1, "http_threads must be >= 1, got ", opt_.http_threads);
    QFLASH_CHECK(opt_.limits.max_body_bytes >= 1, "max_body_bytes must be >= 1, got ", opt_.limits.max_body_bytes);
    QFLASH_CHECK(opt_.limits.max_n >= 1, "max_n must be >= 1, got ", opt_.limits.max_n);
    QFLASH_CHECK(opt_.limits.max_tokens >= 0 && opt_.limits.max_prompt_tokens >= 0,
                 "max_tokens and max_prompt_tokens must be >= 0 (0: the context)");
    started_at_ = std::time(nullptr);
    routes();
  }
  Server(Server const&) = delete;
  Server& operator=(Server const&) = delete;

  /// Binds the listening socket and returns its port. Throws Error when it cannot.
  int bind() {
    // httplib's default sets SO_REUSEPORT, with which a second server binds the same port and
    // the kernel splits connections between the two. SO_REUSEADDR only lets a restarted server
    // bind past its predecessor's closing connections; a port in use is refused.
    svr_.set_socket_options([this](socket_t sock) {
      int const yes = 1;
      ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
      listen_socket_ = sock;
    });
    int const port = opt_.port == 0                              ? svr_.bind_to_any_port(opt_.host)
                     : svr_.bind_to_port(opt_.host, opt_.port) ? opt_.port
                                                               : -1;
    QFLASH_CHECK(port > 0, "cannot listen on ", opt_.host, ":", opt_.port,
                 " (is the port in use, or the address not one of this machine's?)");
    // Debian's libcpp-httplib listens with a backlog of 5: a burst of clients connecting at
    // once overflows it, and each connection dropped waits a second for its SYN to be resent.
    // listen() again on a listening socket sets its backlog.
    QFLASH_CHECK(::listen(listen_socket_, SOMAXCONN) == 0, "cannot set the listen backlog on ", opt_.host, ":",
                 port, ": ", std::strerror(errno));
    return port;
  }

  /// Serves on the bound socket until drain() or stop() ends it. Throws Error when accepting fails.
  void listen() {
    listen_called_ = true;
    if (stop_requested_) return;
    bool const ok = svr_.listen_after_bind();
    listen_returned_ = true;
    QFLASH_CHECK(ok || stop_requested_, "the HTTP server stopped accepting connections");
  }

  /// Starts serving `engine` (and `chat_template`, null when the model has none), which must
  /// outlive the server. False when the server is draining already.
  bool attach(runtime::Engine& engine, io::ChatTemplate const* chat_template) {
    std::lock_guard lock(mutex_);
    if (state_ != State::kLoading) return false;
    auto ctx = std::make_unique<ModelContext>();
    ctx->tokenizer = &engine.tokenizer();
    ctx->chat_template = chat_template;
    ctx->info = engine.info();
    ctx->served_name = opt_.served_model_name.empty() ? ctx->info.model_id : opt_.served_model_name;
    ctx->vocab = engine.config().vocab;
    ctx->limits = opt_.limits;
    context_ = std::move(ctx);
    engine_ = &engine;
    state_.store(State::kServing, std::memory_order_release);
    return true;
  }

  /// Drains: /health and new requests answer 503, the engine finishes every request it
  /// accepted, their responses are sent to the end, then listen() returns. Blocks until then.
  void drain() {
    runtime::Engine* engine = nullptr;
    {
      std::lock_guard lock(mutex_);
      state_.store(State::kDraining, std::memory_order_release);
      engine = engine_;
    }
    QFLASH_LOG_INFO("draining: finishing ", metrics_.in_flight(), " requests in progress");
    if (engine) engine->drain();
    {
      std::unique_lock lock(mutex_);
      idle_.wait(lock, [&] { return active_ == 0; });
    }
    stop();
  }

  /// Stops listening now; responses in progress are cut off.
  void stop() {
    stop_requested_ = true;
    if (listen_called_)  // stop() before listen() starts accepting would do nothing: wait for it
      while (!svr_.is_running() && !listen_returned_) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    svr_.stop();
  }

  [[nodiscard]] State state() const { return state_.load(std::memory_order_acquire); }
  [[nodiscard]] HttpMetrics const& metrics() const { return metrics_; }

 private:
  using Clock = std::chrono::steady_clock;

  struct RouteSpec {
    std::string_view path;
    bool prefix;  ///< the path continues (/v1/models/{id})
    std::string_view method;
    Route route;
    bool needs_key;
  };
  static constexpr RouteSpec kRoutes[] = {
      {"/v1/completions", false, "POST", Route::kCompletions, true},
      {"/v1/chat/completions", false, "POST", Route::kChat, true},
      {"/generate", false, "POST", Route::kGenerate, true},
      {"/v1/models", false, "GET", Route::kModels, true},
      {"/v1/models/", true, "GET", Route::kModels, true},
      {"/health", false, "GET", Route::kHealth, false},
      {"/metrics", false, "GET", Route::kMetrics, false},
  };

  /// One request from its arrival to its last byte: counted in flight (drain() waits for
  /// none), then logged and measured once.
  class Exchange {
   public:
    Exchange(Server& s, Route route, httplib::Request const& req)
        : s_(&s), route_(route), method_(req.method), path_(req.path.substr(0, 200)), t0_(Clock::now()) {
      s_->metrics_.started();
      std::lock_guard lock(s_->mutex_);
      ++s_->active_;
    }
    Exchange(Exchange const&) = delete;
    Exchange& operator=(Exchange const&) = delete;
    ~Exchange() {
      if (!done_) finish(500);
    }

    void set_usage(runtime::RequestUsage const& u) { usage_ = u; }
    void finish(int status, std::string_view note = {}) {
      done_ = true;
      double const secs = std::chrono::duration<double>(Clock::now() - t0_).count();
      s_->metrics_.finished(route_, status, secs);
      std::string tokens;
      if (usage_)
        tokens = " " + std::to_string(usage_->prompt_tokens) + "+" + std::to_string(usage_->completion_tokens) +
                 " tokens";
      QFLASH_LOG_INFO(method_, " ", path_, " ", status, tokens, " ", static_cast<long long>(secs * 1000), " ms",
                      note.empty() ? "" : " (", note, note.empty() ? "" : ")");
      std::lock_guard lock(s_->mutex_);
      if (--s_->active_ == 0) s_->idle_.notify_all();
    }

   private:
    Server* s_;
    Route route_;
    std::string method_, path_;
    Clock::time_point t0_;
    std::optional<runtime::RequestUsage> usage_;
    bool done_ = false;
  };

  /// A streamed response: the engine's events turned into SSE chunks as they come.
  struct Stream {
    Stream(std::shared_ptr<runtime::RequestStream> e, ChunkBuilder c, std::unique_ptr<Exchange> x, Server* s)
        : events(std::move(e)), chunks(std::move(c)), exchange(std::move(x)), server(s) {}

    std::shared_ptr<runtime::RequestStream> events;
    ChunkBuilder chunks;
    std::unique_ptr<Exchange> exchange;
    Server* server;
    bool started = false;
    Clock::time_point last_write = Clock::now();
    std::vector<runtime::ChoiceEvent> pending;

    /// Writes what is ready (called by httplib until done()); false once the client is gone.
    bool pump(httplib::DataSink& sink) {
      std::string out;
      bool more = true;
      try {
        if (!started) {
          out = chunks.role_chunks();
          started = true;
        }
        more = events->wait(pending, std::chrono::milliseconds(200));
        for (auto const& e : pending) out += chunks.event(e);
        pending.clear();
        if (!more) {
          if (auto err = events->error())
            out += ChunkBuilder::error(500, qflash::detail::concat("the engine failed: ", *err));
          else
            out += chunks.end(events->usage());
        }
      } catch (std::exception const& e) {
        events->cancel();
        out += ChunkBuilder::error(500, qflash::detail::concat("the server failed: ", e.what()));
        more = false;
      }
      if (out.empty() && Clock::now() - last_write >= server->opt_.keepalive) out = ": keep-alive\n\n";
      if (!out.empty()) {
        if (!sink.write(out.data(), out.size())) {
          events->cancel();
          return false;
        }
        last_write = Clock::now();
      }
      if (!more) sink.done();
      return true;
    }

    /// The response is over: sent to its end (`sent`), or cut off.
    void close(bool sent) {
      bool const complete = sent && events->ended();
      if (!complete) {
        events->cancel();
        server->metrics_.stream_disconnected();
      }
      exchange->set_usage(events->usage());
      exchange->finish(200, complete ? "" : "streamed; the client went away, request cancelled");
    }
  };

  // ---- routing ----------------------------------------------------------------------------

  void routes() {
    svr_.new_task_queue = [n = opt_.http_threads] { return new httplib::ThreadPool(static_cast<std::size_t>(n)); };
    // httplib refuses a larger Content-Length before reading anything; read_body refuses at the
    // limit itself and drains up to kDrainBytes more, so that the client reads the 413.
    svr_.set_payload_max_length(static_cast<std::size_t>(opt_.limits.max_body_bytes) + kDrainBytes);
    svr_.set_pre_routing_handler([this](httplib::Request const& req, httplib::Response& res) {
      return pre_route(req, res) ? httplib::Server::HandlerResponse::Handled
                                 : httplib::Server::HandlerResponse::Unhandled;
    });
    // Statuses httplib sets itself (a malformed request line, a URI too long): OpenAI's shape.
    svr_.set_error_handler(httplib::Server::HandlerWithResponse([](httplib::Request const&, httplib::Response& res) {
      if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
      res.set_content(dump(error_body(res.status, status_text(res.status))), "application/json");
      return httplib::Server::HandlerResponse::Handled;
    }));
    svr_.set_exception_handler([](httplib::Request const&, httplib::Response& res, std::exception_ptr) {
      set_error(res, 500, error_body(500, "the server failed on this request"));
    });
    svr_.Post("/v1/completions", [this](httplib::Request const& req, httplib::Response& res,
                                        httplib::ContentReader const& reader) {
      generation(Api::kCompletions, Route::kCompletions, req, res, reader);
    });
    svr_.Post("/v1/chat/completions", [this](httplib::Request const& req, httplib::Response& res,
                                             httplib::ContentReader const& reader) {
      generation(Api::kChat, Route::kChat, req, res, reader);
    });
    svr_.Post("/generate", [this](httplib::Request const& req, httplib::Response& res,
                                  httplib::ContentReader const& reader) {
      generation(Api::kGenerate, Route::kGenerate, req, res, reader);
    });
    svr_.Get("/v1/models", [this](httplib::Request const& req, httplib::Response& res) { models(req, res); });
    svr_.Get("/v1/models/(.+)", [this](httplib::Request const& req, httplib::Response& res) { models(req, res); });
    svr_.Get("/health", [this](httplib::Request const& req, httplib::Response& res) { health(req, res); });
    svr_.Get("/metrics", [this](httplib::Request const& req, httplib::Response& res) { prometheus(req, res); });
  }

  /// What the statuses httplib answers by itself mean.
  static std::string_view status_text(int status) {
    switch (status) {
      case 400: return "the request is malformed";
      case 413: return "the request is larger than this server's limit";
      case 414: return "the request URI is too long";
      case 416: return "the requested range cannot be satisfied";
      default: return "the request failed";
    }
  }

  static RouteSpec const* find_route(std::string_view path) {
    for (auto const& r : kRoutes)
      if (r.prefix ? path.size() > r.path.size() && path.starts_with(r.path) : path == r.path) return &r;
    return nullptr;
  }

  /// Answers, before the body is read, what the path, method and key decide: 404, 405, 401.
  /// Such a response closes the connection when a body may follow (it is left unread).
  bool pre_route(httplib::Request const& req, httplib::Response& res) {
    RouteSpec const* r = find_route(req.path);
    std::optional<ApiError> refusal;
    if (!r) {
      refusal.emplace(404, "", "", qflash::detail::concat("Invalid URL (", req.method, " ", req.path.substr(0, 200), ")"),
                      __FILE__, __LINE__);
    } else if (req.method != r->method && !(req.method == "HEAD" && r->method == "GET")) {
      res.set_header("Allow", std::string(r->method));
      refusal.emplace(405, "", "",
                      qflash::detail::concat("method ", req.method.substr(0, 20), " is not allowed for ", r->path,
                                     " (use ", r->method, ")"),
                      __FILE__, __LINE__);
    } else if (r->needs_key && !key_.authorizes(req.get_header_value("Authorization"))) {
      refusal.emplace(401, "", "invalid_api_key",
                      "missing or incorrect API key: send it as 'Authorization: Bearer <key>'", __FILE__, __LINE__);
    }
    if (!refusal) return false;
    Exchange ex(*this, r ? r->route : Route::kOther, req);
    if (req.method != "GET" && req.method != "HEAD") res.set_header("Connection", "close");
    set_error(res, refusal->status(), error_body(*refusal));
    ex.finish(refusal->status());
    return true;
  }

  // ---- handlers ---------------------------------------------------------------------------

  static void set_error(httplib::Response& res, int status, Json const& body) {
    res.status = status;
    res.set_content(dump(body), "application/json");
  }

  /// The model context while serving; 503 while loading or draining.
  ModelContext const& serving() const {
    switch (state_.load(std::memory_order_acquire)) {
      case State::kLoading: QFLASH_API_FAIL(503, "", "loading", "the model is still loading; try again shortly");
      case State::kDraining: QFLASH_API_FAIL(503, "", "draining", "the server is shutting down");
      case State::kServing: break;
    }
    return *context_;
  }

  /// Bytes past max_body_bytes read and dropped before a 413, so that a client still sending its
  /// body reads the answer instead of a reset connection; beyond them the connection closes.
  static constexpr std::size_t kDrainBytes = std::size_t{16} << 20;

  /// The body, at most max_body_bytes whatever its transfer encoding (413 beyond).
  std::string read_body(httplib::ContentReader const& reader, httplib::Response& res) const {
    auto const limit = static_cast<std::size_t>(opt_.limits.max_body_bytes);
    std::string body;
    bool too_large = false;
    std::size_t seen = 0;
    bool const ok = reader([&](char const* data, std::size_t n) {
      seen += n;
      if (!too_large && n <= limit - body.size()) {
        body.append(data, n);
        return true;
      }
      too_large = true;
      body.clear();
      return seen <= limit + kDrainBytes;  // drop the rest, within bounds
    });
    if (!ok) res.set_header("Connection", "close");  // the rest of the body was not read
    if (too_large || res.status == 413)
      QFLASH_API_FAIL(413, "", "request_too_large", "the request body is larger than this server's limit of ", limit,
                      " bytes");
    if (!ok) QFLASH_API_FAIL(400, "", "", "the request body could not be read");
    return body;
  }

  std::string new_id(std::string_view prefix) {
    static constexpr char kHex[] = "0123456789abcdef";
    std::lock_guard lock(rng_mutex_);
    std::string id(prefix);
    for (int i = 0; i < 24; ++i) id += kHex[rng_() & 15];
    return id;
  }
  std::uint64_t random_seed() {
    std::lock_guard lock(rng_mutex_);
    return rng_();
  }

  std::shared_ptr<runtime::RequestStream> submit(runtime::GenerationRequest g) {
    try {
      return engine_->submit(std::move(g));
    } catch (runtime::RequestError const& e) {
      switch (e.kind()) {
        case runtime::RequestErrorKind::kInvalid: QFLASH_API_FAIL(400, "", "", e.what());
        case runtime::RequestErrorKind::kQueueFull:
          QFLASH_API_FAIL(429, "", "queue_full", "the server is busy (its queue is full); retry later: ", e.what());
        case runtime::RequestErrorKind::kDraining: QFLASH_API_FAIL(503, "", "draining", "the server is shutting down");
        case runtime::RequestErrorKind::kInternal: break;
      }
      QFLASH_API_FAIL(500, "", "", "the engine failed: ", e.what());
    }
  }

  void generation(Api api, Route route, httplib::Request const& req, httplib::Response& res,
                  httplib::ContentReader const& reader) {
    auto ex = std::make_unique<Exchange>(*this, route, req);
    std::shared_ptr<runtime::RequestStream> events;  // once submitted: cancelled if answering fails
    try {
      std::string const body = read_body(reader, res);
      ModelContext const& m = serving();
      ParsedRequest p = parse_request(api, parse_body(body), m);
      runtime::GenerationRequest& g = p.generation;
      if (std::string const salt = req.get_header_value("X-Cache-Salt"); !salt.empty()) {
        if (p.cache_salt_given && salt != g.cache_salt)
          QFLASH_API_FAIL(400, "cache_salt", "", "'cache_salt' and the X-Cache-Salt header differ; send one of them");
        if (salt.size() > kMaxCacheSaltBytes)
          QFLASH_API_FAIL(400, "cache_salt", "", "the X-Cache-Salt header is longer than ", kMaxCacheSaltBytes, " bytes");
        g.cache_salt = salt;
      }
      g.id = new_id(api == Api::kChat ? "chatcmpl-" : api == Api::kCompletions ? "cmpl-" : "gen-");
      if (!p.seed_given) g.sampling.seed = random_seed();
      int const n = g.n;
      bool const logprobs = g.top_logprobs >= 0;
      ResponseMeta meta{g.id, static_cast<std::int64_t>(std::time(nullptr)), g.lora.empty() ? m.served_name : g.lora};
      events = submit(std::move(g));

      if (p.stream) {
        auto st = std::make_shared<Stream>(
            events, ChunkBuilder(api, std::move(meta), *m.tokenizer, n, logprobs, p.include_usage), std::move(ex), this);
        res.set_header("Cache-Control", "no-cache");
        res.set_chunked_content_provider(
            "text/event-stream", [st](std::size_t, httplib::DataSink& sink) { return st->pump(sink); },
            [st](bool sent) { st->close(sent); });
        return;
      }

      std::vector<ChoiceOutput> choices(static_cast<std::size_t>(n));
      std::vector<runtime::ChoiceEvent> pending;
      while (events->wait(pending, std::chrono::seconds(1))) gather(choices, pending);
      gather(choices, pending);
      runtime::RequestUsage const usage = events->usage();
      ex->set_usage(usage);
      if (auto err = events->error()) QFLASH_API_FAIL(500, "", "", "the engine failed: ", *err);
      Json out = api == Api::kCompletions ? completion_response(meta, choices, usage, *m.tokenizer, logprobs)
                 : api == Api::kChat      ? chat_response(meta, choices, usage, *m.tokenizer, logprobs)
                                          : generate_response(choices.front(), usage, runtime::flash_used(m.info));
      res.status = 200;
      res.set_content(dump(out), "application/json");
    } catch (ApiError const& e) {
      set_error(res, e.status(), error_body(e));
    } catch (std::exception const& e) {
      set_error(res, 500, error_body(500, qflash::detail::concat("the server failed: ", e.what())));
    }
    if (events) events->cancel();  // a no-op once it has ended
    ex->finish(res.status);
  }

  void models(httplib::Request const& req, httplib::Response& res) {
    Exchange ex(*this, Route::kModels, req);
    try {
      ModelContext const& m = serving();
      Json const model = {{"id", m.served_name},
                          {"object", "model"},
                          {"created", static_cast<std::int64_t>(started_at_)},
                          {"owned_by", "qflash"},
                          {"max_model_len", m.info.max_context}};
      // Each LoRA adapter is a model of its own whose parent is the base (as vLLM lists them).
      Json list = Json::array({model});
      for (auto const& name : m.info.adapters) {
        Json a = model;
        a["id"] = name;
        a["parent"] = m.served_name;
        list.push_back(std::move(a));
      }
      if (req.matches.size() > 1) {
        auto it = std::find_if(list.begin(), list.end(), [&](Json const& x) { return x["id"] == req.matches[1].str(); });
        if (it == list.end())
          QFLASH_API_FAIL(404, "model", "model_not_found", "the model '", req.matches[1].str(),
                          "' does not exist; this server serves '", m.served_name, "'");
        res.set_content(dump(*it), "application/json");
      } else {
        res.set_content(dump({{"object", "list"}, {"data", list}}), "application/json");
      }
      res.status = 200;
    } catch (ApiError const& e) {
      set_error(res, e.status(), error_body(e));
    }
    ex.finish(res.status);
  }

  void health(httplib::Request const& req, httplib::Response& res) {
    Exchange ex(*this, Route::kHealth, req);
    State const s = state();
    res.status = s == State::kServing ? 200 : 503;
    res.set_content(dump({{"status", s == State::kServing ? "ok" : s == State::kLoading ? "loading" : "draining"}}),
                    "application/json");
    ex.finish(res.status);
  }

  void prometheus(httplib::Request const& req, httplib::Response& res) {
    Exchange ex(*this, Route::kMetrics, req);
    std::string out;
    try {
      if (state() != State::kLoading && engine_) engine_->write_metrics(out);  // engine_ is set before the state changes
      metrics_.write(out);
      res.status = 200;
      res.set_content(out, "text/plain; version=0.0.4; charset=utf-8");
    } catch (std::exception const& e) {
      set_error(res, 500, error_body(500, qflash::detail::concat("metrics failed: ", e.what())));
    }
    ex.finish(res.status);
  }

  ServerOptions opt_;
  ApiKey key_;
  httplib::Server svr_;
  socket_t listen_socket_ = -1;  ///< the socket bind() bound, when it has
  HttpMetrics metrics_;
  std::time_t started_at_ = 0;

  mutable std::mutex mutex_;
  std::condition_variable idle_;
  int active_ = 0;  // Exchanges in progress
  std::atomic<State> state_{State::kLoading};
  runtime::Engine* engine_ = nullptr;          // set once by attach(), before state_ turns kServing
  std::unique_ptr<ModelContext const> context_;

  std::atomic<bool> listen_called_{false}, listen_returned_{false}, stop_requested_{false};

  std::mutex rng_mutex_;
  std::mt19937_64 rng_;
};

}  // namespace qflash::serve
