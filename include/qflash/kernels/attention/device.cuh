/// @file
/// Attention over paged, compressed KV on CUDA: the warp-per-row kernel, the tile decode and
/// the key splits that the tensor-core path (mma.cuh) and attention_decode share; launch.cuh
/// chooses between the paths. The view's convention is kv_append/device.cuh's (base and block
/// table on the device, head layouts on the host, passed by value).
///
/// A CTA holds kWarps query rows of one KV head, one warp per row (a row is one token and one
/// query head of the head's group), so a decode step's 8 query heads share each decoded key.
/// It walks its keys in tiles: the CTA decodes a tile's K and V to fp32 in shared memory (each
/// head in its own format, kv_decode's arithmetic), then each warp scores the tile's keys
/// (lane-split dot products, xor-shuffle sums) and folds them into a running max, sum and
/// output held in registers (lane i owns dimensions i, i + 32, ...). Softmax is fp32 with
/// accurate expf.
///
/// Long contexts with few CTAs (decode: one row tile per KV head) are split over the keys
/// (flash-decoding): each split writes its rows' max, sum and unnormalised output to the
/// stream's workspace (common/stream_workspace.cuh), and a second kernel merges the splits.
/// Prefill of few rows reuses the same kernel (keys beyond a row's position are masked); of
/// many rows it takes the tensor-core path (mma.cuh), which shares the tile decode and splits.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "qflash/kernels/attention/op.hpp"
#include "qflash/kernels/common/cuda.cuh"
#include "qflash/kernels/common/stream_workspace.cuh"
#include "qflash/kernels/kv_append/device.cuh"

