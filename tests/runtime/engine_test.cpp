// The batch engine (runtime/batch_engine.hpp) on the embedded default model: its output equals
// single-sequence generation, batching, chunked prefill, preemption and the prefix cache change
// no greedy token, n choices fork, cancellation and errors behave, and the metrics and router
// log say what happened.
#include <doctest/doctest.h>

#include <array>
#include <chrono>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "qflash/runtime/batch_engine.hpp"
#include "qflash/runtime/generate.hpp"
#include "qflash/runtime/lora.hpp"
#include "qflash/runtime/with_model.hpp"
#include "support/engine_client.hpp"
#include "support/expect_error.hpp"

using namespace qflash;
using namespace qflash::runtime;

namespace {

LoadedModel load() { return test::load_micro(); }
io::Tokenizer tokenizer() { return test::micro_tokenizer(); }

std::unique_ptr<Engine> start(EngineOptions o = {}) { return make_engine(load(), tokenizer(), std::move(o), "micro"); }

using Result = test::EngineResult;
using test::collect;
using test::greedy;
using test::metric;

/// runtime::generate's greedy result on the instance the engine runs (with `mo`, on `model`).
GenerateResult reference(std::vector<std::int32_t> const& prompt, int max_tokens, model::ModelOptions const& mo = {},
                         LoadedModel model = load()) {
  GenerateResult out;
  auto tok = tokenizer();
  with_model(std::move(model), mo, [&](auto& m) {
    GenerateOptions g;
    g.max_tokens = max_tokens;
    g.eos_ids.assign(m.config().eos_token_ids.begin(), m.config().eos_token_ids.end());
    out = generate(m, tok, prompt, g);
  });
  return out;
}

std::vector<std::string> const& kPrompts = test::kEnginePrompts;

std::vector<std::int32_t> encode(std::string const& s) { return test::encode_micro(s); }

}  // namespace

TEST_CASE("engine: a request streams generate()'s greedy tokens and text") {
  auto e = start();
  for (std::string const& p : {kPrompts[0], kPrompts[3]}) {
    CAPTURE(p);
    auto const ids = encode(p);
    GenerateResult const want = reference(ids, 24);
    Result const got = collect(*e->submit(greedy(ids, 24)));
    REQUIRE_FALSE(got.error);
    CHECK(got.tokens[0] == want.tokens);
    CHECK(got.text[0] == want.text);
    CHECK(got.finish[0] == want.finish);
    CHECK(got.usage.prompt_tokens == static_cast<std::int64_t>(ids.size()));
    CHECK(got.usage.completion_tokens >= static_cast<std::int64_t>(want.tokens.size()));
  }
  EngineInfo const info = e->info();
  CHECK(info.model_id == "micro");
  CHECK(info.max_context == 1024);
  CHECK(info.prefix_cache);
  CHECK_FALSE(info.compressed_kv);  // f32 KV by default
  CHECK_FALSE(flash_used(info));
  CHECK(info.arch == "cpu");
}

TEST_CASE("engine: the KV budget on the host; a GPU memory share is refused there") {
  // The default: max_num_seqs full contexts (f32 KV, 32 KiB a block of 16 tokens) beside the
  // DeltaNet snapshots' quarter, at most 1 GiB.
  EngineOptions o;
  o.max_num_seqs = 2;
  CHECK(start(o)->info().kv_cache_bytes == (2 * (1024 / 16) * 32768 * 4 + 2) / 3);
  o.prefix.enabled = false;  // no snapshots
  CHECK(start(o)->info().kv_cache_bytes == 2 * (1024 / 16) * 32768);
  o.prefix.enabled = true;
  o.kv_cache_bytes = 12345678;
  CHECK(start(o)->info().kv_cache_bytes == 12345678);
  o.kv_cache_bytes = 0;
  o.gpu_memory_utilization = 0.5;
  test::expect_error([&] { (void)start(o); }, {"gpu_memory_utilization applies to a model on a GPU", "cpu"});
}

