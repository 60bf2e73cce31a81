/// @file
/// Routed experts on CUDA, shared by sm80.cuh and sm90a.cuh, in five steps on one stream:
///  1. group (one block): the route slots counted per expert and given rows grouped by
///     expert (the shared expert's rows first, one per token), cut into tiles of at most
///     linear_cuda::kTokens rows of one expert;
///  2. the tokens quantized once per rounding the gate and up formats ask for (kernels/linear);
///  3. gate and up with SwiGLU: a warp owns one d_ff row of a tile's expert and computes both
///     projections for the tile's rows with linear's lane_dot (lane_dot_codes for block
///     formats), so each weight row is read once per tile; when gate and up differ in format,
///     or fused_swiglu is false, gate runs in its own pass and up's pass applies SwiGLU to it
///     (a warp owning two rows there);
///  4. the SwiGLU outputs quantized for down's format; down per tile, two rows per warp;
///  5. combine: out[t] += w_j y[row of slot j] in slot order, then the shared expert's.
/// Steps 3 and 4 serve the shared expert in the same launches when it has the routed experts'
/// formats and shapes (its tiles, expert -1, lead the list); else it has its own, first.
/// With rows enough for them (prefill), tiles hold up to 16 rows and steps 2 to 4 run on
/// tensor cores (expert_mma_kernel), gate and up sharing each stage of a CTA: bf16 or fp8
/// weights on linear/mma.cuh's tiles (the tokens and then the SwiGLU outputs split into bf16
/// parts), block formats on linear/mma_blocks.cuh's (the inputs quantized to codes).
/// Each row's sums do not depend on which rows share its tile, so results are deterministic
/// though the rows within an expert come in the order atomics give them.
/// One token (a decode step) skips step 1: its rows follow its route slots (Tiles), and down
/// and combine run as one launch (down_combine_kernel), a warp per slot; so a step without
/// block formats is two launches. Not with LoRA, nor with a shared expert that needs its own.
/// Tokens with LoRA updates (token_lora) take the same passes with gate and up unfused, each
/// into its own rows; beside each projection, u = A x and then y += B u for the pair rows whose
/// token has an update (lora_a_kernel, lora_b_kernel); SwiGLU then runs on its own.
/// Routed experts, and their updates, are read as StackedViews (stacked.hpp): others are
/// kErrorNotSupported. Slots with an expert id out of range make no row, as kNoExpert's do
/// (the ids are on the device; the CPU refuses them, and the router never writes one).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "qflash/kernels/common/cub.cuh"
#include "qflash/kernels/common/cuda.cuh"
#include "qflash/kernels/common/stream_workspace.cuh"
#include "qflash/kernels/expert_ffn/op.hpp"
#include "qflash/kernels/expert_ffn/stacked.hpp"
#include "qflash/kernels/linear/device.cuh"

namespace qflash::kernels::expert_ffn_cuda {

using linear_cuda::kThreads;
using linear_cuda::kTokens;
using linear_cuda::kWarps;
using linear_cuda::Rounding;
inline constexpr int kGroupThreads = 1024;
inline constexpr unsigned kMaxTileBlocks = 65535;

/// Rows [row, row + n) of the pair rows, all of expert `expert`.
struct Tile {
  int expert;
  int row;
  int n;
};

/// row_expert's mark for a pair row no slot took.
inline constexpr int kNoRow = -2;

/// Rows per tile of the tensor-core passes (one m-tile of linear/mma.cuh).
inline constexpr int kMmaTileRows = linear_cuda::mma::Tile<1>::kBlockM;

/// Where a pass finds its tiles of at most tile_rows rows:
///  - a device list grouped by expert (`list`: group_kernel's, its length at *count);
///  - else, without `routes`: dense_rows rows of expert 0 from row 0 (the shared expert's own
///    launches);
///  - else one token's route slots as they come, with no grouping launch: the shared expert's
///    row first when shared_rows is 1 (expert -1), then row shared_rows + s for slot s, a tile
///    of one row (of none when the slot has no expert).
struct Tiles {
  Tile const* list;
  int const* count;
  int dense_rows;
  std::int32_t const* routes;
  int n_slots, n_expert, shared_rows;