namespace qflash::kernels::attention_cuda {

using kv_cuda::DeviceKv;

inline constexpr int kWarps = 8;  ///< query rows per CTA
inline constexpr int kThreads = 32 * kWarps;
inline constexpr int kChunk = 8;  ///< values one thread decodes per step
inline constexpr int kMaxHeadDim = 512;
inline constexpr int kSplitKeys = 64;  ///< fewest keys per split of a long context
inline constexpr int kMaxSplits = 128;

/// Dimensions each lane owns for a head of d (<= kMaxHeadDim).
constexpr int per_lane(int d) { return d <= 32 ? 1 : d <= 64 ? 2 : d <= 128 ? 4 : d <= 256 ? 8 : 16; }

/// Keys per tile: two fp32 tiles of K and V stay within 32 KiB of shared memory.
constexpr int tile_keys(int per_lane) { return per_lane <= 8 ? 16 : 8; }

struct Params {
  float const* q;  // [n_tokens, n_head, d]
  float* out;      // [n_tokens, n_head, d]
  float const* gate;
  std::int64_t gate_token_stride;
  std::int64_t gate_head_stride;  ///< resolved (AttentionArgs::gate_head_stride_or_default)
  std::int64_t n_tokens;
  std::int64_t n_ctx;
  int n_head;
  int group;  ///< query heads per KV head
  int d;
  float scale;
  std::int64_t split_keys;  ///< keys per split, a multiple of the tile
  float* part_o;            ///< [n_split, n_tokens * n_head, d]; null: one split, out written directly
  float* part_ml;           ///< [n_split, n_tokens * n_head, 2]: max, sum
};

/// N bytes (N even) at p as little-endian 32-bit words, read with the widest accesses p's
/// alignment allows; the words stay in registers.
template <int N>
__device__ __forceinline__ void load_words(std::uint8_t const* p, std::uint32_t (&w)[(N + 3) / 4]) {
  static_assert(N % 2 == 0);
  auto const a = reinterpret_cast<std::uintptr_t>(p);
  if constexpr (N % 16 == 0) {
    if (a % 16 == 0) {
#pragma unroll
      for (int k = 0; k < N / 16; ++k) {
        uint4 const v = reinterpret_cast<uint4 const*>(p)[k];
        w[4 * k] = v.x, w[4 * k + 1] = v.y, w[4 * k + 2] = v.z, w[4 * k + 3] = v.w;
      }
      return;
    }
  }
  if constexpr (N % 8 == 0) {
    if (a % 8 == 0) {
#pragma unroll
      for (int k = 0; k < N / 8; ++k) {
        uint2 const v = reinterpret_cast<uint2 const*>(p)[k];
        w[2 * k] = v.x, w[2 * k + 1] = v.y;
      }
      return;
    }
  }
  if constexpr (N % 4 == 0) {
    if (a % 4 == 0) {
#pragma unroll
      for (int k = 0; k < N / 4; ++k) w[k] = reinterpret_cast<std::uint32_t const*>(p)[k];
      return;
    }
  }
#pragma unroll
  for (int k = 0; k < (N + 3) / 4; ++k) w[k] = 0;
  if (a % 2 == 0) {
#pragma unroll
    for (int k = 0; k < N / 2; ++k)
      w[k / 2] |= static_cast<std::uint32_t>(reinterpret_cast<std::uint16_t const*>(p)[k]) << (16 * (k % 2));
    return;
  }
#pragma unroll
  for (int k = 0; k < N; ++k) w[k / 4] |= static_cast<std::uint32_t>(p[k]) << (8 * (k % 4));
}

template <int N>
__device__ __forceinline__ std::uint32_t byte_of(std::uint32_t const (&w)[N], int k) {
  return (w[k / 4] >> (8 * (k % 4))) & 0xFFu;
}

/// Value i of a stored vector of d values, as kv_decode reads it.
__device__ __forceinline__ float decode_value(KvFormat f, std::uint8_t const* vec, int d, int i) {
  switch (f) {
    case KvFormat::kF32: return detail::get_f32(vec + 4 * i);
    case KvFormat::kBf16: return to_float(Bf16{detail::get_u16(vec + 2 * i)});
    case KvFormat::kFp8E4m3: return to_float(Fp8E4m3{vec[4 + i]}) * detail::get_f32(vec);
    case KvFormat::kInt8:
    case KvFormat::kInt6: break;
  }
  int const g = i / kKvGroup;
  int const j = i - g * kKvGroup;
  Int6Params const p{to_float(Fp16{detail::get_u16(vec + 4 * g)}), to_float(Fp16{detail::get_u16(vec + 4 * g + 2)})};
  std::uint8_t const* codes = vec + kv_group_codes_offset(f, d, g);
  return p.min + p.scale * static_cast<float>(f == KvFormat::kInt8 ? codes[j] : int6_get(codes, static_cast<std::size_t>(j)));
}

/// Values [i0, i0 + n) of a stored vector of d values (i0 a multiple of kChunk, inside one
/// int8/int6 group), decoded as kv_decode does, into dst.
__device__ __forceinline__ void decode_chunk(KvFormat f, std::uint8_t const* vec, int d, int i0, float* dst) {
  int const n = min(kChunk, d - i0);
  if (n < kChunk) {  // a head's last, short chunk
    for (int e = 0; e < n; ++e) dst[e] = decode_value(f, vec, d, i0 + e);
    return;
  }
  switch (f) {
    case KvFormat::kF32: {
      std::uint32_t w[kChunk];
      load_words<4 * kChunk>(vec + 4 * i0, w);
#pragma unroll
      for (int e = 0; e < kChunk; ++e) dst[e] = __uint_as_float(w[e]);
      return;
    }
    case KvFormat::kBf16: {
      std::uint32_t w[kChunk / 2];
      load_words<2 * kChunk>(vec + 2 * i0, w);
#pragma unroll
      for (int e = 0; e < kChunk; ++e) dst[e] = to_float(Bf16{static_cast<std::uint16_t>(w[e / 2] >> (16 * (e % 2)))});
      return;
    }
    case KvFormat::kFp8E4m3: {
      float const scale = detail::get_f32(vec);
      std::uint32_t w[kChunk / 4];
      load_words<kChunk>(vec + 4 + i0, w);
#pragma unroll
      for (int e = 0; e < kChunk; ++e) dst[e] = to_float(Fp8E4m3{static_cast<std::uint8_t>(byte_of(w, e))}) * scale;
      return;
    }
    case KvFormat::kInt8:
    case KvFormat::kInt6: {
      int const g = i0 / kKvGroup;
      int const in_group = i0 - g * kKvGroup;
      Int6Params const p{to_float(Fp16{detail::get_u16(vec + 4 * g)}), to_float(Fp16{detail::get_u16(vec + 4 * g + 2)})};
      std::uint8_t const* codes = vec + kv_group_codes_offset(f, d, g);
      if (f == KvFormat::kInt8) {
        std::uint32_t w[kChunk / 4];
        load_words<kChunk>(codes + in_group, w);
#pragma unroll
        for (int e = 0; e < kChunk; ++e) dst[e] = p.min + p.scale * static_cast<float>(byte_of(w, e));
      } else {  // 8 codes in 6 bytes, 6 bits each from bit 0
        std::uint32_t w[2];
        load_words<kChunk / kInt6PerGroup * kInt6GroupBytes>(codes + in_group / kInt6PerGroup * kInt6GroupBytes, w);
        std::uint64_t const bits = w[0] | static_cast<std::uint64_t>(w[1] & 0xFFFFu) << 32;
#pragma unroll
        for (int e = 0; e < kChunk; ++e) dst[e] = p.min + p.scale * static_cast<float>((bits >> (6 * e)) & 0x3Fu);
      }
      return;
    }
  }
}

/// The CTA (kBlockThreads) decodes keys [s0, s0 + n_keys) of KV head h of the sequence whose
/// block table is `table`: K to sk, V to sv, each [n_keys, ld] (dimensions [0, d) of each row).
/// Plain loads, never the read-only path (__ldg, __restrict__): attention_decode's CTA reads
/// here the key and value it stored.
template <KvScheme kScheme, int kBlockThreads = kThreads>
__device__ __forceinline__ void decode_tile(DeviceKv const& kv, std::int32_t const* table, int h, std::int64_t s0,
                                            int n_keys, int ld, float* sk, float* sv) {
  int const d = kv.d_head;
  int const chunks = (d + kChunk - 1) / kChunk;
  KvFormat const kf = kv::compiled_format(kScheme, kv.heads[h].k_format);
  KvFormat const vf = kv::compiled_format(kScheme, kv.heads[h].v_format);
  for (int u = static_cast<int>(threadIdx.x); u < 2 * n_keys * chunks; u += kBlockThreads) {
    bool const is_v = u >= n_keys * chunks;
    int const w = is_v ? u - n_keys * chunks : u;
    int const s = w / chunks;
    int const i0 = (w % chunks) * kChunk;
    if (is_v)
      decode_chunk(vf, kv.value(table, s0 + s, h), d, i0, sv + s * ld + i0);
    else
      decode_chunk(kf, kv.key(table, s0 + s, h), d, i0, sk + s * ld + i0);
  }
}

/// out[t, h] = o * inv, times sigmoid(gate) when there is a gate.
template <int kPerLane>
__device__ __forceinline__ void store_row(Params const& p, std::int64_t t, int h, float const (&o)[kPerLane],
                                          float inv, int lane) {
  float* out = p.out + (t * p.n_head + h) * p.d;
  float const* gate = p.gate ? p.gate + t * p.gate_token_stride + h * p.gate_head_stride : nullptr;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    int const i = lane + 32 * j;
    if (i < p.d) out[i] = gate ? o[j] * inv / (1.0f + expf(-gate[i])) : o[j] * inv;
  }
}

