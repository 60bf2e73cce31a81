// The chunked gated delta rule's state pass on tensor cores (kernels/gated_delta/mma_tile.hpp,
// device.cuh's state_kernel), run on the host: S and V' in the CTA's shared-memory layout, each
// warp's fragments and 3xTF32 products on an emulated mma.sync.m16n8k8 (support/mma_emulator.hpp),
// chunk after chunk, as the kernel steps. Its input, chunk_kernel's workspace, is computed here
// in fp64 from op.hpp's WY formulas and laid out as ChunkLayout says. Outputs and final states
// equal ref::gated_delta (the per-token recurrence) within the GPU test's tolerance, over d_k
// and d_v that fill no tile, several value heads, partial chunks and chunks of 1 to 64 tokens.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <vector>

#include "qflash/kernels/gated_delta/mma_tile.hpp"
#include "qflash/kernels/gated_delta/ref.hpp"
#include "support/mma_emulator.hpp"
#include "support/random.hpp"
#include "support/tolerance.hpp"

using namespace qflash;
using namespace qflash::kernels;
namespace gd = qflash::kernels::gated_delta_cuda;
namespace mma = qflash::kernels::gated_delta_cuda::mma;

namespace {

using test::Acc;
using test::all_close;
using test::emulate_mma_3xtf32;
using test::Floats2;
using test::Floats4;
using test::Tolerance;

constexpr Tolerance kDelta{5e-5, 2e-4};  // layer_ops_gpu_test's, for the delta rule

auto at(std::int64_t i) { return static_cast<std::size_t>(i); }

struct Problem {
  int n_head_k, n_head_v, d_k, d_v;
  std::int64_t n_tokens;
  int chunk;
  bool long_memory = false;  ///< decays near 1 and keys of one sign, as layer_ops_gpu_test's
};

struct Inputs {
  std::vector<float> q, k, v, g, beta, state;
};

Inputs make_inputs(Problem const& p) {
  auto const seed = static_cast<std::uint64_t>(p.d_k * 7 + p.d_v * 3 + p.n_tokens);
  std::int64_t const qk = std::int64_t{p.n_head_k} * p.d_k, vw = std::int64_t{p.n_head_v} * p.d_v;
  float const lo = p.long_memory ? 0.0f : -1.0f;
  Inputs in;
  in.q = test::random_floats(at(p.n_tokens * qk), seed, lo, 1);
  in.k = test::random_floats(at(p.n_tokens * qk), seed + 1, lo, 1);
  in.v = test::random_floats(at(p.n_tokens * vw), seed + 2, -1, 1);
  in.g = test::random_floats(at(p.n_tokens * p.n_head_v), seed + 3, p.long_memory ? -0.05f : -2.0f,
                             p.long_memory ? 0.0f : -0.001f);
  in.beta = test::random_floats(in.g.size(), seed + 4, 0.0f, 1.0f);
  in.state = test::random_floats(at(std::int64_t{p.n_head_v} * p.d_k * p.d_v), seed + 5, -0.5f, 0.5f);
  return in;
}

GatedDeltaArgs args_of(Problem const& p, Inputs const& in, float* state, float* out) {
  GatedDeltaArgs a{};
  a.q = in.q.data(), a.k = in.k.data(), a.v = in.v.data(), a.g = in.g.data(), a.beta = in.beta.data();
  a.state = state, a.out = out, a.n_tokens = p.n_tokens;
  a.n_head_k = p.n_head_k, a.n_head_v = p.n_head_v, a.d_k = p.d_k, a.d_v = p.d_v;
  a.form = DeltaRuleForm::kChunked, a.chunk_size = p.chunk;
  return a;
}

/// chunk_kernel's workspace for the chunk [t0, t0 + n) and value head h, in fp64 from op.hpp's
/// formulas, rounded to fp32 where it is stored.
void fill_workspace(GatedDeltaArgs const& a, gd::ChunkLayout const& l, std::int64_t t0, int n, int h, float* base) {
  int const dk = a.d_k, dv = a.d_v, kh = a.key_head(h);
  auto const idx = [](int i, int j, int ld) { return at(std::int64_t{i} * ld + j); };
  std::vector<double> qn(at(n * dk)), kn(at(n * dk)), gam(at(n)), beta(at(n));
  auto l2norm = [&](float const* x, double scale, double* y) {
    double ss = 0;
    for (int i = 0; i < dk; ++i) ss += double{x[i]} * x[i];
    double const f = scale / std::sqrt(ss + a.l2norm_eps);
    for (int i = 0; i < dk; ++i) y[i] = x[i] * f;
  };
  for (int i = 0; i < n; ++i) {
    std::int64_t const t = t0 + i;
    l2norm(a.q + t * a.q_stride_or_default() + kh * dk, 1.0 / std::sqrt(double(dk)), &qn[idx(i, 0, dk)]);
    l2norm(a.k + t * a.k_stride_or_default() + kh * dk, 1.0, &kn[idx(i, 0, dk)]);
    gam[at(i)] = (i ? gam[at(i - 1)] : 0.0) + a.g[t * a.n_head_v + h];
    beta[at(i)] = a.beta[t * a.n_head_v + h];
  }
  auto dot = [&](std::vector<double> const& x, int i, std::vector<double> const& y, int j) {
    double s = 0;
    for (int d = 0; d < dk; ++d) s += x[idx(i, d, dk)] * y[idx(j, d, dk)];
    return s;
  };
  auto gamma = [&](int i, int j) { return std::exp(gam[at(i)] - gam[at(j)]); };
  // (I + A) X = B by forward substitution, A_ij = β_i k̂_i·k̂_j Γ_ij for j < i.
  auto solve = [&](int cols, auto b_of, float* x_out) {
    std::vector<double> x(at(n * cols));
    for (int i = 0; i < n; ++i)
      for (int c = 0; c < cols; ++c) {
        double s = b_of(i, c);
        for (int j = 0; j < i; ++j) s -= beta[at(i)] * dot(kn, i, kn, j) * gamma(i, j) * x[idx(j, c, cols)];
        x[idx(i, c, cols)] = s;
        x_out[idx(i, c, cols)] = static_cast<float>(s);
      }
  };
  solve(dk, [&](int i, int c) { return beta[at(i)] * std::exp(gam[at(i)]) * kn[idx(i, c, dk)]; }, l.w(base));
  solve(dv, [&](int i, int c) { return beta[at(i)] * a.v[(t0 + i) * a.v_stride_or_default() + h * dv + c]; },
        l.u(base));
  for (int i = 0; i < n; ++i)
    for (int d = 0; d < dk; ++d) {
      l.qg(base)[idx(i, d, dk)] = static_cast<float>(std::exp(gam[at(i)]) * qn[idx(i, d, dk)]);
      l.kd(base)[idx(i, d, dk)] = static_cast<float>(gamma(n - 1, i) * kn[idx(i, d, dk)]);
    }
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) l.qk(base)[idx(i, j, l.c)] = j <= i ? static_cast<float>(dot(qn, i, kn, j) * gamma(i, j)) : 0.0f;
  *l.last(base) = static_cast<float>(std::exp(gam[at(n - 1)]));
}