  __device__ int total(int tile_rows) const {
    if (list) return *count;
    return routes ? shared_rows + n_slots : (dense_rows + tile_rows - 1) / tile_rows;
  }
  __device__ Tile at(int i, int tile_rows) const {
    if (list) return list[i];
    if (!routes) return {0, i * tile_rows, min(tile_rows, dense_rows - i * tile_rows)};
    if (i < shared_rows) return {-1, i, 1};
    std::int32_t const e = routes[i - shared_rows];
    return {e, i, e >= 0 && e < n_expert ? 1 : 0};
  }
};

/// Step 1. Rows [0, shared_rows) are the shared expert's (row t: token t); routed rows start
/// at shared_rows, grouped by expert in id order, in tiles of at most tile_rows.
/// slot_row[s]: slot s's row, or -1; row_expert (when given): each row's expert, -1 for the
/// shared expert's, kNoRow for rows no slot took. Each thread owns a run of experts;
/// block-wide prefix sums place their rows and tiles. With shared_tiles, the shared rows'
/// tiles (expert -1) come first in the list.
template <class Arch>
__global__ void __launch_bounds__(kGroupThreads)
    group_kernel(std::int32_t const* routes, int n_slots, int n_expert_used, int n_expert, int shared_rows,
                 bool shared_tiles, int tile_rows, Tile* tiles, int* tile_count, int* row_token, int* slot_row,
                 int* row_expert) {
  using Scan = cub::BlockScan<int, kGroupThreads>;
  __shared__ typename Scan::TempStorage scan;
  QFLASH_DYNAMIC_SMEM(int, cursor);  // [n_expert]: counts, then each expert's next row
  for (int e = threadIdx.x; e < n_expert; e += blockDim.x) cursor[e] = 0;
  if (row_expert)
    for (int r = threadIdx.x; r < shared_rows + n_slots; r += blockDim.x) row_expert[r] = r < shared_rows ? -1 : kNoRow;
  __syncthreads();
  for (int s = threadIdx.x; s < n_slots; s += blockDim.x)
    if (std::int32_t const e = routes[s]; e >= 0 && e < n_expert) atomicAdd(&cursor[e], 1);
  __syncthreads();
  int const per = (n_expert + kGroupThreads - 1) / kGroupThreads;
  int const e0 = min(static_cast<int>(threadIdx.x) * per, n_expert), e1 = min(e0 + per, n_expert);
  int my_rows = 0, my_tiles = 0;
  for (int e = e0; e < e1; ++e) my_rows += cursor[e], my_tiles += (cursor[e] + tile_rows - 1) / tile_rows;
  int row = 0, tile = 0, n_tiles = 0;
  Scan(scan).ExclusiveSum(my_rows, row);
  __syncthreads();  // the scan's storage is reused
  Scan(scan).ExclusiveSum(my_tiles, tile, n_tiles);
  row += shared_rows;
  if (shared_tiles) {  // the shared expert's rows first, as expert -1
    int const n_shared = (shared_rows + tile_rows - 1) / tile_rows;
    for (int i = threadIdx.x; i < n_shared; i += blockDim.x)
      tiles[i] = {-1, i * tile_rows, min(tile_rows, shared_rows - i * tile_rows)};
    tile += n_shared;
    n_tiles += n_shared;
  }
  for (int e = e0; e < e1; ++e) {
    int const count = cursor[e];
    for (int r = 0; r < count; r += tile_rows) tiles[tile++] = {e, row + r, min(tile_rows, count - r)};
    cursor[e] = row;
    row += count;
  }
  if (threadIdx.x == 0) *tile_count = n_tiles;
  __syncthreads();
  for (int t = threadIdx.x; t < shared_rows; t += blockDim.x) row_token[t] = t;
  for (int s = threadIdx.x; s < n_slots; s += blockDim.x) {
    std::int32_t const e = routes[s];
    int row = -1;
    if (e >= 0 && e < n_expert) {
      row = atomicAdd(&cursor[e], 1);
      row_token[row] = s / n_expert_used;
      if (row_expert) row_expert[row] = e;
    }
    slot_row[s] = row;
  }
}

enum class Pass {
  kGateUp,     ///< y = silu(gate x) * (up x)
  kGate,       ///< y = gate x
  kUpSwiglu,   ///< y = silu(y) * (up x)
  kDown,       ///< y = down x
};

struct ProjectParams {
  StackedView w;   ///< gate, up or down
  StackedView up;  ///< kGateUp: up
  /// The shared expert's w and up, for tiles of expert -1 (same format and shape as w, up).
  StackedView shared_w, shared_up;
  Tiles tiles;
  int const* row_token;  ///< x's row of each pair row; null: the pair row itself
  bool single_x;         ///< x is one row, read for every pair row (one token's gate and up)
  float const* x;        ///< [.., xs] the projection's input
  std::int64_t xs;
  linear_cuda::Codes8 codes;  ///< block formats: x as codes (rows as x's)
  float* y;  ///< [pair rows, ys]
  std::int64_t ys;
};

/// Output rows per warp: kGateUp's warp reads one row each of gate and up; the other passes'
/// warps read two rows of their projection.
__host__ __device__ constexpr int rows_per_warp(Pass pass) { return pass == Pass::kGateUp ? 1 : 2; }

/// Steps 3 and 4. Grid: x output rows by kWarps * rows_per_warp, y tiles (strided).
template <class Arch, WeightFormat kF, bool kAligned, Pass kPass>
__global__ void __launch_bounds__(kThreads, 1) project_kernel(ProjectParams const p) {
  constexpr int kOut = rows_per_warp(kPass);
  int const lane = static_cast<int>(threadIdx.x % 32);
  std::int64_t const rows = p.w.first.rows;
  std::int64_t const o0 = (static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32) * kOut;
  if (o0 >= rows) return;
  int const n_tiles = p.tiles.total(kTokens);
  for (int i = static_cast<int>(blockIdx.y); i < n_tiles; i += static_cast<int>(gridDim.y)) {
    Tile const tile = p.tiles.at(i, kTokens);
    if (tile.n == 0) continue;
    std::int64_t x_row[kTokens];
#pragma unroll
    for (int tt = 0; tt < kTokens; ++tt) {
      int const row = tile.row + (tt < tile.n ? tt : 0);
      x_row[tt] = p.single_x ? 0 : p.row_token ? p.row_token[row] : row;
    }
    bool const is_shared = tile.expert < 0;
    int const e = is_shared ? 0 : tile.expert;
    WeightView const w = (is_shared ? p.shared_w : p.w).at(e);
    linear_cuda::RowRef w_rows[2];
    if constexpr (kPass == Pass::kGateUp) {
      w_rows[0] = linear_cuda::row_ref<kF>(w, o0);
      w_rows[1] = linear_cuda::row_ref<kF>((is_shared ? p.shared_up : p.up).at(e), o0);
    } else {
      w_rows[0] = linear_cuda::row_ref<kF>(w, o0);
      w_rows[1] = linear_cuda::row_ref<kF>(w, min(o0 + 1, rows - 1));
    }
    float acc[2][kTokens] = {};
    if constexpr (linear_cuda::reads_codes(kF)) {
      linear_cuda::lane_dot_codes<kF>(w_rows, p.codes, x_row, tile.n, lane, acc);
    } else {
      float const* x[kTokens];
#pragma unroll
      for (int tt = 0; tt < kTokens; ++tt) x[tt] = p.x + x_row[tt] * p.xs;
      linear_cuda::lane_dot<kF, kAligned>(w_rows, w.cols, x, tile.n, lane, acc);
    }
    cuda::warp_sums(acc);  // every lane takes part
#pragma unroll
    for (int tt = 0; tt < kTokens; ++tt) {
      float const a0 = acc[0][tt], a1 = acc[1][tt];
      if (lane != 0 || tt >= tile.n) continue;
      float* y = p.y + static_cast<std::int64_t>(tile.row + tt) * p.ys + o0;
      if constexpr (kPass == Pass::kGateUp) {
        y[0] = cuda::silu(a0) * a1;
      } else {
#pragma unroll
        for (int r = 0; r < kOut; ++r) {
          if (o0 + r >= rows) break;
          float const a = r == 0 ? a0 : a1;
          y[r] = kPass == Pass::kUpSwiglu ? cuda::silu(y[r]) * a : a;
        }
      }
    }
  }
}

/// Steps 3 and 4 on tensor cores: gate and up together (kMats 2, y = silu(gate x) * (up x)),
/// or down (kMats 1, y = down x), for tiles of at most 16 rows of one expert. bf16 and fp8
/// weights on linear/mma.cuh's tiles, over the inputs split into bf16 parts (its
/// split_kernel); block formats on linear/mma_blocks.cuh's, over the inputs quantized to codes.
struct MmaParams {
  StackedView w[2];         ///< gate and up, or down: one format and shape
  StackedView shared_w[2];  ///< the shared expert's, for tiles of expert -1 (w's format and shape)
  Tiles tiles;              ///< a list or dense, never by slot
  int const* row_token;  ///< the inputs' row of each pair row; null: the pair row less act_row0
  std::int64_t act_row0;
  std::uint16_t const* parts;  ///< bf16, fp8: [mma::kParts][input rows][k] bf16
  std::int64_t part_stride;    ///< elements between parts
  linear_cuda::mma_blocks::Activations codes;  ///< block formats
  float* y;                    ///< [pair rows, ys]
  std::int64_t ys;
};

/// Grid: x output rows by mma::kBlockN, y tiles (strided).
template <class Arch, int kMats, WeightFormat kF>
__global__ void __launch_bounds__(linear_cuda::mma::kThreads, 1) expert_mma_kernel(MmaParams const p) {
  namespace mma = linear_cuda::mma;
  namespace mb = linear_cuda::mma_blocks;
  constexpr bool kCodes = linear_cuda::reads_codes(kF);
  constexpr int kWBytes = mma::weight_bytes(kF);
  constexpr int kStageBytes = kCodes ? mb::Tile<1>::kStageBytes : mma::Tile<1, kMats, kWBytes>::kStageBytes;
  __shared__ __align__(16) std::uint8_t smem[2][kStageBytes];
  int const lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  // Codes: whole groups, the activations' padded columns.
  std::int64_t const rows = p.w[0].first.rows, k = kCodes ? p.codes.k : p.w[0].first.cols;
  std::int64_t const n0 = static_cast<std::int64_t>(blockIdx.x) * mma::kBlockN;
  int const n_tiles = p.tiles.total(kMmaTileRows);
  for (int i = static_cast<int>(blockIdx.y); i < n_tiles; i += static_cast<int>(gridDim.y)) {
    Tile const tile = p.tiles.at(i, kMmaTileRows);
    bool const is_shared = tile.expert < 0;
    WeightView w[kMats];
#pragma unroll
    for (int j = 0; j < kMats; ++j) w[j] = (is_shared ? p.shared_w[j] : p.w[j]).at(is_shared ? 0 : tile.expert);
    auto const token_row = [&](int t) -> std::int64_t {
      if (t >= tile.n) return -1;
      int const row = tile.row + t;
      return p.row_token ? p.row_token[row] : row - p.act_row0;
    };
    float acc[kMats][1][mma::kNTiles][4];
    if constexpr (kCodes) {
      mb::multiply_groups<kF, 1, kMats>(
          mb::warp_rows(w, n0 + warp * 16), k,
          [&](std::int64_t kt, std::uint8_t* stage) { mb::load_stage<1>(p.codes, token_row, kt, stage); }, smem, acc);
    } else {
      std::uint8_t const* wb[kMats];
      float const* scales[kMats];
#pragma unroll
      for (int j = 0; j < kMats; ++j) {
        wb[j] = static_cast<std::uint8_t const*>(w[j].data);
        scales[j] = kWBytes == 1 ? w[j].scale_row(n0) : nullptr;
      }
      auto const scale = [&](int j, std::int64_t k0) {
        return (kMats == 1 || j == 0 ? scales[0] : scales[kMats - 1])[k0 / kFp8BlockSize];
      };
      mma::multiply_tiles<1, kMats, kWBytes>(
          k,
          [&](std::int64_t k0, std::uint8_t* stage) {
            mma::load_stage<1, kMats, kWBytes>(wb, rows, n0, p.parts, p.part_stride, token_row, k, k0, stage);
          },
          scale, smem, acc);
    }
#pragma unroll
    for (int nt = 0; nt < mma::kNTiles; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        int const t = mma::c_token(lane, r);
        std::int64_t const o = n0 + warp * 16 + nt * 8 + mma::c_row(lane, r);
        if (t >= tile.n || o >= rows) continue;
        float const v = kMats == 2 ? cuda::silu(acc[0][0][nt][r]) * acc[kMats - 1][0][nt][r] : acc[0][0][nt][r];
        p.y[static_cast<std::int64_t>(tile.row + t) * p.ys + o] = v;
      }
  }
}

/// Whether the tensor-core passes read format f: bf16, fp8 e4m3 and the block formats.
__host__ __device__ constexpr bool mma_reads(WeightFormat f) {
  return linear_cuda::mma::weight_bytes(f) > 0 || linear_cuda::reads_codes(f);
}

/// Launches expert_mma_kernel over at most max_tiles tiles, for the format of p.w.
template <class Arch, MoeSpec S, int kMats>
Status project_mma(MmaParams const& p, std::int64_t max_tiles, cudaStream_t stream) {
  namespace mma = linear_cuda::mma;
  dim3 const grid(static_cast<unsigned>((p.w[0].first.rows + mma::kBlockN - 1) / mma::kBlockN),
                  static_cast<unsigned>(std::clamp<std::int64_t>(max_tiles, 1, kMaxTileBlocks)));
  return linear_cuda::with_format<S>(p.w[0].first.format, [&]<WeightFormat kF>() {
    if constexpr (mma_reads(kF)) {
      QFLASH_LAUNCH(grid, mma::kThreads, 0, stream, expert_mma_kernel<Arch, kMats, kF>)(p);
      return cuda::last_launch_status();
    } else {
      return Status::kErrorNotSupported;
    }
  });
}

/// LoRA updates of one projection, for at most kLoraRuns runs of tokens that share an adapter:
/// the runs travel as kernel arguments, so the launches read no table in device memory (and
/// record into a CUDA graph as they are).
inline constexpr int kLoraRuns = 8;

struct LoraRun {
  int token0, token1;             ///< the tokens [token0, token1)
  StackedView a, b;               ///< the routed experts' A [rank, n_in] and B [n_out, rank]; no data: none
  WeightView shared_a, shared_b;  ///< the shared expert's; no data: none
};

struct LoraParams {
  LoraRun runs[kLoraRuns];
  int n_runs;
  int n_rows;             ///< pair rows
  int const* row_token;   ///< [n_rows]
  int const* row_expert;  ///< [n_rows] (group_kernel's)
  float const* x;         ///< the projection's input: row row_token[r] (by_token) or r, rows xs apart
  std::int64_t xs;
  bool by_token;
  float* u;  ///< [n_rows, rank]: A x
  int rank;  ///< the largest rank of the runs' updates
  float* y;  ///< [n_rows, ys], added to
  std::int64_t ys;
  std::int64_t n_out;  ///< y's columns the launch covers (each row's B covers its own)
};

/// Pair row r's update in p: A and B, or no data when its token has none for its expert.
__device__ __forceinline__ LowRank lora_of(LoraParams const& p, int r) {
  int const e = p.row_expert[r];
  if (e == kNoRow) return {};
  int const t = p.row_token[r];
#pragma unroll
  for (int i = 0; i < kLoraRuns; ++i) {  // unrolled: the runs stay in the parameter space
    LoraRun const& run = p.runs[i];
    if (i >= p.n_runs || t < run.token0 || t >= run.token1) continue;
    if (e < 0) return {run.shared_a, run.shared_b};
    if (!run.a.first.data) return {};
    return {run.a.at(e), run.b.at(e)};
  }
  return {};
}

/// u[r, j] = A_j . x_r: a warp per pair row and rank index.
template <class Arch>
__global__ void __launch_bounds__(kThreads) lora_a_kernel(LoraParams const p) {
  int const lane = static_cast<int>(threadIdx.x % 32);
  std::int64_t const n = static_cast<std::int64_t>(p.n_rows) * p.rank;
  for (std::int64_t w = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; w < n;
       w += static_cast<std::int64_t>(gridDim.x) * kWarps) {
    int const r = static_cast<int>(w / p.rank), j = static_cast<int>(w % p.rank);
    LowRank const d = lora_of(p, r);
    if (!d.a.data || j >= d.a.rows) continue;  // the whole warp
    float const* a = static_cast<float const*>(d.a.data) + j * d.a.cols;
    float const* x = p.x + (p.by_token ? p.row_token[r] : r) * p.xs;
    float s = 0;
    for (std::int64_t i = lane; i < d.a.cols; i += 32) s += a[i] * x[i];
    s = cuda::warp_sum(s);
    if (lane == 0) p.u[static_cast<std::int64_t>(r) * p.rank + j] = s;
  }
}

/// y[r, o] += B_o . u_r: a thread per output value.
template <class Arch>
__global__ void __launch_bounds__(kThreads) lora_b_kernel(LoraParams const p) {
  std::int64_t const n = p.n_rows * p.n_out;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * kThreads) {
    int const r = static_cast<int>(i / p.n_out);
    std::int64_t const o = i % p.n_out;
    LowRank const d = lora_of(p, r);
    if (!d.b.data || o >= d.b.rows) continue;
    float const* b = static_cast<float const*>(d.b.data) + o * d.b.cols;
    float const* u = p.u + static_cast<std::int64_t>(r) * p.rank;
    float s = 0;
    for (std::int64_t j = 0; j < d.b.cols; ++j) s += b[j] * u[j];
    p.y[r * p.ys + o] += s;
  }
}

