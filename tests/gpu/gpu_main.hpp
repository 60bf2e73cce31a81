/// @file
/// What every GPU test shares: the device it runs on, a check for CUDA calls, whether an arch
/// was compiled, and its main(), which exits 77 (ctest: Skipped) when there is no CUDA device
/// or no compiled arch runs on it. Include it once per test executable, first.
#pragma once

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "qflash/arch/select.hpp"
#include "qflash/generated/instances.hpp"

namespace qflash::test::gpu {

struct DeviceInfo {
  int major = 0;
  int minor = 0;
  std::string name;
};
inline DeviceInfo g_device;

/// Whether the build compiled arch Tag (QFLASH_CUDA_ARCHS).
template <class Tag>
constexpr bool compiled() {
  return std::find(instances::kArchs.begin(), instances::kArchs.end(), Tag::id) != instances::kArchs.end();
}

/// Whether this device runs arch Tag's code.
template <class Tag>
bool runs_here() {
  return arch::can_run(Tag::id, g_device.major, g_device.minor);
}

}  // namespace qflash::test::gpu

#define QFLASH_TEST_CUDA(expr)                                              \
  do {                                                                      \
    cudaError_t const e_ = (expr);                                          \
    REQUIRE_MESSAGE(e_ == cudaSuccess, #expr ": ", cudaGetErrorString(e_)); \
  } while (0)

int main(int argc, char** argv) {
  using qflash::test::gpu::g_device;
  int n_devices = 0;
  cudaError_t const e = cudaGetDeviceCount(&n_devices);
  if (e != cudaSuccess || n_devices == 0) {
    std::printf("no CUDA device: skipping GPU tests (%s)\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "device count is 0");
    return 77;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    std::printf("cannot query CUDA device 0: skipping GPU tests\n");
    return 77;
  }
  g_device = {prop.major, prop.minor, prop.name};
  if (!qflash::arch::select_cuda_arch(qflash::instances::kArchs, prop.major, prop.minor)) {
    std::printf("no compiled arch runs on %s (cc %d.%d): skipping GPU tests\n", prop.name, prop.major, prop.minor);
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