/// A warp's accumulators over the CTA's columns: n-tile, lane, register.
using Tiles = std::array<std::array<Acc, 32>, mma::kNTiles>;

/// The B fragment of rows [8 kt, 8 kt + 8) and columns [8 nt, 8 nt + 8) of S or V' in shared
/// memory.
std::array<Floats2, 32> b_fragment(float const* m, int kt, int nt) {
  std::array<Floats2, 32> b{};
  for (int lane = 0; lane < 32; ++lane)
    for (int r = 0; r < 2; ++r) b[at(lane)][at(r)] = m[mma::b_offset(lane, r, kt, nt)];
  return b;
}

/// acc += a V'[8 kt, 8 kt + 8) over the CTA's columns, as device.cuh's add_times_vp.
void add_times_vp(Tiles& acc, std::array<Floats4, 32> const& a, float const* vp, int kt) {
  for (int nt = 0; nt < mma::kNTiles; ++nt) emulate_mma_3xtf32(acc[at(nt)], a, b_fragment(vp, kt, nt));
}

/// One CTA of state_kernel (value head h, columns [32 bx, 32 bx + 32)) over every chunk, on the
/// host: reads a.state and the workspace, writes a.out and a.state.
void run_cta(GatedDeltaArgs const& a, gd::ChunkLayout const& l, std::vector<float>& work, int h, int bx) {
  using mma::a_col;
  using mma::a_row;
  using mma::c_col;
  using mma::c_row;
  using mma::kLd;
  using mma::kNTiles;
  using mma::kWarps;
  int const dk = a.d_k, dv = a.d_v, c = l.c, rows = mma::state_rows(dk), k_steps = (dk + 7) / 8;
  int const col0 = bx * gd::kCols;
  std::vector<float> smem(at(mma::smem_floats(dk)), std::numeric_limits<float>::quiet_NaN());
  float* const ss = smem.data();
  float* const vp = ss + rows * kLd;
  float* const state = a.state + std::int64_t{h} * dk * dv;
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < gd::kCols; ++j)
      ss[i * kLd + j] = i < dk && col0 + j < dv ? state[std::int64_t{i} * dv + col0 + j] : 0.0f;

  std::int64_t const n_chunks = (a.n_tokens + c - 1) / c;
  for (std::int64_t ci = 0; ci < n_chunks; ++ci) {
    std::int64_t const t0 = ci * c;
    int const n = static_cast<int>(std::min<std::int64_t>(c, a.n_tokens - t0));
    float* const base = work.data() + (ci * a.n_head_v + h) * l.floats();
    std::array<Tiles, kWarps> o{};
    // 1. every warp: W S and e^γ q̂ S; V' = U − W S.
    for (int warp = 0; warp < kWarps; ++warp) {
      int const r0 = 16 * warp;
      if (r0 >= n) continue;
      Tiles ws{};
      for (int ks = 0; ks < k_steps; ++ks) {
        std::array<Floats4, 32> aw{}, aq{};
        for (int lane = 0; lane < 32; ++lane)
          for (int r = 0; r < 4; ++r) {
            int const i = r0 + a_row(lane, r), d = 8 * ks + a_col(lane, r);
            bool const in = i < n && d < dk;
            aw[at(lane)][at(r)] = in ? l.w(base)[i * dk + d] : 0.0f;
            aq[at(lane)][at(r)] = in ? l.qg(base)[i * dk + d] : 0.0f;
          }
        for (int nt = 0; nt < kNTiles; ++nt) {
          auto const b = b_fragment(ss, ks, nt);
          emulate_mma_3xtf32(ws[at(nt)], aw, b);
          emulate_mma_3xtf32(o[at(warp)][at(nt)], aq, b);
        }
      }
      for (int nt = 0; nt < kNTiles; ++nt)
        for (int lane = 0; lane < 32; ++lane)
          for (int r = 0; r < 4; ++r) {
            int const i = r0 + c_row(lane, r), col = col0 + 8 * nt + c_col(lane, r);
            float const ui = i < n && col < dv ? l.u(base)[std::int64_t{i} * dv + col] : 0.0f;
            vp[mma::c_offset(lane, r, warp, nt)] = i < n ? ui - ws[at(nt)][at(lane)][at(r)] : 0.0f;
          }
    }
    // barrier; 2. every warp: O += (Q Kᵀ ⊙ Γ) V', written out.
    for (int warp = 0; warp < kWarps; ++warp) {
      int const r0 = 16 * warp;
      if (r0 >= n) continue;
      int const kt_end = (std::min(n, r0 + 16) + 7) / 8;
      for (int kt = 0; kt < kt_end; ++kt) {
        std::array<Floats4, 32> aqk{};
        for (int lane = 0; lane < 32; ++lane)
          for (int r = 0; r < 4; ++r) {
            int const i = r0 + a_row(lane, r), j = 8 * kt + a_col(lane, r);
            aqk[at(lane)][at(r)] = i < n && j < n ? l.qk(base)[i * c + j] : 0.0f;
          }
        add_times_vp(o[at(warp)], aqk, vp, kt);
      }
      for (int nt = 0; nt < kNTiles; ++nt)
        for (int lane = 0; lane < 32; ++lane)
          for (int r = 0; r < 4; ++r) {
            int const i = r0 + c_row(lane, r), col = col0 + 8 * nt + c_col(lane, r);
            if (i < n && col < dv) a.out[((t0 + i) * a.n_head_v + h) * dv + col] = o[at(warp)][at(nt)][at(lane)][at(r)];
          }
    }
    // 3. every warp's row tiles: S ← e^{γ_last} S + kdᵀ V'.
    float const last = *l.last(base);
    int const kt_end = (n + 7) / 8;
    for (int warp = 0; warp < kWarps; ++warp)
      for (int mt = warp; mt < rows / 16; mt += kWarps) {
        Tiles acc{};
        for (int nt = 0; nt < kNTiles; ++nt)
          for (int lane = 0; lane < 32; ++lane)
            for (int r = 0; r < 4; ++r) acc[at(nt)][at(lane)][at(r)] = last * ss[mma::c_offset(lane, r, mt, nt)];
        for (int kt = 0; kt < kt_end; ++kt) {
          std::array<Floats4, 32> akd{};
          for (int lane = 0; lane < 32; ++lane)
            for (int r = 0; r < 4; ++r) {
              int const d = 16 * mt + a_row(lane, r), j = 8 * kt + a_col(lane, r);
              akd[at(lane)][at(r)] = d < dk && j < n ? l.kd(base)[j * dk + d] : 0.0f;
            }
          add_times_vp(acc, akd, vp, kt);
        }
        for (int nt = 0; nt < kNTiles; ++nt)
          for (int lane = 0; lane < 32; ++lane)
            for (int r = 0; r < 4; ++r)
              if (16 * mt + c_row(lane, r) < dk) ss[mma::c_offset(lane, r, mt, nt)] = acc[at(nt)][at(lane)][at(r)];
      }
  }
  for (int i = 0; i < dk; ++i)
    for (int j = 0; j < gd::kCols; ++j)
      if (col0 + j < dv) state[std::int64_t{i} * dv + col0 + j] = ss[i * kLd + j];
}

