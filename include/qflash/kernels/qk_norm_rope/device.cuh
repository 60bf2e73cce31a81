/// @file
/// Query/key head norm fused with partial NeoX RoPE on CUDA, shared by sm80.cuh and
/// sm90a.cuh: one warp per (token, head). The sum of squares is fp32 over the lanes; each
/// lane then owns rotation pairs (j, j + r/2) and the dimensions past rotary_dim, so it writes
/// only what it read and y may be x. The inverse frequencies come from the host
/// (rope_inv_freq, as the CPU kernel's) in the kernel's parameters; angles are fp32 products
/// and their cosine and sine are taken in fp64, as on the CPU.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "qflash/kernels/common/cuda.cuh"
#include "qflash/kernels/qk_norm_rope/op.hpp"
#include "qflash/kernels/rope/op.hpp"

namespace qflash::kernels::qk_norm_rope_cuda {

inline constexpr int kThreads = 256;
inline constexpr std::int64_t kMaxBlocks = 1 << 16;
inline constexpr int kMaxPairs = 256;  ///< rotary_dim / 2 a launch takes

struct Params {
  QkNormRopeArgs a;
  std::int64_t head_stride;
  std::int64_t token_stride;
  float w_offset;
  float inv_freq[kMaxPairs];
};

template <class Arch>
__global__ void __launch_bounds__(kThreads) qk_norm_rope_kernel(Params const p) {
  constexpr int kWarps = kThreads / 32;
  int const lane = static_cast<int>(threadIdx.x % 32);
  int const d = p.a.d_head;
  int const half = p.a.rotary_dim / 2;
  std::int64_t const items = p.a.n_tokens * p.a.n_head;
  for (std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; item < items;
       item += static_cast<std::int64_t>(gridDim.x) * kWarps) {
    std::int64_t const t = item / p.a.n_head;
    int const h = static_cast<int>(item % p.a.n_head);
    float const* x = p.a.x + t * p.token_stride + h * p.head_stride;
    float* y = p.a.y + item * d;
    float ss = 0.0f;
    for (int i = lane; i < d; i += 32) ss = fmaf(x[i], x[i], ss);
    float const inv = 1.0f / sqrtf(cuda::warp_sum(ss) / static_cast<float>(d) + p.a.eps);
    auto normed = [&](int i) { return (x[i] * inv) * (p.a.weight[i] + p.w_offset); };
    float const pos = static_cast<float>(p.a.positions[t]);
    for (int j = lane; j < half; j += 32) {
      float const ang = pos * p.inv_freq[j];
      float const c = static_cast<float>(cos(static_cast<double>(ang)));
      float const s = static_cast<float>(sin(static_cast<double>(ang)));
      float const x0 = normed(j), x1 = normed(j + half);
      y[j] = x0 * c - x1 * s;
      y[j + half] = x1 * c + x0 * s;
    }
    for (int i = 2 * half + lane; i < d; i += 32) y[i] = normed(i);
  }
}

/// The body of `launch_qk_norm_rope<S>(Arch, args, stream)` for a CUDA arch tag.
template <class Arch, MoeSpec S>
Status launch(QkNormRopeArgs const& a, stream_t stream) {
  if (Status s = can_implement_qk_norm_rope<S>(a); s != Status::kSuccess) return s;
  if (a.rotary_dim / 2 > kMaxPairs) return Status::kErrorNotSupported;
  std::int64_t const items = a.n_tokens * a.n_head;
  if (items == 0) return Status::kSuccess;
  Params p{};
  p.a = a;
  p.head_stride = a.head_stride ? a.head_stride : a.d_head;
  p.token_stride = a.token_stride ? a.token_stride : a.n_head * p.head_stride;
  p.w_offset = a.weight_kind == NormWeight::kZeroCentered ? 1.0f : 0.0f;
  for (int j = 0; j < a.rotary_dim / 2; ++j) p.inv_freq[j] = rope_inv_freq(a.theta, j, a.rotary_dim);
  std::int64_t const blocks = std::min<std::int64_t>((items + kThreads / 32 - 1) / (kThreads / 32), kMaxBlocks);
  qk_norm_rope_kernel<Arch><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  return cuda::last_launch_status();
}

}  // namespace qflash::kernels::qk_norm_rope_cuda