/// g = silu(g) * u, elementwise: SwiGLU when gate and up ran apart.
template <class Arch>
__global__ void __launch_bounds__(kThreads) swiglu_kernel(float* g, float const* u, std::int64_t n) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * kThreads)
    g[i] = cuda::silu(g[i]) * u[i];
}

/// Blocks of kThreads for n work items, at most 65536.
inline unsigned blocks_for(std::int64_t n) {
  return static_cast<unsigned>(std::clamp<std::int64_t>((n + kThreads - 1) / kThreads, 1, 1 << 16));
}

/// Step 5: one thread per output value (added to out, or written when not accumulate).
template <class Arch>
__global__ void __launch_bounds__(kThreads)
    combine_kernel(float* out, bool accumulate, float const* y, std::int64_t d_model, std::int64_t n_tokens,
                   int const* slot_row, float const* route_weights, int n_expert_used, float const* shared_weights) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n_tokens * d_model;
       i += static_cast<std::int64_t>(gridDim.x) * kThreads) {
    std::int64_t const t = i / d_model, o = i % d_model;
    float v = accumulate ? out[i] : 0.0f;
    for (int j = 0; j < n_expert_used; ++j)
      if (int const row = slot_row[t * n_expert_used + j]; row >= 0)
        v += route_weights[t * n_expert_used + j] * y[row * d_model + o];
    if (shared_weights) v += shared_weights[t] * y[t * d_model + o];
    out[i] = v;
  }
}

