// expert_ffn on CUDA: time per call (CUDA events) of one Qwen3.6-35B-A3B MoE block (256
// experts of 2048 -> 512 -> 2048, top-8, a shared expert of width 512) in bf16, fp8, q8_0 and
// q4_k, for 1, 4 and 16 tokens (decode) and 512 (a prompt), with the expert weight bytes the
// call reads, their GB/s and the fraction of the measured copy bandwidth (decode is bound by
// reading the experts), and the multiply-adds' TFLOP/s (what bounds a prompt).
//
//   build/ci/bench/gpu/expert_ffn_gpu_bench     (exits 77 without a CUDA device)
//
// Successive calls route to different experts (32 route sets cycled), so the experts a call
// reads are not left in L2 by the one before. Weight bytes are a fixed pattern, finite in
// every format. Each timed call is the mean of 64 after 3 warm-up calls. Every compiled arch
// this device runs is measured, with the first compiled spec that takes every weight format and d_model 2048.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "gpu_bench.hpp"
#include "qflash/generated/instances.hpp"
#include "qflash/kernels/expert_ffn/op.hpp"

using namespace qflash;
using namespace qflash::bench::gpu;

namespace {

constexpr std::int64_t kDModel = 2048, kDff = 512, kDffShared = 512;
constexpr int kExperts = 256, kTopK = 8, kRouteSets = 32, kMaxTokens = 512;

/// The first compiled spec that takes every weight format and this d_model.
constexpr std::size_t bench_spec_index() {
  for (std::size_t i = 0; i < instances::kSpecs.size(); ++i)
    if (MoeSpec const& s = instances::kSpecs[i];
        s.weights == WeightFormat::kAny && (s.d_model == kDynamic || s.d_model == kDModel))
      return i;
  return instances::kSpecs.size();
}

/// A stacked [n * rows, cols] tensor of format f on the device (fp8: with its scale grid),
/// filled with a pattern; each of the n a slice.
struct DeviceStack {
  void* bytes = nullptr;
  float* scales = nullptr;
  WeightView tensor;
  bool ready = false;

