/// @file
/// Device helpers the CUDA kernels share: warp reductions, silu and the launch status.
#pragma once

#include <cuda_runtime.h>

#include "qflash/core/status.hpp"

namespace qflash::kernels::cuda {

/// The sum, max or min of v over the 32 lanes of a warp, returned to every lane.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int m = 16; m > 0; m /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}
__device__ __forceinline__ float warp_min(float v) {
#pragma unroll
  for (int m = 16; m > 0; m /= 2) v = fminf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

/// silu(x) = x * sigmoid(x) from e = e^{-|x|}, the CPU kernels' form (gdn::silu_f32): never
/// overflows.
__device__ __forceinline__ float silu(float x) {
  float const e = expf(-fabsf(x));
  return x * ((x >= 0.0f ? 1.0f : e) / (1.0f + e));
}

/// kErrorCuda when the last launch failed (e.g. no kernel image for this device).
inline Status last_launch_status() {
  return cudaGetLastError() == cudaSuccess ? Status::kSuccess : Status::kErrorCuda;
}

}  // namespace qflash::kernels::cuda
