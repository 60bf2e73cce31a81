// Attention over paged, compressed KV on CUDA at Qwen3.6-35B-A3B's attention shape (16 query
// heads, 2 KV heads of 256), per KV format: time per call (CUDA events)
// - for decode, one token of one sequence per context, with the KV bytes read per call, their
//   GB/s and the fraction of the measured copy bandwidth;
// - for prefill, 512 tokens after 0 and after 4096 cached (the tensor-core path), with the
//   TFLOP/s of its products (4 d flops a query head and key at or before the token).
//
//   build/ci/bench/gpu/paged_attention_gpu_bench     (exits 77 without a CUDA device)
//
// KV bytes = context x KV heads x (key + value vector bytes, scales included). A context's
// cache that fits in L2 measures L2, not DRAM: at 4096 positions every format fits an H100's
// 50 MB; at 131072 none does. Each timed call is the mean of 20 after 3 warm-up calls. Every
// compiled arch this device can run is measured, with the qwen3_6_35b_a3b instance when it is
// compiled, else the generic one.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gpu_bench.hpp"
#include "qflash/arch/select.hpp"
#include "qflash/generated/instances.hpp"
#include "qflash/kernels/attention/op.hpp"
#include "qflash/kv/layer_cache.hpp"
#include "qflash/spec/presets.hpp"

using namespace qflash;
using namespace qflash::bench::gpu;

