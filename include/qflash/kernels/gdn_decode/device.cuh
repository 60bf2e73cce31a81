/// @file
/// kernels/gdn_decode on CUDA, shared by sm80.cuh and sm90a.cuh: one launch for up to
/// kSeqsPerLaunch sequences (their rows and state pointers travel in the kernel's parameters,
/// so a captured CUDA graph holds them by value), where the separate ops take two launches per
/// sequence (the conv and the recurrence) and one each for the gates and the norm.
///
/// step_kernel's CTA is gated_delta's recurrent CTA (gated_delta_cuda::token_step) on 32 state
/// columns of one value head of one sequence, with the conv and the gates before it and the
/// norm after:
///  - it convolves its q/k head's q and k channels into shared memory (each CTA of the head's
///    value heads does, from the same state), and its own v channels, whose conv state it
///    moves on by the token; the conv sums the taps in causal_conv1d's order, then SiLU;
///  - raw gates become the gates as gdn_gates' gates_of() computes them;
///  - the last of a q/k head's CTAs to finish (counted on a stream counter per sequence and
///    q/k head, which it sets back to zero) moves the q and k conv state on, writes the gates
///    in place and applies the gated RMSNorm to its value heads' rows
///    (gated_rmsnorm_cuda::norm_row).
/// So the op needs the stream's counters: made outside a graph capture (the model's stream has
/// them from its start), it fails without them.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "qflash/kernels/common/cuda.cuh"
#include "qflash/kernels/common/stream_workspace.cuh"
#include "qflash/kernels/gated_delta/device.cuh"
#include "qflash/kernels/gated_rmsnorm/device.cuh"
#include "qflash/kernels/gdn_gates/device.cuh"
#include "qflash/kernels/gdn_decode/op.hpp"

namespace qflash::kernels::gdn_decode_cuda {

inline constexpr int kSeqsPerLaunch = 64;  ///< keeps the parameters under 4 KiB

struct Params {
  GdnDecodeArgs a;  ///< its host arrays (rows, conv_state, state) are not read on the device
  std::int64_t rows[kSeqsPerLaunch];
  float* conv_state[kSeqsPerLaunch];
  float* state[kSeqsPerLaunch];
  unsigned* done;  ///< the CTAs done [sequences][n_head_k] (stream counters)
};

/// Channel ch's output for a token x: silu of the conv over the k - 1 carried inputs `st` (null
/// when k == 1) and x, the taps summed in causal_conv1d's order.
__device__ __forceinline__ float conv_channel(GdnDecodeArgs const& a, int k, std::int64_t ch, float x,
                                              float const* st) {
  float const* const w = a.conv_weight + ch * k;
  float acc = w[0] * (k > 1 ? st[0] : x);
  for (int j = 1; j < k; ++j) acc += w[j] * (j < k - 1 ? st[j] : x);
  return cuda::silu(acc);
}

/// The k - 1 carried inputs `st` moved on by x.
__device__ __forceinline__ void move_state(float* st, int k, float x) {
  for (int j = 0; j + 1 < k - 1; ++j) st[j] = st[j + 1];
  if (k > 1) st[k - 2] = x;
}

/// Shared floats of step_kernel besides gated_delta's Columns: q and k after the conv
/// [2 d_k], v after the conv [kCols], g and β.
__host__ __device__ inline int step_floats(int d_k) { return 2 * d_k + gated_delta_cuda::kCols + 2; }

/// Grid: x column blocks of gated_delta_cuda::kCols, y value heads, z sequences; block
/// 32 * ceil(d_k / 32) threads.
template <class Arch, int kConv>
__global__ void __launch_bounds__(32 * gated_delta_cuda::kMaxWarps, 2) step_kernel(Params const p) {
  using namespace gated_delta_cuda;
  QFLASH_DYNAMIC_SMEM(float, smem);
  GdnDecodeArgs const& a = p.a;
  int const k = kConv != kDynamic ? kConv : a.d_conv;
  int const i = static_cast<int>(blockIdx.z), h = static_cast<int>(blockIdx.y);
  int const hv = a.n_head_v, dk = a.d_k, dv = a.d_v, group = hv / a.n_head_k;
  int const kh = a.key_head(h);
  auto value_head = [&](int j) { return a.value_head(kh, j); };
  std::int64_t const cd = a.conv_dim(), key_dim = std::int64_t{a.n_head_k} * dk, row = p.rows[i];
  float const* const x = a.x + row * cd;
  float* const y = a.conv_out + row * cd;
  float* const conv_state = p.conv_state[i];  // null when k == 1
  auto carried = [&](std::int64_t ch) { return k > 1 ? conv_state + ch * (k - 1) : nullptr; };
  // Channel of q (j < d_k) or k (j - d_k) of the q/k head.
  auto qk_channel = [&](int j) { return (j < dk ? 0 : key_dim - dk) + std::int64_t{kh} * dk + j; };

  Columns const c(dk, dv, smem);
  float* const qk = smem + Columns::floats(dk, c.warps);  // [2 d_k]
  float* const v_conv = qk + 2 * dk;                      // [kCols]
  float* const gates = v_conv + kCols;                    // g, β
  float* const state = p.state[i] + static_cast<std::int64_t>(h) * dk * dv;
  float s[kRows];
  load_columns(state, dk, dv, c.warp, c.col, s);  // in flight during the conv

  bool const writes_qk = h == value_head(0) && blockIdx.x == 0;  // one CTA writes q and k out
  for (int j = static_cast<int>(threadIdx.x); j < 2 * dk; j += static_cast<int>(blockDim.x)) {
    std::int64_t const ch = qk_channel(j);
    qk[j] = conv_channel(a, k, ch, x[ch], carried(ch));
    if (writes_qk) y[ch] = qk[j];
  }
  if (c.warp == 0 && c.has_col) {  // the CTA's own v channels
    std::int64_t const ch = 2 * key_dim + std::int64_t{h} * dv + c.col;
    float* const st = carried(ch);
    v_conv[c.lane] = conv_channel(a, k, ch, x[ch], st);
    y[ch] = v_conv[c.lane];
    if (k > 1) move_state(st, k, x[ch]);
  }
  if (threadIdx.x == 0) {
    float g = a.g[row * hv + h], beta = a.beta[row * hv + h];
    if (a.dt_bias) {
      gdn_gates_cuda::Gates const r = gdn_gates_cuda::gates_of(a.gates_args(row), g, beta, h);
      g = r.g;
      beta = r.beta;
    }
    gates[0] = g;
    gates[1] = beta;
  }
  __syncthreads();
  token_step(c, s, qk, qk + dk, c.has_col ? v_conv[c.lane] : 0.0f, expf(gates[0]), gates[1], a.l2norm_eps,
             a.q_scale(), a.out + (row * hv + h) * dv);
  store_columns(s, dk, dv, c.warp, c.col, state);

  __threadfence();  // this CTA's out columns, before its count
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0) {
    __threadfence();  // the CTA's writes, seen through the barrier, before the count
    unsigned* const done = p.done + i * a.n_head_k + kh;
    last = atomicAdd(done, 1u) == static_cast<unsigned>(group) * gridDim.x - 1;
    if (last) {
      __threadfence();  // acquire: the counted CTAs' writes, before this CTA reads them
      *done = 0;
    }
  }
  __syncthreads();
  if (!last) return;
  __threadfence();  // every CTA's writes and reads, before the state, gates and rows they used
  for (int j = static_cast<int>(threadIdx.x); k > 1 && j < 2 * dk; j += static_cast<int>(blockDim.x)) {
    std::int64_t const ch = qk_channel(j);
    move_state(carried(ch), k, x[ch]);
  }
  if (a.dt_bias)
    for (int j = static_cast<int>(threadIdx.x); j < group; j += static_cast<int>(blockDim.x))
      gdn_gates_cuda::gate(a.gates_args(row), value_head(j), value_head(j));
  if (a.norm_weight)
    for (int j = c.warp; j < group; j += c.warps) {
      std::int64_t const at = (row * hv + value_head(j)) * std::int64_t{dv};  // the head's row
      gated_rmsnorm_cuda::norm_row(a.out + at, a.z + at, a.norm_weight, a.out + at, dv, a.norm_eps, c.lane);
    }
}

