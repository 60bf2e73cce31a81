// linear on CUDA: time per call (CUDA events) of a 65536 x 4096 projection in every weight
// format, for 1, 4 and 16 tokens (decode) and 512 (a prompt), with the weight bytes read per
// call, their GB/s and the fraction of the measured copy bandwidth (decode GEMV is bound by
// reading the weights), and the multiply-adds' TFLOP/s (what bounds a prompt).
//
//   build/ci/bench/gpu/linear_gpu_bench     (exits 77 without a CUDA device)
//
// Every matrix is 140 MB or more, beyond any GPU's L2, so the figures are DRAM's. The weight
// bytes are a fixed pattern (finite in every format: the time does not depend on the values).
// Each timed call is the mean of 20 after 3 warm-up calls. Every compiled arch this device
// runs is measured, with the first compiled spec that takes every weight format.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>

#include "gpu_bench.hpp"
#include "qflash/arch/select.hpp"
#include "qflash/generated/instances.hpp"
#include "qflash/kernels/linear/op.hpp"

using namespace qflash;
using namespace qflash::bench::gpu;

namespace {

constexpr std::int64_t kRows = 65536, kCols = 4096, kMaxTokens = 512;

constexpr std::size_t bench_spec_index() {
  for (std::size_t i = 0; i < instances::kSpecs.size(); ++i)
    if (instances::kSpecs[i].weights == WeightFormat::kAny) return i;
  return instances::kSpecs.size();
}

template <class Tag>
void bench_arch(int major, int minor, Roofs const& roofs, cudaStream_t stream) {
  constexpr std::size_t I = bench_spec_index();
  if constexpr (compiled<Tag>() && I < instances::kSpecs.size()) {
    constexpr MoeSpec S = instances::kSpecs[I];
    if (!runs_on<Tag>(major, minor)) return;
    float *x = nullptr, *y = nullptr;
    ok(cudaMalloc(&x, kMaxTokens * kCols * sizeof(float)), "cudaMalloc");
    ok(cudaMalloc(&y, kMaxTokens * kRows * sizeof(float)), "cudaMalloc");
    cudaMemsetAsync(x, 0x3c, kMaxTokens * kCols * sizeof(float), stream);
    for (WeightFormat f : kAllWeightFormats) {
      WeightView w{f, nullptr, kRows, kCols};
      void* bytes = nullptr;
      float* scales = nullptr;
      if (!ok(cudaMalloc(&bytes, static_cast<std::size_t>(w.bytes())), "cudaMalloc")) continue;
      cudaMemsetAsync(bytes, 0x11, static_cast<std::size_t>(w.bytes()), stream);
      w.data = bytes;
      if (f == WeightFormat::kFp8E4m3) {
        std::size_t const n = static_cast<std::size_t>(fp8_scale_blocks(kRows) * fp8_scale_blocks(kCols));
        ok(cudaMalloc(&scales, n * sizeof(float)), "cudaMalloc");
        cudaMemsetAsync(scales, 0x3c, n * sizeof(float), stream);
        w.scales = scales;
      }
      for (std::int64_t tokens : {std::int64_t{1}, std::int64_t{4}, std::int64_t{16}, kMaxTokens}) {
        kernels::LinearArgs a{};
        a.w = w;
        a.x = x;
        a.y = y;
        a.n_tokens = tokens;
        Status st = Status::kSuccess;
        double const sec = time_calls(stream, [&] {
          Status const s = kernels::launch_linear<S>(Tag{}, a, stream);
          if (s != Status::kSuccess) st = s;
        });
        cudaError_t const e = cudaStreamSynchronize(stream);
        if (st != Status::kSuccess || e != cudaSuccess) {
          std::printf("%-6s %-8s %3lld tokens  FAILED (%s%s%s)\n", std::string(Tag::name).c_str(),
                      std::string(to_string(f)).c_str(), static_cast<long long>(tokens), std::string(to_string(st)).c_str(),
                      e != cudaSuccess ? ", " : "", e != cudaSuccess ? cudaGetErrorString(e) : "");
          continue;
        }
        double const gbps = static_cast<double>(w.bytes()) / sec / 1e9;
        double const tflops = 2.0 * static_cast<double>(tokens * kRows * kCols) / sec / 1e12;
        std::printf("%-6s %-16s %-8s %3lld tokens %9.2f us  W %7.1f MB %8.1f GB/s %6.1f%% of copy %7.1f TFLOP/s\n",
                    std::string(Tag::name).c_str(), std::string(instances::kSpecNames[I]).c_str(),
                    std::string(to_string(f)).c_str(), static_cast<long long>(tokens), sec * 1e6,
                    static_cast<double>(w.bytes()) / 1e6, gbps, 100.0 * gbps / roofs.copy_gbps, tflops);
      }
      cudaFree(bytes);
      cudaFree(scales);
    }
    cudaFree(x);
    cudaFree(y);
  } else if constexpr (compiled<Tag>()) {
    std::printf("%s: no compiled spec takes every weight format, skipped\n", std::string(Tag::name).c_str());
  }
}

}  // namespace

int main() {
  return run_on_device([](int major, int minor, Roofs const& roofs, cudaStream_t stream) {
    bench_arch<arch::Sm90a>(major, minor, roofs, stream);
    bench_arch<arch::Sm80>(major, minor, roofs, stream);
  });
}