/// A row's running softmax over keys, lane i holding output dimensions i, i + 32, ...
template <int kPerLane>
struct RowState {
  float q[kPerLane], o[kPerLane];
  float mx = -INFINITY, sum = 0.0f;
};

/// The CTA walks keys [s_begin, s_end) of KV head kv_head (the sequence's block `table`) in
/// tiles decoded to shared memory; each active warp folds those at or before its row's
/// position `pos` into its RowState. Every thread of the CTA calls it with the same keys.
template <KvScheme kScheme, int kPerLane>
__device__ __forceinline__ void attend_keys(DeviceKv const& kv, std::int32_t const* table, int kv_head,
                                            std::int64_t s_begin, std::int64_t s_end, std::int64_t pos, bool active,
                                            float scale, float* smem, RowState<kPerLane>& st) {
  constexpr int kTile = tile_keys(kPerLane);
  int const d = kv.d_head;
  float* const sk = smem;
  float* const sv = smem + kTile * d;
  int const lane = static_cast<int>(threadIdx.x % 32);
  for (std::int64_t s0 = s_begin; s0 < s_end; s0 += kTile) {
    int const n_keys = static_cast<int>(std::min<std::int64_t>(kTile, s_end - s0));
    __syncthreads();  // the previous tile's readers are done
    decode_tile<kScheme>(kv, table, kv_head, s0, n_keys, d, sk, sv);
    __syncthreads();
    if (!active) continue;
    float score[kTile];
    float tile_max = -INFINITY;
#pragma unroll
    for (int s = 0; s < kTile; ++s) {
      score[s] = -INFINITY;
      if (s < n_keys && s0 + s <= pos) {  // the same for every lane
        float part = 0.0f;
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) {
          int const i = lane + 32 * j;
          if (i < d) part = fmaf(st.q[j], sk[s * d + i], part);
        }
        score[s] = cuda::warp_sum(part) * scale;
        tile_max = fmaxf(tile_max, score[s]);
      }
    }
    if (tile_max == -INFINITY) continue;
    float const new_max = fmaxf(st.mx, tile_max);
    float const rescale = expf(st.mx - new_max);  // 0 on the first keys
    st.sum *= rescale;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) st.o[j] *= rescale;
