/// @file
/// add + RMSNorm on CUDA: the kernels and the launcher body shared by sm80.cuh and sm90a.cuh.
///
/// Three kernels, chosen per call (fewest passes over memory first):
/// - `add_rmsnorm_static_kernel`: width fixed by the spec, 16-byte accesses; each block owns
///   rows, each thread keeps its slice of h = x + residual and of w' = w + w_offset in
///   registers, so DRAM sees x, residual and y once and the weight once per block.
/// - `add_rmsnorm_block_kernel`: any width, one row per block; pass 2 re-reads h (L1/L2).
/// - `add_rmsnorm_warp_kernel`: narrow rows, one per warp, no block barrier.
/// Sums of squares are fp32 (CUB BlockReduce across the block, xor shuffles within a warp);
/// the finishing `1 / sqrt(sum / n + eps)` and the products are the CPU kernels' (cpu.hpp),
/// all correctly rounded, so GPU and CPU differ only in summation order.
///
/// Every __global__ template takes the arch tag first. The sm80 instance TUs are compiled for
/// sm_80 only and the sm90a ones for sm_90a only; a kernel instantiated with the same template
/// arguments in both would be one weak host symbol, the linker would keep one, and one arch's
/// code would run for the other. The tag makes the symbols differ.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "qflash/kernels/add_rmsnorm/op.hpp"
#include "qflash/kernels/common/cub.cuh"
#include "qflash/kernels/common/cuda.cuh"
#include "qflash/kernels/add_rmsnorm/policy.hpp"

namespace qflash::kernels::add_rmsnorm_cuda {

template <class Act, class W>
struct Params {
  Act const* x;       // [n_rows, n_cols]
  Act* residual;      // [n_rows, n_cols] in: residual, out: h = x + residual; null: h = x
  W const* weight;    // [n_cols]
  Act* y;             // [n_rows, n_cols]; may alias x
  std::int64_t n_rows;
  int n_cols;
  float eps;
  float w_offset;     // 0: y = x_hat * w; 1: y = x_hat * (1 + w)
};

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T>
__device__ __forceinline__ T from_f32(float v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else
    return __float2bfloat16_rn(v);
}

/// N elements of T moved with the widest aligned accesses (16 bytes at most per access).
template <class T, int N>
struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) Pack {
  T v[N];
};

template <class T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(T const* p) {
  return *reinterpret_cast<Pack<T, N> const*>(p);
}
template <class T, int N>
__device__ __forceinline__ void store_pack(T* p, Pack<T, N> const& v) {
  *reinterpret_cast<Pack<T, N>*>(p) = v;
}

/// h = x (+ residual, stored back rounded to Act) for one vector at `off`; returns h in fp32.
template <int kVec, class Act, class W>
__device__ __forceinline__ void add_residual(Params<Act, W> const& p, std::size_t off,
                                             float (&h)[kVec]) {
  Pack<Act, kVec> const xv = load_pack<Act, kVec>(p.x + off);
  if (p.residual) {
    Pack<Act, kVec> const rv = load_pack<Act, kVec>(p.residual + off);
    Pack<Act, kVec> hv;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      hv.v[j] = from_f32<Act>(to_f32(xv.v[j]) + to_f32(rv.v[j]));
      h[j] = to_f32(hv.v[j]);
    }
    store_pack<Act, kVec>(p.residual + off, hv);
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) h[j] = to_f32(xv.v[j]);
  }
}

template <int kVec, class Act, class W>
__device__ __forceinline__ void load_weight(Params<Act, W> const& p, int col, float (&w)[kVec]) {
  Pack<W, kVec> const wv = load_pack<W, kVec>(p.weight + col);
#pragma unroll
  for (int j = 0; j < kVec; ++j) w[j] = to_f32(wv.v[j]) + p.w_offset;
}

template <int kVec, class Act>
__device__ __forceinline__ void store_output(Act* y, float const (&h)[kVec], float inv,
                                             float const (&w)[kVec]) {
  Pack<Act, kVec> yv;
#pragma unroll
  for (int j = 0; j < kVec; ++j) yv.v[j] = from_f32<Act>((h[j] * inv) * w[j]);
  store_pack<Act, kVec>(y, yv);
}

__device__ __forceinline__ float inv_rms(float sum_sq, int n_cols, float eps) {
  return 1.0f / sqrtf(sum_sq / static_cast<float>(n_cols) + eps);
}

