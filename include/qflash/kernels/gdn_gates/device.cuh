/// @file
/// Gated DeltaNet's per-token gates on CUDA, shared by sm80.cuh and sm90a.cuh: one thread per
/// (token, value head), the CPU kernel's formulas in fp32.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "qflash/kernels/common/cuda.cuh"
#include "qflash/kernels/gdn_gates/op.hpp"

namespace qflash::kernels::gdn_gates_cuda {

inline constexpr int kThreads = 256;
inline constexpr std::int64_t kMaxBlocks = 1 << 16;

struct Gates {
  float g, beta;
};

/// Value head h's gates from its raw a and b (also kernels/gdn_decode's).
__device__ __forceinline__ Gates gates_of(GdnGatesArgs const& args, float a, float b, int h) {
  float const x = a + args.dt_bias[h];
  return {args.neg_a[h] * (x > 20.0f ? x : log1pf(expf(x))), 1.0f / (1.0f + expf(-b))};
}

/// Value i of a's rows, value head h, in place (also kernels/gdn_decode's).
__device__ __forceinline__ void gate(GdnGatesArgs const& a, std::int64_t i, int h) {
  Gates const r = gates_of(a, a.g[i], a.beta[i], h);
  a.g[i] = r.g;
  a.beta[i] = r.beta;
}

template <class Arch>
__global__ void __launch_bounds__(kThreads) gdn_gates_kernel(GdnGatesArgs const a) {
  std::int64_t const n = a.n_tokens * a.n_head_v;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * kThreads)
    gate(a, i, static_cast<int>(i % a.n_head_v));
}

/// The body of `launch_gdn_gates<S>(Arch, args, stream)` for a CUDA arch tag.
template <class Arch, MoeSpec S>
Status launch(GdnGatesArgs const& a, stream_t stream) {
  if (Status s = can_implement_gdn_gates<S>(a); s != Status::kSuccess) return s;
  std::int64_t const n = a.n_tokens * a.n_head_v;
  if (n == 0) return Status::kSuccess;
  std::int64_t const blocks = std::min<std::int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks);
  QFLASH_LAUNCH(static_cast<unsigned>(blocks), kThreads, 0, stream, gdn_gates_kernel<Arch>)(a);
  return cuda::last_launch_status();
}

}  // namespace qflash::kernels::gdn_gates_cuda