/// The chunked form on the host through run_cta: workspace for every chunk and head, then the
/// grid's CTAs (they touch disjoint columns, so their order does not matter).
void tiled_gated_delta(GatedDeltaArgs const& a) {
  int const c = gd::chunk_tokens(a.chunk_size, a.d_k);
  gd::ChunkLayout const l{c, a.d_k, a.d_v};
  std::int64_t const n_chunks = (a.n_tokens + c - 1) / c;
  std::vector<float> work(at(n_chunks * a.n_head_v * l.floats()), std::numeric_limits<float>::quiet_NaN());
  for (std::int64_t ci = 0; ci < n_chunks; ++ci)
    for (int h = 0; h < a.n_head_v; ++h) {
      int const n = static_cast<int>(std::min<std::int64_t>(c, a.n_tokens - ci * c));
      fill_workspace(a, l, ci * c, n, h, work.data() + (ci * a.n_head_v + h) * l.floats());
    }
  for (int h = 0; h < a.n_head_v; ++h)
    for (int bx = 0; bx < (a.d_v + gd::kCols - 1) / gd::kCols; ++bx) run_cta(a, l, work, h, bx);
}

void check(Problem const& p) {
  CAPTURE(p.n_head_k);
  CAPTURE(p.n_head_v);
  CAPTURE(p.d_k);
  CAPTURE(p.d_v);
  CAPTURE(p.n_tokens);
  CAPTURE(p.chunk);
  CAPTURE(p.long_memory);
  Inputs const in = make_inputs(p);
  std::size_t const out_n = at(p.n_tokens * p.n_head_v * p.d_v);
  std::vector<float> want(out_n), got(out_n, std::numeric_limits<float>::quiet_NaN());
  auto state_want = in.state, state_got = in.state;
  ref::gated_delta(args_of(p, in, state_want.data(), want.data()));
  tiled_gated_delta(args_of(p, in, state_got.data(), got.data()));
  auto const o = all_close<float, float>(got, want, kDelta);
  CHECK_MESSAGE(o.ok, "outputs: ", o.report);
  auto const s = all_close<float, float>(state_got, state_want, kDelta);
  CHECK_MESSAGE(s.ok, "state: ", s.report);
}

}  // namespace

