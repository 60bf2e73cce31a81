/// @file
/// kernels/gdn_decode on CUDA, shared by sm80.cuh and sm90a.cuh: two launches for up to
/// kSeqsPerLaunch sequences (their rows and state pointers travel in the kernels' parameters,
/// so a captured CUDA graph holds them by value), where the separate ops take three launches
/// per sequence.
///  1. conv_kernel: one thread per (sequence, channel) sums the K taps in causal_conv1d's
///     order, applies SiLU and moves the conv state on by the token (it alone reads and
///     writes that channel's state).
///  2. recurrent_kernel: gated_delta's recurrent CTA (gated_delta_cuda::recurrent_columns) on
///     each sequence's row and state, the sequence in blockIdx.z.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "qflash/kernels/common/cuda.cuh"
#include "qflash/kernels/gated_delta/device.cuh"
#include "qflash/kernels/gdn_decode/op.hpp"

namespace qflash::kernels::gdn_decode_cuda {

inline constexpr int kSeqsPerLaunch = 64;  ///< keeps the parameters under 4 KiB
inline constexpr int kConvThreads = 256;

struct Params {
  GdnDecodeArgs a;  ///< its host arrays (rows, conv_state, state) are not read on the device
  std::int64_t rows[kSeqsPerLaunch];
  float* conv_state[kSeqsPerLaunch];
  float* state[kSeqsPerLaunch];
};

/// Grid: x channel blocks, y sequences.
template <class Arch, int kConv>
__global__ void __launch_bounds__(kConvThreads) conv_kernel(Params const p) {
  GdnDecodeArgs const& a = p.a;
  int const k = kConv != kDynamic ? kConv : a.d_conv;
  std::int64_t const cd = a.conv_dim();
  int const i = static_cast<int>(blockIdx.y);
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
__global__ void __launch_bounds__(32 * gated_delta_cuda::kMaxWarps) recurrent_kernel(Params const p) {
  GdnDecodeArgs const& a = p.a;
  int const i = static_cast<int>(blockIdx.z);
  GatedDeltaArgs const d = a.delta_args(p.rows[i], p.state[i]);
  gated_delta_cuda::Params g{};
  g.qs = g.ks = g.vs = d.q_stride;
  g.group = a.n_head_v / a.n_head_k;
  g.q_scale = 1.0f / sqrtf(static_cast<float>(a.d_k));
  gated_delta_cuda::recurrent_columns(g, d);
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
  for (int first = 0; first < a.n_seqs; first += kSeqsPerLaunch) {
    int const n = std::min(kSeqsPerLaunch, a.n_seqs - first);
    Params p{};
    p.a = a;
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
  return Status::kSuccess;
}

}  // namespace qflash::kernels::gdn_decode_cuda
