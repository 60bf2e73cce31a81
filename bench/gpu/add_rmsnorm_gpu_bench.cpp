// add + RMSNorm on CUDA: time per call (CUDA events), achieved GB/s, and its fraction of the
// device's measured copy bandwidth and of its theoretical DRAM bandwidth.
//
//   build/ci/bench/gpu/add_rmsnorm_gpu_bench        (exits 77 without a CUDA device)
//
// GB/s = bytes read + written per call (x, residual in and out, y, the weight) / time. The
// "copy" roof is a device-to-device cudaMemcpy of 1 GiB (read + write counted); the
// theoretical one is 2 x memory clock x bus width (DDR). The large shapes (>= 16384 rows)
// are several times the L2 size, so they measure DRAM; each timed call is the mean of 20
// after 3 warm-up calls. Every compiled arch this device can run is measured, each spec.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "gpu_bench.hpp"
#include "qflash/arch/select.hpp"
#include "qflash/generated/instances.hpp"
#include "qflash/kernels/add_rmsnorm/op.hpp"

using namespace qflash;
using namespace qflash::bench::gpu;

namespace {

struct Shape {
  DType dtype;
  std::int64_t rows;
  int cols;
};

/// Device buffers for one shape (x, residual, y, weight), filled with small values.
struct DeviceProblem {
  void *x = nullptr, *residual = nullptr, *y = nullptr, *weight = nullptr;
  std::size_t tensor_bytes = 0;
  kernels::AddRmsNormArgs args{};

  DeviceProblem(Shape s, cudaStream_t stream) {
    tensor_bytes = static_cast<std::size_t>(s.rows) * static_cast<std::size_t>(s.cols) * size_of(s.dtype);
    std::size_t const wbytes = static_cast<std::size_t>(s.cols) * size_of(s.dtype);
    ok(cudaMalloc(&x, tensor_bytes), "cudaMalloc");
    ok(cudaMalloc(&residual, tensor_bytes), "cudaMalloc");
    ok(cudaMalloc(&y, tensor_bytes), "cudaMalloc");
    ok(cudaMalloc(&weight, wbytes), "cudaMalloc");
    // 0x3c bytes: 0.0117 in fp32 / 0.0117 in bf16 per element: finite, non-zero.
    cudaMemsetAsync(x, 0x3c, tensor_bytes, stream);
    cudaMemsetAsync(residual, 0x3c, tensor_bytes, stream);
    cudaMemsetAsync(weight, 0x3c, wbytes, stream);
    args.dtype = s.dtype;
    args.weight_dtype = s.dtype;
    args.x = x;
    args.residual = residual;
    args.weight = weight;
    args.y = y;
    args.n_rows = s.rows;
    args.n_cols = s.cols;
    args.weight_kind = kernels::NormWeight::kZeroCentered;
  }
  DeviceProblem(DeviceProblem const&) = delete;
  DeviceProblem& operator=(DeviceProblem const&) = delete;
  ~DeviceProblem() {
    cudaFree(x);
    cudaFree(residual);
    cudaFree(y);
    cudaFree(weight);
  }
  [[nodiscard]] double bytes_per_call() const {
    return 4.0 * static_cast<double>(tensor_bytes) +
           static_cast<double>(args.n_cols) * static_cast<double>(size_of(args.dtype));
  }
};

template <class Tag, std::size_t I>
void bench_instance(Roofs const& roofs, cudaStream_t stream) {
  constexpr MoeSpec S = instances::kSpecs[I];
  std::vector<int> widths;
  if (S.d_model != kDynamic)
    widths = {S.d_model};
  else
    widths = {2048, 4096, 129};
  for (int cols : widths)
    for (DType t : {DType::kBF16, DType::kF32})
      for (std::int64_t rows : {std::int64_t{1}, std::int64_t{16}, std::int64_t{4096}, std::int64_t{32768}}) {
        DeviceProblem p(Shape{t, rows, cols}, stream);
        Status st = Status::kSuccess;
        double const sec = time_calls(stream, [&] {
          Status const s = kernels::launch_add_rmsnorm<S>(Tag{}, p.args, stream);
          if (s != Status::kSuccess) st = s;
        });
        cudaError_t const e = cudaStreamSynchronize(stream);
        if (st != Status::kSuccess || e != cudaSuccess) {
          std::printf("%-6s %-16s %-5s %6lld x %-6d  FAILED (%s%s%s)\n", std::string(Tag::name).c_str(),
                      std::string(instances::kSpecNames[I]).c_str(), std::string(to_string(t)).c_str(),
                      static_cast<long long>(rows), cols, std::string(to_string(st)).c_str(),
                      e != cudaSuccess ? ", " : "", e != cudaSuccess ? cudaGetErrorString(e) : "");
          continue;
        }
        double const gbps = p.bytes_per_call() / sec / 1e9;
        std::printf("%-6s %-16s %-5s %6lld x %-6d %10.2f us %9.1f GB/s %7.1f%% of copy %7.1f%% of theoretical\n",
                    std::string(Tag::name).c_str(), std::string(instances::kSpecNames[I]).c_str(),
                    std::string(to_string(t)).c_str(), static_cast<long long>(rows), cols, sec * 1e6, gbps,
                    100.0 * gbps / roofs.copy_gbps, 100.0 * gbps / roofs.theoretical_gbps);
      }
}

template <class Tag>
void bench_arch(int major, int minor, Roofs const& roofs, cudaStream_t stream) {
  if constexpr (compiled<Tag>()) {
    if (!runs_on<Tag>(major, minor)) return;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (bench_instance<Tag, I>(roofs, stream), ...);
    }(std::make_index_sequence<instances::kSpecs.size()>{});
  }
}

}  // namespace

int main() {
  return run_on_device([](int major, int minor, Roofs const& roofs, cudaStream_t stream) {
    bench_arch<arch::Sm90a>(major, minor, roofs, stream);
    bench_arch<arch::Sm80>(major, minor, roofs, stream);
  });
}
