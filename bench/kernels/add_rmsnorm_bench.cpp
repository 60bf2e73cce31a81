// add + RMSNorm on the CPU: achieved GB/s and its fraction of this machine's read bandwidth,
// which this program measures first (runtime/bandwidth.hpp).
//
//   build/cpu-release/bench/kernels/add_rmsnorm_bench [--benchmark_filter=bf16]
//
// Counters: GB/s = bytes read + written per call (x, residual in and out, y, the weight) / time;
// roofline_fraction = that / measured read bandwidth. Every call reads and writes new memory:
// each benchmark rotates over buffer sets totalling >= 4x the L3 size, so DRAM, not cache, is
// measured (except the decode shapes, which are latency: one row lives in L1/L2 anyway).
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/core/parallel.hpp"
#include "qflash/kernels/add_rmsnorm/cpu.hpp"
#include "qflash/runtime/bandwidth.hpp"
#include "qflash/spec/presets.hpp"

using namespace qflash;
using arch::CpuIsa;

namespace {

using Clock = std::chrono::steady_clock;

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};
using Memory = std::unique_ptr<void, AlignedFree>;

Memory allocate(std::size_t bytes) {
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (!p) {
    std::fprintf(stderr, "add_rmsnorm_bench: cannot allocate %zu bytes\n", bytes);
    std::exit(1);
  }
  return Memory(p);
}

std::size_t l3_bytes() {
  std::int64_t const llc = runtime::last_level_cache_bytes();
  return llc > 0 ? static_cast<std::size_t>(llc) : std::size_t{32} << 20;
}

double g_read_gbps = 0.0;

// ---- kernel workloads ---------------------------------------------------------------------------

/// Buffer sets for one shape, rotated per call so that each call meets cold memory.
struct Workload {
  DType dtype;
  std::int64_t rows;
  int cols;
  std::size_t tensor_bytes;
  std::vector<Memory> x, residual, y;
  Memory weight;

  Workload(DType t, std::int64_t r, int c, std::size_t min_total_bytes)
      : dtype(t), rows(r), cols(c),
        tensor_bytes(static_cast<std::size_t>(r) * static_cast<std::size_t>(c) * size_of(t)) {
    std::size_t const set_bytes = 3 * tensor_bytes;
    std::size_t const sets = std::max<std::size_t>(1, (min_total_bytes + set_bytes - 1) / set_bytes);
    std::size_t const n = static_cast<std::size_t>(r) * static_cast<std::size_t>(c);
    for (std::size_t s = 0; s < sets; ++s) {
      x.push_back(fill(n, 0.25f));
      residual.push_back(fill(n, -0.5f));
      y.push_back(fill(n, 0.0f));
    }
    weight = fill(static_cast<std::size_t>(c), 0.1f);
  }

  /// Deterministic non-zero values in [-0.5, 0.5) + offset, written by the threads that use them.
  Memory fill(std::size_t n, float offset) const {
    Memory m = allocate(n * size_of(dtype));
    std::int64_t const threads = max_threads();
    parallel_for(0, threads, [&](std::int64_t t) {
      std::size_t const begin = n * static_cast<std::size_t>(t) / static_cast<std::size_t>(threads);
      std::size_t const end = n * static_cast<std::size_t>(t + 1) / static_cast<std::size_t>(threads);
      for (std::size_t i = begin; i < end; ++i) {
        float const v = static_cast<float>(i % 97) / 97.0f - 0.5f + offset;
        if (dtype == DType::kF32)
          static_cast<float*>(m.get())[i] = v;
        else
          static_cast<kernels::bf16_bits*>(m.get())[i] = kernels::float_to_bf16(v);
      }
    });
    return m;
  }

  [[nodiscard]] kernels::AddRmsNormArgs args(std::size_t set) const {
    kernels::AddRmsNormArgs a;
    a.dtype = dtype;
    a.weight_dtype = dtype;
    a.x = x[set].get();
    a.residual = residual[set].get();
    a.weight = weight.get();
    a.y = y[set].get();
    a.n_rows = rows;
    a.n_cols = cols;
    a.eps = 1e-6f;
    a.weight_kind = kernels::NormWeight::kZeroCentered;
    return a;
  }