  DeviceStack(WeightFormat f, int n, std::int64_t rows, std::int64_t cols, cudaStream_t stream)
      : tensor{f, nullptr, n * rows, cols} {
    if (!ok(cudaMalloc(&bytes, static_cast<std::size_t>(tensor.bytes())), "cudaMalloc")) return;
    cudaMemsetAsync(bytes, 0x11, static_cast<std::size_t>(tensor.bytes()), stream);
    tensor.data = bytes;
    if (f == WeightFormat::kFp8E4m3) {
      auto const count = static_cast<std::size_t>(fp8_scale_blocks(n * rows) * fp8_scale_blocks(cols));
      if (!ok(cudaMalloc(&scales, count * sizeof(float)), "cudaMalloc")) return;
      cudaMemsetAsync(scales, 0x3c, count * sizeof(float), stream);
      tensor.scales = scales;
    }
    ready = true;
  }
  DeviceStack(DeviceStack const&) = delete;
  DeviceStack& operator=(DeviceStack const&) = delete;
  ~DeviceStack() {
    cudaFree(bytes);
    cudaFree(scales);
  }
  WeightView slice(int i, std::int64_t rows) const { return tensor.slice_rows(i * rows, rows); }
};

template <class Tag>
void bench_arch(int major, int minor, Roofs const& roofs, cudaStream_t stream) {
  constexpr std::size_t I = bench_spec_index();
  if constexpr (compiled<Tag>() && I < instances::kSpecs.size()) {
    constexpr MoeSpec S = instances::kSpecs[I];
    if (!runs_on<Tag>(major, minor)) return;
    // Route set r sends token t's slot j to expert (8 r + 37 t + 11 j) mod 256: eight distinct
    // experts per token, and each set mostly others than the set before.
    std::vector<std::int32_t> routes(static_cast<std::size_t>(kRouteSets * kMaxTokens * kTopK));
    for (int r = 0; r < kRouteSets; ++r)
      for (int t = 0; t < kMaxTokens; ++t)
        for (int j = 0; j < kTopK; ++j)
          routes[static_cast<std::size_t>((r * kMaxTokens + t) * kTopK + j)] = (8 * r + 37 * t + 11 * j) % kExperts;
    std::vector<float> weights(routes.size(), 1.0f / kTopK), shared_weights(kMaxTokens, 0.5f);
    std::int32_t* d_routes = nullptr;
    float *x = nullptr, *out = nullptr, *d_weights = nullptr, *d_shared_weights = nullptr;
    ok(cudaMalloc(&d_routes, routes.size() * sizeof(std::int32_t)), "cudaMalloc");
    ok(cudaMalloc(&d_weights, weights.size() * sizeof(float)), "cudaMalloc");
    ok(cudaMalloc(&d_shared_weights, shared_weights.size() * sizeof(float)), "cudaMalloc");
    ok(cudaMalloc(&x, kMaxTokens * kDModel * sizeof(float)), "cudaMalloc");
    ok(cudaMalloc(&out, kMaxTokens * kDModel * sizeof(float)), "cudaMalloc");
    cudaMemcpy(d_routes, routes.data(), routes.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice);
    cudaMemcpy(d_weights, weights.data(), weights.size() * sizeof(float), cudaMemcpyHostToDevice);
    cudaMemcpy(d_shared_weights, shared_weights.data(), shared_weights.size() * sizeof(float), cudaMemcpyHostToDevice);
    cudaMemsetAsync(x, 0x3c, kMaxTokens * kDModel * sizeof(float), stream);
    cudaMemsetAsync(out, 0, kMaxTokens * kDModel * sizeof(float), stream);
    for (WeightFormat f : {WeightFormat::kBf16, WeightFormat::kFp8E4m3, WeightFormat::kQ8_0, WeightFormat::kQ4K}) {
      DeviceStack gate(f, kExperts, kDff, kDModel, stream), up(f, kExperts, kDff, kDModel, stream),
          down(f, kExperts, kDModel, kDff, stream), shared_gu(f, 2, kDffShared, kDModel, stream),
          shared_down(f, 1, kDModel, kDffShared, stream);
      if (!gate.ready || !up.ready || !down.ready || !shared_gu.ready || !shared_down.ready) continue;
      std::vector<kernels::ExpertWeights> experts;
      for (int e = 0; e < kExperts; ++e)
        experts.push_back({gate.slice(e, kDff), up.slice(e, kDff), down.slice(e, kDModel)});
      kernels::ExpertWeights const shared{shared_gu.slice(0, kDffShared), shared_gu.slice(1, kDffShared),
                                          shared_down.slice(0, kDModel)};
      std::int64_t const expert_bytes = 2 * experts[0].gate.bytes() + experts[0].down.bytes();
      std::int64_t const shared_bytes = 2 * shared.gate.bytes() + shared.down.bytes();
      for (int tokens : {1, 4, 16, kMaxTokens}) {
        std::set<std::int32_t> used;  // experts one call reads (every set reads as many)
        for (int s = 0; s < tokens * kTopK; ++s) used.insert(routes[static_cast<std::size_t>(s)]);
        std::int64_t const bytes = static_cast<std::int64_t>(used.size()) * expert_bytes + shared_bytes;
        kernels::ExpertFfnArgs a{};
        a.experts = experts;
        a.x = x;
        a.out = out;
        a.n_tokens = tokens;
        a.n_expert_used = kTopK;
        a.shared = &shared;
        a.shared_weights = d_shared_weights;
        Status st = Status::kSuccess;
        int call = 0;
        double const sec = time_calls(
            stream,
            [&] {
              std::size_t const set = static_cast<std::size_t>(call++ % kRouteSets) * kMaxTokens * kTopK;
              a.routes = d_routes + set;
              a.route_weights = d_weights + set;
              Status const s = kernels::launch_expert_ffn<S>(Tag{}, a, stream);
              if (s != Status::kSuccess) st = s;
            },
            3, 64);
        cudaError_t const e = cudaStreamSynchronize(stream);
        if (st != Status::kSuccess || e != cudaSuccess) {
          std::printf("%-6s %-8s %3d tokens  FAILED (%s%s%s)\n", std::string(Tag::name).c_str(),
                      std::string(to_string(f)).c_str(), tokens, std::string(to_string(st)).c_str(),
                      e != cudaSuccess ? ", " : "", e != cudaSuccess ? cudaGetErrorString(e) : "");
          continue;
        }
        double const gbps = static_cast<double>(bytes) / sec / 1e9;
        double const macs = static_cast<double>(tokens) * 3 * kDModel * (kTopK * kDff + kDffShared);
        std::printf(
            "%-6s %-16s %-8s %3d tokens %3zu experts %9.2f us  W %7.1f MB %8.1f GB/s %6.1f%% of copy %7.1f TFLOP/s\n",
            std::string(Tag::name).c_str(), std::string(instances::kSpecNames[I]).c_str(),
            std::string(to_string(f)).c_str(), tokens, used.size(), sec * 1e6, static_cast<double>(bytes) / 1e6, gbps,
            100.0 * gbps / roofs.copy_gbps, 2 * macs / sec / 1e12);
      }
    }
    cudaFree(d_routes);
    cudaFree(d_weights);
    cudaFree(d_shared_weights);
    cudaFree(x);
    cudaFree(out);
  } else if constexpr (compiled<Tag>()) {
    std::printf("%s: no compiled spec takes every weight format and d_model 2048, skipped\n", std::string(Tag::name).c_str());
  }
}

}  // namespace

int main() {
  return run_on_device([](int major, int minor, Roofs const& roofs, cudaStream_t stream) {
    bench_arch<arch::Sm90a>(major, minor, roofs, stream);
    bench_arch<arch::Sm80>(major, minor, roofs, stream);
  });
}