TEST_CASE("engine: batched, chunked and queued requests give their single-run tokens") {
  std::vector<GenerateResult> want;
  for (auto const& p : kPrompts) want.push_back(reference(encode(p), 32));
  EngineOptions o;
  o.max_num_seqs = 3;              // the rest wait
  o.max_num_batched_tokens = 8;    // prompts in chunks, beside decode tokens
  auto e = start(o);
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (auto const& p : kPrompts) streams.push_back(e->submit(greedy(encode(p), 32)));
  for (std::size_t i = 0; i < streams.size(); ++i) {
    CAPTURE(kPrompts[i]);
    Result const got = collect(*streams[i]);
    CHECK(got.tokens[0] == want[i].tokens);
    CHECK(got.text[0] == want[i].text);
  }
  CHECK(metric(*e, "qflash:kv_cache_blocks{state=\"used\"}") == 0);
  CHECK(metric(*e, "qflash:requests_finished_total") == static_cast<double>(kPrompts.size()));
  CHECK(metric(*e, "qflash:generation_tokens_total") > 0);
}

TEST_CASE("engine: a KV pool too small for all still completes every request with the same tokens") {
  std::vector<GenerateResult> want;
  for (auto const& p : kPrompts) want.push_back(reference(encode(p), 48));
  for (bool prefix : {false, true}) {
    CAPTURE(prefix);
    EngineOptions o;
    o.max_num_seqs = 6;
    o.prefix.enabled = prefix;
    o.prefix.snapshot_bf16 = false;
    // f32 KV of this model: 32 KiB a block of 16 tokens; 5 blocks cannot hold 6 sequences.
    o.kv_cache_bytes = std::int64_t{5} * 32768 * 4 / 3 + 1;
    auto e = start(o);
    std::vector<std::shared_ptr<RequestStream>> streams;
    for (auto const& p : kPrompts) streams.push_back(e->submit(greedy(encode(p), 48)));
    for (std::size_t i = 0; i < streams.size(); ++i) {
      CAPTURE(kPrompts[i]);
      Result const got = collect(*streams[i]);
      REQUIRE_FALSE(got.error);
      CHECK(got.tokens[0] == want[i].tokens);
    }
    CHECK(metric(*e, "qflash:num_preemptions_total") > 0);
  }
}

TEST_CASE("engine: by default one sequence reaches max_context beside the snapshots' share") {
  EngineOptions o;
  o.max_num_seqs = 1;
  o.max_context = 128;
  auto e = start(o);
  auto const ids = encode(kPrompts[0]);
  auto r = greedy(ids, 128 - static_cast<int>(ids.size()));
  r.ignore_eos = true;
  Result const got = collect(*e->submit(std::move(r)));
  REQUIRE_FALSE(got.error);
  CHECK(got.finish[0] == FinishReason::kLength);
  CHECK(ids.size() + got.tokens[0].size() == 128);
}

TEST_CASE("engine: a sequence that outgrows the whole pool ends with finish 'length'") {
  EngineOptions o;
  o.prefix.enabled = false;
  o.kv_cache_bytes = 2 * 32768;  // 2 blocks: 32 positions
  auto e = start(o);
  auto const ids = encode(kPrompts[0]);
  Result const got = collect(*e->submit(greedy(ids, 200)));
  REQUIRE_FALSE(got.error);
  CHECK(got.finish[0] == FinishReason::kLength);
  CHECK(static_cast<std::int64_t>(ids.size() + got.tokens[0].size()) <= 33);
  // A prompt the pool can never hold is refused up front.
  auto const long_prompt = encode(kPrompts[3] + " " + kPrompts[3]);
  REQUIRE(long_prompt.size() > 32);
  test::expect_error([&] { e->submit(greedy(long_prompt, 4)); }, {"KV cache"});
}

