/// @file
/// attention's tensor-core path on sm_80 and sm_90a (mma.sync with tf32 operands; the geometry
/// and its reasons: mma_tile.hpp). Taken for prefill: kMinRows rows or more (tokens times the
/// group) and heads up to kWidestHead. A CTA walks its keys in tiles that all its threads
/// decode to fp32 in shared memory (device.cuh's decode_tile), then each warp
/// 1. multiplies its 16 query rows by the tile's keys (3xTF32) into score accumulators,
/// 2. masks them (causal, and keys past the tile), folds them into its rows' running max and
///    sum (the 4 lanes of a row trade maxima with shuffles) and rescales its outputs,
/// 3. multiplies the weights, still in the accumulators, by the tile's values into its outputs.
/// Long contexts with few CTAs split the keys as the warp-per-row kernel does, into the same
/// workspace rows, merged by its combine kernel. A key past a row's position, inside a tile the
/// row reads, is weighed by 0 rather than skipped: an Inf or NaN value cached there (which the
/// warp-per-row kernel and the CPU skip) makes the row NaN.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "qflash/kernels/attention/device.cuh"
#include "qflash/kernels/attention/mma_tile.hpp"
#include "qflash/kernels/common/mma_tf32.cuh"

namespace qflash::kernels::attention_cuda::mma {

using tf32::mma_3x;
using tf32::split;

/// One warp's rows: output accumulators (n-tile nt holds dimensions [8 nt, 8 nt + 8)), and
/// for the lane's two rows (g and g + 8) the running max and the lane's part of the sum.
template <int kD>
struct WarpRows {
  float o[kD / 8][4] = {};
  float mx[2] = {-INFINITY, -INFINITY};
  float sum[2] = {0.0f, 0.0f};
};

/// A warp's scores (then weights) for a tile's keys: n-tile nt holds keys [8 nt, 8 nt + 8).
template <int kD>
using Scores = float[keys_per_tile(kD) / 8][4];

/// Scores of the warp's rows against the tile's keys.
template <int kD>
__device__ __forceinline__ void score_tile(float const* sq, float const* sk, int ld, int d8, int warp, int lane,
                                           bool k_exact, Scores<kD>& s) {
  constexpr int kKeyTiles = keys_per_tile(kD) / 8;
#pragma unroll
  for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
    for (int r = 0; r < 4; ++r) s[nt][r] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < kD / 8; ++ks) {
    if (ks >= d8) break;
    float q[4], q_big[4], q_small[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) q[r] = sq[q_offset(lane, r, warp, ks, ld)];
    split(q, q_big, q_small);
#pragma unroll
    for (int nt = 0; nt < kKeyTiles; ++nt) {
      float k[2], k_big[2], k_small[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) k[r] = sk[k_offset(lane, r, nt, ks, ld)];
      split(k, k_big, k_small);
      mma_3x(s[nt], q_big, q_small, k_big, k_small, k_exact);
    }
  }
}

/// Folds a tile's scores (scaled here; keys [s0, s0 + n_keys), each row's keys ending at its
/// position pos[0] / pos[1]) into the rows' running max and sum, rescales the outputs, and
/// leaves the weights in s.
template <int kD>
__device__ __forceinline__ void softmax_tile(Scores<kD>& s, std::int64_t s0, int n_keys,
                                             std::int64_t const (&pos)[2], float scale, int lane, WarpRows<kD>& w) {
  constexpr int kKeyTiles = keys_per_tile(kD) / 8;
  float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      int const key = 8 * nt + c_col(lane, r);
      bool const valid = key < n_keys && s0 + key <= pos[r / 2];
      s[nt][r] = valid ? s[nt][r] * scale : -INFINITY;
      tile_max[r / 2] = fmaxf(tile_max[r / 2], s[nt][r]);
    }
  float base[2], rescale[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    // The row's 4 lanes are lanes 4g .. 4g + 3.
    tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
    tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
    float const new_max = fmaxf(w.mx[h], tile_max[h]);
    base[h] = new_max == -INFINITY ? 0.0f : new_max;  // a row with no keys yet keeps zeros
    rescale[h] = expf(w.mx[h] - base[h]);             // 0 on the row's first keys
    w.mx[h] = new_max;
    w.sum[h] *= rescale[h];
  }
