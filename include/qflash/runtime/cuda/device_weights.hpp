/// @file
/// A model's weights copied to a CUDA device, as views of device memory that
/// `Model<S, arch::Sm80 | arch::Sm90a>` reads: every matrix byte for byte in its own format
/// (fp8 with the fp32 scale rows it uses), each layer's routed experts stacked per projection
/// (one allocation, a constant stride: the StackedView kernels/expert_ffn/device.cuh reads),
/// and the small fp32 vectors. Host bytes go through two pinned staging buffers, so copying
/// one chunk overlaps filling the next, with a progress bar over the matrices' bytes.
///
/// Host code that calls the CUDA runtime API: include it only where CUDA is enabled and link
/// CUDA::cudart (host-only builds never see it).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/io/progress.hpp"
#include "qflash/kernels/expert_ffn/stacked.hpp"
#include "qflash/model/weights.hpp"
#include "qflash/runtime/cuda/memory.hpp"

namespace qflash::runtime {

using kernels::ExpertWeights;
using kernels::WeightView;

/// Device memory that holds a model's weights, freed with it, and the staging buffers that
/// fill it. Not copyable; shared by the views through a shared_ptr.
class DeviceWeightStorage {
 public:
  /// Pinned staging: two buffers of this many bytes.
  static constexpr std::size_t kStagingBytes = std::size_t{32} << 20;

  explicit DeviceWeightStorage(int device) : device_(device) {
    check_cuda(cudaSetDevice(device_), "cudaSetDevice(" + std::to_string(device_) + ")");
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "creating the upload stream");
  }
  DeviceWeightStorage(DeviceWeightStorage const&) = delete;
  DeviceWeightStorage& operator=(DeviceWeightStorage const&) = delete;
  ~DeviceWeightStorage() {
    cudaSetDevice(device_);
    release_staging();
    if (stream_) cudaStreamDestroy(stream_);
    for (void* p : blocks_) cudaFree(p);
  }

  [[nodiscard]] int device() const { return device_; }
  /// Device bytes held.
  [[nodiscard]] std::int64_t bytes() const { return bytes_; }

  /// `bytes` of device memory, held until the storage goes.
  std::byte* allocate(std::int64_t bytes) {
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, static_cast<std::size_t>(std::max<std::int64_t>(bytes, 1))),
               "allocating " + std::to_string(bytes) + " bytes of weights on CUDA device " + std::to_string(device_) +
                   " (" + std::to_string(bytes_) + " held already)");
    blocks_.push_back(p);
    bytes_ += bytes;
    return static_cast<std::byte*>(p);
  }

  /// Copies `bytes` host bytes to device address `dst` through the staging buffers.
  void upload(void* dst, void const* src, std::int64_t bytes) {
    if (!staging_[0]) acquire_staging();
    auto* out = static_cast<std::byte*>(dst);
    auto const* in = static_cast<std::byte const*>(src);
    for (std::int64_t done = 0; done < bytes;) {
      std::size_t const n = std::min<std::size_t>(kStagingBytes, static_cast<std::size_t>(bytes - done));
      int const b = next_;
      next_ ^= 1;
      check_cuda(cudaEventSynchronize(ready_[b]), "waiting for a staging buffer");  // its last copy is done
      std::memcpy(staging_[b], in + done, n);
      check_cuda(cudaMemcpyAsync(out + done, staging_[b], n, cudaMemcpyHostToDevice, stream_),
                 "copying weights to CUDA device " + std::to_string(device_));
      check_cuda(cudaEventRecord(ready_[b], stream_), "recording a copy");
      done += static_cast<std::int64_t>(n);
    }
  }

  /// Waits for every copy, then gives the staging buffers back.
  void finish_uploads() {
    check_cuda(cudaStreamSynchronize(stream_), "finishing the weight upload");
    release_staging();
  }

 private:
  void acquire_staging() {
    for (int b = 0; b < 2; ++b) {
      check_cuda(cudaMallocHost(&staging_[b], kStagingBytes), "allocating pinned staging memory");
      check_cuda(cudaEventCreateWithFlags(&ready_[b], cudaEventDisableTiming), "creating an event");
      check_cuda(cudaEventRecord(ready_[b], stream_), "recording an event");
    }
  }
  void release_staging() {
    for (int b = 0; b < 2; ++b) {
      if (ready_[b]) cudaEventDestroy(ready_[b]);
      if (staging_[b]) cudaFreeHost(staging_[b]);
      ready_[b] = nullptr;
      staging_[b] = nullptr;
    }
  }

  int device_;
  cudaStream_t stream_ = nullptr;
  std::vector<void*> blocks_;
  std::int64_t bytes_ = 0;
  std::array<void*, 2> staging_{};
  std::array<cudaEvent_t, 2> ready_{};
  int next_ = 0;
};

