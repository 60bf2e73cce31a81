/// @file
/// What every GPU test shares: the device it runs on, a check for CUDA calls, device arrays,
/// whether an arch was compiled, and its main(), which exits 77 (ctest: Skipped) when there is no CUDA device
/// or no compiled arch runs on it. Include it once per test executable, first.
#pragma once

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "qflash/arch/select.hpp"
#include "qflash/generated/instances.hpp"

#define QFLASH_TEST_CUDA(expr)                                              \
  do {                                                                      \
    cudaError_t const e_ = (expr);                                          \
    REQUIRE_MESSAGE(e_ == cudaSuccess, #expr ": ", cudaGetErrorString(e_)); \
  } while (0)

namespace qflash::test::gpu {

/// Whether the kernels run on the CUDA emulator (tests/support/cuda_emulator), on the CPU:
/// there the tests leave out their largest cases (hundreds of thousands of rows, there to go
/// past a kernel's grid cap), which would take many minutes.
#ifdef QFLASH_CUDA_EMULATOR
inline constexpr bool kEmulated = true;
#else
inline constexpr bool kEmulated = false;
#endif
inline constexpr bool kLargeCases = !kEmulated;

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

/// Calls check.template operator()<I>() for every spec instance I when the build compiled arch
/// Tag and it runs on this device; otherwise says in the test log why not.
template <class Tag, class Check>
void check_each_instance(Check&& check) {
  if constexpr (compiled<Tag>()) {
    if (!runs_here<Tag>()) {
      MESSAGE(Tag::name, " cannot run on cc ", g_device.major, ".", g_device.minor, ": not checked here");
      return;
    }
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (check.template operator()<I>(), ...);
    }(std::make_index_sequence<instances::kSpecs.size()>{});
  } else {
    MESSAGE(Tag::name, " is not compiled in this build (QFLASH_CUDA_ARCHS)");
  }
}

/// Device memory for n elements of T: zeros, or a copy of host data.
template <class T>
class DeviceArray {
 public:
  explicit DeviceArray(std::size_t n) : n_(n) {
    QFLASH_TEST_CUDA(cudaMalloc(&p_, std::max<std::size_t>(n_, 1) * sizeof(T)));
    QFLASH_TEST_CUDA(cudaMemset(p_, 0, std::max<std::size_t>(n_, 1) * sizeof(T)));
  }
  explicit DeviceArray(std::vector<T> const& host) : DeviceArray(host.size()) { upload(host.data()); }
  DeviceArray(DeviceArray const&) = delete;
  DeviceArray& operator=(DeviceArray const&) = delete;
  ~DeviceArray() { cudaFree(p_); }
  T* get() { return p_; }
  void upload(T const* host) {
    if (n_) QFLASH_TEST_CUDA(cudaMemcpy(p_, host, n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> out(n_);
    if (n_) QFLASH_TEST_CUDA(cudaMemcpy(out.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return out;
  }

 private:
  T* p_ = nullptr;
  std::size_t n_;
};

}  // namespace qflash::test::gpu

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