#pragma unroll
    for (int s = 0; s < kTile; ++s) {
      if (score[s] == -INFINITY) continue;
      float const w = expf(score[s] - new_max);
      st.sum += w;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        int const i = lane + 32 * j;
        if (i < d) st.o[j] = fmaf(w, sv[s * d + i], st.o[j]);
      }
    }
    st.mx = new_max;
  }
}

/// Loads query row `qrow` into st (zeros for an inactive warp).
template <int kPerLane>
__device__ __forceinline__ void load_query(float const* qrow, int d, bool active, RowState<kPerLane>& st) {
  int const lane = static_cast<int>(threadIdx.x % 32);
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    int const i = lane + 32 * j;
    st.q[j] = active && i < d ? qrow[i] : 0.0f;
    st.o[j] = 0.0f;
  }
}

/// Writes a row's state: to out (token t, head h) when the keys are not split, else as split
/// z's partial result in row `part_row` of the workspace.
template <int kPerLane>
__device__ __forceinline__ void finish_row(Params const& p, std::int64_t t, int h, std::int64_t part_row,
                                           RowState<kPerLane> const& st) {
  int const lane = static_cast<int>(threadIdx.x % 32);
  if (!p.part_o) {
    store_row(p, t, h, st.o, 1.0f / st.sum, lane);
    return;
  }
  float* po = p.part_o + part_row * p.d;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j)
    if (lane + 32 * j < p.d) po[lane + 32 * j] = st.o[j];
  if (lane == 0) {
    p.part_ml[2 * part_row] = st.mx;
    p.part_ml[2 * part_row + 1] = st.sum;
  }
}

