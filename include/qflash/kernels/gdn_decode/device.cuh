/// @file
/// kernels/gdn_decode on CUDA, shared by sm80.cuh and sm90a.cuh: two launches for up to
/// kSeqsPerLaunch sequences (their rows and state pointers travel in the kernels' parameters,
/// so a captured CUDA graph holds them by value), where the separate ops take three launches
/// per sequence.
///  1. conv_kernel: one thread per (sequence, channel) sums the K taps in causal_conv1d's
///     order, applies SiLU and moves the conv state on by the token (it alone reads and
///     writes that channel's state); raw gates become the gates there too (gdn_gates' gate(),
///     the first CTA of each sequence's channels).
///  2. recurrent_kernel: gated_delta's recurrent CTA (gated_delta_cuda::recurrent_columns) on
///     each sequence's row and state, the sequence in blockIdx.z. With the output norm, the
///     last of a value head's CTAs to finish (counted on a stream counter per sequence and
///     head, which it sets back to zero) norms the head's row (gated_rmsnorm_cuda::norm_row).
///     Without the counters (a graph capture before they were made) the norm is its own
///     launch per sequence.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "qflash/kernels/common/cuda.cuh"
#include "qflash/kernels/common/stream_workspace.cuh"
#include "qflash/kernels/gated_delta/device.cuh"
#include "qflash/kernels/gated_rmsnorm/device.cuh"
#include "qflash/kernels/gdn_gates/device.cuh"
#include "qflash/kernels/gdn_decode/op.hpp"

namespace qflash::kernels::gdn_decode_cuda {

inline constexpr int kSeqsPerLaunch = 64;  ///< keeps the parameters under 4 KiB
inline constexpr int kConvThreads = 256;

struct Params {
  GdnDecodeArgs a;  ///< its host arrays (rows, conv_state, state) are not read on the device
  std::int64_t rows[kSeqsPerLaunch];
  float* conv_state[kSeqsPerLaunch];
  float* state[kSeqsPerLaunch];
  unsigned* done;  ///< the norm's CTAs done [sequences][n_head_v] (stream counters); null: no norm here
};

/// Grid: x channel blocks, y sequences.
template <class Arch, int kConv>
__global__ void __launch_bounds__(kConvThreads) conv_kernel(Params const p) {
  GdnDecodeArgs const& a = p.a;
  int const k = kConv != kDynamic ? kConv : a.d_conv;
  std::int64_t const cd = a.conv_dim();
  int const i = static_cast<int>(blockIdx.y);
  if (a.dt_bias && blockIdx.x == 0) {
    GdnGatesArgs const gates = a.gates_args(p.rows[i]);
    for (int h = static_cast<int>(threadIdx.x); h < a.n_head_v; h += kConvThreads) gdn_gates_cuda::gate(gates, h, h);
  }
  std::int64_t const c = static_cast<std::int64_t>(blockIdx.x) * kConvThreads + threadIdx.x;
  if (c >= cd) return;
  float const x = a.x[p.rows[i] * cd + c];
  float* const st = k > 1 ? p.conv_state[i] + c * (k - 1) : nullptr;
  float const* const w = a.conv_weight + c * k;
  float acc = w[0] * (k > 1 ? st[0] : x);
  for (int j = 1; j < k; ++j) acc += w[j] * (j < k - 1 ? st[j] : x);
  a.conv_out[p.rows[i] * cd + c] = cuda::silu(acc);
  for (int j = 0; j + 1 < k - 1; ++j) st[j] = st[j + 1];
  if (k > 1) st[k - 2] = x;
}

/// Grid: x column blocks of gated_delta_cuda::kCols, y value heads, z sequences.
template <class Arch>
__global__ void __launch_bounds__(32 * gated_delta_cuda::kMaxWarps, 2) recurrent_kernel(Params const p) {
  GdnDecodeArgs const& a = p.a;
  int const i = static_cast<int>(blockIdx.z);
  GatedDeltaArgs const d = a.delta_args(p.rows[i], p.state[i]);
  gated_delta_cuda::Params g{};
  g.qs = g.ks = g.vs = d.q_stride;
  g.group = a.n_head_v / a.n_head_k;
  g.q_scale = 1.0f / sqrtf(static_cast<float>(a.d_k));
  gated_delta_cuda::recurrent_columns(g, d);
  if (!p.done) return;
  __threadfence();  // this CTA's columns, before its count
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0) {
    __threadfence();  // the CTA's columns, seen through the barrier, before the count
    unsigned* const done = p.done + i * a.n_head_v + blockIdx.y;
    last = atomicAdd(done, 1u) == gridDim.x - 1;
    if (last) *done = 0;
  }
  __syncthreads();
  if (!last || threadIdx.x >= 32) return;
  __threadfence();  // every CTA's columns, after their counts
  std::int64_t const at = (p.rows[i] * a.n_head_v + blockIdx.y) * std::int64_t{a.d_v};  // the head's row
  gated_rmsnorm_cuda::norm_row(a.out + at, a.z + at, a.norm_weight, a.out + at, a.d_v, a.norm_eps,
                               static_cast<int>(threadIdx.x));
}

