/// @file
/// linear's tensor-core path for bf16 and fp8 e4m3 weights on sm_80 and sm_90a (mma.sync; the
/// geometry and its reasons: mma_tile.hpp). Taken for kMinTokens tokens or more (prefill, many sequences):
/// 1. split_kernel writes the activations' three bf16 parts into the stream's workspace,
///    [kParts][n_tokens][cols];
/// 2. mma_kernel stages weight and part tiles through shared memory with cp.async (two stages:
///    the next tile's copies fly while the warps multiply this one) and sums each part's
///    products, lo first, into fp32 accumulators (bf16 weights: the hi part's apart from the
///    others'; fp8: a stage's, scaled into the running sums).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "qflash/kernels/common/cuda.cuh"
#include "qflash/kernels/common/stream_workspace.cuh"
#include "qflash/kernels/linear/mma_tile.hpp"
#include "qflash/kernels/linear/op.hpp"

namespace qflash::kernels::linear_cuda::mma {

struct Params {
  WeightView w;                // [n, k] bf16 or fp8 e4m3 (and its scales)
  std::uint16_t const* parts;  // [kParts][m, k] bf16
  float* y;                    // [m, ys]
  std::int64_t m, ys;
  bool accumulate;
};

/// One thread per activation: its three parts.
template <class Arch>
__global__ void __launch_bounds__(256) split_kernel(float const* x, std::int64_t xs, std::int64_t m, std::int64_t k,
                                                    std::uint16_t* parts) {
  std::int64_t const n = m * k;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    std::int64_t const t = i / k, c = i % k;
    std::uint16_t p[kParts];
    split3(x[t * xs + c], p);
#pragma unroll
    for (int j = 0; j < kParts; ++j) parts[j * n + i] = p[j];
  }
}