TEST_CASE("engine: the prefix cache serves a repeated prompt, never across salts") {
  EngineOptions o;
  o.prefix.snapshot_bf16 = false;  // restore the exact state: the same greedy tokens follow
  auto e = start(o);
  auto const ids = encode(kPrompts[3] + " " + kPrompts[0] + ". " + kPrompts[4] + " " + kPrompts[2] + " " + kPrompts[5] + ".");
  REQUIRE(ids.size() >= 40);
  REQUIRE(ids.size() % 16 != 0);  // its last full block is cached with a snapshot, and matchable
  Result const first = collect(*e->submit(greedy(ids, 16)));
  CHECK(first.usage.cached_tokens == 0);
  Result const again = collect(*e->submit(greedy(ids, 16)));
  CHECK(again.usage.cached_tokens == static_cast<std::int64_t>(ids.size() / 16 * 16));
  CHECK(again.tokens[0] == first.tokens[0]);
  GenerationRequest other = greedy(ids, 16);
  other.cache_salt = "tenant-b";
  Result const salted = collect(*e->submit(other));
  CHECK(salted.usage.cached_tokens == 0);
  CHECK(salted.tokens[0] == first.tokens[0]);
  CHECK(metric(*e, "qflash:deltanet_snapshot_hits_total") >= 1);
  CHECK(metric(*e, "qflash:kv_shared_hit_rate") > 0);
  // A longer prompt with the same start resumes at the last snapshot inside the shared part.
  auto longer = ids;
  for (auto t : encode(" and so it ended")) longer.push_back(t);
  Result const extended = collect(*e->submit(greedy(longer, 8)));
  CHECK(extended.usage.cached_tokens > 0);
  CHECK(extended.tokens[0] == reference(longer, 8).tokens);

  // bf16 snapshots (the default): half the bytes, and a hit all the same.
  auto f = start();
  collect(*f->submit(greedy(ids, 4)));
  CHECK(collect(*f->submit(greedy(ids, 4))).usage.cached_tokens > 0);
}

TEST_CASE("engine: a tenant's request does the same work whether or not another tenant sent its prompt") {
  // Timing isolation by construction: a request's time follows from the work the engine does
  // for it (prompt tokens computed, snapshots restored), so if that work is the same as on a
  // fresh engine, hit-or-miss timing cannot be observed across tenants. (Wall times are
  // measured, not asserted: bench/serve/serve_bench.py --scenario tenants.)
  auto const ids = encode(kPrompts[3] + " " + kPrompts[0] + ". " + kPrompts[4] + " " + kPrompts[2] + ".");
  REQUIRE(ids.size() >= 32);
  char const* const counters[] = {"qflash:prefill_tokens_total", "qflash:decode_tokens_total",
                                  "qflash:prefix_cache_queries_total", "qflash:prefix_cache_hits_total",
                                  "qflash:deltanet_snapshot_hits_total"};
  struct Work {
    std::int64_t cached = 0;
    std::vector<double> counters;
    std::vector<std::int32_t> tokens;
  };
  auto run = [&](Engine& e, std::string const& salt) {
    std::vector<double> before;
    for (auto const* c : counters) before.push_back(metric(e, c));
    GenerationRequest r = greedy(ids, 8);
    r.cache_salt = salt;
    Result const got = collect(*e.submit(r));
    REQUIRE_FALSE(got.error);
    Work w{got.usage.cached_tokens, {}, got.tokens[0]};
    for (std::size_t i = 0; i < std::size(counters); ++i) w.counters.push_back(metric(e, counters[i]) - before[i]);
    return w;
  };

  EngineOptions o;
  o.prefix.snapshot_bf16 = false;  // restore the exact state: the hit below gives the same tokens
  auto fresh = start(o);
  Work const cold = run(*fresh, "tenant-b");
  CHECK(cold.cached == 0);

  auto shared = start(o);
  Work const a = run(*shared, "tenant-a");
  Work const b = run(*shared, "tenant-b");  // the same prompt, after tenant a's
  CHECK(b.cached == 0);
  CHECK(b.counters == cold.counters);
  CHECK(b.tokens == cold.tokens);
  CHECK(a.counters == cold.counters);
  // Within a tenant the hit is there (and is meant to be): fewer prompt tokens computed.
  Work const again = run(*shared, "tenant-a");
  CHECK(again.cached > 0);
  CHECK(again.counters[0] < cold.counters[0]);
  CHECK(again.tokens == cold.tokens);
}