/// Steps 4 and 5 in one launch for one token's rows by slot (Tiles): out += each route slot's
/// weight times its down projection, in slot order, then the shared expert's, summed as
/// combine_kernel sums them. A CTA owns rows_per_warp(kDown) output rows; its warp j reads slot
/// j's expert (warp n_slots the shared expert) and leaves its rows in shared memory, then a
/// thread per row adds them up. The shared expert has the routed experts' format and shape.
inline constexpr int kMaxCombineWarps = 16;

struct DownCombineParams {
  StackedView w;               ///< the routed experts' down
  StackedView shared_w;        ///< the shared expert's; no data: none
  std::int32_t const* routes;  ///< [n_slots]
  float const* route_weights;  ///< [n_slots]
  float const* shared_weight;  ///< [1]
  int n_slots, n_expert;
  float const* x;  ///< the SwiGLU outputs, a row per Tiles row (the shared expert's first)
  std::int64_t xs;
  linear_cuda::Codes8 codes;  ///< block formats: x as codes
  float* out;                 ///< [d_model], added to (accumulate) or written
  bool accumulate;
};

/// Grid: x output rows by rows_per_warp(kDown); n_slots + 1 warps (n_slots without a shared expert).
template <class Arch, WeightFormat kF, bool kAligned>
__global__ void __launch_bounds__(32 * kMaxCombineWarps) down_combine_kernel(DownCombineParams const p) {
  constexpr int kOut = rows_per_warp(Pass::kDown);
  __shared__ float part[kMaxCombineWarps][kOut];
  int const lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  int const shared_rows = p.shared_w.first.data ? 1 : 0;
  std::int64_t const rows = p.w.first.rows;
  std::int64_t const o0 = static_cast<std::int64_t>(blockIdx.x) * kOut;
  auto const used = [&](std::int32_t e) { return e >= 0 && e < p.n_expert; };
  bool const is_shared = warp == p.n_slots;
  std::int32_t const e = is_shared ? 0 : p.routes[warp];
  if (is_shared || used(e)) {  // the whole warp
    WeightView const w = is_shared ? p.shared_w.at(0) : p.w.at(e);
    std::int64_t const row = is_shared ? 0 : shared_rows + warp;
    linear_cuda::RowRef const w_rows[kOut] = {linear_cuda::row_ref<kF>(w, o0),
                                              linear_cuda::row_ref<kF>(w, min(o0 + 1, rows - 1))};
    float acc[kOut][kTokens] = {};
    if constexpr (linear_cuda::reads_codes(kF)) {
      std::int64_t x_row[kTokens];
#pragma unroll
      for (int tt = 0; tt < kTokens; ++tt) x_row[tt] = row;
      linear_cuda::lane_dot_codes<kF>(w_rows, p.codes, x_row, 1, lane, acc);
    } else {
      float const* x[kTokens];
#pragma unroll
      for (int tt = 0; tt < kTokens; ++tt) x[tt] = p.x + row * p.xs;
      linear_cuda::lane_dot<kF, kAligned>(w_rows, w.cols, x, 1, lane, acc);
    }
    float sum[kOut];
#pragma unroll
    for (int r = 0; r < kOut; ++r) sum[r] = acc[r][0];
    cuda::warp_sums(sum);
    if (lane == 0)
#pragma unroll
      for (int r = 0; r < kOut; ++r) part[warp][r] = sum[r];
  }
  __syncthreads();
  int const r = static_cast<int>(threadIdx.x);
  if (r >= kOut || o0 + r >= rows) return;
  float v = p.accumulate ? p.out[o0 + r] : 0.0f;
  for (int j = 0; j < p.n_slots; ++j)
    if (used(p.routes[j])) v += p.route_weights[j] * part[j][r];
  if (shared_rows) v += *p.shared_weight * part[p.n_slots][r];
  p.out[o0 + r] = v;
}