TEST_CASE("gated_delta mma: the state pass equals the recurrence, Qwen3.6's heads") {
  check({1, 2, 128, 128, 150, 64});                        // two whole chunks and 22 tokens
  check({1, 1, 128, 128, 200, 64, /*long_memory=*/true});  // far products that weigh
}

TEST_CASE("gated_delta mma: widths that fill no tile, short and one-token chunks") {
  check({1, 1, 17, 33, 40, 64, true});   // one k-step short, two column blocks, 40 of 64 rows
  check({1, 2, 40, 70, 77, 20});         // chunks of 20: a warp's 4 tokens past the chunk
  check({2, 4, 64, 64, 65, 64});         // a last chunk of one token
  check({1, 1, 64, 32, 30, 1, true});    // chunks of one token
  check({1, 1, 256, 40, 70, 64});        // d_k 256: chunks of 32, as chunk_kernel's shared memory allows
  check({1, 1, 24, 16, 16, 16});         // exactly one chunk of 16
}

TEST_CASE("gated_delta mma: fragment loads fall in 32 banks and inside shared memory") {
  for (int kt = 0; kt < 4; ++kt)
    for (int nt = 0; nt < mma::kNTiles; ++nt)
      for (int r = 0; r < 2; ++r) {
        std::set<int> banks;
        for (int lane = 0; lane < 32; ++lane) banks.insert(mma::b_offset(lane, r, kt, nt) % 32);
        CHECK(banks.size() == 32);
      }
  for (int dk : {1, 17, 128, 256}) {
    int const rows = mma::state_rows(dk);
    CHECK(rows % 16 == 0);
    CHECK(rows >= dk);
    // The last row tile's accumulators and the last k-step's B fragments of S stay in S.
    for (int lane = 0; lane < 32; ++lane)
      for (int nt = 0; nt < mma::kNTiles; ++nt) {
        for (int r = 0; r < 4; ++r) CHECK(mma::c_offset(lane, r, rows / 16 - 1, nt) < rows * mma::kLd);
        for (int r = 0; r < 2; ++r) CHECK(mma::b_offset(lane, r, (dk + 7) / 8 - 1, nt) < rows * mma::kLd);
      }
    // V' (after S) holds every chunk's tokens.
    CHECK(mma::smem_floats(dk) == (rows + gd::kMaxChunk) * mma::kLd);
  }
  CHECK(mma::kWarps * 16 == gd::kMaxChunk);
}

