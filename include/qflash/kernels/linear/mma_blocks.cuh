/// @file
/// The tensor-core path for block-format weights (q8_0, q4_k, q6_k, int4) on sm_80 and
/// sm_90a: products of integer codes with mma.sync (the geometry and its reasons:
/// mma_blocks.hpp). linear takes it for mma::kMinTokens tokens or more, and the experts'
/// prompt passes (expert_ffn/device.cuh) through multiply_groups:
/// 1. quantize_kernel (rounding.cuh) writes the activations' codes, and per group of 32
///    columns their scale and scaled code sum, into the stream's workspace;
/// 2. the mma kernel stages those through shared memory (cp.async, two stages), reads the
///    weight codes into its fragments, and adds each span's products to fp32 accumulators.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "qflash/kernels/common/cuda.cuh"
#include "qflash/kernels/common/stream_workspace.cuh"
#include "qflash/kernels/linear/mma.cuh"
#include "qflash/kernels/linear/mma_blocks.hpp"
#include "qflash/kernels/linear/rounding.cuh"

namespace qflash::kernels::linear_cuda::mma_blocks {

/// The activations as this path reads them: bf16 codes.
using Activations = CodeRows<std::uint16_t>;

/// Queues the copies of group kt into a stage for the tile's tokens, whose activation rows
/// token_row gives (-1: none, zeros).
template <int kMTiles, class TokenRow>
__device__ __forceinline__ void load_stage(Activations const& a, TokenRow const& token_row, std::int64_t kt,
                                           std::uint8_t* stage) {
  for (int c = static_cast<int>(threadIdx.x); c < Tile<kMTiles>::kCopies; c += mma::kThreads) {
    StageCopy const s = stage_copy<kMTiles>(c);
    std::int64_t const row = token_row(s.token);
    bool const valid = row >= 0;
    if (s.what == 0) {
      mma::copy16(stage + s.smem, valid ? a.codes + row * a.k + kt * kGroup + s.col : a.codes, valid);
    } else {
      float const* const v = s.what == 1 ? a.scales : a.sums;
      mma::copy4(stage + s.smem, valid ? v + kt * a.stride + row : v, valid);
    }
  }
}

/// The warp's 16 weight rows from n0 of kMats matrices of one format and shape: each
/// matrix's row n0, the bytes between rows, and how many of the 16 the matrices have.
template <int kMats>
struct WarpRows {
  std::byte const* first[kMats];
  std::int64_t row_bytes;
  std::int64_t valid;

  /// Row r (0..15) of matrix j, or null past the matrices.
  __device__ __forceinline__ std::byte const* row(int j, int r) const {
    return r < valid ? first[j] + r * row_bytes : nullptr;
  }
};
template <int kMats>
__device__ __forceinline__ WarpRows<kMats> warp_rows(WeightView const (&w)[kMats], std::int64_t n0) {
  WarpRows<kMats> r;
#pragma unroll
  for (int j = 0; j < kMats; ++j) r.first[j] = w[j].row(n0);
  r.row_bytes = w[0].row_bytes();
  r.valid = w[0].rows - n0;
  return r;
}

/// A CTA's products over k columns (whole groups: the activations' padded columns) into acc[j]
/// for matrix j, through two stages of `smem`: load(kt, stage) queues the copies of group kt.
template <WeightFormat kF, int kMTiles, int kMats, class Load>
__device__ __forceinline__ void multiply_groups(WarpRows<kMats> const& rows, std::int64_t k, Load const& load,
                                                std::uint8_t (&smem)[2][Tile<kMTiles>::kStageBytes],
                                                float (&acc)[kMats][kMTiles][mma::kNTiles][4]) {
  using T = Tile<kMTiles>;
  using C = Codes<kF>;
  constexpr int kSpans = kGroup / C::kSpan;
  constexpr int kNTiles = mma::kNTiles;
  int const lane = static_cast<int>(threadIdx.x % 32);
  mma::zero(acc);
  // A group's weight codes and spans, read ahead: global loads in flight while its stage lands.
  std::uint32_t b[kMats][2][kNTiles][2];
  Affine span[kMats][kNTiles][2][kSpans];
  auto const read_weights = [&](std::int64_t kt) {
    std::int64_t const k0 = kt * kGroup;
#pragma unroll
    for (int j = 0; j < kMats; ++j)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        // Codes of row g of the n-tile (B), spans of its rows 2t and 2t + 1 (C).
        std::byte const* const b_row = rows.row(j, nt * 8 + mma::group_of(lane));
#pragma unroll
        for (int ks = 0; ks < 2; ++ks) b_fragment<kF>(b_row, k0, lane, ks, b[j][ks][nt]);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          std::byte const* const c_row = rows.row(j, nt * 8 + mma::c_row(lane, e));
#pragma unroll
          for (int sp = 0; sp < kSpans; ++sp)
            span[j][nt][e][sp] = c_row ? C::affine(c_row, k0 + sp * C::kSpan) : Affine{};
        }
      }
  };
  auto const multiply = [&](std::int64_t, std::uint8_t const* stage) {
    auto const* codes = reinterpret_cast<std::uint16_t const*>(stage);
    auto const* scales = reinterpret_cast<float const*>(stage + T::kScaleBase);
    auto const* sums = reinterpret_cast<float const*>(stage + T::kSumBase);
    float part[kMats][kMTiles][kNTiles][4] = {};
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        uint2 const lo = *reinterpret_cast<uint2 const*>(codes + a_offset(mt * 16 + mma::group_of(lane), lane, ks));
        uint2 const hi = *reinterpret_cast<uint2 const*>(codes + a_offset(mt * 16 + mma::group_of(lane) + 8, lane, ks));
        std::uint32_t const a[4] = {lo.x, hi.x, lo.y, hi.y};
#pragma unroll
        for (int j = 0; j < kMats; ++j)
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt) mma::mma_bf16(part[j][mt][nt], a, b[j][ks][nt]);
      }
      if (kSpans == 1 && ks == 0) continue;  // a span of 32: both k-steps
      int const sp = kSpans == 1 ? 0 : ks;