/// Pieces of the stream's workspace (common/stream_workspace.cuh), each 256-byte aligned:
/// offsets first, then pointers.
class Workspace {
 public:
  template <class T>
  std::size_t reserve(std::int64_t n) {
    std::size_t const at = size_;
    size_ += (static_cast<std::size_t>(n) * sizeof(T) + 255) / 256 * 256;
    return at;
  }
  Status allocate(cudaStream_t stream) {
    base_ = cuda::stream_workspace(stream, std::max<std::size_t>(size_, 1));
    return base_ ? Status::kSuccess : Status::kErrorCuda;
  }
  template <class T>
  T* at(std::size_t offset) const {
    return reinterpret_cast<T*>(static_cast<std::byte*>(base_) + offset);
  }

 private:
  std::size_t size_ = 0;
  void* base_ = nullptr;
};

/// Launches project_kernel over at most max_tiles tiles, for w's format.
template <class Arch, MoeSpec S>
Status project(Pass pass, ProjectParams const& p, std::int64_t max_tiles, cudaStream_t stream) {
  std::int64_t const rows_per_block = std::int64_t{kWarps} * rows_per_warp(pass);
  dim3 const grid(static_cast<unsigned>((p.w.first.rows + rows_per_block - 1) / rows_per_block),
                  static_cast<unsigned>(std::clamp<std::int64_t>(max_tiles, 1, kMaxTileBlocks)));
  auto vector_path = [&](StackedView const& w) {
    return linear_cuda::vector_path(w.first, p.x, p.xs) && w.data_stride % 16 == 0;
  };
  bool const vec = vector_path(p.w) && (pass != Pass::kGateUp || vector_path(p.up)) &&
                   (!p.shared_w.first.data || vector_path(p.shared_w)) &&
                   (pass != Pass::kGateUp || !p.shared_up.first.data || vector_path(p.shared_up));
  return linear_cuda::with_format<S>(p.w.first.format, [&]<WeightFormat kF>() {
    auto go = [&]<bool kVec>() {
      switch (pass) {
        case Pass::kGateUp:
          QFLASH_LAUNCH(grid, kThreads, 0, stream, project_kernel<Arch, kF, kVec, Pass::kGateUp>)(p);
          break;
        case Pass::kGate:
          QFLASH_LAUNCH(grid, kThreads, 0, stream, project_kernel<Arch, kF, kVec, Pass::kGate>)(p);
          break;
        case Pass::kUpSwiglu:
          QFLASH_LAUNCH(grid, kThreads, 0, stream, project_kernel<Arch, kF, kVec, Pass::kUpSwiglu>)(p);
          break;
        case Pass::kDown:
          QFLASH_LAUNCH(grid, kThreads, 0, stream, project_kernel<Arch, kF, kVec, Pass::kDown>)(p);
          break;
      }
      return cuda::last_launch_status();
    };
    if constexpr (block_values(kF) == 1)
      if (vec) return go.template operator()<true>();
    return go.template operator()<false>();
  });
}

/// Launches down_combine_kernel for p's format.
template <class Arch, MoeSpec S>
Status down_combine(DownCombineParams const& p, cudaStream_t stream) {
  constexpr int kOut = rows_per_warp(Pass::kDown);
  bool const has_shared = p.shared_w.first.data != nullptr;
  unsigned const blocks = static_cast<unsigned>((p.w.first.rows + kOut - 1) / kOut);
  unsigned const threads = 32u * static_cast<unsigned>(p.n_slots + (has_shared ? 1 : 0));
  auto vector_path = [&](StackedView const& w) {
    return linear_cuda::vector_path(w.first, p.x, p.xs) && w.data_stride % 16 == 0;
  };
  bool const vec = vector_path(p.w) && (!has_shared || vector_path(p.shared_w));
  return linear_cuda::with_format<S>(p.w.first.format, [&]<WeightFormat kF>() {
    if constexpr (block_values(kF) == 1)
      if (vec) {
        QFLASH_LAUNCH(blocks, threads, 0, stream, down_combine_kernel<Arch, kF, true>)(p);
        return cuda::last_launch_status();
      }
    QFLASH_LAUNCH(blocks, threads, 0, stream, down_combine_kernel<Arch, kF, false>)(p);
    return cuda::last_launch_status();
  });
}

