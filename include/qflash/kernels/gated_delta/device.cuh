/// @file
/// The gated delta rule on CUDA, shared by sm80.cuh and sm90a.cuh, in fp32 (the chunked form's
/// Gram products and state pass on tensor cores, 3xTF32).
///
/// kRecurrent, and calls of up to kMinChunkedTokens tokens: the per-token recurrence. A CTA
/// owns 32 state columns (value dims) of one value head and keeps them in registers for the
/// whole call: warp w, lane l holds S[32 w + i][32 b + l] for i < 32, so d_k / 32 warps cover
/// the rows. Per token the CTA forms q̂ and k̂ in shared memory (l2norm by a warp each), decays
/// its state, sums Sᵀk̂ and Sᵀq̂ over the warps through shared memory, and applies the rank-1
/// update; the state is read once and written once per call.
///
/// kChunked (prefill): op.hpp's WY form, as the CPU's chunk_step computes it, in groups of
/// chunks whose workspace fits kGroupBytes (Qwen3.6: 7 chunks of 64), two launches a group:
///  1. chunk_kernel, a CTA per chunk and value head, all in parallel: q̂ and k̂, Γ as products
///     of per-token decays, A and Q Kᵀ ⊙ Γ (the Gram products K Kᵀ and Q Kᵀ on tensor cores,
///     by the 16 x 16 blocks on or below the diagonal: mma_tile.hpp's gram_block), then
///     W = A⁻¹ diag(β e^γ) K and U = A⁻¹ diag(β) V by forward substitution (a thread per
///     column, 16 rows at a time in registers), into the workspace with e^γ q̂ and
///     e^{γ_last − γ} k̂;
///  2. state_kernel, a CTA per 32 state columns of a value head (S in shared memory) stepping
///     through the group's chunks on tensor cores (mma_tile.hpp): V' = U − W S,
///     O = (e^γ q̂) S + (Q Kᵀ ⊙ Γ) V', S ← e^{γ_last} S + kdᵀ V'.
/// Chunks hold min(chunk_size, 64) tokens, halved while a chunk's q̂ and k̂ would not fit in
/// 99 KiB of shared memory; the result equals the CPU's up to fp32 rounding for any chunk length.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "qflash/kernels/common/cuda.cuh"
#include "qflash/kernels/common/mma_tf32.cuh"
#include "qflash/kernels/common/stream_workspace.cuh"
#include "qflash/kernels/gated_delta/mma_tile.hpp"
#include "qflash/kernels/gated_delta/op.hpp"

namespace qflash::kernels::gated_delta_cuda {

inline constexpr int kRows = 32;       ///< state rows per warp
inline constexpr int kMaxWarps = 8;    ///< d_k up to 256

struct Params {
  GatedDeltaArgs a;
  std::int64_t qs, ks, vs;  ///< token strides
  float q_scale;            ///< 1 / sqrt(d_k)
};

/// y = x * scale / sqrt(sum(x^2) + eps) for d values, by one warp, into shared memory.
__device__ __forceinline__ void l2norm_warp(float const* x, int d, float eps, float scale, float* y, int lane) {
  float ss = 0.0f;
  for (int i = lane; i < d; i += 32) ss = fmaf(x[i], x[i], ss);
  float const f = scale / sqrtf(cuda::warp_sum(ss) + eps);
  for (int i = lane; i < d; i += 32) y[i] = x[i] * f;
}

/// The state rows warp w holds of column `col` ([d_k, d_v] `state`, rows 32 w + i), into s;
/// zeros past d_k or d_v.
__device__ __forceinline__ void load_columns(float const* state, int dk, int dv, int warp, int col, float (&s)[kRows]) {
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    int const row = warp * kRows + i;
    s[i] = col < dv && row < dk ? state[static_cast<std::int64_t>(row) * dv + col] : 0.0f;
  }
}
/// load_columns' inverse.
__device__ __forceinline__ void store_columns(float const (&s)[kRows], int dk, int dv, int warp, int col, float* state) {
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    int const row = warp * kRows + i;
    if (col < dv && row < dk) state[static_cast<std::int64_t>(row) * dv + col] = s[i];
  }
}