TEST_CASE("engine: n choices fork one prefill; a seed reproduces them") {
  auto e = start();
  GenerationRequest r = greedy(encode(kPrompts[0]), 20);
  r.n = 3;
  r.sampling.temperature = 1.2f;
  r.sampling.seed = 11;
  Result const a = collect(*e->submit(r), 3);
  Result const b = collect(*e->submit(r), 3);
  for (int i = 0; i < 3; ++i) {
    CHECK(a.finish[static_cast<std::size_t>(i)].has_value());
    CHECK(a.tokens[static_cast<std::size_t>(i)] == b.tokens[static_cast<std::size_t>(i)]);
  }
  CHECK((a.tokens[0] != a.tokens[1] || a.tokens[1] != a.tokens[2]));  // different seeds per choice
  std::int64_t total = 0;
  for (auto const& t : a.tokens) total += static_cast<std::int64_t>(t.size());
  CHECK(a.usage.completion_tokens >= total);
}

TEST_CASE("engine: stop strings and logprobs") {
  auto e = start();
  auto const ids = encode(kPrompts[0]);
  GenerateResult const free_run = reference(ids, 24);
  REQUIRE(free_run.text.size() > 6);
  GenerationRequest r = greedy(ids, 24);
  std::string const stop = free_run.text.substr(4, 3);
  r.stop = {stop};
  r.top_logprobs = 3;
  Result const got = collect(*e->submit(r));
  CHECK(got.finish[0] == FinishReason::kStopString);
  CHECK(got.text[0] == free_run.text.substr(0, free_run.text.find(stop)));
  REQUIRE(got.logprobs[0].size() == got.tokens[0].size());
  for (std::size_t i = 0; i < got.tokens[0].size(); ++i) {
    TokenLogprob const& lp = got.logprobs[0][i];
    CHECK(lp.token == got.tokens[0][i]);
    REQUIRE(lp.top.size() == 3);
    CHECK(lp.top[0].first == lp.token);  // greedy picks the most likely
    CHECK(lp.logprob == doctest::Approx(lp.top[0].second));
    CHECK(lp.top[0].second >= lp.top[1].second);
    CHECK(lp.top[1].second >= lp.top[2].second);
    double mass = 0;
    for (auto const& [id, l] : lp.top) mass += std::exp(l);
    CHECK(mass <= 1.0 + 1e-5);
  }
}

TEST_CASE("engine: bad requests are refused, a full queue and draining say so") {
  EngineOptions o;
  o.max_num_seqs = 1;
  o.max_queue = 1;
  auto e = start(o);
  auto kind_of = [&](GenerationRequest r) {
    try {
      e->submit(std::move(r));
    } catch (RequestError const& err) {
      return err.kind();
    }
    return RequestErrorKind::kInternal;  // accepted
  };
  CHECK(kind_of(greedy({}, 4)) == RequestErrorKind::kInvalid);
  CHECK(kind_of(greedy({1, 99999}, 4)) == RequestErrorKind::kInvalid);
  CHECK(kind_of(greedy(std::vector<std::int32_t>(1024, 5), 4)) == RequestErrorKind::kInvalid);
  GenerationRequest bad = greedy({1, 2}, 4);
  bad.top_logprobs = 21;
  CHECK(kind_of(bad) == RequestErrorKind::kInvalid);
  bad = greedy({1, 2}, 4);
  bad.sampling.top_p = 0;
  CHECK(kind_of(bad) == RequestErrorKind::kInvalid);
  test::expect_error([&] { e->submit(greedy({1, 2}, 0)); }, {"max_tokens must be >= 1"});

  // One runs, one waits, the next is refused.
  auto long_run = greedy(encode(kPrompts[0]), 400);
  long_run.ignore_eos = true;
  auto s1 = e->submit(long_run);
  std::vector<RequestErrorKind> kinds;
  for (int i = 0; i < 3; ++i) kinds.push_back(kind_of(long_run));
  CHECK(std::count(kinds.begin(), kinds.end(), RequestErrorKind::kQueueFull) >= 1);

  // Cancelling ends the stream and frees its blocks.
  s1->cancel();
  Result const cancelled = collect(*s1);
  CHECK_FALSE(cancelled.error);
  e->drain();
  CHECK(kind_of(greedy({1, 2}, 4)) == RequestErrorKind::kDraining);
  CHECK(metric(*e, "qflash:kv_cache_blocks{state=\"used\"}") == 0);
}