/// A model's weights on a device: views of memory that `storage` owns.
struct DeviceModelWeights {
  model::ModelWeights weights;
  std::shared_ptr<DeviceWeightStorage> storage;
};

namespace detail {

/// The block rows of an fp8 view's scale grid that its rows use: [first, first + count).
struct ScaleRows {
  std::int64_t first = 0, count = 0;
};
inline ScaleRows fp8_scale_rows(WeightView const& w) {
  std::int64_t const first = w.scale_row0 / kFp8BlockSize;
  return {first, (w.scale_row0 + w.rows - 1) / kFp8BlockSize - first + 1};
}

/// Copies the weights of one model to a device; the progress bar counts matrix bytes.
class Uploader {
 public:
  Uploader(DeviceWeightStorage& storage, io::Progress& progress) : st_(storage), progress_(progress) {}

  /// One matrix: its bytes, and for fp8 the scale rows it uses (its scale_row0 then counts
  /// from the first of them).
  WeightView matrix(WeightView const& w) {
    WeightView d = w;
    std::byte* data = st_.allocate(w.bytes());
    st_.upload(data, w.data, w.bytes());
    progress_.advance(static_cast<std::uint64_t>(w.bytes()));
    d.data = data;
    if (w.format == WeightFormat::kFp8E4m3) {
      ScaleRows const s = fp8_scale_rows(w);
      std::int64_t const cols = fp8_scale_blocks(w.cols);
      auto* grid = reinterpret_cast<float*>(st_.allocate(s.count * cols * 4));
      st_.upload(grid, w.scales + s.first * cols, s.count * cols * 4);
      d.scales = grid;
      d.scale_row0 = w.scale_row0 - s.first * kFp8BlockSize;
    }
    return d;
  }

  /// Projection `which` of every routed expert, stacked: expert e's bytes at e * (one
  /// expert's bytes), fp8 scale rows at e * (one expert's), so that the device views form a
  /// StackedView. Experts already stacked on the host keep their layout (one copy).
  void experts(std::span<ExpertWeights const> host, std::span<ExpertWeights> dev, WeightView ExpertWeights::*which) {
    if (host.empty()) return;
    WeightView const& w0 = host[0].*which;
    std::optional<kernels::StackedView> const stacked = kernels::stack(host, which);
    if (stacked && stacked->data_stride >= w0.bytes() && stacked->scales_stride >= 0) {
      // One range from the first expert's bytes to the end of the last's, as laid out.
      std::int64_t const n = static_cast<std::int64_t>(host.size());
      std::int64_t const span_bytes = (n - 1) * stacked->data_stride + w0.bytes();
      std::byte* data = st_.allocate(span_bytes);
      st_.upload(data, w0.data, span_bytes);
      progress_.advance(static_cast<std::uint64_t>(n * w0.bytes()), static_cast<int>(n));
      float* grid = nullptr;
      std::int64_t first_block = 0;
      if (w0.format == WeightFormat::kFp8E4m3) {  // the scale rows from the first expert's to the last's
        WeightView const& last = host.back().*which;
        std::int64_t const cols = fp8_scale_blocks(w0.cols);
        ScaleRows const r0 = fp8_scale_rows(w0), r1 = fp8_scale_rows(last);
        first_block = r0.first;
        float const* begin = w0.scales + r0.first * cols;
        std::int64_t const floats = last.scales + (r1.first + r1.count) * cols - begin;
        grid = reinterpret_cast<float*>(st_.allocate(floats * 4));
        st_.upload(grid, begin, floats * 4);
      }
      for (std::size_t e = 0; e < host.size(); ++e) {
        WeightView v = stacked->at(static_cast<int>(e));
        v.data = data + static_cast<std::int64_t>(e) * stacked->data_stride;
        if (grid) {
          v.scales = grid + static_cast<std::int64_t>(e) * stacked->scales_stride;
          v.scale_row0 -= first_block * kFp8BlockSize;
        }
        dev[e].*which = v;
      }
      return;
    }
    // Separate tensors: packed one after another.
    std::int64_t const one = w0.bytes();
    std::int64_t grid_rows = 0, row0 = 0;
    std::int64_t const cols = w0.format == WeightFormat::kFp8E4m3 ? fp8_scale_blocks(w0.cols) : 0;
    for (auto const& e : host) {
      WeightView const& w = e.*which;
      QFLASH_CHECK(w.format == w0.format && w.rows == w0.rows && w.cols == w0.cols,
                   "uploading experts: expert projections differ in format or shape (", to_string(w.format), " ",
                   w.rows, "x", w.cols, " vs ", to_string(w0.format), " ", w0.rows, "x", w0.cols, ")");
      if (cols) {
        ScaleRows const s = fp8_scale_rows(w);
        std::int64_t const r0 = w.scale_row0 - s.first * kFp8BlockSize;
        QFLASH_CHECK(&e == &host[0] || r0 == row0,
                     "uploading experts: fp8 experts whose rows start at different offsets in their scale tiles "
                     "cannot be stacked");
        row0 = r0;
        grid_rows = std::max(grid_rows, s.count);
      }
    }
    std::byte* data = st_.allocate(one * static_cast<std::int64_t>(host.size()));
    auto* grid = cols ? reinterpret_cast<float*>(st_.allocate(grid_rows * cols * 4 * static_cast<std::int64_t>(host.size())))
                      : nullptr;
    for (std::size_t e = 0; e < host.size(); ++e) {
      WeightView const& w = host[e].*which;
      WeightView v = w;
      std::byte* const slot = data + static_cast<std::int64_t>(e) * one;
      st_.upload(slot, w.data, one);
      progress_.advance(static_cast<std::uint64_t>(one));
      v.data = slot;
      if (grid) {
        ScaleRows const s = fp8_scale_rows(w);
        float* const rows = grid + static_cast<std::int64_t>(e) * grid_rows * cols;
        st_.upload(rows, w.scales + s.first * cols, s.count * cols * 4);
        v.scales = rows;
        v.scale_row0 = row0;
      }
      dev[e].*which = v;
    }
  }