/// A CTA's place among the recurrence's columns: warp w, lane l holds rows [32 w, 32 w + 32) of
/// column 32 blockIdx.x + l; its shared memory holds q̂ [d_k], k̂ [d_k] and the warps' partial
/// sums [2][warps][kCols] (floats(), at the start of the dynamic shared memory).
struct Columns {
  int dk, dv, warps, warp, lane, col;
  bool has_col;
  float* q_hat;
  float* k_hat;
  float* part_u;  // [warps][kCols]
  float* part_o;  // [warps][kCols]

  __device__ Columns(int d_k, int d_v, float* smem)
      : dk(d_k),
        dv(d_v),
        warps(static_cast<int>(blockDim.x / 32)),
        warp(static_cast<int>(threadIdx.x / 32)),
        lane(static_cast<int>(threadIdx.x % 32)),
        col(static_cast<int>(blockIdx.x) * kCols + lane),
        has_col(col < d_v),
        q_hat(smem),
        k_hat(smem + d_k),
        part_u(smem + 2 * d_k),
        part_o(part_u + warps * kCols) {}

  /// Shared floats the CTA's columns take, for d_k and a block of 32 * warps threads.
  static __host__ __device__ int floats(int d_k, int warps) { return 2 * d_k + 2 * warps * kCols; }
};

/// One token's step on the CTA's state columns s: q and k are the token's rows of its q/k head
/// (global or shared memory), v the value of the thread's column (0 past d_v), out its value
/// head's row (warp 0 writes the CTA's columns). Ends with the CTA's threads all past their
/// reads of q̂, k̂ and part_u; part_o is next written after two more barriers, so a following
/// step may start at once.
__device__ __forceinline__ void token_step(Columns const& c, float (&s)[kRows], float const* q, float const* k,
                                           float v, float decay, float beta, float l2norm_eps, float q_scale,
                                           float* out) {
  if (c.warp == 0) l2norm_warp(q, c.dk, l2norm_eps, q_scale, c.q_hat, c.lane);
  if (c.warp == (c.warps > 1 ? 1 : 0)) l2norm_warp(k, c.dk, l2norm_eps, 1.0f, c.k_hat, c.lane);
  __syncthreads();  // q̂ and k̂ are ready
  float u = 0.0f;
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    int const row = c.warp * kRows + i;
    s[i] *= decay;
    if (row < c.dk) u = fmaf(s[i], c.k_hat[row], u);
  }
  c.part_u[c.warp * kCols + c.lane] = u;
  __syncthreads();
  float sum_u = 0.0f;
  for (int w = 0; w < c.warps; ++w) sum_u += c.part_u[w * kCols + c.lane];
  float const delta = beta * (v - sum_u);
  float o = 0.0f;
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    int const row = c.warp * kRows + i;
    if (row < c.dk) {
      s[i] = fmaf(c.k_hat[row], delta, s[i]);
      o = fmaf(s[i], c.q_hat[row], o);
    }
  }
  c.part_o[c.warp * kCols + c.lane] = o;
  __syncthreads();
  if (c.warp == 0 && c.has_col) {
    float sum_o = 0.0f;
    for (int w = 0; w < c.warps; ++w) sum_o += c.part_o[w * kCols + c.lane];
    out[c.col] = sum_o;
  }
}

/// One CTA's columns (blockIdx.x) of value head blockIdx.y over every token of `a`: the body
/// of recurrent_kernel. Block: 32 * ceil(d_k / 32) threads; shared: Columns::floats.
__device__ __forceinline__ void recurrent_columns(Params const& p, GatedDeltaArgs const& a) {
  QFLASH_DYNAMIC_SMEM(float, smem);
  Columns const c(a.d_k, a.d_v, smem);
  int const h = static_cast<int>(blockIdx.y);
  int const kh = a.key_head(h);
  float* const state = a.state + static_cast<std::int64_t>(h) * c.dk * c.dv;
  float s[kRows];
  load_columns(state, c.dk, c.dv, c.warp, c.col, s);
  for (std::int64_t t = 0; t < a.n_tokens; ++t) {
    float const v = c.has_col ? a.v[t * p.vs + static_cast<std::int64_t>(h) * c.dv + c.col] : 0.0f;
    token_step(c, s, a.q + t * p.qs + kh * c.dk, a.k + t * p.ks + kh * c.dk, v, expf(a.g[t * a.n_head_v + h]),
               a.beta[t * a.n_head_v + h], a.l2norm_eps, p.q_scale, a.out + (t * a.n_head_v + h) * c.dv);
  }
  store_columns(s, c.dk, c.dv, c.warp, c.col, state);
}