TEST_CASE("engine: routing metrics and the router decision log") {
  std::string const log = "engine_test_router.jsonl";
  EngineOptions o;
  o.router_log_path = log;
  auto e = start(o);
  Result const got = collect(*e->submit(greedy(encode(kPrompts[1]), 6)));
  REQUIRE_FALSE(got.error);
  auto const cfg = e->config();
  for (int l = 0; l < cfg.n_layer; ++l) {
    double const h = metric(*e, "qflash:router_entropy{layer=\"" + std::to_string(l) + "\"}");
    CHECK(h > 0);
    CHECK(h <= std::log(static_cast<double>(cfg.n_expert)) + 1e-6);
  }
  double load = 0;
  for (int x = 0; x < cfg.n_expert; ++x) load += metric(*e, "qflash:expert_load_total{expert=\"" + std::to_string(x) + "\"}");
  CHECK(load > 0);
  CHECK(std::fmod(load, static_cast<double>(cfg.n_expert_used * cfg.n_layer)) == 0);
  e.reset();  // the log is complete once the engine stops
  std::ifstream in(log);
  int lines = 0;
  for (std::string line; std::getline(in, line); ++lines) {
    auto const j = nlohmann::json::parse(line);
    CHECK(j["experts"].size() == static_cast<std::size_t>(cfg.n_expert_used));
    CHECK(j["weights"].size() == static_cast<std::size_t>(cfg.n_expert_used));
    CHECK(j["layer"].get<int>() < cfg.n_layer);
  }
  // One line per MoE layer for every decode step: every generated token is fed back but the
  // last of a run cut by length (an end-of-sequence token is not in tokens).
  int const fed = static_cast<int>(got.tokens[0].size()) - (got.finish[0] == FinishReason::kLength ? 1 : 0);
  CHECK(lines == fed * cfg.n_layer);
  std::remove(log.c_str());
}

TEST_CASE("engine: each request routes as it asks, beside others; the prefix cache keeps routings apart") {
  EngineOptions o;
  o.prefix.snapshot_bf16 = false;  // restore the exact state: the same greedy tokens follow
  auto e = start(o);
  auto const ids = encode(kPrompts[3] + " " + kPrompts[0] + ". " + kPrompts[4]);
  REQUIRE(ids.size() >= 32);
  std::vector<std::optional<model::Routing>> const routings{std::nullopt, model::parse_routing("top_p=0.5"),
                                                            model::parse_routing("top_k=1")};
  // All three at once: they share batches.
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (auto const& r : routings) {
    GenerationRequest g = greedy(ids, 12);
    g.routing = r;
    streams.push_back(e->submit(g));
  }
  std::vector<Result> results;
  for (auto& s : streams) results.push_back(collect(*s));
  for (std::size_t i = 0; i < routings.size(); ++i) {
    CAPTURE(i);
    REQUIRE_FALSE(results[i].error);
    model::ModelOptions mo;
    if (routings[i]) mo.routing = *routings[i];
    CHECK(results[i].tokens[0] == reference(ids, 12, mo).tokens);
  }
  CHECK(results[1].tokens[0] != results[2].tokens[0]);
  // Only a request with the same routing reuses a routing's cached prefix.
  GenerationRequest again = greedy(ids, 12);
  again.routing = routings[2];
  Result const hit = collect(*e->submit(again));
  CHECK(hit.usage.cached_tokens > 0);
  CHECK(hit.tokens[0] == results[2].tokens[0]);
  // top_k=1 and top_p=0.5 ran: fewer than the model's 2 experts per token on average.
  double const per_token = metric(*e, "qflash:experts_per_token");
  CHECK(per_token >= 1.0);
  CHECK(per_token < 2.0);
  // A routing the model cannot run is refused as invalid.
  GenerationRequest bad = greedy(ids, 4);
  bad.routing = model::parse_routing("top_k=17");
  try {
    e->submit(bad);
    FAIL("accepted");
  } catch (RequestError const& err) {
    CHECK(err.kind() == RequestErrorKind::kInvalid);
    CHECK(std::string(err.what()).find("the model has 16") != std::string::npos);
  }
}

