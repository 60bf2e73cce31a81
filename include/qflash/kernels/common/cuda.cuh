/// @file
/// Device helpers the CUDA kernels share: warp reductions, silu, where weights must lie, and the
/// launch status.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "qflash/core/status.hpp"
#include "qflash/numeric/weight_format.hpp"

// kernel<<<grid, block, smem, stream>>> and a kernel's dynamic shared memory, spelled so that the
// CUDA emulator (tests/support/cuda_emulator, which defines its own) runs the kernels as C++.
#ifndef QFLASH_CUDA_EMULATOR
#define QFLASH_LAUNCH(grid, block, smem, stream, ...) __VA_ARGS__<<<grid, block, smem, stream>>>
#define QFLASH_DYNAMIC_SMEM(T, name) extern __shared__ T name[]
#endif

namespace qflash::kernels::cuda {

/// The sum, max or min of v over the 32 lanes of a warp, returned to every lane. (The emulator
/// runs the same butterfly as one collective.)
__device__ __forceinline__ float warp_sum(float v) {
#ifdef QFLASH_CUDA_EMULATOR
  return ::qflash::emulator::warp_butterfly(v, ::qflash::emulator::kButterflySum);
#else
#pragma unroll
  for (int m = 16; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
#endif
}
__device__ __forceinline__ float warp_max(float v) {
#ifdef QFLASH_CUDA_EMULATOR
  return ::qflash::emulator::warp_butterfly(v, ::qflash::emulator::kButterflyMax);
#else
#pragma unroll
  for (int m = 16; m > 0; m /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
#endif
}
__device__ __forceinline__ float warp_min(float v) {
#ifdef QFLASH_CUDA_EMULATOR
  return ::qflash::emulator::warp_butterfly(v, ::qflash::emulator::kButterflyMin);
#else
#pragma unroll
  for (int m = 16; m > 0; m /= 2) v = fminf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
#endif
}
/// warp_sum of each of v's values, in place: the values' butterflies step by step together
/// (each value's sum as warp_sum's, bit for bit; on the emulator, one collective for all).
template <int N>
__device__ __forceinline__ void warp_sums(float (&v)[N]) {
#ifdef QFLASH_CUDA_EMULATOR
  static_assert(N <= ::qflash::emulator::kMaxButterflyValues);
  ::qflash::emulator::warp_butterfly(v, N, ::qflash::emulator::kButterflySum);
#else
#pragma unroll
  for (int m = 16; m > 0; m /= 2)
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], m);
#endif
}
template <int R, int C>
__device__ __forceinline__ void warp_sums(float (&v)[R][C]) {
#ifdef QFLASH_CUDA_EMULATOR
  static_assert(R * C <= ::qflash::emulator::kMaxButterflyValues);
  ::qflash::emulator::warp_butterfly(&v[0][0], R * C, ::qflash::emulator::kButterflySum);
#else
#pragma unroll
  for (int m = 16; m > 0; m /= 2)
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int c = 0; c < C; ++c) v[r][c] += __shfl_xor_sync(0xffffffffu, v[r][c], m);
#endif
}

/// silu(x) = x * sigmoid(x) from e = e^{-|x|}, the CPU kernels' form (gdn::silu_f32): never
/// overflows.
__device__ __forceinline__ float silu(float x) {
  float const e = expf(-fabsf(x));
  return x * ((x >= 0.0f ? 1.0f : e) / (1.0f + e));
}

/// Whether the kernels can read `w` where it lies: f32 values at 4-byte addresses; bf16, f16
/// and the block formats' 16-bit fields at even ones; fp8 anywhere, its float scales at 4. (The
/// CPU reads any address.)
inline bool device_aligned(WeightView const& w) {
  std::uintptr_t const need = w.format == WeightFormat::kF32 ? 4 : w.format == WeightFormat::kFp8E4m3 ? 1 : 2;
  return reinterpret_cast<std::uintptr_t>(w.data) % need == 0 &&
         reinterpret_cast<std::uintptr_t>(w.scales) % alignof(float) == 0;
}

/// kErrorCuda when the last launch failed (e.g. no kernel image for this device).
inline Status last_launch_status() {
  return cudaGetLastError() == cudaSuccess ? Status::kSuccess : Status::kErrorCuda;
}

/// Lets `kernel` launch with up to `bytes` of dynamic shared memory (above 48 KiB an opt-in).
/// Callers pass the most any launch of the kernel takes, the same on every call, so that host
/// threads launching it at once never lower each other's limit. A refusal is taken off the
/// runtime's last error too, so that the next launch's status is its own.
template <class... Params>
Status allow_dynamic_smem(void (*kernel)(Params...), std::size_t bytes) {
  if (bytes <= 48 * 1024 ||
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)) == cudaSuccess)
    return Status::kSuccess;
  static_cast<void>(cudaGetLastError());
  return Status::kErrorCuda;
}

}  // namespace qflash::kernels::cuda
