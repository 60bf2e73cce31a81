/// @file
/// kernels/attention_decode on CUDA, shared by sm80.cuh and sm90a.cuh: for up to
/// kSeqsPerLaunch sequences (their rows, lengths and block tables travel in the kernels'
/// parameters, so a captured CUDA graph holds them by value) one launch, two when the keys are
/// split (one more when a KV head has over kWarps query heads), where the separate ops take two
/// or three per sequence:
///  1. decode_kernel: attention/device.cuh's CTA (attend_keys) with the sequence in
///     blockIdx.x: a CTA holds up to kWarps query heads of one KV head of one sequence. The
///     CTA whose keys end at the new token first encodes its key and value into the cache
///     (kv_append/device.cuh's encode_warp, warps 0 and 1); attend_keys' first barrier makes
///     them visible to the CTA, and no other CTA reads that position. When a KV head's query
///     heads take several CTAs (more than kWarps), append_kernel does it in a launch before:
///     one warp per (sequence, KV head, K|V).
///  2. combine_kernel: merges the key splits (flash-decoding), as attention's does.
/// The splits are planned from all the sequences' keys and counted over the longest; a shorter
/// one's later splits see no keys and add nothing.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "qflash/kernels/attention/device.cuh"
#include "qflash/kernels/attention_decode/op.hpp"
#include "qflash/kernels/kv_append/device.cuh"