TEST_CASE("gated_delta mma: chunks on the device hold at most 64 tokens, fewer where d_k is wide") {
  CHECK(gd::chunk_tokens(64, 128) == 64);
  CHECK(gd::chunk_tokens(1024, 128) == 64);
  CHECK(gd::chunk_tokens(20, 128) == 20);
  CHECK(gd::chunk_tokens(64, 152) == 64);
  CHECK(gd::chunk_tokens(64, 153) == 32);  // q̂ and k̂ rows 164 floats apart
  CHECK(gd::chunk_tokens(64, 256) == 32);
  CHECK(gd::chunk_tokens(1, 256) == 1);
  for (int dk = 1; dk <= 256; ++dk) CHECK(gd::chunk_smem(gd::chunk_tokens(64, dk), dk) <= gd::kMaxChunkSmem);
}

TEST_CASE("gated_delta mma: chunk_kernel's Gram blocks cover the lower triangle once, its fragments without bank conflicts") {
  for (int row_tiles = 1; row_tiles <= gd::kMaxChunk / 16; ++row_tiles) {
    CAPTURE(row_tiles);
    int const m = 16 * row_tiles;
    std::vector<int> hits(static_cast<std::size_t>(m * m));
    for (int t = 0; t < gd::gram_blocks(row_tiles); ++t) {
      gd::GramBlock const block = gd::gram_block(t);
      REQUIRE(block.mt < row_tiles);
      CHECK(block.ct <= block.mt);  // no block wholly above the diagonal
      for (int i = 16 * block.mt; i < 16 * block.mt + 16; ++i)
        for (int j = 16 * block.ct; j < 16 * block.ct + 16; ++j) ++hits[static_cast<std::size_t>(i * m + j)];
    }
    for (int i = 0; i < m; ++i)
      for (int j = 0; j <= i; ++j) CHECK(hits[static_cast<std::size_t>(i * m + j)] == 1);
  }
  // A by columns chunk_lda apart: the Gram's C fragments (rows g, columns 2 t + r % 2) write 32
  // banks; columns a whole number of float4s apart; and the substitution's reads of 16 rows of
  // a column, for every chunk length and last token, stay inside A.
  for (int c = 1; c <= gd::kMaxChunk; ++c) {
    CAPTURE(c);
    int const lda = gd::chunk_lda(c);
    CHECK(lda >= c);
    CHECK(lda % 4 == 0);
    for (int n = 1; n <= c; ++n) {
      int const last_block = (n - 1) / gd::kSolveRows * gd::kSolveRows;
      CHECK((n - 1) * lda + last_block + gd::kSolveRows <= gd::chunk_a_floats(c));
    }
    for (int r = 0; r < 4; ++r) {
      std::set<int> banks;
      for (int lane = 0; lane < 32; ++lane) banks.insert((tf32::c_col(lane, r) * lda + tf32::c_row(lane, r)) % 32);
      CHECK(banks.size() == 32);
    }
  }
  // q̂ and k̂ rows chunk_ld apart: an A fragment's lanes (rows g, columns t) and a B fragment's
  // (columns g, rows t: k̂'s rows again) read 32 different banks.
  for (int dk : {1, 17, 40, 64, 128, 256}) {
    CAPTURE(dk);
    int const ld = gd::chunk_ld(dk);
    CHECK(ld >= (dk + 7) / 8 * 8);
    for (int r = 0; r < 4; ++r) {
      std::set<int> banks;
      for (int lane = 0; lane < 32; ++lane) banks.insert((tf32::a_row(lane, r) * ld + tf32::a_col(lane, r)) % 32);
      CHECK(banks.size() == 32);
    }
    for (int r = 0; r < 2; ++r) {
      std::set<int> banks;
      for (int lane = 0; lane < 32; ++lane) banks.insert((tf32::b_col(lane) * ld + tf32::b_row(lane, r)) % 32);
      CHECK(banks.size() == 32);
    }
  }
}