  /// x and residual read, residual and y written, the weight read once.
  [[nodiscard]] double bytes_per_call() const {
    return 4.0 * static_cast<double>(tensor_bytes) + static_cast<double>(cols) * static_cast<double>(size_of(dtype));
  }
};

/// One workload alive at a time (benchmarks of the same shape run back to back).
Workload& workload(DType t, std::int64_t rows, int cols) {
  static std::unique_ptr<Workload> w;
  if (!w || w->dtype != t || w->rows != rows || w->cols != cols) {
    w.reset();
    std::size_t const scrub = std::clamp<std::size_t>(4 * l3_bytes(), std::size_t{256} << 20,
                                                      std::size_t{2} << 30);
    w = std::make_unique<Workload>(t, rows, cols, rows >= 256 ? scrub : 0);
  }
  return *w;
}

template <MoeSpec S>
void bm_add_rmsnorm(benchmark::State& state, DType dtype, CpuIsa isa, std::int64_t rows) {
  Workload& w = workload(dtype, rows, 2048);
  std::size_t set = 0;
  double seconds = 0.0;
  for (auto _ : state) {
    kernels::AddRmsNormArgs const a = w.args(set);
    set = (set + 1) % w.x.size();
    auto const t0 = Clock::now();
    Status const s = kernels::launch_add_rmsnorm<S>(arch::Cpu{}, isa, a);
    double const dt = std::chrono::duration<double>(Clock::now() - t0).count();
    if (s != Status::kSuccess) {
      state.SkipWithError("launch_add_rmsnorm failed");
      break;
    }
    state.SetIterationTime(dt);
    seconds += dt;
  }
  double const gbps = w.bytes_per_call() * static_cast<double>(state.iterations()) / seconds / 1e9;
  state.counters["GB/s"] = gbps;
  state.counters["roofline_fraction"] = gbps / g_read_gbps;
  state.counters["buffer_sets"] = static_cast<double>(w.x.size());
}

void register_benchmarks() {
  std::vector<CpuIsa> isas;
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512})
    if (isa <= arch::detect_cpu_isa()) isas.push_back(isa);
  CpuIsa const best = isas.back();

  auto add = [](std::string name, auto fn) {
    benchmark::RegisterBenchmark(name.c_str(), fn)
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond)
        ->MinTime(0.3);
  };
  for (DType t : {DType::kF32, DType::kBF16}) {
    std::string const dt(to_string(t));
    // Prefill-sized batch, static width 2048 (qwen3 specs), every ISA path.
    for (CpuIsa isa : isas)
      add("add_rmsnorm/" + dt + "/" + std::string(arch::to_string(isa)) + "/static/4096x2048",
          [t, isa](benchmark::State& s) { bm_add_rmsnorm<spec::qwen3_30b_a3b>(s, t, isa, 4096); });
    // The same through the generic (run-time width) instance.
    add("add_rmsnorm/" + dt + "/" + std::string(arch::to_string(best)) + "/generic/4096x2048",
        [t, best](benchmark::State& s) { bm_add_rmsnorm<spec::generic>(s, t, best, 4096); });
  }
  // Decode: one and a few rows (latency; data stays in cache).
  for (std::int64_t rows : {1, 16})
    add("add_rmsnorm/bf16/" + std::string(arch::to_string(best)) + "/static/" + std::to_string(rows) + "x2048",
        [rows, best](benchmark::State& s) {
          bm_add_rmsnorm<spec::qwen3_6_35b_a3b>(s, DType::kBF16, best, rows);
        });
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  g_read_gbps = runtime::measure_read_bandwidth().gbs;
  std::printf("measured read bandwidth: %.1f GB/s (%d threads; L3 %zu MiB)\n",
              g_read_gbps, max_threads(), l3_bytes() >> 20);
  std::printf("cpu isa: %s\n", std::string(arch::to_string(arch::detect_cpu_isa())).c_str());
  benchmark::AddCustomContext("read_bandwidth_GBps", std::to_string(g_read_gbps));
  register_benchmarks();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