/// Grid: x column blocks of kCols, y value heads.
template <class Arch>
__global__ void __launch_bounds__(32 * kMaxWarps) recurrent_kernel(Params const p) {
  recurrent_columns(p, p.a);
}

// ---- kChunked ---------------------------------------------------------------------------

inline constexpr int kMinChunkedTokens = 16;       ///< shorter calls run the recurrence
inline constexpr std::int64_t kGroupBytes = std::int64_t{32} << 20;  ///< workspace of a pair of launches, at most
inline constexpr int kChunkThreads = 256;
struct ChunkParams {
  Params p;
  std::int64_t t0;   ///< the group's first token
  std::int64_t n;    ///< its tokens
  ChunkLayout l;
  float* work;       ///< [chunks, n_head_v] ChunkLayouts
};

/// A lane's A fragments (common/tf32.hpp) for rows [r0, r0 + 16) and columns [8 ks, 8 ks + 8)
/// of two row-major matrices x and y, rows ld floats apart; zero past n rows and dk columns.
__device__ __forceinline__ void a_fragments(float const* x, float const* y, int ld, int r0, int ks, int n, int dk,
                                            int lane, float (&ax)[4], float (&ay)[4]) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    int const i = r0 + tf32::a_row(lane, r), d = 8 * ks + tf32::a_col(lane, r);
    bool const in = i < n && d < dk;
    ax[r] = in ? x[i * ld + d] : 0.0f;
    ay[r] = in ? y[i * ld + d] : 0.0f;
  }
}

/// kSolveRows entries of a column of chunk_kernel's A, from 16-byte aligned shared memory (the
/// dynamic shared memory's start, A's offset 2 c chunk_ld, lda and the block's first row are
/// multiples of 4 floats).
__device__ __forceinline__ void load_column(float const* p, float (&a)[kSolveRows]) {
#pragma unroll
  for (int q = 0; q < kSolveRows / 4; ++q) {
    float4 const v = reinterpret_cast<float4 const*>(p)[q];
    a[4 * q] = v.x, a[4 * q + 1] = v.y, a[4 * q + 2] = v.z, a[4 * q + 3] = v.w;
  }
}