/// The body of `launch_gdn_decode<S>(Arch, args, stream)` for a CUDA arch tag.
template <class Arch, MoeSpec S>
Status launch(GdnDecodeArgs const& a, stream_t stream) {
  using namespace gated_delta_cuda;
  if (Status s = can_implement_gdn_decode<S>(a); s != Status::kSuccess) return s;
  int const warps = (a.d_k + kRows - 1) / kRows;
  if (warps > kMaxWarps) return Status::kErrorNotSupported;
  std::int64_t const cd = a.conv_dim();
  std::size_t const smem =
      (2 * static_cast<std::size_t>(a.d_k) + 2 * static_cast<std::size_t>(warps) * kCols) * sizeof(float);
  // The norm counts each sequence's value heads' CTAs on stream counters: as many sequences a
  // launch as there are counters for.
  int per_launch = kSeqsPerLaunch;
  unsigned* const done = a.norm_weight && a.n_head_v <= cuda::kStreamCounters
                             ? cuda::stream_counters(static_cast<cudaStream_t>(stream))
                             : nullptr;
  if (done) per_launch = std::min(per_launch, cuda::kStreamCounters / a.n_head_v);
  for (int first = 0; first < a.n_seqs; first += per_launch) {
    int const n = std::min(per_launch, a.n_seqs - first);
    Params p{};
    p.a = a;
    p.done = done;
    for (int i = 0; i < n; ++i) {
      p.rows[i] = a.rows[first + i];
      p.conv_state[i] = a.d_conv > 1 ? a.conv_state[first + i] : nullptr;
      p.state[i] = a.state[first + i];
    }
    dim3 const conv_grid(static_cast<unsigned>((cd + kConvThreads - 1) / kConvThreads), static_cast<unsigned>(n));
    conv_kernel<Arch, S.d_conv><<<conv_grid, kConvThreads, 0, stream>>>(p);
    if (Status s = cuda::last_launch_status(); s != Status::kSuccess) return s;
    dim3 const grid(static_cast<unsigned>((a.d_v + kCols - 1) / kCols), static_cast<unsigned>(a.n_head_v),
                    static_cast<unsigned>(n));
    recurrent_kernel<Arch><<<grid, 32 * warps, smem, stream>>>(p);
    if (Status s = cuda::last_launch_status(); s != Status::kSuccess) return s;
  }
  if (a.norm_weight && !done)
    for (int i = 0; i < a.n_seqs; ++i)
      if (Status s = gated_rmsnorm_cuda::launch<Arch, S>(a.norm_args(a.rows[i]), stream); s != Status::kSuccess)
        return s;
  return Status::kSuccess;
}

}  // namespace qflash::kernels::gdn_decode_cuda