#pragma unroll
  for (int nt = 0; nt < kD / 8; ++nt)
#pragma unroll
    for (int r = 0; r < 4; ++r) w.o[nt][r] *= rescale[r / 2];
#pragma unroll
  for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      s[nt][r] = expf(s[nt][r] - base[r / 2]);  // 0 for a masked key
      w.sum[r / 2] += s[nt][r];
    }
}

/// Outputs += the weights (score accumulators, read as A fragments) times the tile's values.
template <int kD>
__device__ __forceinline__ void weigh_values(Scores<kD> const& s, float const* sv, int ld, int d8,
                                             int lane, bool v_exact, WarpRows<kD>& w) {
#pragma unroll
  for (int kt = 0; kt < keys_per_tile(kD) / 8; ++kt) {
    float p[4], p_big[4], p_small[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) p[r] = s[kt][p_from_c(r)];
    split(p, p_big, p_small);
#pragma unroll
    for (int nt = 0; nt < kD / 8; ++nt) {
      if (nt >= d8) break;
      float v[2], v_big[2], v_small[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) v[r] = sv[v_offset(lane, r, kt, nt, ld)];
      split(v, v_big, v_small);
      mma_3x(w.o[nt], p_big, p_small, v_big, v_small, v_exact);
    }
  }
}

/// Writes the lane's rows: to out (token t, head h) when the keys are not split, else as the
/// split's partial result in the workspace (device.cuh's layout).
template <int kD>
__device__ __forceinline__ void finish_rows(Params const& p, std::int64_t r0, int lane, WarpRows<kD>& w) {
  std::int64_t const rows = p.n_tokens * p.group;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    w.sum[h] += __shfl_xor_sync(0xffffffffu, w.sum[h], 1);
    w.sum[h] += __shfl_xor_sync(0xffffffffu, w.sum[h], 2);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    std::int64_t const r = r0 + group_of(lane) + 8 * h;
    if (r >= rows) continue;
    std::int64_t const t = r / p.group;
    int const head = static_cast<int>(blockIdx.y) * p.group + static_cast<int>(r % p.group);
    std::int64_t const row = t * p.n_head + head;
    std::int64_t const part_row = static_cast<std::int64_t>(blockIdx.z) * p.n_tokens * p.n_head + row;
    float const inv = 1.0f / w.sum[h];
    float const* gate = p.gate ? p.gate + t * p.gate_token_stride + head * p.gate_head_stride : nullptr;
    float* const out = p.part_o ? p.part_o + part_row * p.d : p.out + row * p.d;
#pragma unroll
    for (int nt = 0; nt < kD / 8; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        int const i = 8 * nt + 2 * pair_of(lane) + j;
        if (i >= p.d) continue;
        float const o = w.o[nt][2 * h + j];
        if (p.part_o)
          out[i] = o;
        else
          out[i] = gate ? o * inv / (1.0f + expf(-gate[i])) : o * inv;
      }
    if (p.part_o && pair_of(lane) == 0) {
      p.part_ml[2 * part_row] = w.mx[h];
      p.part_ml[2 * part_row + 1] = w.sum[h];
    }
  }
}

