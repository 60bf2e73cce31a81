/// @file
/// Query/key head norm fused with partial NeoX RoPE on CUDA, shared by sm80.cuh and
/// sm90a.cuh: one warp per (token, head). The sum of squares is fp32 over the lanes; each
/// lane then owns rotation pairs (j, j + r/2) and the dimensions past rotary_dim, so it writes
/// only what it read and y may be x. The inverse frequencies come from the host
/// (rope_inv_freq, as the CPU kernel's) in the kernel's parameters; angles are fp32 products
/// and their cosine and sine are taken in fp64, as on the CPU. A call's second set of heads
/// (keys) takes the items after the first set's, in the same launch.
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

/// One set of heads, its strides resolved.
struct Heads {
  float const* x;
  std::int64_t token_stride, head_stride;
  float const* weight;
  float* y;
  int n_head;
};

struct Params {
  QkNormRopeArgs a;  ///< positions, n_tokens, d_head, rotary_dim, eps
  Heads sets[2];
  int n_sets;
  float w_offset;
  float inv_freq[kMaxPairs];
};

template <class Arch>
__global__ void __launch_bounds__(kThreads) qk_norm_rope_kernel(Params const p) {
  constexpr int kWarps = kThreads / 32;
  int const lane = static_cast<int>(threadIdx.x % 32);
  int const d = p.a.d_head;
  int const half = p.a.rotary_dim / 2;
  std::int64_t const items0 = p.a.n_tokens * p.sets[0].n_head;
  std::int64_t const items = items0 + (p.n_sets > 1 ? p.a.n_tokens * p.sets[1].n_head : 0);
  for (std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; item < items;
       item += static_cast<std::int64_t>(gridDim.x) * kWarps) {
    bool const second = item >= items0;
    Heads const& set = p.sets[second ? 1 : 0];
    std::int64_t const local = second ? item - items0 : item;  // (token, head) within the set
    std::int64_t const t = local / set.n_head;
    int const h = static_cast<int>(local % set.n_head);
    float const* x = set.x + t * set.token_stride + h * set.head_stride;
    float* y = set.y + local * d;
    float ss = 0.0f;
    for (int i = lane; i < d; i += 32) ss = fmaf(x[i], x[i], ss);
    float const inv = 1.0f / sqrtf(cuda::warp_sum(ss) / static_cast<float>(d) + p.a.eps);
    auto normed = [&](int i) { return (x[i] * inv) * (set.weight[i] + p.w_offset); };
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
  std::int64_t const items = a.n_tokens * (a.n_head + (a.keys.x ? a.keys.n_head : 0));
  if (items == 0) return Status::kSuccess;
  Params p{};
  p.a = a;
  auto heads = [](QkNormRopeArgs const& c) {
    return Heads{c.x, c.token_stride_or_default(), c.head_stride_or_default(), c.weight, c.y, c.n_head};
  };
  p.sets[0] = heads(a);
  p.n_sets = 1;
  if (a.keys.x) p.sets[p.n_sets++] = heads(a.keys_call());
  p.w_offset = a.weight_kind == NormWeight::kZeroCentered ? 1.0f : 0.0f;
  for (int j = 0; j < a.rotary_dim / 2; ++j) p.inv_freq[j] = rope_inv_freq(a.theta, j, a.rotary_dim);
  std::int64_t const blocks = std::min<std::int64_t>((items + kThreads / 32 - 1) / (kThreads / 32), kMaxBlocks);
  QFLASH_LAUNCH(static_cast<unsigned>(blocks), kThreads, 0, stream, qk_norm_rope_kernel<Arch>)(p);
  return cuda::last_launch_status();
}

}  // namespace qflash::kernels::qk_norm_rope_cuda
