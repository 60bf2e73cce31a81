// The serving engine with its model on CUDA (runtime/cuda/engine.hpp) against the same engine
// on the CPU, on the embedded default model: concurrent requests with chunked prefill, a KV
// pool too small for all of them (preemption), prefix hits that restore Gated DeltaNet states
// from device memory, forked choices, the KV budget from the device's memory, and a LoRA
// adapter that updates the experts.
#include "gpu/gpu_main.hpp"

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "qflash/runtime/batch_engine.hpp"
#include "qflash/runtime/cuda/engine.hpp"
#include "qflash/runtime/lora.hpp"
#include "support/engine_client.hpp"
#include "support/expect_error.hpp"

using namespace qflash;
using namespace qflash::runtime;

namespace {

// fp32 weights on both sides: the kernels sum in another order, so two tokens whose
// log-probabilities lie closer than this may swap places (model_gpu_test: logits within 1e-3).
constexpr float kNearTie = 2e-3f;

LoadedModel load() { return test::load_micro(); }
io::Tokenizer tokenizer() { return test::micro_tokenizer(); }

std::unique_ptr<Engine> on_gpu(EngineOptions o = {}) {
  return make_cuda_engine(load(), 0, tokenizer(), std::move(o), "micro", false);
}
std::unique_ptr<Engine> on_cpu(EngineOptions o = {}) { return make_engine(load(), tokenizer(), std::move(o), "micro"); }

std::vector<std::int32_t> encode(std::string const& s) { return test::encode_micro(s); }

std::vector<std::string> const& kPrompts = test::kEnginePrompts;

/// A greedy request that also returns each token's two most likely alternatives.
GenerationRequest greedy_with_logprobs(std::vector<std::int32_t> prompt, int max_tokens) {
  GenerationRequest r = test::greedy(std::move(prompt), max_tokens);
  r.top_logprobs = 2;
  return r;
}

/// `got`'s greedy tokens equal `want`'s, or part ways only where `want` had two tokens within
/// kNearTie of each other and `got` took the other one.
void check_same_greedy(test::EngineResult const& got, test::EngineResult const& want) {
  REQUIRE_FALSE(got.error);
  REQUIRE_FALSE(want.error);
  auto const& g = got.tokens[0];
  auto const& w = want.tokens[0];
  std::size_t i = 0;
  while (i < g.size() && i < w.size() && g[i] == w[i]) ++i;
  if (i == g.size() && i == w.size()) return;
  REQUIRE_MESSAGE(i < g.size(), "the device run ended early, at token ", i);
  REQUIRE_MESSAGE(i < w.size(), "the device run went on past the host run's end, at token ", i);
  REQUIRE(i < want.logprobs[0].size());
  float const best = want.logprobs[0][i].logprob;
  float taken = -INFINITY;
  for (auto const& [token, lp] : want.logprobs[0][i].top)
    if (token == g[i]) taken = lp;
  MESSAGE("the runs part at token ", i, " (", w[i], " on the host, ", g[i], " on the device): a near tie");
  CHECK_MESSAGE(best - taken <= kNearTie, "token ", i, ": the device took ", g[i], ", whose host log-probability is ",
                taken, ", not within ", kNearTie, " of the host's ", w[i], " (", best, ")");
}

}  // namespace

TEST_CASE("engine on CUDA: concurrent, chunked and queued requests give the CPU engine's tokens") {
  EngineOptions o;
  o.max_num_seqs = 3;            // the rest wait
  o.max_num_batched_tokens = 8;  // prompts in chunks, beside decode tokens
  auto cpu = on_cpu(o);
  auto gpu = on_gpu(o);
  EngineInfo const info = gpu->info();
  CHECK((info.arch == "sm80" || info.arch == "sm90a"));
  std::vector<std::shared_ptr<RequestStream>> on_host, on_device;
  for (auto const& p : kPrompts) {
    on_host.push_back(cpu->submit(greedy_with_logprobs(encode(p), 32)));
    on_device.push_back(gpu->submit(greedy_with_logprobs(encode(p), 32)));
  }
  for (std::size_t i = 0; i < kPrompts.size(); ++i) {
    CAPTURE(kPrompts[i]);
    check_same_greedy(test::collect(*on_device[i]), test::collect(*on_host[i]));
  }
  CHECK(test::metric(*gpu, "qflash:requests_finished_total") == static_cast<double>(kPrompts.size()));
  CHECK(test::metric(*gpu, "qflash:kv_cache_blocks{state=\"used\"}") == 0);
}