/// Grid: x the group's chunks, y value heads.
template <class Arch>
__global__ void __launch_bounds__(kChunkThreads) chunk_kernel(ChunkParams const cp) {
  using tf32::b_col;
  using tf32::b_row;
  using tf32::c_col;
  using tf32::c_row;
  QFLASH_DYNAMIC_SMEM(float, smem);
  GatedDeltaArgs const& a = cp.p.a;
  int const dk = a.d_k, dv = a.d_v, c = cp.l.c, ldk = chunk_ld(dk), lda = chunk_lda(c);
  int const h = static_cast<int>(blockIdx.y);
  int const kh = a.key_head(h);
  std::int64_t const t0 = cp.t0 + static_cast<std::int64_t>(blockIdx.x) * c;
  int const n = static_cast<int>(min(static_cast<std::int64_t>(c), cp.t0 + cp.n - t0));
  int const warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  constexpr int kChunkWarps = kChunkThreads / 32;
  float* const qn = smem;              // [c][ldk]
  float* const kn = qn + c * ldk;      // [c][ldk]
  float* const at = kn + c * ldk;      // [c][lda]: Γᵀ, then strictlower(diag(β) K Kᵀ ⊙ Γ)ᵀ
  float* const eg = at + chunk_a_floats(c);  // e^{g_i}
  float* const ecum = eg + c;          // e^{γ_i}
  float* const beta = ecum + c;
  float* const glast = beta + c;       // Γ_{n-1, j}
  float* const base = cp.work + (static_cast<std::int64_t>(blockIdx.x) * a.n_head_v + h) * cp.l.floats();
  float* const w = cp.l.w(base);
  float* const qg = cp.l.qg(base);
  float* const kd = cp.l.kd(base);
  float* const u = cp.l.u(base);
  float* const qk = cp.l.qk(base);

  for (int i = warp; i < n; i += kChunkWarps) {
    l2norm_warp(a.q + (t0 + i) * cp.p.qs + kh * dk, dk, a.l2norm_eps, cp.p.q_scale, qn + i * ldk, lane);
    l2norm_warp(a.k + (t0 + i) * cp.p.ks + kh * dk, dk, a.l2norm_eps, 1.0f, kn + i * ldk, lane);
  }
  if (threadIdx.x == 0)
    for (int i = 0; i < n; ++i) {
      eg[i] = expf(a.g[(t0 + i) * a.n_head_v + h]);
      ecum[i] = (i ? ecum[i - 1] : 1.0f) * eg[i];
      beta[i] = a.beta[(t0 + i) * a.n_head_v + h];
    }
  __syncthreads();
  // Γ_ij = e^{g_{j+1}} ... e^{g_i} in that order (the CPU's product), down each column j into
  // at; Q Kᵀ ⊙ Γ is zero above the diagonal.
  if (int const j = static_cast<int>(threadIdx.x); j < n) {
    float gamma = 1.0f;
    at[j * lda + j] = gamma;
    for (int i = j + 1; i < n; ++i) at[j * lda + i] = gamma *= eg[i];
    glast[j] = gamma;
  }
  for (int idx = static_cast<int>(threadIdx.x); idx < n * n; idx += kChunkThreads)
    if (int const i = idx / n, j = idx % n; j > i) qk[i * c + j] = 0.0f;
  __syncthreads();
  // K Kᵀ and Q Kᵀ on tensor cores (3xTF32), by the 16 x 16 blocks on or below the diagonal
  // (warp w takes blocks w, w + 8, ...), then A = strictlower(diag(β) K Kᵀ ⊙ Γ) and Q Kᵀ ⊙ Γ,
  // each entry of at read and written by the one lane that holds it.
  for (int t = warp; t < gram_blocks((n + 15) / 16); t += kChunkWarps) {
    GramBlock const block = gram_block(t);
    int const r0 = 16 * block.mt, c0 = 16 * block.ct;
    float kk[2][4] = {}, qkd[2][4] = {};
    for (int ks = 0; ks < (dk + 7) / 8; ++ks) {
      float ak[4], aq[4];
      a_fragments(kn, qn, ldk, r0, ks, n, dk, lane, ak, aq);
      float ak_big[4], ak_small[4], aq_big[4], aq_small[4];
      tf32::split(ak, ak_big, ak_small);
      tf32::split(aq, aq_big, aq_small);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        float b[2], b_big[2], b_small[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          int const j = c0 + 8 * nt + b_col(lane), d = 8 * ks + b_row(lane, r);
          b[r] = j < n && d < dk ? kn[j * ldk + d] : 0.0f;
        }
        tf32::split(b, b_big, b_small);
        tf32::mma_3x(kk[nt], ak_big, ak_small, b_big, b_small);
        tf32::mma_3x(qkd[nt], aq_big, aq_small, b_big, b_small);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        int const i = r0 + c_row(lane, r), j = c0 + 8 * nt + c_col(lane, r);
        if (i >= n || j > i) continue;
        float const gamma = at[j * lda + i];
        at[j * lda + i] = j < i ? kk[nt][r] * (beta[i] * gamma) : 0.0f;
        qk[i * c + j] = qkd[nt][r] * gamma;
      }
  }
  __syncthreads();
  if (threadIdx.x == 0) *cp.l.last(base) = ecum[n - 1];
  for (int idx = static_cast<int>(threadIdx.x); idx < n * dk; idx += kChunkThreads) {
    int const i = idx / dk, d = idx % dk;
    qg[idx] = qn[i * ldk + d] * ecum[i];
    kd[idx] = kn[i * ldk + d] * glast[i];
  }
  // Forward substitution, a thread per column of W (d < dk) or U: x_i = b_i − Σ_{j<i} A_ij x_j
  // in that order, kSolveRows rows at a time in registers: a block of rows takes the rows before
  // it (read back from the workspace, each once a block, by the thread that wrote it), then its
  // own, one column of A at a time.
  for (int col = static_cast<int>(threadIdx.x); col < dk + dv; col += kChunkThreads) {
    bool const is_w = col < dk;
    float* const x = is_w ? w + col : u + (col - dk);
    int const ld = is_w ? dk : dv;
    for (int i0 = 0; i0 < n; i0 += kSolveRows) {
      int const rows = min(kSolveRows, n - i0);
      float xb[kSolveRows];
#pragma unroll
      for (int r = 0; r < kSolveRows; ++r) {
        int const i = i0 + r;
        xb[r] = r >= rows ? 0.0f
                : is_w    ? beta[i] * ecum[i] * kn[i * ldk + col]
                          : beta[i] * a.v[(t0 + i) * cp.p.vs + static_cast<std::int64_t>(h) * dv + (col - dk)];
      }
      // Rows past n (in the last block) take entries of A never written, or past their column
      // (inside A: chunk_a_floats); they are neither stored nor used by the rows before them.
      for (int j = 0; j < i0; ++j) {
        float const xj = x[j * ld];
        float a_j[kSolveRows];
        load_column(at + j * lda + i0, a_j);
#pragma unroll
        for (int r = 0; r < kSolveRows; ++r) xb[r] = fmaf(-a_j[r], xj, xb[r]);
      }
#pragma unroll
      for (int j = 0; j < kSolveRows; ++j)
        if (j < rows) {
          x[(i0 + j) * ld] = xb[j];
          float a_j[kSolveRows];
          load_column(at + (i0 + j) * lda + i0, a_j);
#pragma unroll
          for (int r = j + 1; r < kSolveRows; ++r) xb[r] = fmaf(-a_j[r], xb[j], xb[r]);
        }
    }
  }
}

