/// @file
/// Token embedding lookup on CUDA, shared by sm80.cuh and sm90a.cuh: one thread per (token,
/// unit of a row), a unit being a block of the table's format (32 values of an element
/// format), decoded with the format's host-device row dequantizers (numeric/), as the CPU.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "qflash/kernels/common/cuda.cuh"
#include "qflash/kernels/embedding/op.hpp"

namespace qflash::kernels::embedding_cuda {

inline constexpr int kThreads = 256;
inline constexpr std::int64_t kMaxBlocks = 1 << 16;
inline constexpr int kElementUnit = 32;  ///< values per thread of an element format

/// Values a thread decodes: a whole block of a block format.
constexpr int unit_of(WeightFormat f) { return block_values(f) > 1 ? block_values(f) : kElementUnit; }

/// Values [c0, c0 + n) of row r (c0 a multiple of unit_of(format)) into y.
__device__ __forceinline__ void decode_span(WeightView const& w, std::int64_t r, std::int64_t c0, int n, float* y) {
  std::byte const* src = w.row(r);
  auto const block = [&](std::size_t bytes) { return src + c0 / block_values(w.format) * static_cast<std::int64_t>(bytes); };
  switch (w.format) {
    case WeightFormat::kF32:
      for (int e = 0; e < n; ++e) y[e] = reinterpret_cast<float const*>(src)[c0 + e];
      return;
    case WeightFormat::kBf16:
      for (int e = 0; e < n; ++e) y[e] = to_float(Bf16{reinterpret_cast<std::uint16_t const*>(src)[c0 + e]});
      return;
    case WeightFormat::kF16:
      for (int e = 0; e < n; ++e) y[e] = to_float(Fp16{reinterpret_cast<std::uint16_t const*>(src)[c0 + e]});
      return;
    case WeightFormat::kFp8E4m3: {
      float const* scales = w.scale_row(r);
      for (int e = 0; e < n; ++e)
        y[e] = to_float(Fp8E4m3{reinterpret_cast<std::uint8_t const*>(src)[c0 + e]}) * scales[(c0 + e) / kFp8BlockSize];
      return;
    }
    case WeightFormat::kQ8_0:
      gguf::dequantize_row_q8_0(reinterpret_cast<gguf::BlockQ8_0 const*>(block(sizeof(gguf::BlockQ8_0))),
                                static_cast<std::size_t>(n), y);
      return;
    case WeightFormat::kQ4K:
      gguf::dequantize_row_q4_k(reinterpret_cast<gguf::BlockQ4K const*>(block(sizeof(gguf::BlockQ4K))),
                                static_cast<std::size_t>(n), y);
      return;
    case WeightFormat::kQ6K:
      gguf::dequantize_row_q6_k(reinterpret_cast<gguf::BlockQ6K const*>(block(sizeof(gguf::BlockQ6K))),
                                static_cast<std::size_t>(n), y);
      return;
    case WeightFormat::kInt4:
      dequantize_row_int4_g128(reinterpret_cast<BlockInt4G128 const*>(block(sizeof(BlockInt4G128))),
                               static_cast<std::size_t>(n), y);
      return;
    case WeightFormat::kAny: return;
  }
}

template <class Arch>
__global__ void __launch_bounds__(kThreads, 1) embedding_kernel(EmbeddingArgs const a, int unit) {
  std::int64_t const cols = a.table.cols;
  std::int64_t const units = (cols + unit - 1) / unit;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < a.n_tokens * units;
       i += static_cast<std::int64_t>(gridDim.x) * kThreads) {
    std::int64_t const t = i / units;
    std::int64_t const c0 = (i % units) * unit;
    int const n = static_cast<int>(cols - c0 < unit ? cols - c0 : unit);
    float* y = a.y + t * cols + c0;
    std::int32_t const id = a.tokens[t];
    if (id < 0 || id >= a.table.rows) {  // unchecked on the host: make it loud downstream
      for (int e = 0; e < n; ++e) y[e] = NAN;
      continue;
    }
    decode_span(a.table, id, c0, n, y);
  }
}

/// The body of `launch_embedding<S>(Arch, args, stream)` for a CUDA arch tag.
template <class Arch, MoeSpec S>
Status launch(EmbeddingArgs const& a, stream_t stream) {
  if (Status s = can_implement_embedding_shape<S>(a); s != Status::kSuccess) return s;
  if (!cuda::device_aligned(a.table)) return Status::kErrorMisalignedOperand;
  int const unit = unit_of(a.table.format);
  std::int64_t const work = a.n_tokens * ((a.table.cols + unit - 1) / unit);
  if (work == 0) return Status::kSuccess;
  std::int64_t const blocks = std::min<std::int64_t>((work + kThreads - 1) / kThreads, kMaxBlocks);
  QFLASH_LAUNCH(static_cast<unsigned>(blocks), kThreads, 0, stream, embedding_kernel<Arch>)(a, unit);
  return cuda::last_launch_status();
}

}  // namespace qflash::kernels::embedding_cuda