/// Grid: x row tiles of kRows, y KV heads, z key splits. Dynamic shared memory:
/// smem_floats(kD, d) floats.
template <class Arch, KvScheme kScheme, int kD>
__global__ void __launch_bounds__(kThreads, 1) mma_kernel(DeviceKv const kv, Params const p) {
  constexpr int kKeys = keys_per_tile(kD);
  QFLASH_DYNAMIC_SMEM(float, smem);
  int const lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  int const d = p.d, d8 = (d + 7) / 8, ld = row_stride(d);
  float* const sq = smem;
  float* const sk = sq + kRows * ld;
  float* const sv = sk + kKeys * ld;
  int const kv_head = static_cast<int>(blockIdx.y);
  std::int64_t const rows = p.n_tokens * p.group;
  std::int64_t const r0 = static_cast<std::int64_t>(blockIdx.x) * kRows;
  std::int64_t const first = p.n_ctx - p.n_tokens;  // the first new token's position

  // The rows' queries (zeros past the rows and the head), and zeros in the tiles' padding.
  for (int e = static_cast<int>(threadIdx.x); e < kRows * ld; e += kThreads) {
    int const row = e / ld, i = e % ld;
    std::int64_t const r = r0 + row;
    float x = 0.0f;
    if (r < rows && i < d) {
      std::int64_t const t = r / p.group;
      int const h = kv_head * p.group + static_cast<int>(r % p.group);
      x = p.q[(t * p.n_head + h) * d + i];
    }
    sq[e] = x;
  }
  for (int e = static_cast<int>(threadIdx.x); e < 2 * kKeys * ld; e += kThreads) sk[e] = 0.0f;

  std::int64_t const warp_r0 = r0 + 16 * warp;
  bool const warp_active = warp_r0 < rows;
  std::int64_t const warp_last = warp_active ? first + (std::min(warp_r0 + 16, rows) - 1) / p.group : -1;
  std::int64_t pos[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) pos[h] = first + std::min(warp_r0 + group_of(lane) + 8 * h, rows - 1) / p.group;
  std::int64_t const cta_keys = first + (std::min(r0 + kRows, rows) - 1) / p.group + 1;
  std::int64_t const s_begin = static_cast<std::int64_t>(blockIdx.z) * p.split_keys;
  std::int64_t const s_end = std::min(cta_keys, s_begin + p.split_keys);
  KvFormat const kf = kv::compiled_format(kScheme, kv.heads[kv_head].k_format);
  KvFormat const vf = kv::compiled_format(kScheme, kv.heads[kv_head].v_format);
  bool const k_exact = kf == KvFormat::kBf16, v_exact = vf == KvFormat::kBf16;

  WarpRows<kD> w;
  for (std::int64_t s0 = s_begin; s0 < s_end; s0 += kKeys) {
    int const n_keys = static_cast<int>(std::min<std::int64_t>(kKeys, s_end - s0));
    __syncthreads();  // the previous tile's readers are done (the first time: the zeros are written)
    decode_tile<kScheme, kThreads>(kv, kv.block_table, kv_head, s0, n_keys, ld, sk, sv);
    for (int e = static_cast<int>(threadIdx.x); e < (kKeys - n_keys) * ld; e += kThreads)
      sv[n_keys * ld + e] = 0.0f;  // a weight of 0 times a stale value must stay 0
    __syncthreads();
    if (!warp_active || s0 > warp_last) continue;
    Scores<kD> s;
    score_tile<kD>(sq, sk, ld, d8, warp, lane, k_exact, s);
    softmax_tile<kD>(s, s0, n_keys, pos, p.scale, lane, w);
    weigh_values<kD>(s, sv, ld, d8, lane, v_exact, w);
  }
  if (warp_active) finish_rows<kD>(p, warp_r0, lane, w);
}

/// Whether attention `a` takes this path.
inline bool usable(AttentionArgs const& a) {
  return a.d_head <= kWidestHead && a.n_tokens * (a.n_head / a.n_head_kv) >= kMinRows;
}

/// Launches the path (usable(a) holds) for heads of up to kD.
template <class Arch, KvScheme kScheme, int kD>
Status launch(DeviceKv const& kv, Params p, int n_head_kv, cudaStream_t stream) {
  constexpr int kKeys = keys_per_tile(kD);
  std::int64_t const row_tiles = (p.n_tokens * p.group + kRows - 1) / kRows;
  std::int64_t const n_split = use_splits(p, kKeys, split_count(row_tiles * n_head_kv, p.n_ctx), p.n_ctx,
                                          p.n_tokens * p.n_head, stream);
  if (n_split == 0) return Status::kErrorCuda;
  auto const smem = static_cast<std::size_t>(smem_floats(kD, p.d)) * sizeof(float);
  auto const kernel = mma_kernel<Arch, kScheme, kD>;
  if (Status s = cuda::allow_dynamic_smem(kernel, static_cast<std::size_t>(smem_floats(kD, kD)) * sizeof(float));
      s != Status::kSuccess)
    return s;
  dim3 const grid(static_cast<unsigned>(row_tiles), static_cast<unsigned>(n_head_kv), static_cast<unsigned>(n_split));
  QFLASH_LAUNCH(grid, kThreads, smem, stream, kernel)(kv, p);
  Status status = cuda::last_launch_status();
  if (n_split > 1 && status == Status::kSuccess) status = combine<Arch, per_lane(kD)>(p, n_split, stream);
  return status;
}

}  // namespace qflash::kernels::attention_cuda::mma
