/// @file
/// MoE routing on CUDA, shared by sm80.cuh and sm90a.cuh: one warp per token. Each lane holds
/// its share of the logits; softmax with warp max and sum; the experts are taken one per
/// round by a warp argmax (higher probability first, lower id on ties, as the CPU sorts);
/// lane j keeps slot j. The policy counts the slots used from the sorted probabilities
/// exactly as the CPU does, and renormalises over them.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "qflash/kernels/common/cuda.cuh"
#include "qflash/kernels/router_topk/op.hpp"

namespace qflash::kernels::router_topk_cuda {

inline constexpr int kThreads = 256;
inline constexpr std::int64_t kMaxBlocks = 1 << 16;
inline constexpr int kMaxSlots = 32;     ///< route slots per token (a lane each)
inline constexpr int kMaxExperts = 1024;  ///< 32 logits per lane

/// Experts each lane holds for n experts.
constexpr int per_lane(int n) { return n <= 32 ? 1 : n <= 64 ? 2 : n <= 128 ? 4 : n <= 256 ? 8 : n <= 512 ? 16 : 32; }

template <class Arch, int kPerLane>
__global__ void __launch_bounds__(kThreads) router_kernel(RouterTopkArgs const a) {
  constexpr int kWarps = kThreads / 32;
  int const lane = static_cast<int>(threadIdx.x % 32);
  int const n = a.n_expert, k = a.n_expert_used;
  for (std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; t < a.n_tokens;
       t += static_cast<std::int64_t>(gridDim.x) * kWarps) {
    float const* l = a.logits + t * (a.logits_stride ? a.logits_stride : n);
    float p[kPerLane];
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      int const e = lane + 32 * j;
      p[j] = e < n ? l[e] : -INFINITY;
      mx = fmaxf(mx, p[j]);
    }
    mx = cuda::warp_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      p[j] = lane + 32 * j < n ? expf(p[j] - mx) : -1.0f;  // -1: never chosen
      sum += fmaxf(p[j], 0.0f);
    }
    float const inv = 1.0f / cuda::warp_sum(sum);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
      if (p[j] >= 0.0f) p[j] *= inv;

    float mine_w = 0.0f;  // slot `lane`'s probability and expert
    int mine_e = kNoExpert;
    for (int slot = 0; slot < k; ++slot) {
      float best = -1.0f;
      int best_e = INT_MAX;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j)
        if (p[j] > best) best = p[j], best_e = lane + 32 * j;  // ascending ids: ties keep the lower
#pragma unroll
      for (int m = 16; m > 0; m /= 2) {
        float const ob = __shfl_xor_sync(0xffffffffu, best, m);
        int const oe = __shfl_xor_sync(0xffffffffu, best_e, m);
        if (ob > best || (ob == best && oe < best_e)) best = ob, best_e = oe;
      }
      if (lane == slot) mine_w = best, mine_e = best_e;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j)
        if (lane + 32 * j == best_e) p[j] = -1.0f;  // taken
    }

    float sorted[kMaxSlots];
#pragma unroll
    for (int j = 0; j < kMaxSlots; ++j) sorted[j] = __shfl_sync(0xffffffffu, mine_w, j);
    RoutingPolicy const policy = a.token_policies ? a.token_policies[t] : a.policy;
    int const used = policy.count(sorted, k);
    float top = 0.0f;
    for (int j = 0; j < used; ++j) top += sorted[j];
    float const scale = a.renormalize ? 1.0f / top : 1.0f;
    if (lane < k) {
      a.experts[t * k + lane] = lane < used ? mine_e : kNoExpert;
      a.weights[t * k + lane] = lane < used ? mine_w * scale : 0.0f;
    }
    if (a.shared_weights && lane == 0) a.shared_weights[t] = 1.0f / (1.0f + expf(-l[n]));
  }
}

/// The body of `launch_router_topk<S>(Arch, args, stream)` for a CUDA arch tag.
template <class Arch, MoeSpec S>
Status launch(RouterTopkArgs const& a, stream_t stream) {
  if (Status s = can_implement_router_topk_shape<S>(a); s != Status::kSuccess) return s;
  if (a.n_expert > kMaxExperts || a.n_expert_used > kMaxSlots) return Status::kErrorNotSupported;
  if (a.n_tokens == 0) return Status::kSuccess;
  std::int64_t const blocks = std::min<std::int64_t>((a.n_tokens + kThreads / 32 - 1) / (kThreads / 32), kMaxBlocks);
  auto const grid = static_cast<unsigned>(blocks);
  if constexpr (S.n_expert != kDynamic) {
    router_kernel<Arch, per_lane(S.n_expert)><<<grid, kThreads, 0, stream>>>(a);
  } else {
    switch (per_lane(a.n_expert)) {
      case 1: router_kernel<Arch, 1><<<grid, kThreads, 0, stream>>>(a); break;
      case 2: router_kernel<Arch, 2><<<grid, kThreads, 0, stream>>>(a); break;
      case 4: router_kernel<Arch, 4><<<grid, kThreads, 0, stream>>>(a); break;
      case 8: router_kernel<Arch, 8><<<grid, kThreads, 0, stream>>>(a); break;
      case 16: router_kernel<Arch, 16><<<grid, kThreads, 0, stream>>>(a); break;
      default: router_kernel<Arch, 32><<<grid, kThreads, 0, stream>>>(a); break;
    }
  }
  return cuda::last_launch_status();
}

}  // namespace qflash::kernels::router_topk_cuda