/// One row by a group of `stride` threads (a block or a warp), `rank` = this thread's index in
/// it; `reduce` sums a float over the group and returns the total to every member.
template <int kVec, class Act, class W, class Reduce>
__device__ __forceinline__ void add_rmsnorm_row_device(Params<Act, W> const& p, std::int64_t row,
                                                       int rank, int stride, Reduce&& reduce) {
  int const n_vecs = p.n_cols / kVec;
  std::size_t const base = static_cast<std::size_t>(row) * static_cast<std::size_t>(p.n_cols);
  float sum_sq = 0.0f;
  // Two vectors in flight per thread; the compiler's default unrolling spilled (nvcc 13, sm_90a).
#pragma unroll 2
  for (int v = rank; v < n_vecs; v += stride) {
    float h[kVec];
    add_residual<kVec>(p, base + static_cast<std::size_t>(v) * kVec, h);
#pragma unroll
    for (int j = 0; j < kVec; ++j) sum_sq = fmaf(h[j], h[j], sum_sq);
  }
  float const inv = inv_rms(reduce(sum_sq), p.n_cols, p.eps);

  // Each thread re-reads the elements it wrote itself: no barrier needed for visibility.
  Act const* hs = p.residual ? p.residual : p.x;
#pragma unroll 2
  for (int v = rank; v < n_vecs; v += stride) {
    std::size_t const off = base + static_cast<std::size_t>(v) * kVec;
    Pack<Act, kVec> const hv = load_pack<Act, kVec>(hs + off);
    float h[kVec], w[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) h[j] = to_f32(hv.v[j]);
    load_weight<kVec>(p, v * kVec, w);
    store_output<kVec>(p.y + off, h, inv, w);
  }
}

/// Width kN known at compile time: the row slice lives in registers (see @file).
template <class Arch, class Act, class W, int kN, int kVec, int kThreads>
__global__ void __launch_bounds__(kThreads) add_rmsnorm_static_kernel(Params<Act, W> const p) {
  constexpr int kVecsPerRow = kN / kVec;
  constexpr int kItems = (kVecsPerRow + kThreads - 1) / kThreads;
  static_assert(kN % kVec == 0, "add_rmsnorm: static width must be a multiple of the vector");
  using BlockReduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename BlockReduce::TempStorage temp;
  __shared__ float total;

  float w[kItems][kVec];
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    int const v = static_cast<int>(threadIdx.x) + k * kThreads;
    if (v < kVecsPerRow) load_weight<kVec>(p, v * kVec, w[k]);
  }

  for (std::int64_t row = blockIdx.x; row < p.n_rows; row += gridDim.x) {
    std::size_t const base = static_cast<std::size_t>(row) * kN;
    float h[kItems][kVec];
    float sum_sq = 0.0f;
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      int const v = static_cast<int>(threadIdx.x) + k * kThreads;
      if (v < kVecsPerRow) {
        add_residual<kVec>(p, base + static_cast<std::size_t>(v) * kVec, h[k]);
#pragma unroll
        for (int j = 0; j < kVec; ++j) sum_sq = fmaf(h[k][j], h[k][j], sum_sq);
      }
    }
    float const block_sum = BlockReduce(temp).Sum(sum_sq);
    if (threadIdx.x == 0) total = block_sum;
    __syncthreads();
    float const inv = inv_rms(total, kN, p.eps);
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      int const v = static_cast<int>(threadIdx.x) + k * kThreads;
      if (v < kVecsPerRow) store_output<kVec>(p.y + base + static_cast<std::size_t>(v) * kVec, h[k], inv, w[k]);
    }
    __syncthreads();  // `temp` and `total` are reused by the next row
  }
}

/// Any width, one row per block.
template <class Arch, class Act, class W, int kVec, int kThreads>
__global__ void __launch_bounds__(kThreads) add_rmsnorm_block_kernel(Params<Act, W> const p) {
  using BlockReduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename BlockReduce::TempStorage temp;
  __shared__ float total;
  auto block_sum = [&](float v) {
    float const s = BlockReduce(temp).Sum(v);
    if (threadIdx.x == 0) total = s;
    __syncthreads();
    float const t = total;
    __syncthreads();  // everyone has read `total` and left `temp` before the next row
    return t;
  };
  for (std::int64_t row = blockIdx.x; row < p.n_rows; row += gridDim.x)
    add_rmsnorm_row_device<kVec>(p, row, static_cast<int>(threadIdx.x), kThreads, block_sum);
}

/// Narrow rows, one per warp.
template <class Arch, class Act, class W, int kVec, int kThreads>
__global__ void __launch_bounds__(kThreads) add_rmsnorm_warp_kernel(Params<Act, W> const p) {
  constexpr int kWarps = kThreads / 32;
  int const lane = static_cast<int>(threadIdx.x) % 32;
  auto warp_sum = [](float v) { return cuda::warp_sum(v); };
  std::int64_t const first = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  for (std::int64_t row = first; row < p.n_rows; row += static_cast<std::int64_t>(gridDim.x) * kWarps)
    add_rmsnorm_row_device<kVec>(p, row, lane, 32, warp_sum);
}

