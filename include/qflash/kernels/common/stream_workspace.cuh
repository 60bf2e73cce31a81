/// @file
/// Device scratch for the launches on one CUDA stream: the CUDA ops' temporary buffers
/// (rounded activations, the experts' grouping, attention's key splits). Each op takes it in
/// turn: stream order keeps one op's kernels from overlapping the next op's, so each may use
/// all of it, and a step's launches allocate nothing (a CUDA graph of them holds no memory
/// nodes). It grows in stream order (the old buffer is freed after the work queued before
/// it), never while the stream is being captured into a graph: there an op that needs more
/// gets null and fails, and the caller runs the step uncaptured once. Host code (CUDA runtime
/// API only); one host thread per stream.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <map>
#include <mutex>
#include <utility>

namespace qflash::kernels::cuda {

namespace detail {
struct StreamBuffer {
  void* data = nullptr;
  std::size_t bytes = 0;
  unsigned* counters = nullptr;  ///< stream_counters()
};
/// Buffers by (device, stream): the legacy stream's handle is null on every device.
struct StreamBuffers {
  std::mutex mutex;
  std::map<std::pair<int, cudaStream_t>, StreamBuffer> buffers;
};
inline StreamBuffers& stream_buffers() {
  static StreamBuffers b;  // a stream's buffer lives until it is released, else to the process's end
  return b;
}
/// A runtime call here failed: its error is taken off the runtime's last error (the caller
/// learns of it from the null it gets, and may go on without the memory), so that no later
/// launch's status reports it.
inline std::nullptr_t failed() {
  static_cast<void>(cudaGetLastError());
  return nullptr;
}
/// Whether `stream` is being captured into a graph, or its state cannot be read: no
/// allocation on it then.
inline bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) == cudaSuccess) return capture != cudaStreamCaptureStatusNone;
  failed();
  return true;
}
}  // namespace detail

/// At least `bytes` bytes of device memory for work queued on `stream` (the current device's),
/// until the next call for that stream; null when it must grow while the stream is being
/// captured, or the allocation failed (its error taken off the runtime's last error).
inline void* stream_workspace(cudaStream_t stream, std::size_t bytes) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return detail::failed();
  detail::StreamBuffers& all = detail::stream_buffers();
  std::lock_guard lock(all.mutex);
  detail::StreamBuffer& b = all.buffers[{device, stream}];
  if (bytes <= b.bytes && b.data) return b.data;
  if (detail::capturing(stream)) return nullptr;
  // At least 8 MiB: a decode step's needs (attention's 128 key splits of 16 heads of 256 take
  // 2 MiB) are met at once, so a step recorded later does not have to grow it.
  constexpr std::size_t kGranule = std::size_t{1} << 20, kFirst = 8 * kGranule;
  std::size_t const want = (std::max({bytes, 2 * b.bytes, kFirst}) + kGranule - 1) / kGranule * kGranule;
  void* p = nullptr;
  if (cudaMallocAsync(&p, want, stream) != cudaSuccess) return detail::failed();
  if (b.data) cudaFreeAsync(b.data, stream);
  b.data = p;
  b.bytes = want;
  return p;
}

/// Counters a kernel may have on `stream` (the current device's): kStreamCounters zeroed
/// 32-bit words that live as long as the stream's workspace, for kernels whose CTAs count
/// themselves (the last one to finish does the rest). Stream order gives each launch the
/// counters alone; a kernel leaves the one it used at zero. Null when they must be made while
/// the stream is being captured, or the allocation failed.
inline constexpr int kStreamCounters = 4096;
inline unsigned* stream_counters(cudaStream_t stream) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return detail::failed();
  detail::StreamBuffers& all = detail::stream_buffers();
  std::lock_guard lock(all.mutex);
  detail::StreamBuffer& b = all.buffers[{device, stream}];
  if (b.counters) return b.counters;
  if (detail::capturing(stream)) return nullptr;
  void* p = nullptr;
  std::size_t const bytes = kStreamCounters * sizeof(unsigned);
  if (cudaMallocAsync(&p, bytes, stream) != cudaSuccess) return detail::failed();
  if (cudaMemsetAsync(p, 0, bytes, stream) != cudaSuccess) {
    cudaFreeAsync(p, stream);
    return detail::failed();
  }
  b.counters = static_cast<unsigned*>(p);
  return b.counters;
}

/// Frees `stream`'s workspace and counters on the current device, after the work queued on it
/// (call before destroying the stream).
inline void release_stream_workspace(cudaStream_t stream) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return;
  detail::StreamBuffers& all = detail::stream_buffers();
  std::lock_guard lock(all.mutex);
  auto const it = all.buffers.find({device, stream});
  if (it == all.buffers.end()) return;
  if (it->second.data) cudaFreeAsync(it->second.data, stream);
  if (it->second.counters) cudaFreeAsync(it->second.counters, stream);
  all.buffers.erase(it);
}

}  // namespace qflash::kernels::cuda