/// Grid: x row tiles of kWarps rows, y KV heads, z key splits.
template <class Arch, KvScheme kScheme, int kPerLane>
__global__ void __launch_bounds__(kThreads, 1) attention_kernel(DeviceKv const kv, Params const p) {
  QFLASH_DYNAMIC_SMEM(float, smem);
  int const kv_head = static_cast<int>(blockIdx.y);
  std::int64_t const rows = p.n_tokens * p.group;
  std::int64_t const r0 = static_cast<std::int64_t>(blockIdx.x) * kWarps;
  std::int64_t const r = r0 + threadIdx.x / 32;
  bool const active = r < rows;
  std::int64_t const t = active ? r / p.group : 0;
  int const h = kv_head * p.group + (active ? static_cast<int>(r % p.group) : 0);
  std::int64_t const first = p.n_ctx - p.n_tokens;  // the first new token's position
  std::int64_t const cta_keys = first + (std::min(r0 + kWarps, rows) - 1) / p.group + 1;
  std::int64_t const s_begin = static_cast<std::int64_t>(blockIdx.z) * p.split_keys;
  std::int64_t const s_end = std::min(cta_keys, s_begin + p.split_keys);

  RowState<kPerLane> st;
  load_query(p.q + (t * p.n_head + h) * p.d, p.d, active, st);
  attend_keys<kScheme>(kv, kv.block_table, kv_head, s_begin, s_end, first + t, active, p.scale, smem, st);
  if (!active) return;
  finish_row(p, t, h, static_cast<std::int64_t>(blockIdx.z) * p.n_tokens * p.n_head + t * p.n_head + h, st);
}

/// Merges the key splits' partial results of workspace row `row` (of `rows` per split) and
/// stores them as token t, head h. One warp.
template <int kPerLane>
__device__ __forceinline__ void combine_row(Params const& p, std::int64_t rows, std::int64_t row, int n_split,
                                            std::int64_t t, int h) {
  int const lane = static_cast<int>(threadIdx.x % 32);
  float mx = -INFINITY;
  for (int z = 0; z < n_split; ++z) mx = fmaxf(mx, p.part_ml[2 * (z * rows + row)]);
  float o[kPerLane] = {};
  float sum = 0.0f;
  for (int z = 0; z < n_split; ++z) {
    std::int64_t const zr = z * rows + row;
    float const w = expf(p.part_ml[2 * zr] - mx);  // 0 for a split that saw none of the row's keys
    if (w == 0.0f) continue;
    sum = fmaf(w, p.part_ml[2 * zr + 1], sum);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
      if (lane + 32 * j < p.d) o[j] = fmaf(w, p.part_o[zr * p.d + lane + 32 * j], o[j]);
  }
  store_row(p, t, h, o, 1.0f / sum, lane);
}

/// One warp per output row merges the key splits' partial results.
template <class Arch, int kPerLane>
__global__ void __launch_bounds__(kThreads) combine_kernel(Params const p, int n_split) {
  std::int64_t const rows = p.n_tokens * p.n_head;
  std::int64_t const row = (static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
  if (row >= rows) return;
  combine_row<kPerLane>(p, rows, row, n_split, row / p.n_head, static_cast<int>(row % p.n_head));
}

/// Streaming multiprocessors of the current device; 0 when they cannot be read (callers then
/// split nothing), the error taken off the runtime's last error so that no later launch's
/// status reports it.
inline int sm_count() {
  int device = 0, n_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    static_cast<void>(cudaGetLastError());
    return 0;
  }
  return n_sm;
}

/// Splits of the keys: enough CTAs to fill the device twice, each split kSplitKeys or more.
inline std::int64_t split_count(std::int64_t ctas, std::int64_t n_ctx) {
  if (n_ctx < 2 * kSplitKeys) return 1;
  int const n_sm = sm_count();
  if (n_sm == 0 || ctas >= 2 * n_sm) return 1;
  std::int64_t const want = (2 * n_sm + ctas - 1) / ctas;
  return std::clamp<std::int64_t>(std::min(want, n_ctx / kSplitKeys), 1, kMaxSplits);
}

