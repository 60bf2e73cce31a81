/// @file
/// MoE routing on CUDA, shared by sm80.cuh and sm90a.cuh: one warp per token. With the
/// router's GEMV in the call and a decode step's tokens, one kernel does both: linear's CTAs
/// write the logits, and the last to finish routes (fused_kernel). Each lane holds its share
/// of the logits; softmax with warp max and sum; the experts are taken one per
/// round by a warp argmax (higher probability first, lower id on ties, as the CPU sorts);
/// lane j keeps slot j. The policy counts the slots used from the sorted probabilities
/// exactly as the CPU does, and renormalises over them.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "qflash/kernels/common/cuda.cuh"
#include "qflash/kernels/common/stream_workspace.cuh"
#include "qflash/kernels/gated_delta/common.hpp"
#include "qflash/kernels/linear/device.cuh"
#include "qflash/kernels/router_topk/op.hpp"

namespace qflash::kernels::router_topk_cuda {

inline constexpr int kThreads = 256;
inline constexpr std::int64_t kMaxBlocks = 1 << 16;
inline constexpr int kMaxSlots = 32;     ///< route slots per token (a lane each)
inline constexpr int kMaxExperts = 1024;  ///< 32 logits per lane

/// Experts each lane holds for n experts.
constexpr int per_lane(int n) { return n <= 32 ? 1 : n <= 64 ? 2 : n <= 128 ? 4 : n <= 256 ? 8 : n <= 512 ? 16 : 32; }

/// The routing of token t from its logits l, by the 32 lanes of a warp; `sorted` is the warp's
/// kMaxSlots floats of shared memory (the chosen probabilities, in order, for the policy).
/// kFresh: the logits were written by other CTAs of this launch, so they are read past L1.
template <int kPerLane, bool kFresh>
__device__ __forceinline__ void route_token(RouterTopkArgs const& a, float const* l, std::int64_t t, int lane,
                                            float* sorted) {
  int const n = a.n_expert, k = a.n_expert_used;
  auto const load = [&](int e) { return kFresh ? __ldcg(l + e) : l[e]; };
  float p[kPerLane];
  float mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    int const e = lane + 32 * j;
    p[j] = e < n ? load(e) : -INFINITY;
    mx = fmaxf(mx, p[j]);
  }
  mx = cuda::warp_max(mx);
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    // Differences below gdn::kExpFloor count as it, as the CPU's exponential takes them (a NaN
    // stays NaN): experts that far below the best tie, and ties go to the lower id on both.
    float const d = p[j] - mx;
    p[j] = lane + 32 * j < n ? expf(d < gdn::kExpFloor ? gdn::kExpFloor : d) : -1.0f;  // -1: never chosen
    sum += fmaxf(p[j], 0.0f);
  }
  float const inv = 1.0f / cuda::warp_sum(sum);
  // A NaN probability (from a NaN or an infinite logit) counts as 0, so that every slot still
  // gets an expert below n, as the CPU's do: such a token's weights mean nothing, but no
  // kernel reads past the experts.
#pragma unroll
  for (int j = 0; j < kPerLane; ++j)
    if (lane + 32 * j < n) p[j] = p[j] * inv >= 0.0f ? p[j] * inv : 0.0f;

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

  __syncwarp();  // the warp's last token has read `sorted`
  sorted[lane] = mine_w;
  __syncwarp();
  RoutingPolicy const policy = a.token_policies ? a.token_policies[t] : a.policy;
  int const used = policy.count(sorted, k);
  float top = 0.0f;
  for (int j = 0; j < used; ++j) top += sorted[j];
  float const scale = a.renormalize ? 1.0f / top : 1.0f;
  if (lane < k) {
    a.experts[t * k + lane] = lane < used ? mine_e : kNoExpert;
    a.weights[t * k + lane] = lane < used ? mine_w * scale : 0.0f;
  }
  if (a.shared_weights && lane == 0) a.shared_weights[t] = 1.0f / (1.0f + expf(-load(n)));
}

/// One warp per token.
template <class Arch, int kPerLane>
__global__ void __launch_bounds__(kThreads) router_kernel(RouterTopkArgs const a) {
  constexpr int kWarps = kThreads / 32;
  int const lane = static_cast<int>(threadIdx.x % 32);
  __shared__ float sorted[kWarps][kMaxSlots];
  for (std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; t < a.n_tokens;
       t += static_cast<std::int64_t>(gridDim.x) * kWarps)
    route_token<kPerLane, false>(a, a.logits + t * (a.logits_stride ? a.logits_stride : a.n_expert), t, lane,
                                 sorted[threadIdx.x / 32]);
}

/// Tokens a call may have for the GEMV and the routing to run as one kernel (a decode step's).
inline constexpr std::int64_t kFusedMaxTokens = 16;

struct FusedParams {
  linear_cuda::Params gemv;  ///< the router's GEMV: its logits
  RouterTopkArgs route;      ///< routing_of the call
  unsigned* done;            ///< the CTAs that finished their logits (a stream counter)
};