/// acc += a V'[8 kt, 8 kt + 8) over the CTA's columns: a is the lane's A fragment (16 rows x
/// 8 tokens), V' in shared memory (mma_tile.hpp).
__device__ __forceinline__ void add_times_vp(float (&acc)[mma::kNTiles][4], float const (&a)[4], float const* vp,
                                             int kt, int lane) {
  float a_big[4], a_small[4];
  tf32::split(a, a_big, a_small);
#pragma unroll
  for (int nt = 0; nt < mma::kNTiles; ++nt) {
    float b[2], b_big[2], b_small[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) b[r] = vp[mma::b_offset(lane, r, kt, nt)];
    tf32::split(b, b_big, b_small);
    tf32::mma_3x(acc[nt], a_big, a_small, b_big, b_small);
  }
}

/// Grid: x column blocks of kCols, y value heads; block mma::kThreads. Shared: mma::smem_floats(d_k).
template <class Arch>
__global__ void __launch_bounds__(mma::kThreads) state_kernel(ChunkParams const cp) {
  using namespace mma;
  using tf32::mma_3x;
  using tf32::split;
  QFLASH_DYNAMIC_SMEM(float, smem);
  GatedDeltaArgs const& a = cp.p.a;
  int const dk = a.d_k, dv = a.d_v, c = cp.l.c, rows = state_rows(dk), k_steps = (dk + 7) / 8;
  int const warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  int const h = static_cast<int>(blockIdx.y);
  int const col0 = static_cast<int>(blockIdx.x) * kCols;
  float* const ss = smem;             // S [rows][kLd]
  float* const vp = ss + rows * kLd;  // V' [kMaxChunk][kLd]
  float* const state = a.state + static_cast<std::int64_t>(h) * dk * dv;
  for (int e = static_cast<int>(threadIdx.x); e < rows * kCols; e += kThreads) {
    int const i = e / kCols, j = e % kCols;
    ss[i * kLd + j] = i < dk && col0 + j < dv ? state[static_cast<std::int64_t>(i) * dv + col0 + j] : 0.0f;
  }
  __syncthreads();

  std::int64_t const n_chunks = (cp.n + c - 1) / c;
  for (std::int64_t ci = 0; ci < n_chunks; ++ci) {
    std::int64_t const t0 = cp.t0 + ci * c;
    int const n = static_cast<int>(min(static_cast<std::int64_t>(c), cp.t0 + cp.n - t0));
    float* const base = cp.work + (ci * a.n_head_v + h) * cp.l.floats();
    float const* const w = cp.l.w(base);
    float const* const qg = cp.l.qg(base);
    float const* const kd = cp.l.kd(base);
    float const* const u = cp.l.u(base);
    float const* const qk = cp.l.qk(base);
    int const r0 = 16 * warp;
    bool const has_tokens = r0 < n;
    float o[kNTiles][4] = {};
    // 1. W S and e^γ q̂ S, with the state as it was before this chunk; V' = U − W S.
    if (has_tokens) {
      float ws[kNTiles][4] = {};
      for (int ks = 0; ks < k_steps; ++ks) {
        float b_big[kNTiles][2], b_small[kNTiles][2];
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          float b[2];
#pragma unroll
          for (int r = 0; r < 2; ++r) b[r] = ss[b_offset(lane, r, ks, nt)];
          split(b, b_big[nt], b_small[nt]);
        }
        float aw[4], aq[4], aw_big[4], aw_small[4], aq_big[4], aq_small[4];
        a_fragments(w, qg, dk, r0, ks, n, dk, lane, aw, aq);
        split(aw, aw_big, aw_small);
        split(aq, aq_big, aq_small);
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          mma_3x(ws[nt], aw_big, aw_small, b_big[nt], b_small[nt]);
          mma_3x(o[nt], aq_big, aq_small, b_big[nt], b_small[nt]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          int const i = r0 + c_row(lane, r), col = col0 + 8 * nt + c_col(lane, r);
          float const ui = i < n && col < dv ? u[static_cast<std::int64_t>(i) * dv + col] : 0.0f;
          vp[c_offset(lane, r, warp, nt)] = i < n ? ui - ws[nt][r] : 0.0f;
        }
    }
    __syncthreads();
    // 2. O += (Q Kᵀ ⊙ Γ) V', over the tokens up to the warp's last.
    if (has_tokens) {
      int const kt_end = (min(n, r0 + 16) + 7) / 8;
      for (int kt = 0; kt < kt_end; ++kt) {
        float aqk[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          int const i = r0 + a_row(lane, r), j = 8 * kt + a_col(lane, r);
          aqk[r] = i < n && j < n ? qk[i * c + j] : 0.0f;
        }
        add_times_vp(o, aqk, vp, kt, lane);
      }
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          int const i = r0 + c_row(lane, r), col = col0 + 8 * nt + c_col(lane, r);
          if (i < n && col < dv) a.out[((t0 + i) * a.n_head_v + h) * static_cast<std::int64_t>(dv) + col] = o[nt][r];
        }
    }
    // 3. S ← e^{γ_last} S + kdᵀ V'.
    float const last = *cp.l.last(base);
    int const kt_end = (n + 7) / 8;
    for (int mt = warp; mt < rows / 16; mt += kWarps) {
      float acc[kNTiles][4];
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[nt][r] = last * ss[c_offset(lane, r, mt, nt)];
      for (int kt = 0; kt < kt_end; ++kt) {
        float akd[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          int const d = 16 * mt + a_row(lane, r), j = 8 * kt + a_col(lane, r);
          akd[r] = d < dk && j < n ? kd[j * dk + d] : 0.0f;
        }
        add_times_vp(acc, akd, vp, kt, lane);
      }
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r)
          if (16 * mt + c_row(lane, r) < dk) ss[c_offset(lane, r, mt, nt)] = acc[nt][r];
    }
    __syncthreads();  // S is whole again, and V' is next written for the next chunk
  }
  for (int e = static_cast<int>(threadIdx.x); e < dk * kCols; e += kThreads) {
    int const i = e / kCols, j = e % kCols;
    if (col0 + j < dv) state[static_cast<std::int64_t>(i) * dv + col0 + j] = ss[i * kLd + j];
  }
}