#pragma unroll
      for (int j = 0; j < kMats; ++j)
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              int const token = mt * 16 + mma::c_token(lane, r);
              acc[j][mt][nt][r] =
                  add_span(acc[j][mt][nt][r], part[j][mt][nt][r], scales[token], sums[token], span[j][nt][r % 2][sp]);
              part[j][mt][nt][r] = 0.0f;
            }
    }
  };
  mma::two_stages(k / kGroup, smem, load, read_weights, multiply);
}

struct Params {
  WeightView w;
  Activations a;  // a.rows: the tokens
  float* y;       // [a.rows, ys]
  std::int64_t ys;
  bool accumulate;
};

/// linear. Grid: x weight-row tiles of mma::kBlockN, y token tiles of 16 kMTiles (strided
/// past gridDim.y).
template <class Arch, WeightFormat kF, int kMTiles>
__global__ void __launch_bounds__(mma::kThreads, 1) mma_blocks_kernel(Params const p) {
  using T = Tile<kMTiles>;
  __shared__ __align__(16) std::uint8_t smem[2][T::kStageBytes];
  int const lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  std::int64_t const m = p.a.rows, n0 = static_cast<std::int64_t>(blockIdx.x) * mma::kBlockN + warp * 16;
  WeightView const w[1] = {p.w};
  WarpRows<1> const rows = warp_rows(w, n0);
  for (std::int64_t m0 = static_cast<std::int64_t>(blockIdx.y) * T::kBlockM; m0 < m;
       m0 += static_cast<std::int64_t>(gridDim.y) * T::kBlockM) {
    auto const token_row = [&](int t) { return m0 + t < m ? m0 + t : std::int64_t{-1}; };
    float acc[1][kMTiles][mma::kNTiles][4];
    multiply_groups<kF, kMTiles, 1>(
        rows, p.a.k, [&](std::int64_t kt, std::uint8_t* stage) { load_stage<kMTiles>(p.a, token_row, kt, stage); },
        smem, acc);
    mma::store(acc[0], m0, m, n0, p.w.rows, p.y, p.ys, p.accumulate, lane);
  }
}

/// y = x W^T (+ y) for block format kF (usable(w, a.rows)) over activations quantized for it.
template <class Arch, WeightFormat kF>
Status multiply(WeightView const& w, Activations const& a, float* y, std::int64_t ys, bool accumulate,
                cudaStream_t stream) {
  Params const p{w, a, y, ys, accumulate};
  std::int64_t const m = a.rows;
  auto const n_tiles = static_cast<unsigned>((w.rows + mma::kBlockN - 1) / mma::kBlockN);
  auto grid = [&](int block_m) {
    return dim3(n_tiles, static_cast<unsigned>(std::min<std::int64_t>((m + block_m - 1) / block_m, 65535)));
  };
  // Four m-tiles a CTA once there are tokens for them; one for a few dozen (decode batches).
  if (m > 32)
    QFLASH_LAUNCH(grid(Tile<4>::kBlockM), mma::kThreads, 0, stream, mma_blocks_kernel<Arch, kF, 4>)(p);
  else
    QFLASH_LAUNCH(grid(Tile<1>::kBlockM), mma::kThreads, 0, stream, mma_blocks_kernel<Arch, kF, 1>)(p);
  return cuda::last_launch_status();
}

/// y = x W^T (+ y) through the quantize and mma kernels for block format kF (usable(w, m)).
template <class Arch, WeightFormat kF>
Status launch(WeightView const& w, float const* x, std::int64_t xs, std::int64_t m, float* y, std::int64_t ys,
              bool accumulate, cudaStream_t stream) {
  Activations a{};
  if (Status s = workspace_codes(m, padded_cols(w.cols), stream, a); s != Status::kSuccess) return s;
  if (Status s = quantize<Arch>(rounding(kF), x, xs, w.cols, a, stream); s != Status::kSuccess) return s;
  return multiply<Arch, kF>(w, a, y, ys, accumulate, stream);
}

}  // namespace qflash::kernels::linear_cuda::mma_blocks