/// The router's GEMV and the routing in one kernel. Grid: x the GEMV's rows by
/// linear_cuda::kWarps * kRows (linear's CTAs), y 1. Each CTA writes its logits; the last to
/// finish routes every token, a warp per token, and sets the counter back to zero.
template <class Arch, WeightFormat kF, bool kAligned, int kPerLane>
__global__ void __launch_bounds__(linear_cuda::kThreads, 1) fused_kernel(__grid_constant__ FusedParams const p) {
  static_assert(linear_cuda::kThreads == kThreads);
  linear_cuda::linear_rows<kF, kAligned>(p.gemv, linear_cuda::Codes8{}, blockIdx.x);
  __threadfence();  // this CTA's logits, before its count
  __syncthreads();
  __shared__ unsigned ticket;
  if (threadIdx.x == 0) ticket = atomicAdd(p.done, 1u);
  __syncthreads();
  if (ticket != gridDim.x - 1) return;
  __threadfence();  // every CTA's logits, after their counts
  constexpr int kWarps = kThreads / 32;
  __shared__ float sorted[kWarps][kMaxSlots];
  int const lane = static_cast<int>(threadIdx.x % 32);
  RouterTopkArgs const& a = p.route;
  for (std::int64_t t = threadIdx.x / 32; t < a.n_tokens; t += kWarps)
    route_token<kPerLane, true>(a, a.logits + t * a.logits_stride, t, lane, sorted[threadIdx.x / 32]);
  if (threadIdx.x == 0) *p.done = 0;
}

/// Launches fused_kernel for `a` (gemv set, an element-format gate, kPerLane lanes' worth of
/// experts); false when it cannot (the caller launches the GEMV and the routing apart).
template <class Arch, MoeSpec S, int kPerLane>
bool launch_fused(RouterTopkArgs const& a, cudaStream_t stream) {
  if (a.n_tokens > kFusedMaxTokens || a.n_expert > 32 * kPerLane || block_values(a.gemv->gate.format) != 1)
    return false;
  unsigned* const done = cuda::stream_counters(stream);
  if (!done) return false;
  FusedParams const p{linear_cuda::params_of(gemv_of(a)), routing_of(a), done};
  auto const blocks = static_cast<unsigned>((a.gemv->gate.rows + linear_cuda::kWarps * linear_cuda::kRows - 1) /
                                            (linear_cuda::kWarps * linear_cuda::kRows));
  Status const s = linear_cuda::with_format<S>(a.gemv->gate.format, [&]<WeightFormat kF>() -> Status {
    if constexpr (block_values(kF) == 1) {
      if (linear_cuda::vector_path(p.gemv.w, p.gemv.x, p.gemv.xs))
        QFLASH_LAUNCH(blocks, kThreads, 0, stream, fused_kernel<Arch, kF, true, kPerLane>)(p);
      else
        QFLASH_LAUNCH(blocks, kThreads, 0, stream, fused_kernel<Arch, kF, false, kPerLane>)(p);
      return cuda::last_launch_status();
    } else {
      return Status::kErrorNotSupported;
    }
  });
  return s == Status::kSuccess;
}

/// The body of `launch_router_topk<S>(Arch, args, stream)` for a CUDA arch tag.
template <class Arch, MoeSpec S>
Status launch(RouterTopkArgs const& args, stream_t stream_arg) {
  if (Status s = can_implement_router_topk_shape<S>(args); s != Status::kSuccess) return s;
  if (args.n_expert > kMaxExperts || args.n_expert_used > kMaxSlots) return Status::kErrorNotSupported;
  if (args.gemv && !cuda::device_aligned(args.gemv->gate)) return Status::kErrorMisalignedOperand;
  if (args.n_tokens == 0) return Status::kSuccess;
  auto const stream = static_cast<cudaStream_t>(stream_arg);
  if (args.gemv) {
    // One kernel for a decode step (up to 256 experts unless the spec fixes more); else the
    // GEMV (which may take linear's tensor cores), then the routing.
    constexpr int kFusedPerLane = S.n_expert != kDynamic ? per_lane(S.n_expert) : per_lane(256);
    if (launch_fused<Arch, S, kFusedPerLane>(args, stream)) return Status::kSuccess;
    if (Status s = linear_cuda::launch<Arch, S>(gemv_of(args), stream); s != Status::kSuccess) return s;
  }
  RouterTopkArgs const a = routing_of(args);
  std::int64_t const blocks = std::min<std::int64_t>((a.n_tokens + kThreads / 32 - 1) / (kThreads / 32), kMaxBlocks);
  auto const grid = static_cast<unsigned>(blocks);
  if constexpr (S.n_expert != kDynamic) {
    QFLASH_LAUNCH(grid, kThreads, 0, stream, router_kernel<Arch, per_lane(S.n_expert)>)(a);
  } else {
    switch (per_lane(a.n_expert)) {
      case 1: QFLASH_LAUNCH(grid, kThreads, 0, stream, router_kernel<Arch, 1>)(a); break;
      case 2: QFLASH_LAUNCH(grid, kThreads, 0, stream, router_kernel<Arch, 2>)(a); break;
      case 4: QFLASH_LAUNCH(grid, kThreads, 0, stream, router_kernel<Arch, 4>)(a); break;
      case 8: QFLASH_LAUNCH(grid, kThreads, 0, stream, router_kernel<Arch, 8>)(a); break;
      case 16: QFLASH_LAUNCH(grid, kThreads, 0, stream, router_kernel<Arch, 16>)(a); break;
      default: QFLASH_LAUNCH(grid, kThreads, 0, stream, router_kernel<Arch, 32>)(a); break;
    }
  }
  return cuda::last_launch_status();
}

}  // namespace qflash::kernels::router_topk_cuda
