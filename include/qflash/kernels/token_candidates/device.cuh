/// @file
/// kernels/token_candidates on CUDA, shared by sm80.cuh and sm90a.cuh. Two kernels, each
/// sorting tiles of kTile (key, id) pairs with cub::BlockRadixSort:
/// - tile_kernel: a CTA per 4096 ids of a row (so one row spreads over the GPU): its values
///   (the excluded ids set to -inf in shared memory first), its k best, and its partial sums
///   relative to its max;
/// - merge_kernel: a CTA per kTile / k of those lists: their k best and their sums rescaled
///   to one max. Rounds repeat until one list is left per row; the last writes the op's output.
/// A float's key orders as the float does (-0 as +0); ids past the vocabulary get key 0,
/// below -inf. Radix sort is stable and every tile holds its ids in ascending order, lists in
/// the order of their ids, so equal values keep the lower id first, as the CPU ranks them.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "qflash/kernels/common/cub.cuh"
#include "qflash/kernels/common/cuda.cuh"
#include "qflash/kernels/common/stream_workspace.cuh"
#include "qflash/kernels/token_candidates/op.hpp"

namespace qflash::kernels::token_candidates_cuda {

inline constexpr int kThreads = 256;
inline constexpr int kItems = 16;
inline constexpr int kTile = kThreads * kItems;  ///< pairs a CTA sorts
inline constexpr unsigned kPadKey = 0;           ///< below every float's key
inline constexpr std::int64_t kMaxRows = 65535;  ///< grid.y

/// A run of a row's ids: its max and its sums relative to it.
struct Partial {
  float max;
  double norm;  ///< Σ e^(l - max)
  double mass;  ///< Σ e^((l - max) / T)
  long long non_finite;
};

struct Sums {
  double norm, mass;
  long long non_finite;
};
struct AddSums {
  __device__ Sums operator()(Sums const& x, Sums const& y) const {
    return {x.norm + y.norm, x.mass + y.mass, x.non_finite + y.non_finite};
  }
};

/// Lists of k candidates, one per run of ids, rows after rows.
struct Lists {
  std::int32_t* ids;
  float* values;
  Partial* partials;
};

struct Params {
  TokenCandidatesArgs a;
  std::int64_t ld;
  int n_in;      ///< lists per row read by a merge (tiles per row for tile_kernel)
  int per_cta;   ///< lists a merge CTA reads: kTile / k
  Lists in, out;
  bool last;     ///< a merge writing the op's output
};

__device__ __forceinline__ unsigned key_of(float v) {
  unsigned const b = __float_as_uint(v == 0.0f ? 0.0f : v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float value_of(unsigned key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

__device__ __forceinline__ float temperature_of(TokenCandidatesArgs const& a, std::int64_t r) {
  float const t = a.temperature ? a.temperature[r] : 1.0f;
  return t > 0.0f ? t : 1.0f;
}

using Sort = cub::BlockRadixSort<unsigned, kThreads, kItems, std::int32_t>;
using ReduceMax = cub::BlockReduce<float, kThreads>;
using ReduceSums = cub::BlockReduce<Sums, kThreads>;

union Shared {
  float values[kTile];
  typename Sort::TempStorage sort;
  typename ReduceMax::TempStorage max;
  typename ReduceSums::TempStorage sums;
};

/// The block's max of `v` (every thread's), to every thread.
__device__ __forceinline__ float block_max(Shared& sh, float v, float& broadcast) {
  float const m = ReduceMax(sh.max).Reduce(v, [](float x, float y) { return fmaxf(x, y); });
  if (threadIdx.x == 0) broadcast = m;
  __syncthreads();
  return broadcast;
}

/// Sorts the block's pairs best first, then writes the first k (ids past the vocabulary as
/// id -1, value -inf) and, from thread 0, `part` to list `list` of `out` (or the op's output).
__device__ __forceinline__ void sort_and_write(Params const& p, Shared& sh, unsigned (&keys)[kItems],
                                               std::int32_t (&ids)[kItems], std::int64_t list, std::int64_t row,
                                               Partial const& part) {
  __syncthreads();  // the shared values and reductions are done with
  Sort(sh.sort).SortDescending(keys, ids);
  int const k = p.a.k;
  std::int32_t* const out_ids = p.last ? p.a.ids + row * k : p.out.ids + list * k;
  float* const out_values = p.last ? p.a.values + row * k : p.out.values + list * k;
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    int const rank = static_cast<int>(threadIdx.x) * kItems + j;
    if (rank < k) {
      bool const pad = keys[j] == kPadKey;
      out_ids[rank] = pad ? -1 : ids[j];
      out_values[rank] = pad ? -INFINITY : value_of(keys[j]);
    }
  }
  if (threadIdx.x != 0) return;
  if (!p.last) {
    p.out.partials[list] = part;
    return;
  }
  bool const any = part.max != -INFINITY;
  p.a.stats[row] = CandidateStats{part.max, any ? part.max + static_cast<float>(log(part.norm)) : -INFINITY,
                                  any ? part.mass : 0.0, static_cast<std::int64_t>(part.non_finite)};
}

/// Grid: x tiles of a row, y rows.
template <class Arch>
__global__ void __launch_bounds__(kThreads) tile_kernel(Params const p) {
  __shared__ Shared sh;
  __shared__ float row_max;
  TokenCandidatesArgs const& a = p.a;
  std::int64_t const row = blockIdx.y;
  std::int32_t const base = static_cast<std::int32_t>(blockIdx.x) * kTile;
  float const* const l = a.logits + row * p.ld;
  long long non_finite = 0;
  for (int i = static_cast<int>(threadIdx.x); i < kTile; i += kThreads) {
    std::int32_t const id = base + i;
    float const v = id < a.vocab ? l[id] : -INFINITY;
    non_finite += id < a.vocab && !isfinite(v) ? 1 : 0;
    sh.values[i] = v;
  }
  if (a.n_excluded > 0) {
    __syncthreads();
    auto const first_at_least = [&](std::int32_t id) {
      int lo = 0, hi = a.n_excluded;
      while (lo < hi) {
        int const mid = (lo + hi) / 2;
        if (a.excluded[mid] < id) lo = mid + 1; else hi = mid;
      }
      return lo;
    };
    int const end = first_at_least(base + kTile);
    for (int j = first_at_least(base) + static_cast<int>(threadIdx.x); j < end; j += kThreads)
      sh.values[a.excluded[j] - base] = -INFINITY;
  }
  __syncthreads();
  unsigned keys[kItems];
  std::int32_t ids[kItems];
  float v[kItems];
  float mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    int const i = static_cast<int>(threadIdx.x) * kItems + j;
    v[j] = sh.values[i];
    bool const in = base + i < a.vocab;
    keys[j] = in ? key_of(v[j]) : kPadKey;
    ids[j] = base + i;
    if (in) mx = fmaxf(mx, v[j]);
  }
  __syncthreads();  // sh.values is read; the reductions reuse it
  mx = block_max(sh, mx, row_max);
  float const t = temperature_of(a, row);
  Sums s{0.0, 0.0, non_finite};
  if (mx != -INFINITY) {
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      if (base + static_cast<int>(threadIdx.x) * kItems + j >= a.vocab) continue;
      s.norm += exp(static_cast<double>(v[j] - mx));
      s.mass += static_cast<double>(expf((v[j] - mx) / t));
    }
  }
  Sums const total = ReduceSums(sh.sums).Reduce(s, AddSums{});
  std::int64_t const list = row * p.n_in + blockIdx.x;
  sort_and_write(p, sh, keys, ids, list, row, Partial{mx, total.norm, total.mass, total.non_finite});
}

/// Grid: x groups of per_cta lists of a row, y rows.
template <class Arch>
__global__ void __launch_bounds__(kThreads) merge_kernel(Params const p) {
  __shared__ Shared sh;
  __shared__ float row_max;
  std::int64_t const row = blockIdx.y;
  int const k = p.a.k;
  int const first = static_cast<int>(blockIdx.x) * p.per_cta;
  int const n = min(p.per_cta, p.n_in - first);  // lists this CTA merges
  std::int64_t const in0 = row * p.n_in + first;
  unsigned keys[kItems];
  std::int32_t ids[kItems];
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    int const i = static_cast<int>(threadIdx.x) * kItems + j;
    int const list = i / k;
    keys[j] = kPadKey;
    ids[j] = -1;
    if (list < n) {
      std::int64_t const at = (in0 + list) * k + i % k;
      ids[j] = p.in.ids[at];
      if (ids[j] >= 0) keys[j] = key_of(p.in.values[at]);
    }
  }
  float mx = -INFINITY;
  for (int i = static_cast<int>(threadIdx.x); i < n; i += kThreads) mx = fmaxf(mx, p.in.partials[in0 + i].max);
  mx = block_max(sh, mx, row_max);
  double const inv_t = 1.0 / static_cast<double>(temperature_of(p.a, row));
  Sums s{0.0, 0.0, 0};
  for (int i = static_cast<int>(threadIdx.x); i < n; i += kThreads) {
    Partial const q = p.in.partials[in0 + i];
    s.non_finite += q.non_finite;
    if (q.max == -INFINITY) continue;
    double const shift = static_cast<double>(q.max) - static_cast<double>(mx);
    s.norm += q.norm * exp(shift);
    s.mass += q.mass * exp(shift * inv_t);
  }
  Sums const total = ReduceSums(sh.sums).Reduce(s, AddSums{});
  std::int64_t const list = row * ((p.n_in + p.per_cta - 1) / p.per_cta) + blockIdx.x;
  sort_and_write(p, sh, keys, ids, list, row, Partial{mx, total.norm, total.mass, total.non_finite});
}