namespace {

constexpr int kHeads = 16, kKvHeads = 2, kDim = 256;
constexpr std::int64_t kPrefillTokens = 512;

/// The spec to bench: Qwen3.6's when compiled, else the first dynamic one.
constexpr std::size_t bench_spec_index() {
  for (std::size_t i = 0; i < instances::kSpecs.size(); ++i)
    if (instances::kSpecs[i] == spec::qwen3_6_35b_a3b) return i;
  for (std::size_t i = 0; i < instances::kSpecs.size(); ++i)
    if (instances::kSpecs[i].d_head == kDynamic && instances::kSpecs[i].kv == KvScheme::kAny) return i;
  return instances::kSpecs.size();
}

/// A cache of `n_ctx` positions in format f built on the host and copied to the device.
struct DeviceKvCache {
  kv::LayerCache host;
  void* arena = nullptr;
  std::int32_t* table = nullptr;
  DeviceKvCache(KvFormat f, std::int64_t n_ctx) : host(kKvHeads, kDim, kv::KvFormats{f, f}, n_ctx) {
    std::vector<float> k(static_cast<std::size_t>(n_ctx * kKvHeads * kDim)), v(k.size());
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    for (float& x : k) x = dist(rng);
    for (float& x : v) x = dist(rng);
    host.append(k.data(), v.data(), n_ctx);
    kv::KvView const hv = host.view();
    std::size_t const bytes = static_cast<std::size_t>(hv.n_blocks * hv.block_bytes);
    ok(cudaMalloc(&arena, bytes), "cudaMalloc");
    ok(cudaMemcpy(arena, hv.base, bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
    ok(cudaMalloc(&table, static_cast<std::size_t>(hv.n_blocks) * sizeof(std::int32_t)), "cudaMalloc");
    ok(cudaMemcpy(table, hv.block_table, static_cast<std::size_t>(hv.n_blocks) * sizeof(std::int32_t),
                  cudaMemcpyHostToDevice),
       "cudaMemcpy");
  }
  DeviceKvCache(DeviceKvCache const&) = delete;
  DeviceKvCache& operator=(DeviceKvCache const&) = delete;
  ~DeviceKvCache() {
    cudaFree(arena);
    cudaFree(table);
  }
  kv::KvView view() {
    kv::KvView v = host.view();
    v.base = static_cast<std::uint8_t*>(arena);
    v.block_table = table;
    return v;
  }
};

template <class Tag>
void bench_arch(int major, int minor, Roofs const& roofs, cudaStream_t stream) {
  constexpr std::size_t I = bench_spec_index();
  if constexpr (compiled<Tag>() && I < instances::kSpecs.size()) {
    constexpr MoeSpec S = instances::kSpecs[I];
    if (!runs_on<Tag>(major, minor)) return;
    std::size_t const q_bytes = kPrefillTokens * kHeads * kDim * sizeof(float);
    float *q = nullptr, *out = nullptr;
    ok(cudaMalloc(&q, q_bytes), "cudaMalloc");
    ok(cudaMalloc(&out, q_bytes), "cudaMalloc");
    cudaMemsetAsync(q, 0x3c, q_bytes, stream);
    // One call of n_tokens new tokens at the end of n_ctx positions; its seconds, 0 on failure.
    auto time_one = [&](DeviceKvCache& cache, std::int64_t n_tokens, std::int64_t n_ctx, std::string_view name) {
      kernels::AttentionArgs a{};
      a.q = q;
      a.kv = cache.view();
      a.out = out;
      a.n_tokens = n_tokens;
      a.n_ctx = n_ctx;
      a.n_head = kHeads;
      a.n_head_kv = kKvHeads;
      a.d_head = kDim;
      a.scale = 0.0625f;
      Status st = Status::kSuccess;
      double const sec = time_calls(stream, [&] {
        Status const s = kernels::launch_attention<S>(Tag{}, a, stream);
        if (s != Status::kSuccess) st = s;
      });
      cudaError_t const e = cudaStreamSynchronize(stream);
      if (st == Status::kSuccess && e == cudaSuccess) return sec;
      std::printf("%-6s %-9s %7lld +%lld  FAILED (%s%s%s)\n", std::string(Tag::name).c_str(), std::string(name).c_str(),
                  static_cast<long long>(n_ctx - n_tokens), static_cast<long long>(n_tokens),
                  std::string(to_string(st)).c_str(), e != cudaSuccess ? ", " : "",
                  e != cudaSuccess ? cudaGetErrorString(e) : "");
      return 0.0;
    };
    for (std::int64_t n_ctx : {std::int64_t{4096}, std::int64_t{32768}, std::int64_t{131072}})
      for (auto const& [f, name] : kKvFormats) {
        DeviceKvCache cache(f, n_ctx);
        double const sec = time_one(cache, 1, n_ctx, name);
        if (sec == 0.0) continue;
        double const kv_bytes =
            static_cast<double>(n_ctx) * kKvHeads * 2.0 * static_cast<double>(kv_head_bytes(f, kDim));
        double const gbps = kv_bytes / sec / 1e9;
        std::printf("%-6s %-16s %-9s ctx %7lld %9.2f us  KV %8.1f MB %8.1f GB/s %6.1f%% of copy\n",
                    std::string(Tag::name).c_str(), std::string(instances::kSpecNames[I]).c_str(),
                    std::string(name).c_str(), static_cast<long long>(n_ctx), sec * 1e6, kv_bytes / 1e6, gbps,
                    100.0 * gbps / roofs.copy_gbps);
      }
    for (std::int64_t past : {std::int64_t{0}, std::int64_t{4096}})
      for (auto const& [f, name] : kKvFormats) {
        std::int64_t const n_ctx = past + kPrefillTokens;
        DeviceKvCache cache(f, n_ctx);
        double const sec = time_one(cache, kPrefillTokens, n_ctx, name);
        if (sec == 0.0) continue;
        // Keys at or before each token: past + 1, ..., past + kPrefillTokens.
        double const keys =
            static_cast<double>(kPrefillTokens) * (static_cast<double>(past) + (kPrefillTokens + 1) / 2.0);
        double const tflops = 4.0 * kDim * kHeads * keys / sec / 1e12;
        std::printf("%-6s %-16s %-9s prefill %lld after %5lld %9.2f us %8.2f TFLOP/s\n", std::string(Tag::name).c_str(),
                    std::string(instances::kSpecNames[I]).c_str(), std::string(name).c_str(),
                    static_cast<long long>(kPrefillTokens), static_cast<long long>(past), sec * 1e6, tflops);
      }
    cudaFree(q);
    cudaFree(out);
  } else if constexpr (compiled<Tag>()) {
    std::printf("%s: no compiled spec has Qwen3.6's attention shape or a dynamic one, skipped\n",
                std::string(Tag::name).c_str());
  }
}

}  // namespace

int main() {
  return run_on_device([](int major, int minor, Roofs const& roofs, cudaStream_t stream) {
    bench_arch<arch::Sm90a>(major, minor, roofs, stream);
    bench_arch<arch::Sm80>(major, minor, roofs, stream);
  });
}
