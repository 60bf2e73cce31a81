/// @file
/// Causal depthwise conv1d with carried state on CUDA, shared by sm80.cuh and sm90a.cuh. Two
/// kernels in stream order: one thread per (token, channel) output, reading this call's inputs
/// and the old state (sums in the CPU kernel's order, fp32); then one thread per channel moves
/// the last d_conv - 1 inputs into the state.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "qflash/kernels/causal_conv1d/op.hpp"
#include "qflash/kernels/common/cuda.cuh"

namespace qflash::kernels::causal_conv1d_cuda {

inline constexpr int kThreads = 256;
inline constexpr std::int64_t kMaxBlocks = 1 << 16;

/// in[s, c]: this call's input for s >= 0, else the state's (the previous d_conv - 1 inputs).
__device__ __forceinline__ float input(CausalConv1dArgs const& a, std::int64_t s, int c) {
  return s >= 0 ? a.x[s * a.n_channels + c] : a.state[c * (a.d_conv - 1) + (a.d_conv - 1) + s];
}

template <class Arch, int kConv>
__global__ void __launch_bounds__(kThreads) conv_kernel(CausalConv1dArgs const a) {
  int const k = kConv != kDynamic ? kConv : a.d_conv;
  std::int64_t const n = a.n_tokens * a.n_channels;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * kThreads) {
    std::int64_t const t = i / a.n_channels;
    int const c = static_cast<int>(i % a.n_channels);
    float const* w = a.weight + static_cast<std::int64_t>(c) * k;
    float acc = w[0] * input(a, t - (k - 1), c);
    for (int j = 1; j < k; ++j) acc += w[j] * input(a, t - (k - 1) + j, c);
    a.y[i] = a.apply_silu ? cuda::silu(acc) : acc;
  }
}

/// state[c] = the last d_conv - 1 entries of [state[c], x[:, c]]; runs after conv_kernel.
template <class Arch>
__global__ void __launch_bounds__(kThreads) state_kernel(CausalConv1dArgs const a) {
  int const keep = a.d_conv - 1;
  for (int c = static_cast<int>(blockIdx.x) * kThreads + static_cast<int>(threadIdx.x); c < a.n_channels;
       c += static_cast<int>(gridDim.x) * kThreads) {
    float* s = a.state + static_cast<std::int64_t>(c) * keep;
    // Oldest first: an entry that moves within the state is read before it is overwritten.
    for (int i = 0; i < keep; ++i) s[i] = input(a, a.n_tokens - keep + i, c);
  }
}

/// The body of `launch_causal_conv1d<S>(Arch, args, stream)` for a CUDA arch tag.
template <class Arch, MoeSpec S>
Status launch(CausalConv1dArgs const& a, stream_t stream) {
  if (Status s = can_implement_causal_conv1d<S>(a); s != Status::kSuccess) return s;
  std::int64_t const n = a.n_tokens * a.n_channels;
  std::int64_t const blocks = std::min<std::int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks);
  QFLASH_LAUNCH(static_cast<unsigned>(blocks), kThreads, 0, stream, conv_kernel<Arch, S.d_conv>)(a);
  if (Status s = cuda::last_launch_status(); s != Status::kSuccess || a.d_conv == 1) return s;
  std::int64_t const state_blocks = std::min<std::int64_t>((a.n_channels + kThreads - 1) / kThreads, kMaxBlocks);
  QFLASH_LAUNCH(static_cast<unsigned>(state_blocks), kThreads, 0, stream, state_kernel<Arch>)(a);
  return cuda::last_launch_status();
}

}  // namespace qflash::kernels::causal_conv1d_cuda