/// Bytes of one set of lists for `rows` rows of `n` lists of k.
inline std::size_t lists_bytes(std::int64_t rows, std::int64_t n, int k) {
  auto const round = [](std::size_t b) { return (b + 255) / 256 * 256; };
  std::size_t const lists = static_cast<std::size_t>(rows * n);
  return round(lists * sizeof(Partial)) + 2 * round(lists * static_cast<std::size_t>(k) * 4);
}
inline Lists lists_at(void* base, std::int64_t rows, std::int64_t n, int k) {
  auto const round = [](std::size_t b) { return (b + 255) / 256 * 256; };
  std::size_t const lists = static_cast<std::size_t>(rows * n);
  auto* const bytes = static_cast<unsigned char*>(base);
  std::size_t const ids_at = round(lists * sizeof(Partial));
  std::size_t const values_at = ids_at + round(lists * static_cast<std::size_t>(k) * 4);
  return {reinterpret_cast<std::int32_t*>(bytes + ids_at), reinterpret_cast<float*>(bytes + values_at),
          reinterpret_cast<Partial*>(bytes)};
}

/// The body of `launch_token_candidates<S>(Arch, args, stream)` for a CUDA arch tag.
template <class Arch, MoeSpec S>
Status launch(TokenCandidatesArgs const& a, stream_t stream) {
  if (Status s = can_implement_token_candidates_shape<S>(a); s != Status::kSuccess) return s;
  if (a.rows == 0) return Status::kSuccess;
  if (a.rows > kMaxRows) return Status::kErrorNotSupported;
  Params p{};
  p.a = a;
  p.ld = a.ld ? a.ld : a.vocab;
  p.per_cta = kTile / a.k;
  int const tiles = (a.vocab + kTile - 1) / kTile;
  std::size_t const one = lists_bytes(a.rows, tiles, a.k);
  void* const ws = cuda::stream_workspace(stream, 2 * one);
  if (!ws) return Status::kErrorCuda;
  Lists bufs[2] = {lists_at(ws, a.rows, tiles, a.k), lists_at(static_cast<unsigned char*>(ws) + one, a.rows, tiles, a.k)};
  p.n_in = tiles;
  p.out = bufs[0];
  p.last = false;
  QFLASH_LAUNCH(dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(a.rows)), kThreads, 0, stream,
                tile_kernel<Arch>)(p);
  if (Status s = cuda::last_launch_status(); s != Status::kSuccess) return s;
  for (int round = 0;; ++round) {
    int const groups = (p.n_in + p.per_cta - 1) / p.per_cta;
    p.in = bufs[round % 2];
    p.out = bufs[(round + 1) % 2];
    p.last = groups == 1;
    QFLASH_LAUNCH(dim3(static_cast<unsigned>(groups), static_cast<unsigned>(a.rows)), kThreads, 0, stream,
                  merge_kernel<Arch>)(p);
    if (Status s = cuda::last_launch_status(); s != Status::kSuccess || p.last) return s;
    p.n_in = groups;
  }
}

}  // namespace qflash::kernels::token_candidates_cuda