#ifdef QFLASH_CUDA_EMULATOR
__device__ __forceinline__ void copy16(std::uint8_t* smem, void const* src, bool valid) {
  ::qflash::emulator::async_copy(smem, src, 16, valid ? 16 : 0);
}
__device__ __forceinline__ void copy4(std::uint8_t* smem, void const* src, bool valid) {
  ::qflash::emulator::async_copy(smem, src, 4, valid ? 4 : 0);
}
__device__ __forceinline__ void copy_commit() { ::qflash::emulator::async_commit(); }
template <int kPending>
__device__ __forceinline__ void copy_wait() {
  ::qflash::emulator::async_wait(kPending);
}
__device__ __forceinline__ void mma_bf16(float (&c)[4], std::uint32_t const (&a)[4], std::uint32_t const (&b)[2]) {
  ::qflash::emulator::mma_bf16(c, a, b);
}
#else
__device__ __forceinline__ void copy16(std::uint8_t* smem, void const* src, bool valid) {
  auto const dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  // src-size 0 fills the 16 bytes with zeros and reads nothing.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
/// 4 bytes (cp.async.cg copies only 16); zeros when !valid.
__device__ __forceinline__ void copy4(std::uint8_t* smem, void const* src, bool valid) {
  auto const dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void copy_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

/// c += a b for one m16n8k16 tile (bf16 in, fp32 accumulators).
__device__ __forceinline__ void mma_bf16(float (&c)[4], std::uint32_t const (&a)[4], std::uint32_t const (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

/// The warp's products of one stage: the tile's activations (every part, lo first) times
/// matrix j's n-tile nt, over the stage's kBlockK columns, the hi part's added to
/// hi[j][mt][nt] and the mid and lo parts' to rest[j][mt][nt] (which may be hi).
template <int kMTiles, int kMats, int kWBytes>
__device__ __forceinline__ void multiply_stage(std::uint8_t const* stage, int lane, int warp,
                                               float (&hi)[kMats][kMTiles][kNTiles][4],
                                               float (&rest)[kMats][kMTiles][kNTiles][4]) {
  auto const* words = reinterpret_cast<std::uint32_t const*>(stage);
#pragma unroll
  for (int ks = 0; ks < kBlockK / 16; ++ks) {
    std::uint32_t b[kMats][kNTiles][2];
#pragma unroll
    for (int j = 0; j < kMats; ++j)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          int const at = b_offset<kWBytes>(lane, r, j * kBlockN + warp * 16 + nt * 8, ks);
          if constexpr (kWBytes == 2)
            b[j][nt][r] = words[at / 4];
          else
            b[j][nt][r] = bf16_pair_of_e4m3(*reinterpret_cast<std::uint16_t const*>(stage + at));
        }
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int part = kParts - 1; part >= 0; --part) {
        std::uint32_t a[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) a[r] = words[a_word<kMTiles, kMats, kWBytes>(lane, r, mt, part, ks)];
#pragma unroll
        for (int j = 0; j < kMats; ++j)
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt) mma_bf16(part == 0 ? hi[j][mt][nt] : rest[j][mt][nt], a, b[j][nt]);
      }
  }
}

template <int kMTiles, int kMats>
__device__ __forceinline__ void zero(float (&acc)[kMats][kMTiles][kNTiles][4]) {
#pragma unroll
  for (int j = 0; j < kMats; ++j)
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[j][mt][nt][r] = 0.0f;
}

/// Stages 0 .. n - 1 through the two buffers of `smem`, the copies of each stage in flight
/// while the one before it is used: load(i, stage) queues stage i's copies, ahead(i) runs
/// before the wait for them (work they overlap), use(i, stage) runs once they have landed,
/// before the buffer is refilled.
template <std::size_t kBytes, class Load, class Ahead, class Use>
__device__ __forceinline__ void two_stages(std::int64_t n, std::uint8_t (&smem)[2][kBytes], Load const& load,
                                           Ahead const& ahead, Use const& use) {
  load(0, smem[0]);
  copy_commit();
  for (std::int64_t i = 0; i < n; ++i) {
    ahead(i);
    if (i + 1 < n) {
      load(i + 1, smem[(i + 1) % 2]);
      copy_commit();
      copy_wait<1>();
    } else {
      copy_wait<0>();
    }
    __syncthreads();
    use(i, smem[i % 2]);
    __syncthreads();  // the stage is refilled next
  }
}

/// A CTA's products over k columns into acc, through two stages of `smem`: load(k0, stage)
/// queues the copies of columns [k0, k0 + kBlockK) into a stage. The mid and lo parts'
/// products are summed apart from the running sums, so that they do not round against them:
/// - bf16 weights (kWBytes 2): the hi part's products are summed into acc, the others' apart,
///   and the two added at the end (docs/bench.md has the errors each way);
/// - fp8 weights (kWBytes 1): each stage's sums, every part's, are multiplied by scale(j, k0),
///   matrix j's block scale for the CTA's rows and those columns (a stage lies in one 128 x 128
///   block), and added to acc.
template <int kMTiles, int kMats, int kWBytes, class Load, class Scale>
__device__ __forceinline__ void multiply_tiles(std::int64_t k, Load const& load, Scale const& scale,
                                               std::uint8_t (&smem)[2][Tile<kMTiles, kMats, kWBytes>::kStageBytes],
                                               float (&acc)[kMats][kMTiles][kNTiles][4]) {
  int const lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  float sums[kMats][kMTiles][kNTiles][4];  // bf16: the mid and lo parts' over k; fp8: a stage's
  zero(acc);
  zero(sums);
  auto const fold = [&](auto const& scale_of) {  // acc += scale_of(j) sums
#pragma unroll
    for (int j = 0; j < kMats; ++j) {
      float const s = scale_of(j);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int r = 0; r < 4; ++r) acc[j][mt][nt][r] = fmaf(s, sums[j][mt][nt][r], acc[j][mt][nt][r]);
    }
  };
  two_stages(
      (k + kBlockK - 1) / kBlockK, smem, [&](std::int64_t kt, std::uint8_t* stage) { load(kt * kBlockK, stage); },
      [](std::int64_t) {},
      [&](std::int64_t kt, std::uint8_t const* stage) {
        if constexpr (kWBytes == 2) {
          multiply_stage<kMTiles, kMats, kWBytes>(stage, lane, warp, acc, sums);
        } else {
          zero(sums);
          multiply_stage<kMTiles, kMats, kWBytes>(stage, lane, warp, sums, sums);
          fold([&](int j) { return scale(j, kt * kBlockK); });
        }
      });
  if constexpr (kWBytes == 2) fold([](int) { return 1.0f; });
}

/// Queues the copies of columns [k0, k0 + kBlockK) of a stage: weight matrix j's rows
/// [n0, n0 + kBlockN) from w[j] (rows k values apart), and the activation rows that token_row
/// gives for the tile's tokens (-1: none) from parts (part p's rows at p part_stride). Rows
/// and columns past the matrices are zeros.
template <int kMTiles, int kMats, int kWBytes, class TokenRow>
__device__ __forceinline__ void load_stage(std::uint8_t const* const (&w)[kMats], std::int64_t n, std::int64_t n0,
                                           std::uint16_t const* parts, std::int64_t part_stride,
                                           TokenRow const& token_row, std::int64_t k, std::int64_t k0,
                                           std::uint8_t* stage) {
  for (int c = static_cast<int>(threadIdx.x); c < Tile<kMTiles, kMats, kWBytes>::kCopies; c += kThreads) {
    StageCopy const s = stage_copy<kMTiles, kMats, kWBytes>(c);
    std::int64_t const col = k0 + s.col;
    void const* src = w[0];  // any readable address when the copy is all zeros
    if (s.weight) {
      std::uint8_t const* wm = w[0];  // w[s.mat], picked without indexing (which would spill w)
#pragma unroll
      for (int j = 1; j < kMats; ++j)
        if (s.mat == j) wm = w[j];
      std::int64_t const row = n0 + s.row;
      if (col < k && row < n) src = wm + (row * k + col) * kWBytes;
      copy16(stage + s.smem, src, col < k && row < n);
    } else {
      std::int64_t const row = token_row(s.row);
      if (col < k && row >= 0) src = parts + s.part * part_stride + row * k + col;
      copy16(stage + s.smem, src, col < k && row >= 0);
    }
  }
}