inline bool aligned_to(void const* p, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

/// Any-width kernels with vectors of kVec elements (1: no alignment assumed).
template <class Arch, MoeSpec S, int kVec, class Act, class W>
Status launch_any_width(Params<Act, W> const& p, cudaStream_t stream) {
  constexpr AddRmsNormPolicy kPolicy = select_add_rmsnorm_policy(Arch{}, S);
  constexpr int kWarpMaxCols = 32 * kPolicy.warp_max_vectors_per_lane * kVec;
  // A static width too wide for one warp never instantiates the warp kernel.
  if constexpr (S.d_model == kDynamic || S.d_model <= kWarpMaxCols) {
    if (p.n_cols <= kWarpMaxCols) {
      constexpr int kThreads = kPolicy.warp_block_threads;
      std::int64_t const blocks = std::min<std::int64_t>((p.n_rows + kThreads / 32 - 1) / (kThreads / 32),
                                                         kPolicy.max_blocks);
      QFLASH_LAUNCH(static_cast<unsigned>(blocks), kThreads, 0, stream,
                    add_rmsnorm_warp_kernel<Arch, Act, W, kVec, kThreads>)(p);
      return cuda::last_launch_status();
    }
  }
  constexpr int kThreads = kPolicy.block_threads;
  std::int64_t const blocks = std::min<std::int64_t>(p.n_rows, kPolicy.max_blocks);
  QFLASH_LAUNCH(static_cast<unsigned>(blocks), kThreads, 0, stream,
                add_rmsnorm_block_kernel<Arch, Act, W, kVec, kThreads>)(p);
  return cuda::last_launch_status();
}

/// True when the spec's static width runs the register-resident kernel: whole vectors, and
/// few enough per thread.
template <class Arch, MoeSpec S, class Act>
constexpr bool uses_static_kernel() {
  constexpr AddRmsNormPolicy kPolicy = select_add_rmsnorm_policy(Arch{}, S);
  constexpr int kVec = kPolicy.vec_bytes / static_cast<int>(sizeof(Act));
  if constexpr (S.d_model == kDynamic || S.d_model % kVec != 0) {
    return false;
  } else {
    constexpr int kVecsPerRow = S.d_model / kVec;
    constexpr int kThreads = std::min(kPolicy.block_threads, (kVecsPerRow + 31) / 32 * 32);
    return (kVecsPerRow + kThreads - 1) / kThreads <= kPolicy.max_vectors_per_thread;
  }
}

template <class Arch, MoeSpec S, class Act, class W>
Status launch_typed(AddRmsNormArgs const& a, cudaStream_t stream) {
  constexpr AddRmsNormPolicy kPolicy = select_add_rmsnorm_policy(Arch{}, S);
  constexpr int kVec = kPolicy.vec_bytes / static_cast<int>(sizeof(Act));
  Params<Act, W> const p{static_cast<Act const*>(a.x), static_cast<Act*>(a.residual),
                         static_cast<W const*>(a.weight), static_cast<Act*>(a.y), a.n_rows,
                         a.n_cols, a.eps,
                         a.weight_kind == NormWeight::kZeroCentered ? 1.0f : 0.0f};
  // Vector accesses need every row start aligned: aligned bases and a width of whole vectors.
  auto const vb = static_cast<std::size_t>(kPolicy.vec_bytes);
  bool const vectorizable = a.n_cols % kVec == 0 && aligned_to(a.x, vb) && aligned_to(a.y, vb) &&
                            aligned_to(a.weight, vb) && (!a.residual || aligned_to(a.residual, vb));

  if constexpr (uses_static_kernel<Arch, S, Act>()) {
    constexpr int kVecsPerRow = S.d_model / kVec;
    constexpr int kThreads = std::min(kPolicy.block_threads, (kVecsPerRow + 31) / 32 * 32);
    if (vectorizable) {
      std::int64_t const blocks = std::min<std::int64_t>(a.n_rows, kPolicy.max_blocks);
      QFLASH_LAUNCH(static_cast<unsigned>(blocks), kThreads, 0, stream,
                    add_rmsnorm_static_kernel<Arch, Act, W, S.d_model, kVec, kThreads>)(p);
      return cuda::last_launch_status();
    }
    // Misaligned views of a static-width problem take the scalar any-width kernel.
    return launch_any_width<Arch, S, 1>(p, stream);
  } else {
    if (vectorizable) return launch_any_width<Arch, S, kVec>(p, stream);
    return launch_any_width<Arch, S, 1>(p, stream);
  }
}

/// The body of `launch_add_rmsnorm<S>(Arch, args, stream)` for a CUDA arch tag.
template <class Arch, MoeSpec S>
Status launch(AddRmsNormArgs const& a, stream_t stream) {
  static_assert(valid(S), "add_rmsnorm: invalid MoeSpec");
  if (Status s = can_implement_add_rmsnorm<S>(a); s != Status::kSuccess) return s;
  if (a.n_rows == 0) return Status::kSuccess;
  if (a.dtype == DType::kF32) {
    if (a.weight_dtype == DType::kF32) return launch_typed<Arch, S, float, float>(a, stream);
    return launch_typed<Arch, S, float, __nv_bfloat16>(a, stream);
  }
  if (a.weight_dtype == DType::kF32) return launch_typed<Arch, S, __nv_bfloat16, float>(a, stream);
  return launch_typed<Arch, S, __nv_bfloat16, __nv_bfloat16>(a, stream);
}

}  // namespace qflash::kernels::add_rmsnorm_cuda