/// The body of `launch_expert_ffn<S>(Arch, args, stream)` for a CUDA arch tag.
template <class Arch, MoeSpec S>
Status launch(ExpertFfnArgs const& a, stream_t stream_arg) {
  if (Status s = can_implement_expert_ffn<S>(a); s != Status::kSuccess) return s;
  if (a.n_tokens == 0) return Status::kSuccess;
  auto const stream = static_cast<cudaStream_t>(stream_arg);

  // The two sets of experts: routed (stacked) and the shared one (a set of one).
  struct Set {
    StackedView gate, up, down;
  };
  std::optional<StackedView> const gate = stack(a.experts, &ExpertWeights::gate),
                                   up = stack(a.experts, &ExpertWeights::up),
                                   down = stack(a.experts, &ExpertWeights::down);
  if (!gate || !up || !down) return Status::kErrorNotSupported;
  Set const routed{*gate, *up, *down};
  std::optional<Set> shared;
  if (a.shared) shared = Set{{a.shared->gate}, {a.shared->up}, {a.shared->down}};
  std::array<Set const*, 2> const sets{shared ? &*shared : nullptr, &routed};  // in row order
  auto const n_expert = static_cast<std::int64_t>(a.experts.size());
  for (Set const* set : sets) {
    if (!set) continue;
    for (StackedView const* w : {&set->gate, &set->up, &set->down}) {
      if (Status st = can_implement_weight<S>(w->first); st != Status::kSuccess) return st;
      // Every expert where the first is, when their stride keeps the alignment.
      if (!cuda::device_aligned(w->first) || (n_expert > 1 && !cuda::device_aligned(w->at(1))))
        return Status::kErrorMisalignedOperand;
    }
  }

  std::int64_t const n_slots = a.n_tokens * a.n_expert_used;
  std::int64_t const shared_rows = shared ? a.n_tokens : 0;
  std::int64_t const rows = shared_rows + n_slots;
  if (rows > INT32_MAX || n_expert * static_cast<std::int64_t>(sizeof(int)) > 48 * 1024)
    return Status::kErrorNotSupported;
  std::int64_t const d_model = routed.gate.first.cols;
  // LoRA: the batch's adapters, each projection's updates as views the kernels read (routed
  // experts' stacked: else refused here, before anything is queued), found once per adapter;
  // the runs of tokens that share one; the largest rank.
  enum class Proj { kGate, kUp, kDown };
  struct Adapter {
    ExpertLora const* lora;
    std::array<LoraRun, 3> updates;  ///< per Proj; tokens unset
  };
  struct AdapterRun {
    int token0, token1;
    std::size_t adapter;
  };
  std::vector<Adapter> adapters;
  std::vector<AdapterRun> adapter_runs;
  std::int64_t lora_rank = 0;
  for (std::int64_t t = 0; a.token_lora && t < a.n_tokens; ++t) {
    ExpertLora const* l = a.token_lora[t];
    if (!l) continue;
    if (!adapter_runs.empty() && adapters[adapter_runs.back().adapter].lora == l && adapter_runs.back().token1 == t) {
      ++adapter_runs.back().token1;
      continue;
    }
    auto known = std::find_if(adapters.begin(), adapters.end(), [&](Adapter const& x) { return x.lora == l; });
    if (known == adapters.end()) {
      Adapter ad{l, {}};
      std::array<std::pair<std::span<LowRank const>, LowRank const*>, 3> const lists{
          std::pair(l->gate, &l->shared_gate), std::pair(l->up, &l->shared_up), std::pair(l->down, &l->shared_down)};
      for (std::size_t k = 0; k < lists.size(); ++k) {
        auto const& [routed_updates, shared_update] = lists[k];
        LoraRun& u = ad.updates[k];
        if (!routed_updates.empty()) {
          std::optional<StackedView> const sa = stack(routed_updates, &LowRank::a), sb = stack(routed_updates, &LowRank::b);
          if (!sa || !sb) return Status::kErrorNotSupported;  // upload_lora stacks them
          u.a = *sa, u.b = *sb;
          lora_rank = std::max(lora_rank, sa->first.rows);
        }
        u.shared_a = shared_update->a, u.shared_b = shared_update->b;
        if (!shared_update->empty()) lora_rank = std::max(lora_rank, shared_update->rank());
      }
      adapters.push_back(ad);
      known = adapters.end() - 1;
    }
    adapter_runs.push_back({static_cast<int>(t), static_cast<int>(t) + 1, static_cast<std::size_t>(known - adapters.begin())});
  }
  bool const lora = !adapter_runs.empty();
  // Rows of SwiGLU outputs d_ff_max apart, a multiple of 4 floats: the block formats' lanes
  // read their rounded activations in aligned runs.
  std::int64_t const d_ff_max = (std::max(routed.gate.first.rows, shared ? shared->gate.first.rows : 0) + 3) / 4 * 4;
  // The passes of steps 3 and 4 run once for both sets when the shared expert has the routed
  // experts' formats and shapes (its tiles lead the list), else once per set.
  auto same = [](StackedView const& x, StackedView const& y) {
    return x.first.format == y.first.format && x.first.rows == y.first.rows && x.first.cols == y.first.cols;
  };
  bool const merged = shared && same(shared->gate, routed.gate) && same(shared->up, routed.up) &&
                      same(shared->down, routed.down);
  // Tensor cores when every matrix can be staged (bf16 or fp8 rows whole 16-byte copies, or a
  // block format; gate and up in one format) and the experts have rows for
  // their 16-row tiles: four a used expert on average.
  auto mma_ready = [](StackedView const& w) {
    namespace mma = linear_cuda::mma;
    return (mma::stageable(w.first) && w.data_stride % 16 == 0 && w.row0_stride % mma::kBlockN == 0) ||
           linear_cuda::mma_blocks::stageable(w.first);
  };
  bool const use_mma =
      a.fused_swiglu && a.n_tokens >= linear_cuda::mma::kMinTokens && n_slots >= 4 * std::min(n_expert, n_slots) &&
      std::all_of(sets.begin(), sets.end(), [&](Set const* set) {
        return !set || (set->gate.first.format == set->up.first.format && mma_ready(set->gate) &&
                        mma_ready(set->up) && mma_ready(set->down));
      });
  int const tile_rows = use_mma ? kMmaTileRows : kTokens;
  // One token (decode) takes its rows by slot (Tiles), with no grouping launch, and down and
  // combine in one launch, when one set of passes serves the shared expert too.
  bool const by_slot = a.n_tokens == 1 && !lora && !use_mma && (!shared || merged) &&
                       a.n_expert_used + (shared ? 1 : 0) <= kMaxCombineWarps;
  std::int64_t const max_tiles = (n_slots + tile_rows - 1) / tile_rows + std::min(n_expert, n_slots);
  std::int64_t const shared_tiles = (shared_rows + tile_rows - 1) / tile_rows;
  struct Group {
    Set const* set;
    Set const* shared;  ///< in the tile list as expert -1, or null
    bool listed;        ///< tiles from the list, else dense from row 0
    std::int64_t row0, rows, tiles;
  };
  std::array<Group, 2> groups{};
  int n_groups = 0;
  if (merged) {
    groups[n_groups++] = {&routed, &*shared, true, 0, rows, by_slot ? rows : max_tiles + shared_tiles};
  } else {
    if (shared) groups[n_groups++] = {&*shared, nullptr, false, 0, shared_rows, shared_tiles};
    groups[n_groups++] = {&routed, nullptr, true, shared_rows, n_slots, by_slot ? n_slots : max_tiles};
  }

  // Workspace: the grouping, the tokens rounded per rounding, SwiGLU outputs (and rounded),
  // the down projections of every row.
  Workspace ws;
  std::size_t const tiles_at = ws.reserve<Tile>(max_tiles + (merged ? shared_tiles : 0)), tile_count_at = ws.reserve<int>(1),
                    row_token_at = ws.reserve<int>(rows), slot_row_at = ws.reserve<int>(n_slots),
                    act_at = ws.reserve<float>(rows * d_ff_max), y_at = ws.reserve<float>(rows * d_model);
  // LoRA: up's outputs apart from gate's, each row's expert, A x.
  std::size_t const act_up_at = lora ? ws.reserve<float>(rows * d_ff_max) : 0,
                    row_expert_at = lora ? ws.reserve<int>(rows) : 0,
                    lora_u_at = lora ? ws.reserve<float>(rows * lora_rank) : 0;
  constexpr int kRoundings = 3;
  bool x_rounded[kRoundings] = {}, act_rounded[kRoundings] = {};  // the GEMV passes' codes
  for (Set const* set : sets)
    if (set && !use_mma) {
      x_rounded[static_cast<int>(linear_cuda::rounding(set->gate.first.format))] = true;
      x_rounded[static_cast<int>(linear_cuda::rounding(set->up.first.format))] = true;
      act_rounded[static_cast<int>(linear_cuda::rounding(set->down.first.format))] = true;
    }
  using linear_cuda::Codes8;
  using linear_cuda::padded_cols;
  std::size_t xr_at[kRoundings] = {}, act_r_at[kRoundings] = {};
  for (int r = 1; r < kRoundings; ++r) {
    if (x_rounded[r]) xr_at[r] = ws.reserve<std::byte>(Codes8::size(a.n_tokens, padded_cols(d_model)));
    if (act_rounded[r]) act_r_at[r] = ws.reserve<std::byte>(Codes8::size(rows, padded_cols(d_ff_max)));
  }
  // The tensor-core passes' inputs: split into bf16 parts, or quantized to codes.
  namespace mb = linear_cuda::mma_blocks;
  auto mma_input_bytes = [](std::int64_t n_rows, std::int64_t k) {
    return std::max(static_cast<std::size_t>(linear_cuda::mma::kParts * n_rows * k) * sizeof(std::uint16_t),
                    mb::Activations::size(n_rows, padded_cols(k)));
  };
  std::size_t const x_mma_at = use_mma ? ws.reserve<std::byte>(mma_input_bytes(a.n_tokens, d_model)) : 0,
                    act_mma_at = use_mma ? ws.reserve<std::byte>(mma_input_bytes(rows, d_ff_max)) : 0;
  if (Status st = ws.allocate(stream); st != Status::kSuccess) return st;
  auto* const tiles = ws.at<Tile>(tiles_at);
  auto* const tile_count = ws.at<int>(tile_count_at);
  auto* const row_token = ws.at<int>(row_token_at);
  auto* const slot_row = ws.at<int>(slot_row_at);
  auto* const act = ws.at<float>(act_at);
  auto* const y = ws.at<float>(y_at);
  float* const act_up = lora ? ws.at<float>(act_up_at) : nullptr;
  int* const row_expert = lora ? ws.at<int>(row_expert_at) : nullptr;
  // Rows of cols values as codes for rounding r, in the piece at[r].
  auto codes_in = [&](std::size_t const (&at)[kRoundings], Rounding r, std::int64_t n_rows, std::int64_t cols) {
    return Codes8::in(ws.at<std::byte>(at[static_cast<int>(r)]), n_rows, padded_cols(cols));
  };
  // p's input for format f: x (rows xs apart), and for block formats its codes at[rounding].
  auto input = [&](ProjectParams& p, std::size_t const (&at)[kRoundings], WeightFormat f, float const* x,
                   std::int64_t xs, std::int64_t n_rows, std::int64_t cols) {
    p.x = x, p.xs = xs;
    if (Rounding const r = linear_cuda::rounding(f); r != Rounding::kNone) p.codes = codes_in(at, r, n_rows, cols);
  };

  // A group's tiles: by slot, from the group_kernel's list, or dense.
  auto tiles_of = [&](Group const& g) {
    if (by_slot)
      return Tiles{nullptr, nullptr, 0, a.routes, static_cast<int>(n_slots), static_cast<int>(n_expert),
                   static_cast<int>(shared_rows)};
    return Tiles{g.listed ? tiles : nullptr, tile_count, static_cast<int>(g.rows), nullptr, 0, 0, 0};
  };

  // 5. Combine.
  auto combine = [&]() -> Status {
    QFLASH_LAUNCH(blocks_for(a.n_tokens * d_model), kThreads, 0, stream, combine_kernel<Arch>)(
        a.out, a.accumulate, y, d_model, a.n_tokens, slot_row, a.route_weights, a.n_expert_used,
        shared ? a.shared_weights : nullptr);
    return cuda::last_launch_status();
  };
  // LoRA: out (n_out columns, ys apart) += B (A x) of projection `which` for every pair row whose
  // token has an update; x's rows are the tokens' (by_token) or the pair rows'.
  auto add_lora = [&](Proj which, float const* x, std::int64_t xs, bool by_token, float* out, std::int64_t ys,
                      std::int64_t n_out) -> Status {
    for (std::size_t c0 = 0; c0 < adapter_runs.size(); c0 += kLoraRuns) {
      LoraParams p{};
      p.n_rows = static_cast<int>(rows);
      p.row_token = row_token, p.row_expert = row_expert;
      p.x = x, p.xs = xs, p.by_token = by_token;
      p.u = ws.at<float>(lora_u_at), p.rank = static_cast<int>(lora_rank);
      p.y = out, p.ys = ys, p.n_out = n_out;
      bool any = false;
      for (std::size_t i = c0; i < std::min(adapter_runs.size(), c0 + kLoraRuns); ++i) {
        LoraRun& run = p.runs[p.n_runs++];
        run = adapters[adapter_runs[i].adapter].updates[static_cast<std::size_t>(which)];
        run.token0 = adapter_runs[i].token0, run.token1 = adapter_runs[i].token1;
        any = any || run.a.first.data || run.shared_a.data;
      }
      if (!any) continue;
      QFLASH_LAUNCH(blocks_for(rows * lora_rank * 32), kThreads, 0, stream, lora_a_kernel<Arch>)(p);
      if (Status st = cuda::last_launch_status(); st != Status::kSuccess) return st;
      QFLASH_LAUNCH(blocks_for(rows * n_out), kThreads, 0, stream, lora_b_kernel<Arch>)(p);
      if (Status st = cuda::last_launch_status(); st != Status::kSuccess) return st;
    }
    return Status::kSuccess;
  };
  // LoRA: gate's and up's updates, then SwiGLU, once gate and up have run for every group.
  auto lora_swiglu = [&]() -> Status {
    if (Status st = add_lora(Proj::kGate, a.x, d_model, true, act, d_ff_max, d_ff_max); st != Status::kSuccess)
      return st;
    if (Status st = add_lora(Proj::kUp, a.x, d_model, true, act_up, d_ff_max, d_ff_max); st != Status::kSuccess)
      return st;
    QFLASH_LAUNCH(blocks_for(rows * d_ff_max), kThreads, 0, stream, swiglu_kernel<Arch>)(act, act_up, rows * d_ff_max);
    return cuda::last_launch_status();
  };
  // Steps 2 to 4 on tensor cores: per group the tokens prepared for gate and up's format, gate
  // and up with SwiGLU (with LoRA: each into its own rows, then the updates and SwiGLU for
  // every group); then per group the SwiGLU outputs prepared for down's format, down.
  auto run_mma = [&]() -> Status {
    // n_rows rows of k values (rows in_stride apart) into the piece at `at`, for format f.
    auto prepare = [&](WeightFormat f, float const* in, std::int64_t in_stride, std::int64_t n_rows, std::int64_t k,
                       std::size_t at, MmaParams& p) -> Status {
      if (linear_cuda::reads_codes(f)) {
        p.codes = mb::Activations::in(ws.at<std::byte>(at), n_rows, linear_cuda::padded_cols(k));
        return linear_cuda::quantize<Arch>(linear_cuda::rounding(f), in, in_stride, k, p.codes, stream);
      }
      p.parts = ws.at<std::uint16_t>(at), p.part_stride = n_rows * k;
      return linear_cuda::mma::split<Arch>(in, in_stride, n_rows, k, ws.at<std::uint16_t>(at), stream);
    };
    auto group_params = [&](Group const& g) {
      MmaParams p{};
      p.tiles = tiles_of(g);
      return p;
    };
    for (int gi = 0; gi < n_groups; ++gi) {
      Group const& g = groups[gi];
      MmaParams p = group_params(g);
      p.row_token = row_token;
      p.y = act, p.ys = d_ff_max;
      if (Status st = prepare(g.set->gate.first.format, a.x, d_model, a.n_tokens, d_model, x_mma_at, p);
          st != Status::kSuccess)
        return st;
      if (!lora) {
        p.w[0] = g.set->gate, p.w[1] = g.set->up;
        if (g.shared) p.shared_w[0] = g.shared->gate, p.shared_w[1] = g.shared->up;
        if (Status st = project_mma<Arch, S, 2>(p, g.tiles, stream); st != Status::kSuccess) return st;
        continue;
      }
      for (auto [w, out] : {std::pair(&Set::gate, act), std::pair(&Set::up, act_up)}) {
        p.w[0] = g.set->*w;
        if (g.shared) p.shared_w[0] = g.shared->*w;
        p.y = out;
        if (Status st = project_mma<Arch, S, 1>(p, g.tiles, stream); st != Status::kSuccess) return st;
      }
    }
    if (lora)
      if (Status st = lora_swiglu(); st != Status::kSuccess) return st;
    for (int gi = 0; gi < n_groups; ++gi) {
      Group const& g = groups[gi];
      MmaParams p = group_params(g);
      p.w[0] = g.set->down;
      if (g.shared) p.shared_w[0] = g.shared->down;
      p.act_row0 = g.row0;
      p.y = y, p.ys = d_model;
      if (Status st = prepare(g.set->down.first.format, act + g.row0 * d_ff_max, d_ff_max, g.rows,
                              g.set->gate.first.rows, act_mma_at, p);
          st != Status::kSuccess)
        return st;
      if (Status st = project_mma<Arch, S, 1>(p, g.tiles, stream); st != Status::kSuccess) return st;
    }
    return Status::kSuccess;
  };

  // Steps 2 to 4 on CUDA cores, in the same order as run_mma.
  auto run_gemv = [&]() -> Status {
    // 2. The tokens quantized.
    for (int r = 1; r < kRoundings; ++r)
      if (x_rounded[r])
        if (Status st = linear_cuda::quantize<Arch>(static_cast<Rounding>(r), a.x, d_model, d_model,
                                                     codes_in(xr_at, static_cast<Rounding>(r), a.n_tokens, d_model),
                                                     stream);
            st != Status::kSuccess)
          return st;
    auto group_params = [&](Group const& g) {
      ProjectParams p{};
      p.tiles = tiles_of(g);
      return p;
    };
    // 3. Gate and up, per group.
    for (int gi = 0; gi < n_groups; ++gi) {
      Group const& g = groups[gi];
      Set const* const set = g.set;
      ProjectParams p = group_params(g);
      p.row_token = row_token, p.single_x = by_slot;
      p.y = act;
      p.ys = d_ff_max;
      WeightFormat const gf = set->gate.first.format, uf = set->up.first.format;
      if (gf == uf && a.fused_swiglu && !lora) {
        p.w = set->gate, p.up = set->up;
        input(p, xr_at, gf, a.x, d_model, a.n_tokens, d_model);
        if (g.shared) p.shared_w = g.shared->gate, p.shared_up = g.shared->up;
        if (Status st = project<Arch, S>(Pass::kGateUp, p, g.tiles, stream); st != Status::kSuccess) return st;
        continue;
      }
      p.w = set->gate;
      input(p, xr_at, gf, a.x, d_model, a.n_tokens, d_model);
      if (g.shared) p.shared_w = g.shared->gate;
      if (Status st = project<Arch, S>(Pass::kGate, p, g.tiles, stream); st != Status::kSuccess) return st;
      p.w = set->up;
      input(p, xr_at, uf, a.x, d_model, a.n_tokens, d_model);
      if (g.shared) p.shared_w = g.shared->up;
      if (lora) p.y = act_up;  // SwiGLU after the updates
      if (Status st = project<Arch, S>(lora ? Pass::kGate : Pass::kUpSwiglu, p, g.tiles, stream);
          st != Status::kSuccess)
        return st;
    }
    if (lora)
      if (Status st = lora_swiglu(); st != Status::kSuccess) return st;
    // 4. Down, per group, over the SwiGLU outputs quantized for its format.
    for (int gi = 0; gi < n_groups; ++gi) {
      Group const& g = groups[gi];
      Set const* const set = g.set;
      std::int64_t const d_ff = set->gate.first.rows;
      WeightFormat const df = set->down.first.format;
      if (Rounding const r = linear_cuda::rounding(df); r != Rounding::kNone)
        if (Status st = linear_cuda::quantize<Arch>(r, act + g.row0 * d_ff_max, d_ff_max, d_ff,
                                                     codes_in(act_r_at, r, rows, d_ff).slice(g.row0, g.rows), stream);
            st != Status::kSuccess)
          return st;
      ProjectParams p = group_params(g);
      p.w = set->down;
      if (g.shared) p.shared_w = g.shared->down;
      input(p, act_r_at, df, act, d_ff_max, rows, d_ff);
      if (by_slot) {  // and combine
        DownCombineParams const dc{p.w, p.shared_w, a.routes, a.route_weights, a.shared_weights,
                                   static_cast<int>(n_slots), static_cast<int>(n_expert), p.x, p.xs, p.codes, a.out,
                                   a.accumulate};
        return down_combine<Arch, S>(dc, stream);
      }
      p.y = y, p.ys = d_model;
      if (Status st = project<Arch, S>(Pass::kDown, p, g.tiles, stream); st != Status::kSuccess) return st;
    }
    return Status::kSuccess;
  };

  // 1. Grouping (not by slot); 2 to 4; down's LoRA updates; 5. combine (by slot: with down).
  if (!by_slot) {
    QFLASH_LAUNCH(1, kGroupThreads, static_cast<std::size_t>(n_expert) * sizeof(int), stream, group_kernel<Arch>)(
        a.routes, static_cast<int>(n_slots), a.n_expert_used, static_cast<int>(n_expert),
        static_cast<int>(shared_rows), merged, tile_rows, tiles, tile_count, row_token, slot_row, row_expert);
    if (Status st = cuda::last_launch_status(); st != Status::kSuccess) return st;
  }
  // Rows no slot took (kNoExpert) stay zero where a pass reads every row of its group: down's
  // inputs quantized for a block format or prepared for tensor cores, and LoRA's SwiGLU (other
  // passes read only the rows of tiles).
  for (float* rows_of : {act, act_up})
    if (rows_of && (lora || use_mma || act_rounded[1] || act_rounded[2]))
      if (cudaMemsetAsync(rows_of, 0, static_cast<std::size_t>(rows * d_ff_max) * sizeof(float), stream) != cudaSuccess)
        return Status::kErrorCuda;
  if (Status st = use_mma ? run_mma() : run_gemv(); st != Status::kSuccess) return st;
  if (by_slot) return Status::kSuccess;
  if (lora)
    if (Status st = add_lora(Proj::kDown, act, d_ff_max, false, y, d_model, d_model); st != Status::kSuccess) return st;
  return combine();
}

}  // namespace qflash::kernels::expert_ffn_cuda
