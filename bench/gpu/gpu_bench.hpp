/// @file
/// What the GPU benches share: CUDA error reporting, timing with CUDA events, the device's
/// bandwidth roofs, and whether an arch was compiled.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <string>

#include "qflash/arch/select.hpp"
#include "qflash/generated/instances.hpp"

namespace qflash::bench::gpu {

inline bool ok(cudaError_t e, char const* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  return false;
}

struct Roofs {
  double copy_gbps = 0.0;
  double theoretical_gbps = 0.0;
};

/// Times `fn` (which enqueues on `stream`): mean of `reps` calls after `warmup`, in seconds.
template <class Fn>
double time_calls(cudaStream_t stream, Fn&& fn, int warmup = 3, int reps = 20) {
  for (int i = 0; i < warmup; ++i) fn();
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  cudaEventRecord(start, stream);
  for (int i = 0; i < reps; ++i) fn();
  cudaEventRecord(stop, stream);
  cudaEventSynchronize(stop);
  float ms = 0.0f;
  cudaEventElapsedTime(&ms, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return static_cast<double>(ms) * 1e-3 / reps;
}

inline Roofs measure_roofs(int device, cudaStream_t stream) {
  Roofs r;
  int clock_khz = 0, bus_bits = 0;
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device);
  cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device);
  r.theoretical_gbps = 2.0 * clock_khz * 1e3 * (bus_bits / 8.0) / 1e9;

  std::size_t const bytes = std::size_t{1} << 30;
  void *a = nullptr, *b = nullptr;
  if (ok(cudaMalloc(&a, bytes), "cudaMalloc") && ok(cudaMalloc(&b, bytes), "cudaMalloc")) {
    cudaMemsetAsync(a, 0, bytes, stream);
    double const t = time_calls(stream, [&] { cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream); }, 2, 10);
    r.copy_gbps = 2.0 * static_cast<double>(bytes) / t / 1e9;
  }
  cudaFree(a);
  cudaFree(b);
  return r;
}

/// Whether the build compiled arch Tag (QFLASH_CUDA_ARCHS).
template <class Tag>
constexpr bool compiled() {
  return std::find(instances::kArchs.begin(), instances::kArchs.end(), Tag::id) != instances::kArchs.end();
}

/// Whether arch Tag's code runs on a device of compute capability major.minor; says so when not.
template <class Tag>
bool runs_on(int major, int minor) {
  if (arch::can_run(Tag::id, major, minor)) return true;
  std::printf("%s: not runnable on cc %d.%d, skipped\n", std::string(Tag::name).c_str(), major, minor);
  return false;
}

/// A bench's main: exits 77 without a CUDA device or a compiled arch that runs on it; else
/// prints the device and its roofs and calls bench(cc_major, cc_minor, roofs, stream).
template <class Bench>
int run_on_device(Bench&& bench) {
  int n_devices = 0;
  cudaError_t const e = cudaGetDeviceCount(&n_devices);
  if (e != cudaSuccess || n_devices == 0) {
    std::printf("no CUDA device: skipping the GPU bench (%s)\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "device count is 0");
    return 77;
  }
  cudaDeviceProp prop{};
  if (!ok(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties")) return 1;
  auto const selected = arch::select_cuda_arch(instances::kArchs, prop.major, prop.minor);
  if (!selected) {
    std::printf("no compiled arch runs on %s (cc %d.%d): skipping the GPU bench\n", prop.name, prop.major, prop.minor);
    return 77;
  }
  cudaStream_t stream = nullptr;
  if (!ok(cudaStreamCreate(&stream), "cudaStreamCreate")) return 1;
  Roofs const roofs = measure_roofs(0, stream);
  std::printf("device: %s (cc %d.%d, %d SMs, L2 %d MiB); selected arch: %s\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount, prop.l2CacheSize >> 20, std::string(arch::to_string(*selected)).c_str());
  std::printf("bandwidth: measured D2D copy %.1f GB/s, theoretical %.1f GB/s\n", roofs.copy_gbps,
              roofs.theoretical_gbps);
  bench(prop.major, prop.minor, roofs, stream);
  cudaStreamDestroy(stream);
  return 0;
}

}  // namespace qflash::bench::gpu