namespace qflash::kernels::attention_decode_cuda {

using attention_cuda::kThreads;
using attention_cuda::kWarps;
using kv_cuda::DeviceKv;

inline constexpr int kSeqsPerLaunch = 64;  ///< with DeviceKv, keeps the parameters under 4 KiB

struct Params {
  attention_cuda::Params p;  ///< q, out, gate and the shapes; its n_tokens and n_ctx are not read
  float const* k;
  float const* v;
  int n_seqs;
  bool append_in_decode;  ///< decode_kernel appends the new keys and values (else append_kernel)
  std::int64_t rows[kSeqsPerLaunch];
  std::int64_t n_ctx[kSeqsPerLaunch];
  std::int32_t const* tables[kSeqsPerLaunch];
};

/// Sequence i's new key (is_value false) or value of KV head h into its last position, by one warp.
template <KvScheme kScheme>
__device__ __forceinline__ void append_vector(DeviceKv const& kv, Params const& P, int i, int h, bool is_value,
                                              int lane) {
  int const d = kv.d_head;
  std::int64_t const pos = P.n_ctx[i] - 1;
  std::int64_t const row = (P.rows[i] * kv.n_head_kv + h) * d;
  if (!is_value)
    kv_cuda::encode_warp(kv::compiled_format(kScheme, kv.heads[h].k_format), P.k + row, d,
                         kv.key(P.tables[i], pos, h), lane);
  else
    kv_cuda::encode_warp(kv::compiled_format(kScheme, kv.heads[h].v_format), P.v + row, d,
                         kv.value(P.tables[i], pos, h), lane);
}

/// Warp w encodes sequence w / (2 n_head_kv)'s head (w / 2) % n_head_kv, K when w is even.
template <class Arch, KvScheme kScheme>
__global__ void __launch_bounds__(kv_cuda::kAppendThreads) append_kernel(DeviceKv const kv, Params const P) {
  std::int64_t const w = (static_cast<std::int64_t>(blockIdx.x) * kv_cuda::kAppendThreads + threadIdx.x) / 32;
  if (w >= std::int64_t{P.n_seqs} * kv.n_head_kv * 2) return;
  append_vector<kScheme>(kv, P, static_cast<int>(w / (2 * kv.n_head_kv)), static_cast<int>(w / 2 % kv.n_head_kv),
                         w % 2 == 1, static_cast<int>(threadIdx.x % 32));
}

/// Grid: x (sequence, row tile of the KV head's group), y KV heads, z key splits.
template <class Arch, KvScheme kScheme, int kPerLane>
__global__ void __launch_bounds__(kThreads, 1) decode_kernel(DeviceKv const kv, Params const P) {
  QFLASH_DYNAMIC_SMEM(float, smem);
  attention_cuda::Params const& p = P.p;
  int const row_tiles = (p.group + kWarps - 1) / kWarps;
  int const i = static_cast<int>(blockIdx.x) / row_tiles;
  int const r = static_cast<int>(blockIdx.x) % row_tiles * kWarps + static_cast<int>(threadIdx.x / 32);
  bool const active = r < p.group;
  int const kv_head = static_cast<int>(blockIdx.y);
  int const h = kv_head * p.group + (active ? r : 0);
  std::int64_t const t = P.rows[i];
  std::int64_t const n_ctx = P.n_ctx[i];
  std::int64_t const s_begin = static_cast<std::int64_t>(blockIdx.z) * p.split_keys;
  std::int64_t const s_end = std::min(n_ctx, s_begin + p.split_keys);

  if (P.append_in_decode && s_begin < n_ctx && s_end == n_ctx && threadIdx.x < 64)  // keys end at the new token
    append_vector<kScheme>(kv, P, i, kv_head, threadIdx.x >= 32, static_cast<int>(threadIdx.x % 32));
  attention_cuda::RowState<kPerLane> st;
  attention_cuda::load_query(p.q + (t * p.n_head + h) * p.d, p.d, active, st);
  attention_cuda::attend_keys<kScheme>(kv, P.tables[i], kv_head, s_begin, s_end, n_ctx - 1, active, p.scale, smem,
                                       st);
  if (!active) return;
  attention_cuda::finish_row(p, t, h, static_cast<std::int64_t>(blockIdx.z) * P.n_seqs * p.n_head + i * p.n_head + h,
                             st);
}

/// One warp per (sequence, query head) merges the key splits' partial results.
template <class Arch, int kPerLane>
__global__ void __launch_bounds__(kThreads) combine_kernel(Params const P, int n_split) {
  attention_cuda::Params const& p = P.p;
  std::int64_t const rows = std::int64_t{P.n_seqs} * p.n_head;
  std::int64_t const row = (static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
  if (row >= rows) return;
  attention_cuda::combine_row<kPerLane>(p, rows, row, n_split, P.rows[row / p.n_head],
                                        static_cast<int>(row % p.n_head));
}

/// Key splits for sequences of different lengths: from the work of all (`cta_keys`, each
/// CTA's keys summed), enough splits that the CTAs with keys fill the device twice, each split
/// kSplitKeys keys or more, counted over the longest (`max_ctx`). A shorter sequence's later
/// splits hold no keys and end at once.
inline std::int64_t split_count(std::int64_t cta_keys, std::int64_t max_ctx) {
  using attention_cuda::kSplitKeys;
  if (max_ctx < 2 * kSplitKeys) return 1;
  std::int64_t const n_sm = attention_cuda::sm_count();
  if (n_sm == 0) return 1;
  std::int64_t const keys_per_cta = std::max<std::int64_t>(kSplitKeys, (cta_keys + 2 * n_sm - 1) / (2 * n_sm));
  return std::clamp<std::int64_t>((max_ctx + keys_per_cta - 1) / keys_per_cta, 1, attention_cuda::kMaxSplits);
}

template <class Arch, KvScheme kScheme, int kPerLane>
Status launch_per_lane(DeviceKv const& kv, Params& P, std::int64_t max_ctx, std::int64_t total_ctx,
                       cudaStream_t stream) {
  std::int64_t const row_tiles = (P.p.group + kWarps - 1) / kWarps;
  P.append_in_decode = row_tiles == 1;
  if (!P.append_in_decode) {
    std::int64_t const append_threads = std::int64_t{P.n_seqs} * kv.n_head_kv * 2 * 32;
    auto const append_blocks =
        static_cast<unsigned>((append_threads + kv_cuda::kAppendThreads - 1) / kv_cuda::kAppendThreads);
    QFLASH_LAUNCH(append_blocks, kv_cuda::kAppendThreads, 0, stream, append_kernel<Arch, kScheme>)(kv, P);
    if (Status s = cuda::last_launch_status(); s != Status::kSuccess) return s;
  }

  std::int64_t const ctas = P.n_seqs * row_tiles;
  std::int64_t const rows = std::int64_t{P.n_seqs} * P.p.n_head;
  std::int64_t const n_split =
      attention_cuda::use_splits(P.p, attention_cuda::tile_keys(kPerLane),
                                 split_count(total_ctx * row_tiles * kv.n_head_kv, max_ctx), max_ctx, rows, stream);
  if (n_split == 0) return Status::kErrorCuda;
  dim3 const grid(static_cast<unsigned>(ctas), static_cast<unsigned>(kv.n_head_kv), static_cast<unsigned>(n_split));
  QFLASH_LAUNCH(grid, kThreads, attention_cuda::tile_smem<kPerLane>(P.p.d), stream,
                decode_kernel<Arch, kScheme, kPerLane>)(kv, P);
  if (Status s = cuda::last_launch_status(); s != Status::kSuccess) return s;
  if (n_split > 1) {
    auto const blocks = static_cast<unsigned>((rows + kWarps - 1) / kWarps);
    QFLASH_LAUNCH(blocks, kThreads, 0, stream, combine_kernel<Arch, kPerLane>)(P, static_cast<int>(n_split));
    return cuda::last_launch_status();
  }
  return Status::kSuccess;
}

/// The body of `launch_attention_decode<S>(Arch, args, stream)` for a CUDA arch tag.
template <class Arch, MoeSpec S>
Status launch(AttentionDecodeArgs const& a, stream_t stream) {
  using attention_cuda::per_lane;
  if (Status s = can_implement_attention_decode<S>(a); s != Status::kSuccess) return s;
  if (a.n_seqs == 0) return Status::kSuccess;
  if (a.d_head > attention_cuda::kMaxHeadDim) return Status::kErrorNotSupported;
  DeviceKv kv{};
  if (Status s = kv_cuda::to_device(a.kv, kv); s != Status::kSuccess) return s;
  auto const cs = static_cast<cudaStream_t>(stream);
  for (int first = 0; first < a.n_seqs; first += kSeqsPerLaunch) {
    Params P{};
    AttentionArgs whole = a.attention_args(first);  // the shapes and gate strides, with
    whole.q = a.q, whole.out = a.out, whole.gate = a.gate;  // the whole arrays (rows are P.rows)
    P.p = attention_cuda::params_of(whole);
    P.k = a.k;
    P.v = a.v;
    P.n_seqs = std::min(kSeqsPerLaunch, a.n_seqs - first);
    std::int64_t max_ctx = 0, total_ctx = 0;
    for (int i = 0; i < P.n_seqs; ++i) {
      P.rows[i] = a.rows[first + i];
      P.n_ctx[i] = a.n_ctx[first + i];
      P.tables[i] = a.block_tables[first + i];
      max_ctx = std::max(max_ctx, P.n_ctx[i]);
      total_ctx += P.n_ctx[i];
    }
    Status s = Status::kSuccess;
    if constexpr (S.d_head != kDynamic) {
      s = launch_per_lane<Arch, S.kv, per_lane(S.d_head)>(kv, P, max_ctx, total_ctx, cs);
    } else {
      switch (per_lane(a.d_head)) {
        case 1: s = launch_per_lane<Arch, S.kv, 1>(kv, P, max_ctx, total_ctx, cs); break;
        case 2: s = launch_per_lane<Arch, S.kv, 2>(kv, P, max_ctx, total_ctx, cs); break;
        case 4: s = launch_per_lane<Arch, S.kv, 4>(kv, P, max_ctx, total_ctx, cs); break;
        case 8: s = launch_per_lane<Arch, S.kv, 8>(kv, P, max_ctx, total_ctx, cs); break;
        default: s = launch_per_lane<Arch, S.kv, 16>(kv, P, max_ctx, total_ctx, cs); break;
      }
    }
    if (s != Status::kSuccess) return s;
  }
  return Status::kSuccess;
}

}  // namespace qflash::kernels::attention_decode_cuda