/// The body of `launch_gdn_decode<S>(Arch, args, stream)` for a CUDA arch tag.
template <class Arch, MoeSpec S>
Status launch(GdnDecodeArgs const& a, stream_t stream) {
  using namespace gated_delta_cuda;
  if (Status s = can_implement_gdn_decode<S>(a); s != Status::kSuccess) return s;
  if (a.n_seqs == 0) return Status::kSuccess;
  int const warps = (a.d_k + kRows - 1) / kRows;
  if (warps > kMaxWarps || a.n_head_k > cuda::kStreamCounters) return Status::kErrorNotSupported;
  auto const cs = static_cast<cudaStream_t>(stream);
  unsigned* const done = cuda::stream_counters(cs);
  if (!done) return Status::kErrorCuda;
  std::size_t const smem = static_cast<std::size_t>(Columns::floats(a.d_k, warps) + step_floats(a.d_k)) * sizeof(float);
  // Each sequence's q/k heads count their CTAs on counters of their own.
  int const per_launch = std::min(kSeqsPerLaunch, cuda::kStreamCounters / a.n_head_k);
  for (int first = 0; first < a.n_seqs; first += per_launch) {
    int const n = std::min(per_launch, a.n_seqs - first);
    Params p{};
    p.a = a;
    p.done = done;
    for (int i = 0; i < n; ++i) {
      p.rows[i] = a.rows[first + i];
      p.conv_state[i] = a.d_conv > 1 ? a.conv_state[first + i] : nullptr;
      p.state[i] = a.state[first + i];
    }
    dim3 const grid(static_cast<unsigned>((a.d_v + kCols - 1) / kCols), static_cast<unsigned>(a.n_head_v),
                    static_cast<unsigned>(n));
    QFLASH_LAUNCH(grid, 32 * warps, smem, cs, step_kernel<Arch, S.d_conv>)(p);
    if (Status s = cuda::last_launch_status(); s != Status::kSuccess) return s;
  }
  return Status::kSuccess;
}

}  // namespace qflash::kernels::gdn_decode_cuda