TEST_CASE("engine: each request runs the LoRA adapter it names, beside others; the prefix cache keeps adapters apart") {
  std::string const dir = std::string(QFLASH_SOURCE_DIR) + "/tests/fixtures/lora/austen";
  auto base = load();
  EngineOptions o;
  o.prefix.snapshot_bf16 = false;
  o.adapters.push_back(load_lora(dir, base));
  auto e = make_engine(std::move(base), tokenizer(), o, "micro");
  CHECK(e->info().adapters == std::vector<std::string>{"austen"});
  auto const ids = encode(kPrompts[3] + " " + kPrompts[0]);
  REQUIRE(ids.size() >= 16);
  // With and without the adapter at once: they share batches.
  GenerationRequest plain = greedy(ids, 12), adapted = greedy(ids, 12);
  adapted.lora = "austen";
  auto s1 = e->submit(plain), s2 = e->submit(adapted);
  Result const r_plain = collect(*s1), r_adapted = collect(*s2);
  REQUIRE_FALSE(r_plain.error);
  REQUIRE_FALSE(r_adapted.error);
  CHECK(r_plain.tokens[0] == reference(ids, 12).tokens);
  model::ModelOptions mo;
  auto loaded = load();
  mo.lora = load_lora(dir, loaded);
  auto const want = reference(ids, 12, mo, std::move(loaded));
  CHECK(r_adapted.tokens[0] == want.tokens);
  CHECK(r_adapted.tokens[0] != r_plain.tokens[0]);
  // The adapter's cached prefix serves it again; the base model's never serves the adapter's.
  Result const hit = collect(*e->submit(adapted));
  CHECK(hit.usage.cached_tokens > 0);
  CHECK(hit.tokens[0] == r_adapted.tokens[0]);
  auto const ids2 = encode(kPrompts[4] + " " + kPrompts[3]);
  REQUIRE(ids2.size() >= 16);
  CHECK(collect(*e->submit(greedy(ids2, 2))).usage.cached_tokens == 0);
  GenerationRequest adapted2 = greedy(ids2, 2);
  adapted2.lora = "austen";
  CHECK(collect(*e->submit(adapted2)).usage.cached_tokens == 0);
  CHECK(collect(*e->submit(adapted2)).usage.cached_tokens > 0);
  // An unknown adapter is refused as invalid, naming the loaded ones.
  GenerationRequest bad = greedy(ids, 4);
  bad.lora = "nope";
  try {
    e->submit(bad);
    FAIL("accepted");
  } catch (RequestError const& err) {
    CHECK(err.kind() == RequestErrorKind::kInvalid);
    CHECK(std::string(err.what()).find("unknown LoRA adapter 'nope' (loaded: austen)") != std::string::npos);
  }
}

TEST_CASE("engine: snapshot hints let a request that shares only a system prompt resume after it (hybrid model)") {
  auto const system = encode(kPrompts[3] + ". " + kPrompts[0] + ", that a single man in possession of a fortune");
  REQUIRE(system.size() >= 32);
  auto with_turn = [&](std::string const& turn) {
    std::vector<std::int32_t> ids = system;
    auto const t = encode(" " + turn + " " + kPrompts[4]);
    ids.insert(ids.end(), t.begin(), t.end());
    return ids;
  };
  auto const a = with_turn("Mr. Darcy walked in."), b = with_turn("Emma laughed at the idea.");
  std::int32_t const hint = static_cast<std::int32_t>(system.size());
  std::int64_t const shared_blocks = hint / 16;

  for (bool hinted : {false, true}) {
    CAPTURE(hinted);
    EngineOptions o;
    o.prefix.snapshot_bf16 = false;       // restore the exact state: the same greedy tokens follow
    o.prefix.snapshot_every_blocks = 64;  // no periodic snapshot inside these prompts
    auto e = start(o);
    GenerationRequest ra = greedy(a, 4), rb = greedy(b, 8);
    if (hinted) ra.snapshot_hints = rb.snapshot_hints = {hint};
    REQUIRE_FALSE(collect(*e->submit(ra)).error);
    Result const got = collect(*e->submit(rb));
    REQUIRE_FALSE(got.error);
    // Without the hint the only snapshot is at a's own prompt end, which b does not share.
    CHECK(got.usage.cached_tokens == (hinted ? shared_blocks * 16 : 0));
    CHECK(got.tokens[0] == reference(b, 8).tokens);
  }
  // Hints outside the prompt are refused.
  auto e = start();
  GenerationRequest bad = greedy(a, 2);
  bad.snapshot_hints = {static_cast<std::int32_t>(a.size())};
  CHECK_THROWS_AS(e->submit(bad), RequestError);
}

