/// @file
/// Gated RMSNorm on CUDA, shared by sm80.cuh and sm90a.cuh: one warp per row (a token's value
/// head, d_v = 128 in the Qwen3.6 models), the sum of squares in fp32 over the lanes, then
/// y = w * (x * inv) * silu(z).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "qflash/kernels/common/cuda.cuh"
#include "qflash/kernels/gated_rmsnorm/op.hpp"

namespace qflash::kernels::gated_rmsnorm_cuda {

inline constexpr int kThreads = 256;
inline constexpr std::int64_t kMaxBlocks = 1 << 16;

/// One row of n by one warp. y may alias x: a lane writes only what it read, after the sum. x
/// is read through L2 (kernels/gdn_decode norms rows other CTAs of its launch wrote).
__device__ __forceinline__ void norm_row(float const* x, float const* z, float const* weight, float* y, int n, float eps,
                                         int lane) {
  float ss = 0.0f;
  for (int c = lane; c < n; c += 32) {
    float const v = __ldcg(x + c);
    ss = fmaf(v, v, ss);
  }
  float const inv = 1.0f / sqrtf(cuda::warp_sum(ss) / static_cast<float>(n) + eps);
  for (int c = lane; c < n; c += 32) y[c] = weight[c] * (__ldcg(x + c) * inv) * cuda::silu(z[c]);
}

/// Rows by warps, grid-stride.
template <class Arch>
__global__ void __launch_bounds__(kThreads) gated_rmsnorm_kernel(GatedRmsNormArgs const a) {
  constexpr int kWarps = kThreads / 32;
  int const lane = static_cast<int>(threadIdx.x % 32);
  for (std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; r < a.n_rows;
       r += static_cast<std::int64_t>(gridDim.x) * kWarps)
    norm_row(a.x + r * a.n_cols, a.z + r * a.n_cols, a.weight, a.y + r * a.n_cols, a.n_cols, a.eps, lane);
}

/// The body of `launch_gated_rmsnorm<S>(Arch, args, stream)` for a CUDA arch tag.
template <class Arch, MoeSpec S>
Status launch(GatedRmsNormArgs const& a, stream_t stream) {
  if (Status s = can_implement_gated_rmsnorm<S>(a); s != Status::kSuccess) return s;
  std::int64_t const blocks = std::min<std::int64_t>((a.n_rows + kThreads / 32 - 1) / (kThreads / 32), kMaxBlocks);
  QFLASH_LAUNCH(static_cast<unsigned>(blocks), kThreads, 0, stream, gated_rmsnorm_kernel<Arch>)(a);
  return cuda::last_launch_status();
}

}  // namespace qflash::kernels::gated_rmsnorm_cuda
