/// @file
/// The gated delta rule on CUDA, shared by sm80.cuh and sm90a.cuh: the per-token recurrence
/// (op.hpp's kRecurrent) for either form; the result equals the chunked form's up to fp32
/// rounding, and a tensor-core chunked prefill is yet to come.
///
/// A CTA owns 32 state columns (value dims) of one value head and keeps them in registers for
/// the whole call: warp w, lane l holds S[32 w + i][32 b + l] for i < 32, so d_k / 32 warps
/// cover the rows. Per token the CTA forms q̂ and k̂ in shared memory (l2norm by a warp each),
/// decays its state, sums Sᵀk̂ and Sᵀq̂ over the warps through shared memory, and applies the
/// rank-1 update; the state is read once and written once per call.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "qflash/kernels/common/cuda.cuh"
#include "qflash/kernels/gated_delta/op.hpp"

namespace qflash::kernels::gated_delta_cuda {

inline constexpr int kCols = 32;       ///< state columns per CTA
inline constexpr int kRows = 32;       ///< state rows per warp
inline constexpr int kMaxWarps = 8;    ///< d_k up to 256

struct Params {
  GatedDeltaArgs a;
  std::int64_t qs, ks, vs;  ///< token strides
  int group;                ///< value heads per q/k head
  float q_scale;            ///< 1 / sqrt(d_k)
};

/// y = x * scale / sqrt(sum(x^2) + eps) for d values, by one warp, into shared memory.
__device__ __forceinline__ void l2norm_warp(float const* x, int d, float eps, float scale, float* y, int lane) {
  float ss = 0.0f;
  for (int i = lane; i < d; i += 32) ss = fmaf(x[i], x[i], ss);
  float const f = scale / sqrtf(cuda::warp_sum(ss) + eps);
  for (int i = lane; i < d; i += 32) y[i] = x[i] * f;
}

/// One CTA's columns (blockIdx.x) of value head blockIdx.y over every token of `a`: the body
/// of recurrent_kernel, and of kernels/gdn_decode's per-sequence step. Block: 32 * ceil(d_k / 32)
/// threads. Shared: q̂ [d_k], k̂ [d_k], the warps' partial sums [2][warps][kCols].
__device__ __forceinline__ void recurrent_columns(Params const& p, GatedDeltaArgs const& a) {
  extern __shared__ float smem[];
  int const dk = a.d_k, dv = a.d_v;
  int const warps = static_cast<int>(blockDim.x / 32);
  int const warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  int const h = static_cast<int>(blockIdx.y);
  int const kh = a.tiled_value_heads ? h % a.n_head_k : h / p.group;
  int const col = static_cast<int>(blockIdx.x) * kCols + lane;
  bool const has_col = col < dv;
  float* const q_hat = smem;
  float* const k_hat = q_hat + dk;
  float* const part_u = k_hat + dk;           // [warps][kCols]
  float* const part_o = part_u + warps * kCols;  // [warps][kCols]

  float* const state = a.state + static_cast<std::int64_t>(h) * dk * dv;
  float s[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    int const row = warp * kRows + i;
    s[i] = has_col && row < dk ? state[static_cast<std::int64_t>(row) * dv + col] : 0.0f;
  }

  for (std::int64_t t = 0; t < a.n_tokens; ++t) {
    if (warp == 0) l2norm_warp(a.q + t * p.qs + kh * dk, dk, a.l2norm_eps, p.q_scale, q_hat, lane);
    if (warp == (warps > 1 ? 1 : 0)) l2norm_warp(a.k + t * p.ks + kh * dk, dk, a.l2norm_eps, 1.0f, k_hat, lane);
    float const decay = expf(a.g[t * a.n_head_v + h]);
    float const beta = a.beta[t * a.n_head_v + h];
    __syncthreads();  // q̂ and k̂ are ready
    float u = 0.0f;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      int const row = warp * kRows + i;
      s[i] *= decay;
      if (row < dk) u = fmaf(s[i], k_hat[row], u);
    }
    part_u[warp * kCols + lane] = u;
    __syncthreads();
    float sum_u = 0.0f;
    for (int w = 0; w < warps; ++w) sum_u += part_u[w * kCols + lane];
    float const v = has_col ? a.v[t * p.vs + static_cast<std::int64_t>(h) * dv + col] : 0.0f;
    float const delta = beta * (v - sum_u);
    float o = 0.0f;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      int const row = warp * kRows + i;
      if (row < dk) {
        s[i] = fmaf(k_hat[row], delta, s[i]);
        o = fmaf(s[i], q_hat[row], o);
      }
    }
    part_o[warp * kCols + lane] = o;
    __syncthreads();
    if (warp == 0 && has_col) {
      float sum_o = 0.0f;
      for (int w = 0; w < warps; ++w) sum_o += part_o[w * kCols + lane];
      a.out[(t * a.n_head_v + h) * static_cast<std::int64_t>(dv) + col] = sum_o;
    }
    // The next token's q̂, k̂ and partial sums overwrite this token's only after every
    // warp has read them: the barrier before part_o's reads covers q̂/k̂/part_u, and part_o
    // is next written after two more barriers.
  }
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    int const row = warp * kRows + i;
    if (has_col && row < dk) state[static_cast<std::int64_t>(row) * dv + col] = s[i];
  }
}

/// Grid: x column blocks of kCols, y value heads.
template <class Arch>
__global__ void __launch_bounds__(32 * kMaxWarps) recurrent_kernel(Params const p) {
  recurrent_columns(p, p.a);
}

/// The body of `launch_gated_delta<S>(Arch, args, stream)` for a CUDA arch tag.
template <class Arch, MoeSpec S>
Status launch(GatedDeltaArgs const& a, stream_t stream) {
  if (Status s = can_implement_gated_delta<S>(a); s != Status::kSuccess) return s;
  int const warps = (a.d_k + kRows - 1) / kRows;
  if (warps > kMaxWarps) return Status::kErrorNotSupported;
  Params p{};
  p.a = a;
  p.qs = a.q_stride ? a.q_stride : std::int64_t{a.n_head_k} * a.d_k;
  p.ks = a.k_stride ? a.k_stride : std::int64_t{a.n_head_k} * a.d_k;
  p.vs = a.v_stride ? a.v_stride : std::int64_t{a.n_head_v} * a.d_v;
  p.group = a.n_head_v / a.n_head_k;
  p.q_scale = 1.0f / std::sqrt(static_cast<float>(a.d_k));
  std::size_t const smem = (2 * static_cast<std::size_t>(a.d_k) + 2 * static_cast<std::size_t>(warps) * kCols) * sizeof(float);
  dim3 const grid(static_cast<unsigned>((a.d_v + kCols - 1) / kCols), static_cast<unsigned>(a.n_head_v));
  recurrent_kernel<Arch><<<grid, 32 * warps, smem, stream>>>(p);
  return cuda::last_launch_status();
}

}  // namespace qflash::kernels::gated_delta_cuda