TEST_CASE("engine: sampling from the rows' candidates draws what whole rows draw") {
  // Rows in full (sampling_candidates 0) against the default's 64 and the fewest, 20, which
  // leave more draws to their rows: the same tokens and log-probabilities, to the bit.
  auto request = [&](int i) {
    GenerationRequest r = greedy(encode(kPrompts[static_cast<std::size_t>(i) % kPrompts.size()]), 24);
    r.sampling.temperature = std::array{0.0f, 0.7f, 1.0f, 1.5f}[i % 4];
    r.sampling.top_k = std::array{0, 20, 0, 50, 0}[i % 5];
    r.sampling.top_p = std::array{1.0f, 0.9f, 0.95f}[i % 3];
    r.sampling.min_p = i % 4 == 3 ? 0.05f : 0.0f;
    r.sampling.repetition_penalty = i % 3 == 1 ? 1.2f : 1.0f;
    r.sampling.seed = static_cast<std::uint64_t>(100 + i);
    r.presence_penalty = i % 5 == 2 ? 0.5f : 0.0f;
    r.frequency_penalty = i % 7 == 4 ? -0.3f : 0.0f;
    r.top_logprobs = std::array{-1, 0, 3, 20}[i % 4];
    r.n = i % 6 == 5 ? 2 : 1;
    return r;
  };
  constexpr int kRequests = 18;
  auto run = [&](int candidates) {
    EngineOptions o;
    o.sampling_candidates = candidates;
    o.max_num_seqs = 6;
    auto e = start(o);
    std::vector<std::shared_ptr<RequestStream>> streams;
    for (int i = 0; i < kRequests; ++i) streams.push_back(e->submit(request(i)));
    std::vector<Result> out;
    for (int i = 0; i < kRequests; ++i) out.push_back(collect(*streams[static_cast<std::size_t>(i)], request(i).n));
    double const full = metric(*e, "qflash:sampling_full_row_draws_total");
    double const drawn = metric(*e, "qflash:generation_tokens_total");
    if (candidates == 0) {
      CHECK(full == drawn);
    } else {  // both ways were taken
      CHECK(full > 0);
      CHECK(full < drawn);
    }
    return out;
  };
  std::vector<Result> const whole = run(0);
  for (int candidates : {kSamplingCandidates, 20}) {
    CAPTURE(candidates);
    std::vector<Result> const got = run(candidates);
    for (int i = 0; i < kRequests; ++i) {
      CAPTURE(i);
      Result const& a = whole[static_cast<std::size_t>(i)];
      Result const& b = got[static_cast<std::size_t>(i)];
      REQUIRE_FALSE(b.error);
      CHECK(b.tokens == a.tokens);
      CHECK(b.text == a.text);
      REQUIRE(b.logprobs.size() == a.logprobs.size());
      for (std::size_t c = 0; c < a.logprobs.size(); ++c) {
        REQUIRE(b.logprobs[c].size() == a.logprobs[c].size());
        for (std::size_t t = 0; t < a.logprobs[c].size(); ++t) {
          CHECK(b.logprobs[c][t].token == a.logprobs[c][t].token);
          CHECK(b.logprobs[c][t].logprob == a.logprobs[c][t].logprob);
          CHECK(b.logprobs[c][t].top == a.logprobs[c][t].top);
        }
      }
    }
  }
  EngineOptions bad;
  bad.sampling_candidates = 19;
  test::expect_error([&] { (void)start(bad); }, {"sampling_candidates must be 0 (whole rows) or in [20, 256]"});
}
