// Static vs generic spec: the same CPU op at Qwen3.6-35B-A3B shapes, launched through the
// static `qwen3_6_35b_a3b` instance (its dims compile-time constants) and through `generic`
// (every dim a run-time value). The pair of lines per op is the measurement; the ratio of
// their times is what the static fields pay (peer comparison in the same run, same data).
//
//   build/cpu-release/bench/kernels/spec_bench [--benchmark_filter=router]
//
// Shapes: decode (1 token) and a prefill chunk (512 tokens); attention decodes one token over
// a 4096-position cache. Data stays in cache: these are compute/latency-bound ops.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <string>
#include <vector>

#include "qflash/kernels/add_rmsnorm/cpu.hpp"
#include "qflash/kernels/attention/cpu.hpp"
#include "qflash/kernels/gdn_gates/cpu.hpp"
#include "qflash/kernels/qk_norm_rope/cpu.hpp"
#include "qflash/kernels/router_topk/cpu.hpp"
#include "qflash/kv/layer_cache.hpp"
#include "qflash/spec/presets.hpp"

using namespace qflash;
using namespace qflash::kernels;

namespace {

constexpr MoeSpec kQ36 = spec::qwen3_6_35b_a3b;

std::vector<float> values(std::size_t n, float scale = 1.0f) {
  std::vector<float> v(n);
  std::uint32_t s = 12345;
  for (auto& x : v) {
    s = s * 1664525u + 1013904223u;
    x = scale * (static_cast<float>(s >> 8) / static_cast<float>(1u << 24) - 0.5f);
  }
  return v;
}

template <MoeSpec S>
void BM_router_topk(benchmark::State& st) {
  std::int64_t const T = st.range(0);
  int const E = kQ36.n_expert, K = kQ36.n_expert_used;
  auto logits = values(static_cast<std::size_t>(T * (E + 1)), 8.0f);
  std::vector<std::int32_t> experts(static_cast<std::size_t>(T * K));
  std::vector<float> w(experts.size()), shared(static_cast<std::size_t>(T));
  RouterTopkArgs a{};
  a.logits = logits.data();
  a.logits_stride = E + 1;
  a.experts = experts.data();
  a.weights = w.data();
  a.shared_weights = shared.data();
  a.n_tokens = T;
  a.n_expert = E;
  a.n_expert_used = K;
  for (auto _ : st) benchmark::DoNotOptimize(launch_router_topk<S>(arch::Cpu{}, a));
  st.SetItemsProcessed(st.iterations() * T);
}

template <MoeSpec S>
void BM_qk_norm_rope(benchmark::State& st) {
  std::int64_t const T = st.range(0);
  int const H = kQ36.n_head, D = kQ36.d_head;
  auto x = values(static_cast<std::size_t>(T * H * 2 * D));  // [query | gate] rows
  auto w = values(static_cast<std::size_t>(D));
  std::vector<float> y(static_cast<std::size_t>(T * H * D));
  std::vector<std::int64_t> pos(static_cast<std::size_t>(T));
  for (std::int64_t t = 0; t < T; ++t) pos[static_cast<std::size_t>(t)] = 1000 + t;
  QkNormRopeArgs a{};
  a.x = x.data();
  a.head_stride = 2 * D;
  a.weight = w.data();
  a.y = y.data();
  a.positions = pos.data();
  a.n_tokens = T;
  a.n_head = H;
  a.d_head = D;
  a.rotary_dim = 64;
  a.theta = 1e7f;
  a.weight_kind = NormWeight::kZeroCentered;
  for (auto _ : st) benchmark::DoNotOptimize(launch_qk_norm_rope<S>(arch::Cpu{}, a));
  st.SetItemsProcessed(st.iterations() * T);
}

template <MoeSpec S>
void BM_attention_decode(benchmark::State& st) {
  std::int64_t const ctx = st.range(0);
  int const H = kQ36.n_head, KV = kQ36.n_head_kv, D = kQ36.d_head;
  auto q = values(static_cast<std::size_t>(H * D));
  auto k = values(static_cast<std::size_t>(ctx * KV * D));
  auto v = values(static_cast<std::size_t>(ctx * KV * D));
  auto gate = values(static_cast<std::size_t>(H * D));
  std::vector<float> out(q.size());
  KvFormat const f = kKvFormats[static_cast<std::size_t>(st.range(1))].first;
  kv::LayerCache cache(KV, D, kv::KvFormats{f, f}, ctx);
  cache.append(k.data(), v.data(), ctx);
  AttentionArgs a{};
  a.q = q.data();
  a.kv = cache.view();
  a.out = out.data();
  a.n_tokens = 1;
  a.n_ctx = ctx;
  a.n_head = H;
  a.n_head_kv = KV;
  a.d_head = D;
  a.scale = 0.0625f;
  a.gate = gate.data();
  a.gate_token_stride = H * D;
  for (auto _ : st) benchmark::DoNotOptimize(launch_attention<S>(arch::Cpu{}, a));
  st.SetItemsProcessed(st.iterations() * ctx);
  st.SetBytesProcessed(st.iterations() * ctx * KV * 2 * kv_head_bytes(f, D));
  st.SetLabel(std::string(to_string(f)));
}

template <MoeSpec S>
void BM_add_rmsnorm(benchmark::State& st) {
  std::int64_t const T = st.range(0);
  int const d = kQ36.d_model;
  auto x = values(static_cast<std::size_t>(T * d)), res = values(x.size()), w = values(static_cast<std::size_t>(d));
  std::vector<float> y(x.size());
  AddRmsNormArgs a{};
  a.x = x.data();
  a.residual = res.data();
  a.weight = w.data();
  a.y = y.data();
  a.n_rows = T;
  a.n_cols = d;
  a.weight_kind = NormWeight::kZeroCentered;
  for (auto _ : st) benchmark::DoNotOptimize(launch_add_rmsnorm<S>(arch::Cpu{}, a));
  st.SetItemsProcessed(st.iterations() * T);
}

template <MoeSpec S>
void BM_gdn_gates(benchmark::State& st) {
  std::int64_t const T = st.range(0);
  int const hv = kQ36.n_head_v_linear;
  auto b = values(static_cast<std::size_t>(T * hv), 8.0f), g = values(b.size(), 8.0f);
  auto dt = values(static_cast<std::size_t>(hv)), neg_a = values(static_cast<std::size_t>(hv));
  for (auto& x : neg_a) x = -1.0f - x * x;
  auto b0 = b, g0 = g;
  GdnGatesArgs a{};
  a.beta = b.data();
  a.g = g.data();
  a.dt_bias = dt.data();
  a.neg_a = neg_a.data();
  a.n_tokens = T;
  a.n_head_v = hv;
  for (auto _ : st) {
    st.PauseTiming();
    b = b0;
    g = g0;
    st.ResumeTiming();
    benchmark::DoNotOptimize(launch_gdn_gates<S>(arch::Cpu{}, a));
  }
  st.SetItemsProcessed(st.iterations() * T);
}

}  // namespace

