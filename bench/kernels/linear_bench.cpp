// kernels/linear on the CPU per weight format: decode (1 token) as read bandwidth of the
// weights, prefill (many tokens) as multiply-adds per second.
//
//   build/cpu-release/bench/kernels/linear_bench [--benchmark_filter=q4_k]
//
// Counters: GB/s = weight bytes read per call / time, roofline = that / the read bandwidth
// measured first (runtime/bandwidth.hpp); GMAC/s = tokens * rows * cols / time.
// Decode benchmarks rotate over copies of their matrix totalling >= 512 MiB, so calls meet cold
// memory as the model's projections do (each is read once per token); *_hot ones do not.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/kernels/linear/cpu.hpp"
#include "qflash/numeric/weight_encode.hpp"
#include "qflash/runtime/bandwidth.hpp"

using namespace qflash;

namespace {

constexpr std::size_t kRotationBytes = std::size_t{512} << 20;
double g_read_gbps = 0.0;

struct Workload {
  std::vector<OwnedMatrix> copies;
  std::vector<float> x, y;
  std::int64_t tokens;

  Workload(WeightFormat f, std::int64_t rows, std::int64_t cols, std::int64_t n_tokens, bool rotate)
      : tokens(n_tokens) {
    std::vector<float> w(static_cast<std::size_t>(rows * cols));
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i * 2654435761u % 2001) / 1000.0f - 1.0f;
    OwnedMatrix const m = encode_matrix(f, w.data(), rows, cols);
    std::size_t const n = rotate ? std::max<std::size_t>(1, kRotationBytes / m.bytes.size()) : 1;
    for (std::size_t c = 0; c < n; ++c) {
      OwnedMatrix& copy = copies.emplace_back();
      copy.bytes = m.bytes;
      copy.scales = m.scales;
      copy.view = m.view;
      copy.view.data = copy.bytes.data();
      copy.view.scales = copy.scales.empty() ? nullptr : copy.scales.data();
    }
    x.resize(static_cast<std::size_t>(n_tokens * cols));
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 89) / 89.0f - 0.5f;
    y.resize(static_cast<std::size_t>(n_tokens * rows));
  }
};

void run(benchmark::State& state, WeightFormat f, std::int64_t rows, std::int64_t cols, std::int64_t n_tokens,
         bool cold) {
  Workload wl(f, rows, cols, n_tokens, cold);
  arch::CpuIsa const isa = arch::cpu_isa();
  std::size_t i = 0;
  for (auto _ : state) {
    kernels::LinearArgs a{};
    a.w = wl.copies[i++ % wl.copies.size()].view;
    a.x = wl.x.data();
    a.y = wl.y.data();
    a.n_tokens = n_tokens;
    if (kernels::cpu::linear(isa, a) != Status::kSuccess) {
      state.SkipWithError("linear refused its arguments");
      break;
    }
    benchmark::DoNotOptimize(wl.y.data());
  }
  double const calls = static_cast<double>(state.iterations());
  state.counters["GB/s"] = benchmark::Counter(calls * static_cast<double>(wl.copies[0].view.bytes()) / 1e9,
                                              benchmark::Counter::kIsRate);
  state.counters["roofline"] = benchmark::Counter(
      calls * static_cast<double>(wl.copies[0].view.bytes()) / 1e9 / g_read_gbps, benchmark::Counter::kIsRate);
  state.counters["GMAC/s"] = benchmark::Counter(calls * static_cast<double>(rows * cols * n_tokens) / 1e9,
                                                benchmark::Counter::kIsRate);
}

void register_all() {
  struct Shape {
    char const* name;
    std::int64_t rows, cols, tokens;
    bool cold;  ///< rotate over copies so that every call reads from memory
  };
  // Qwen3.6-35B-A3B: an expert's gate/up (512 x 2048) and down (2048 x 512), the DeltaNet
  // in-projection (12288 x 2048, q k v z together), a 512-token prefill of the in-projection.
  // The *_hot ones read one copy that stays in cache: the kernel's compute ceiling for decode.
  // micro_*: the embedded default model (hidden 192) at 16 decoding sequences, from cache: its
  // DeltaNet in-projection (q k v), lm_head and shared expert's down projection.
  Shape const shapes[] = {{"expert_up", 512, 2048, 1, true},
                          {"expert_up_hot", 512, 2048, 1, false},
                          {"expert_down", 2048, 512, 1, true},
                          {"expert_down_hot", 2048, 512, 1, false},
                          {"in_proj", 12288, 2048, 1, true},
                          {"in_proj_pp512", 12288, 2048, 512, false},
                          {"expert_up_pp16", 512, 2048, 16, false},
                          {"micro_qkv_b16", 512, 192, 16, false},
                          {"micro_lm_head_b16", 4096, 192, 16, false},
                          {"micro_shared_down_b16", 192, 128, 16, false}};
  for (WeightFormat f : {WeightFormat::kF32, WeightFormat::kBf16, WeightFormat::kF16, WeightFormat::kQ8_0,
                         WeightFormat::kQ4K, WeightFormat::kQ6K, WeightFormat::kInt4, WeightFormat::kFp8E4m3})
    for (Shape const& s : shapes) {
      std::string const name = std::string(to_string(f)) + "/" + s.name;
      auto* b = benchmark::RegisterBenchmark(name.c_str(), [=](benchmark::State& st) { run(st, f, s.rows, s.cols, s.tokens, s.cold); });
      b->Unit(benchmark::kMicrosecond)->UseRealTime();
      if (s.tokens > 16) b->Iterations(3);
    }
}

}  // namespace

int main(int argc, char** argv) {
  g_read_gbps = runtime::measure_read_bandwidth().gbs;
  std::printf("measured read bandwidth: %.1f GB/s (%d threads)\n", g_read_gbps, max_threads());
  benchmark::AddCustomContext("read_bandwidth_GBps", std::to_string(g_read_gbps));
  register_all();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
