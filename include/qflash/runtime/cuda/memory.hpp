/// @file
/// A CUDA device's memory for a model's working state (core/memory.hpp): CUDA managed memory,
/// so the kernels read it on the device and the host may read a router's choices or grow a
/// block table after a wait, without explicit copies; copies and zeroing go on the model's
/// stream. It also owns a stream on the device for a model's work, made when first asked for
/// (stream()).
///
/// Host code that calls the CUDA runtime API: include it only where CUDA is enabled and link
/// CUDA::cudart (host-only builds never see it).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "qflash/core/error.hpp"
#include "qflash/core/memory.hpp"
#include "qflash/kernels/common/stream_workspace.cuh"

namespace qflash::runtime {

/// Throws Error naming `what` when a CUDA call failed.
inline void check_cuda(cudaError_t e, std::string const& what) {
  QFLASH_CHECK(e == cudaSuccess, what, ": ", cudaGetErrorString(e));
}

class CudaManagedMemory final : public Memory {
 public:
  /// Memory of CUDA device `device`; throws when there is no such device.
  explicit CudaManagedMemory(int device) : device_(device) {
    int n = 0;
    check_cuda(cudaGetDeviceCount(&n), "counting CUDA devices");
    QFLASH_CHECK(device >= 0 && device < n, "CUDA device ", device, " does not exist (", n, " found)");
  }
  CudaManagedMemory(CudaManagedMemory const&) = delete;
  CudaManagedMemory& operator=(CudaManagedMemory const&) = delete;
  ~CudaManagedMemory() override {
    if (!stream_) return;
    cudaSetDevice(device_);  // no throw here: a failure leaves the stream to the process's end
    kernels::cuda::release_stream_workspace(stream_);
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }

  [[nodiscard]] int device() const { return device_; }
  /// A stream of this memory's device for a model's work (the kernels' workspace is per
  /// stream); blocking, so it is ordered after work on the legacy default stream. Its kernels'
  /// counters are made with it, so a step captured into a graph has them.
  [[nodiscard]] stream_t stream() {
    if (!stream_) {
      activate();
      cudaStream_t stream = nullptr;
      check_cuda(cudaStreamCreate(&stream), "creating a stream on CUDA device " + std::to_string(device_));
      if (!kernels::cuda::stream_counters(stream)) {
        kernels::cuda::release_stream_workspace(stream);
        cudaStreamDestroy(stream);
        QFLASH_FAIL("allocating the kernels' counters on CUDA device ", device_);
      }
      stream_ = stream;
    }
    return stream_;
  }
  [[nodiscard]] bool on_device() const override { return true; }
  void activate() override { check_cuda(cudaSetDevice(device_), "cudaSetDevice(" + std::to_string(device_) + ")"); }
  // Each operation makes the device current first: callers outside a forward (a sequence's
  // reset or fork, a pool's growth, destructors) may run where another device is.
  void copy(void* dst, void const* src, std::size_t bytes, stream_t stream) override {
    if (!bytes) return;
    activate();
    check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream), "copying on the device");
  }
  void zero(void* dst, std::size_t bytes, stream_t stream) override {
    if (!bytes) return;
    activate();
    check_cuda(cudaMemsetAsync(dst, 0, bytes, stream), "zeroing device memory");
  }
  [[nodiscard]] std::optional<DeviceUse> device_use() override {
    activate();
    std::size_t free = 0, total = 0;
    check_cuda(cudaMemGetInfo(&free, &total), "querying CUDA device " + std::to_string(device_) + "'s memory");
    return DeviceUse{static_cast<std::int64_t>(free), static_cast<std::int64_t>(total)};
  }
  /// The stream's work; with no stream, the device's.
  void synchronize(stream_t stream) override {
    activate();
    check_cuda(stream ? cudaStreamSynchronize(stream) : cudaDeviceSynchronize(), "waiting for the device");
  }

 private:
  void* do_allocate(std::size_t bytes, std::size_t) override {  // cudaMallocManaged aligns to 256
    activate();
    void* p = nullptr;
    check_cuda(cudaMallocManaged(&p, bytes ? bytes : 1),
               "allocating " + std::to_string(bytes) + " bytes on CUDA device " + std::to_string(device_));
    return p;
  }
  void do_deallocate(void* p, std::size_t, std::size_t) override {
    cudaSetDevice(device_);  // no throw here: a failure leaves the memory to the process's end
    cudaFree(p);
  }
  [[nodiscard]] bool do_is_equal(std::pmr::memory_resource const& o) const noexcept override { return this == &o; }

  int device_;
  cudaStream_t stream_ = nullptr;
};

inline std::shared_ptr<Memory> cuda_memory(int device) { return std::make_shared<CudaManagedMemory>(device); }

}  // namespace qflash::runtime