/// The chunked form over every group of `p.a`'s tokens.
template <class Arch>
Status launch_chunked(Params const& p, cudaStream_t stream) {
  GatedDeltaArgs const& a = p.a;
  int const c = chunk_tokens(a.chunk_size, a.d_k);
  ChunkLayout const l{c, a.d_k, a.d_v};
  std::int64_t const chunk_bytes = a.n_head_v * l.floats() * static_cast<std::int64_t>(sizeof(float));
  std::int64_t const group = std::max<std::int64_t>(1, kGroupBytes / chunk_bytes) * c;
  std::int64_t const group_chunks = (std::min(group, a.n_tokens) + c - 1) / c;
  auto* const work = static_cast<float*>(
      cuda::stream_workspace(stream, static_cast<std::size_t>(group_chunks * a.n_head_v * l.floats()) * sizeof(float)));
  if (!work) return Status::kErrorCuda;
  std::size_t const smem1 = chunk_smem(c, a.d_k);
  auto const smem2 = static_cast<std::size_t>(mma::smem_floats(a.d_k)) * sizeof(float);
  if (Status s = cuda::allow_dynamic_smem(chunk_kernel<Arch>, kMaxChunkSmem); s != Status::kSuccess) return s;
  if (Status s = cuda::allow_dynamic_smem(
          state_kernel<Arch>, static_cast<std::size_t>(mma::smem_floats(kRows * kMaxWarps)) * sizeof(float));
      s != Status::kSuccess)
    return s;
  for (std::int64_t t0 = 0; t0 < a.n_tokens; t0 += group) {
    ChunkParams cp{p, t0, std::min(group, a.n_tokens - t0), l, work};
    dim3 const chunks(static_cast<unsigned>((cp.n + c - 1) / c), static_cast<unsigned>(a.n_head_v));
    QFLASH_LAUNCH(chunks, kChunkThreads, smem1, stream, chunk_kernel<Arch>)(cp);
    if (Status st = cuda::last_launch_status(); st != Status::kSuccess) return st;
    dim3 const columns(static_cast<unsigned>((a.d_v + kCols - 1) / kCols), static_cast<unsigned>(a.n_head_v));
    QFLASH_LAUNCH(columns, mma::kThreads, smem2, stream, state_kernel<Arch>)(cp);
    if (Status st = cuda::last_launch_status(); st != Status::kSuccess) return st;
  }
  return Status::kSuccess;
}

