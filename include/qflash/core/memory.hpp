/// @file
/// Where a model's working memory lives: its per-call buffers, the batch's token arrays, the
/// KV arenas and block tables, and the recurrent states. `Memory` is a pmr memory resource
/// (so containers take it as their allocator) plus the few operations the model needs on that
/// memory besides kernels: copy, zero and wait. Containers hold it through MemoryAllocator.
/// `host_memory()` is plain host memory (every arch::Cpu model); runtime/cuda/memory.hpp has a
/// CUDA device's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <memory_resource>
#include <new>
#include <optional>
#include <type_traits>
#include <vector>

#include "qflash/core/config.hpp"

namespace qflash {

class Memory : public std::pmr::memory_resource {
 public:
  /// The alignment asked for arenas (SIMD rows start on a cache line).
  static constexpr std::size_t kCacheLine = 64;

  /// True when the memory is a device's: kernels of a CUDA arch read it, and the host may
  /// touch it only between synchronize() and the next launch.
  [[nodiscard]] virtual bool on_device() const = 0;
  /// Makes the memory's device the calling thread's current one (host memory: nothing).
  virtual void activate() = 0;
  /// dst = src, `bytes` bytes, either side host or this memory, after earlier work on `stream`.
  virtual void copy(void* dst, void const* src, std::size_t bytes, stream_t stream) = 0;
  /// Zeroes `bytes` bytes of this memory after earlier work on `stream`.
  virtual void zero(void* dst, std::size_t bytes, stream_t stream) = 0;
  /// Waits until the work queued on `stream` is done.
  virtual void synchronize(stream_t stream) = 0;

  /// A device's memory as its driver counts it: bytes free now and in all, every process's
  /// use included. Host memory: nullopt.
  struct DeviceUse {
    std::int64_t free = 0;
    std::int64_t total = 0;
  };
  [[nodiscard]] virtual std::optional<DeviceUse> device_use() { return std::nullopt; }
};

/// Host memory, every allocation on a cache line.
class HostMemory final : public Memory {
 public:
  [[nodiscard]] bool on_device() const override { return false; }
  void activate() override {}
  void copy(void* dst, void const* src, std::size_t bytes, stream_t) override {
    if (bytes) std::memmove(dst, src, bytes);
  }
  void zero(void* dst, std::size_t bytes, stream_t) override {
    if (bytes) std::memset(dst, 0, bytes);
  }
  void synchronize(stream_t) override {}

 private:
  static std::align_val_t align(std::size_t a) { return std::align_val_t{a > kCacheLine ? a : kCacheLine}; }
  void* do_allocate(std::size_t bytes, std::size_t alignment) override {
    return ::operator new(bytes, align(alignment));
  }
  void do_deallocate(void* p, std::size_t, std::size_t alignment) override {
    ::operator delete(p, align(alignment));  // unsized: clang declares sized delete only on request
  }
  [[nodiscard]] bool do_is_equal(std::pmr::memory_resource const& o) const noexcept override {
    return dynamic_cast<HostMemory const*>(&o) != nullptr;
  }
};

/// The process's host memory, shared (it has no state).
inline std::shared_ptr<Memory> host_memory() {
  static auto const m = std::make_shared<HostMemory>();
  return m;
}

/// An allocator from a Memory that goes with its container's contents: a copy is made in the
/// same memory, and move assignment and swap take the memory along (unlike pmr's, which
/// would leave a device's data in the assignee's host memory). Default: host memory.
template <class T>
class MemoryAllocator {
 public:
  using value_type = T;
  using propagate_on_container_copy_assignment = std::true_type;
  using propagate_on_container_move_assignment = std::true_type;
  using propagate_on_container_swap = std::true_type;

  MemoryAllocator() noexcept : m_(host_memory().get()) {}
  explicit MemoryAllocator(Memory* m) noexcept : m_(m) {}
  template <class U>
  MemoryAllocator(MemoryAllocator<U> const& o) noexcept : m_(o.memory()) {}  // NOLINT: rebinding

  T* allocate(std::size_t n) { return static_cast<T*>(m_->allocate(n * sizeof(T), alignof(T))); }
  void deallocate(T* p, std::size_t n) noexcept { m_->deallocate(p, n * sizeof(T), alignof(T)); }
  [[nodiscard]] Memory* memory() const noexcept { return m_; }

  template <class U>
  bool operator==(MemoryAllocator<U> const& o) const noexcept {
    return m_ == o.memory();
  }

 private:
  Memory* m_;
};

/// A vector in a Memory (the Memory must outlive it).
template <class T>
using MemoryVector = std::vector<T, MemoryAllocator<T>>;

}  // namespace qflash