TEST_CASE("engine on CUDA: a KV pool too small for all completes every request with the unloaded tokens") {
  std::vector<test::EngineResult> want;
  {
    auto alone = on_gpu();
    for (auto const& p : kPrompts) want.push_back(test::collect(*alone->submit(greedy_with_logprobs(encode(p), 48))));
  }
  EngineOptions o;
  o.max_num_seqs = 6;
  o.prefix.snapshot_bf16 = false;
  o.kv_cache_bytes = std::int64_t{5} * 32768 * 4 / 3 + 1;  // f32 KV: 5 blocks of 16 tokens cannot hold 6 sequences
  auto e = on_gpu(o);
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (auto const& p : kPrompts) streams.push_back(e->submit(greedy_with_logprobs(encode(p), 48)));
  for (std::size_t i = 0; i < streams.size(); ++i) {
    CAPTURE(kPrompts[i]);
    check_same_greedy(test::collect(*streams[i]), want[i]);
  }
  CHECK(test::metric(*e, "qflash:num_preemptions_total") > 0);
}

TEST_CASE("engine on CUDA: a prefix hit restores DeltaNet states from device memory; forks and seeds") {
  EngineOptions o;
  o.prefix.snapshot_bf16 = false;  // restore the exact state
  auto e = on_gpu(o);
  auto const ids = encode(kPrompts[3] + " " + kPrompts[0] + ". " + kPrompts[4] + " " + kPrompts[2] + " " + kPrompts[5] + ".");
  REQUIRE(ids.size() >= 40);
  REQUIRE(ids.size() % 16 != 0);
  test::EngineResult const first = test::collect(*e->submit(greedy_with_logprobs(ids, 16)));
  CHECK(first.usage.cached_tokens == 0);
  test::EngineResult const again = test::collect(*e->submit(greedy_with_logprobs(ids, 16)));
  CHECK(again.usage.cached_tokens == static_cast<std::int64_t>(ids.size() / 16 * 16));
  check_same_greedy(again, first);
  CHECK(test::metric(*e, "qflash:deltanet_snapshot_hits_total") >= 1);

  GenerationRequest r = test::greedy(encode(kPrompts[0]), 20);
  r.n = 3;
  r.sampling.temperature = 1.2f;
  r.sampling.seed = 11;
  test::EngineResult const a = test::collect(*e->submit(r), 3);
  test::EngineResult const b = test::collect(*e->submit(r), 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(a.finish[i].has_value());
    CHECK(a.tokens[i] == b.tokens[i]);  // the same device, the same kernels: the same draws
  }
  CHECK((a.tokens[0] != a.tokens[1] || a.tokens[1] != a.tokens[2]));
}

TEST_CASE("engine on CUDA: the KV budget from the device's memory") {
  cudaDeviceProp prop{};
  QFLASH_TEST_CUDA(cudaGetDeviceProperties(&prop, 0));
  auto const total = static_cast<std::int64_t>(prop.totalGlobalMem);

  // Default: what max_num_seqs full contexts take (f32 KV, 32 KiB a block) beside the DeltaNet
  // snapshots' quarter, well within 0.9.
  EngineOptions o;
  o.max_num_seqs = 2;
  CHECK(on_gpu(o)->info().kv_cache_bytes == (2 * (1024 / 16) * 32768 * 4 + 2) / 3);

  // A share: what it leaves after the weights, the runtime and a step's reserve.
  o.gpu_memory_utilization = 0.5;
  std::int64_t const half = on_gpu(o)->info().kv_cache_bytes;
  CHECK(half > 0);
  CHECK(half < total / 2);
  o.gpu_memory_utilization = 0.75;
  std::int64_t const three_quarters = on_gpu(o)->info().kv_cache_bytes;
  CHECK(std::llabs(three_quarters - half - total / 4) < total / 100);  // other processes' use may move a little

  // A share below what is in use already.
  o.gpu_memory_utilization = 1e-6;
  test::expect_error([&] { (void)on_gpu(o); }, {"leaves nothing for the KV cache"});

  // Not both.
  o.gpu_memory_utilization = 0.5;
  o.kv_cache_bytes = 1 << 20;
  test::expect_error([&] { (void)on_gpu(o); }, {"not both"});
}

TEST_CASE("engine on CUDA: an adapter that updates the experts runs unmerged, beside requests without it") {
  EngineOptions o;
  LoadedModel const base = load();
  o.adapters.push_back(load_lora(std::string(QFLASH_SOURCE_DIR) + "/tests/fixtures/lora/austen", base));
  REQUIRE(o.adapters.back()->touches_experts());
  auto cpu = on_cpu(o);
  auto gpu = on_gpu(o);
  // Every other request names the adapter, so batches hold both and runs of each.
  std::vector<std::shared_ptr<RequestStream>> on_host, on_device;
  for (std::size_t i = 0; i < kPrompts.size(); ++i) {
    GenerationRequest r = greedy_with_logprobs(encode(kPrompts[i]), 24);
    if (i % 2 == 0) r.lora = "austen";
    on_host.push_back(cpu->submit(r));
    on_device.push_back(gpu->submit(r));
  }
  for (std::size_t i = 0; i < kPrompts.size(); ++i) {
    CAPTURE(kPrompts[i]);
    CAPTURE(i % 2 == 0);
    check_same_greedy(test::collect(*on_device[i]), test::collect(*on_host[i]));
  }
}