/// Writes a warp's sums for tokens [m0, m0 + 16 kMTiles) and weight rows [o0, o0 + 16) into
/// y [m, ys] (added to it when accumulating), but for tokens past m and rows past n.
template <int kMTiles>
__device__ __forceinline__ void store(float const (&acc)[kMTiles][kNTiles][4], std::int64_t m0, std::int64_t m,
                                      std::int64_t o0, std::int64_t n, float* y, std::int64_t ys, bool accumulate,
                                      int lane) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        std::int64_t const t = m0 + mt * 16 + c_token(lane, r);
        std::int64_t const o = o0 + nt * 8 + c_row(lane, r);
        if (t >= m || o >= n) continue;
        float& out = y[t * ys + o];
        out = accumulate ? acc[mt][nt][r] + out : acc[mt][nt][r];
      }
}

/// Grid: x weight-row tiles of kBlockN, y token tiles of 16 kMTiles (strided past gridDim.y).
template <class Arch, int kMTiles, int kWBytes>
__global__ void __launch_bounds__(kThreads) mma_kernel(Params const p) {
  __shared__ __align__(16) std::uint8_t smem[2][Tile<kMTiles, 1, kWBytes>::kStageBytes];
  constexpr int kBlockM = Tile<kMTiles, 1, kWBytes>::kBlockM;
  int const lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  std::int64_t const n = p.w.rows, k = p.w.cols;
  std::int64_t const n0 = static_cast<std::int64_t>(blockIdx.x) * kBlockN;
  std::uint8_t const* const w[1] = {static_cast<std::uint8_t const*>(p.w.data)};
  float const* const scales = kWBytes == 1 ? p.w.scale_row(n0) : nullptr;
  auto const scale = [&](int, std::int64_t k0) { return scales[k0 / kFp8BlockSize]; };
  for (std::int64_t m0 = static_cast<std::int64_t>(blockIdx.y) * kBlockM; m0 < p.m;
       m0 += static_cast<std::int64_t>(gridDim.y) * kBlockM) {
    auto const token_row = [&](int t) { return m0 + t < p.m ? m0 + t : std::int64_t{-1}; };
    float acc[1][kMTiles][kNTiles][4];
    multiply_tiles<kMTiles, 1, kWBytes>(
        k,
        [&](std::int64_t k0, std::uint8_t* stage) {
          load_stage<kMTiles, 1, kWBytes>(w, n, n0, p.parts, p.m * k, token_row, k, k0, stage);
        },
        scale, smem, acc);
    store(acc[0], m0, p.m, n0 + warp * 16, n, p.y, p.ys, p.accumulate, lane);
  }
}

/// Whether linear of `w` over n_tokens takes this path.
inline bool usable(WeightView const& w, std::int64_t n_tokens) { return n_tokens >= kMinTokens && stageable(w); }

/// Launches split_kernel: x [m, k] (rows xs apart) into parts [kParts][m][k].
template <class Arch>
Status split(float const* x, std::int64_t xs, std::int64_t m, std::int64_t k, std::uint16_t* parts,
             cudaStream_t stream) {
  std::int64_t const elems = m * k;
  if (elems == 0) return Status::kSuccess;
  auto const blocks = static_cast<unsigned>(std::min<std::int64_t>((elems + 255) / 256, 1 << 16));
  QFLASH_LAUNCH(blocks, 256, 0, stream, split_kernel<Arch>)(x, xs, m, k, parts);
  return cuda::last_launch_status();
}

/// y = x W^T (+ y) through the split and mma kernels for kWBytes-byte weights
/// (usable(w, n_tokens) holds).
template <class Arch, int kWBytes>
Status launch(WeightView const& w, float const* x, std::int64_t xs, std::int64_t n_tokens, float* y, std::int64_t ys,
              bool accumulate, cudaStream_t stream) {
  auto* parts = static_cast<std::uint16_t*>(
      cuda::stream_workspace(stream, static_cast<std::size_t>(kParts * n_tokens * w.cols) * sizeof(std::uint16_t)));
  if (!parts) return Status::kErrorCuda;
  if (Status s = split<Arch>(x, xs, n_tokens, w.cols, parts, stream); s != Status::kSuccess) return s;
  Params const p{w, parts, y, n_tokens, ys, accumulate};
  auto const n_tiles = static_cast<unsigned>((w.rows + kBlockN - 1) / kBlockN);
  auto grid = [&](int block_m) {
    return dim3(n_tiles, static_cast<unsigned>(std::min<std::int64_t>((n_tokens + block_m - 1) / block_m, 65535)));
  };
  // Four m-tiles a CTA once there are tokens for them; one for a few dozen (decode batches).
  if (n_tokens > 32)
    QFLASH_LAUNCH(grid(16 * 4), kThreads, 0, stream, mma_kernel<Arch, 4, kWBytes>)(p);
  else
    QFLASH_LAUNCH(grid(16), kThreads, 0, stream, mma_kernel<Arch, 1, kWBytes>)(p);
  return cuda::last_launch_status();
}

}  // namespace qflash::kernels::linear_cuda::mma
