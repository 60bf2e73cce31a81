/// @file
/// The memory bandwidth of a CUDA device, measured: device-to-device copies of a buffer far
/// larger than the L2 cache, the best of several timed with events. A copy reads and writes
/// every byte, so the bandwidth counts both (as CUDA's bandwidthTest does); it is the limit
/// `qflash bench --device cuda` puts decode against.
///
/// Host code that calls the CUDA runtime API: include it only where CUDA is enabled and link
/// CUDA::cudart (host-only builds never see it).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "qflash/runtime/cuda/memory.hpp"

namespace qflash::runtime {

struct DeviceBandwidth {
  double gbs = 0;                 ///< best copy, bytes read + written per second / 1e9
  std::int64_t buffer_bytes = 0;  ///< each of the two buffers
  std::string device;             ///< the device's name
};

/// The L2 cache of CUDA device `device` in bytes.
inline std::int64_t device_l2_bytes(int device) {
  int bytes = 0;
  check_cuda(cudaDeviceGetAttribute(&bytes, cudaDevAttrL2CacheSize, device),
             "querying the L2 cache of CUDA device " + std::to_string(device));
  return bytes;
}

/// Copies a buffer of up to 1 GiB (an eighth of the free memory at most) to another `passes`
/// times after a warm-up, on CUDA device `device`.
inline DeviceBandwidth measure_device_bandwidth(int device, int passes = 10) {
  check_cuda(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, device), "querying CUDA device " + std::to_string(device));
  std::size_t free = 0, total = 0;
  check_cuda(cudaMemGetInfo(&free, &total), "querying free device memory");
  std::size_t const bytes = std::min<std::size_t>(std::size_t{1} << 30, free / 8) & ~std::size_t{4095};
  QFLASH_CHECK(bytes >= (std::size_t{16} << 20), "measuring device bandwidth: only ", free,
               " bytes free on CUDA device ", device);
  void* a = nullptr;
  void* b = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  auto release = [&] {
    cudaFree(a);
    cudaFree(b);
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
  };
  float best_ms = 0;
  try {
    check_cuda(cudaMalloc(&a, bytes), "allocating the bandwidth probe");
    check_cuda(cudaMalloc(&b, bytes), "allocating the bandwidth probe");
    check_cuda(cudaMemset(a, 1, bytes), "filling the bandwidth probe");
    check_cuda(cudaEventCreate(&start), "creating an event");
    check_cuda(cudaEventCreate(&stop), "creating an event");
    check_cuda(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice), "the bandwidth probe's warm-up");
    for (int i = 0; i < passes; ++i) {
      check_cuda(cudaEventRecord(start), "recording an event");
      check_cuda(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice), "the bandwidth probe");
      check_cuda(cudaEventRecord(stop), "recording an event");
      check_cuda(cudaEventSynchronize(stop), "waiting for the bandwidth probe");
      float ms = 0;
      check_cuda(cudaEventElapsedTime(&ms, start, stop), "timing the bandwidth probe");
      if (i == 0 || ms < best_ms) best_ms = ms;
    }
  } catch (...) {
    release();
    throw;
  }
  release();
  return {2.0 * static_cast<double>(bytes) / (static_cast<double>(best_ms) * 1e6), static_cast<std::int64_t>(bytes),
          prop.name};
}

}  // namespace qflash::runtime