/// Splits the keys of `n_ctx` positions `n_split` ways (p.split_keys a multiple of `tile` keys)
/// and, for more than one split, points p's partial results at the stream's workspace, `rows`
/// rows per split. Returns the split count after rounding, 0 when the workspace failed.
inline std::int64_t use_splits(Params& p, int tile, std::int64_t n_split, std::int64_t n_ctx, std::int64_t rows,
                               cudaStream_t stream) {
  p.split_keys = (n_ctx + n_split - 1) / n_split;
  p.split_keys = (p.split_keys + tile - 1) / tile * tile;
  n_split = (n_ctx + p.split_keys - 1) / p.split_keys;
  p.part_o = p.part_ml = nullptr;
  if (n_split > 1) {
    std::size_t const floats = static_cast<std::size_t>(n_split * rows) * static_cast<std::size_t>(p.d + 2);
    void* const workspace = cuda::stream_workspace(stream, floats * sizeof(float));
    if (!workspace) return 0;
    p.part_o = static_cast<float*>(workspace);
    p.part_ml = p.part_o + n_split * rows * p.d;
  }
  return n_split;
}

/// Merges the n_split partial results of each of p's rows into out (combine_kernel).
template <class Arch, int kPerLane>
Status combine(Params const& p, std::int64_t n_split, cudaStream_t stream) {
  std::int64_t const warps = p.n_tokens * p.n_head;
  auto const blocks = static_cast<unsigned>((warps + kWarps - 1) / kWarps);
  QFLASH_LAUNCH(blocks, kThreads, 0, stream, combine_kernel<Arch, kPerLane>)(p, static_cast<int>(n_split));
  return cuda::last_launch_status();
}

/// Shared memory of attend_keys's two tiles.
template <int kPerLane>
std::size_t tile_smem(int d) {
  return 2 * static_cast<std::size_t>(tile_keys(kPerLane)) * static_cast<std::size_t>(d) * sizeof(float);
}

/// The kernels' parameters for a call, one split (use_splits changes that).
inline Params params_of(AttentionArgs const& a) {
  Params p{};
  p.q = a.q;
  p.out = a.out;
  p.gate = a.gate;
  p.gate_token_stride = a.gate_token_stride;
  p.gate_head_stride = a.gate_head_stride_or_default();
  p.n_tokens = a.n_tokens;
  p.n_ctx = a.n_ctx;
  p.n_head = a.n_head;
  p.group = a.n_head / a.n_head_kv;
  p.d = a.d_head;
  p.scale = a.scale;
  p.split_keys = a.n_ctx;
  return p;
}

/// The warp-per-row kernel (and the merge of its key splits) for heads of up to 32 kPerLane.
template <class Arch, KvScheme kScheme, int kPerLane>
Status launch_per_lane(DeviceKv const& kv, Params p, int n_head_kv, cudaStream_t stream) {
  std::int64_t const row_tiles = (p.n_tokens * p.group + kWarps - 1) / kWarps;
  std::int64_t const n_split = use_splits(p, tile_keys(kPerLane), split_count(row_tiles * n_head_kv, p.n_ctx), p.n_ctx,
                                          p.n_tokens * p.n_head, stream);
  if (n_split == 0) return Status::kErrorCuda;
  dim3 const grid(static_cast<unsigned>(row_tiles), static_cast<unsigned>(n_head_kv), static_cast<unsigned>(n_split));
  QFLASH_LAUNCH(grid, kThreads, tile_smem<kPerLane>(p.d), stream, attention_kernel<Arch, kScheme, kPerLane>)(kv, p);
  Status status = cuda::last_launch_status();
  if (n_split > 1 && status == Status::kSuccess) status = combine<Arch, kPerLane>(p, n_split, stream);
  return status;
}

}  // namespace qflash::kernels::attention_cuda