BENCHMARK(BM_router_topk<kQ36>)->Name("router_topk/static")->Arg(1)->Arg(512);
BENCHMARK(BM_router_topk<spec::generic>)->Name("router_topk/generic")->Arg(1)->Arg(512);
BENCHMARK(BM_qk_norm_rope<kQ36>)->Name("qk_norm_rope/static")->Arg(1)->Arg(512);
BENCHMARK(BM_qk_norm_rope<spec::generic>)->Name("qk_norm_rope/generic")->Arg(1)->Arg(512);
// Args: context, KV format (index into kKvFormats: f32, bf16, fp8_e4m3, int8, int6).
BENCHMARK(BM_attention_decode<kQ36>)->Name("attention_decode/static")->ArgsProduct({{4096}, {0, 1, 2, 3, 4}});
BENCHMARK(BM_attention_decode<spec::generic>)->Name("attention_decode/generic")->Args({4096, 0});
BENCHMARK(BM_add_rmsnorm<kQ36>)->Name("add_rmsnorm/static")->Arg(1)->Arg(512);
BENCHMARK(BM_add_rmsnorm<spec::generic>)->Name("add_rmsnorm/generic")->Arg(1)->Arg(512);
BENCHMARK(BM_gdn_gates<kQ36>)->Name("gdn_gates/static")->Arg(512);
BENCHMARK(BM_gdn_gates<spec::generic>)->Name("gdn_gates/generic")->Arg(512);

BENCHMARK_MAIN();