/// The body of `launch_gated_delta<S>(Arch, args, stream)` for a CUDA arch tag.
template <class Arch, MoeSpec S>
Status launch(GatedDeltaArgs const& a, stream_t stream) {
  if (Status s = can_implement_gated_delta<S>(a); s != Status::kSuccess) return s;
  int const warps = (a.d_k + kRows - 1) / kRows;
  if (warps > kMaxWarps || a.n_head_v > 65535) return Status::kErrorNotSupported;  // heads: grid y
  Params p{};
  p.a = a;
  p.qs = a.q_stride_or_default();
  p.ks = a.k_stride_or_default();
  p.vs = a.v_stride_or_default();
  p.q_scale = a.q_scale();
  if (a.form == DeltaRuleForm::kChunked && a.n_tokens > kMinChunkedTokens)
    return launch_chunked<Arch>(p, static_cast<cudaStream_t>(stream));
  std::size_t const smem = static_cast<std::size_t>(Columns::floats(a.d_k, warps)) * sizeof(float);
  dim3 const grid(static_cast<unsigned>((a.d_v + kCols - 1) / kCols), static_cast<unsigned>(a.n_head_v));
  QFLASH_LAUNCH(grid, 32 * warps, smem, stream, recurrent_kernel<Arch>)(p);
  return cuda::last_launch_status();
}

}  // namespace qflash::kernels::gated_delta_cuda