  model::FloatView vector(model::FloatView v) {
    if (v.empty()) return {};
    auto* d = reinterpret_cast<float*>(st_.allocate(static_cast<std::int64_t>(v.size() * sizeof(float))));
    st_.upload(d, v.data(), static_cast<std::int64_t>(v.size() * sizeof(float)));
    return {d, v.size()};
  }

 private:
  DeviceWeightStorage& st_;
  io::Progress& progress_;
};

}  // namespace detail

/// Copies `host` to CUDA device `device`: what the weights of a model on that device are.
/// Throws Error (naming the bytes) when the device runs out of memory, freeing what it took.
/// @param progress  draw a progress bar on stderr
inline DeviceModelWeights upload_weights(model::ModelWeights const& host, int device, bool progress) {
  std::int64_t total = 0;
  host.for_each_matrix([&](std::string const&, WeightView const& w) { total += w.bytes(); });
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, device), "querying CUDA device " + std::to_string(device));
  io::Progress bar(std::string("uploading weights to ") + prop.name, static_cast<std::uint64_t>(total), progress);

  DeviceModelWeights out;
  out.storage = std::make_shared<DeviceWeightStorage>(device);
  detail::Uploader up(*out.storage, bar);
  model::ModelWeights& d = out.weights;
  d.embed = up.matrix(host.embed);
  d.lm_head = host.lm_head.data == host.embed.data ? d.embed : up.matrix(host.lm_head);
  d.final_norm = up.vector(host.final_norm);
  for (model::LayerWeights const& hl : host.layers) {
    model::LayerWeights& dl = d.layers.emplace_back();
    dl.kind = hl.kind;
    dl.input_norm = up.vector(hl.input_norm);
    dl.post_norm = up.vector(hl.post_norm);
    if (hl.kind == model::LayerKind::kFullAttention) {
      auto const& a = hl.attention;
      dl.attention = {up.matrix(a.q), up.matrix(a.k), up.matrix(a.v), up.matrix(a.o), up.vector(a.q_norm),
                      up.vector(a.k_norm)};
    } else {
      auto const& a = hl.linear;
      dl.linear = {up.matrix(a.qkv),    up.matrix(a.z),       up.matrix(a.b),      up.matrix(a.a),
                   up.matrix(a.out),    up.vector(a.conv),    up.vector(a.dt_bias), up.vector(a.neg_a),
                   up.vector(a.norm)};
    }
    dl.moe.router = up.matrix(hl.moe.router);
    dl.moe.experts.resize(hl.moe.experts.size());
    for (auto which : {&ExpertWeights::gate, &ExpertWeights::up, &ExpertWeights::down})
      up.experts(hl.moe.experts, dl.moe.experts, which);
    if (hl.moe.shared)
      dl.moe.shared = ExpertWeights{up.matrix(hl.moe.shared->gate), up.matrix(hl.moe.shared->up),
                                    up.matrix(hl.moe.shared->down)};
  }
  out.storage->finish_uploads();
  bar.finish();
  return out;
}

}  // namespace qflash::runtime
