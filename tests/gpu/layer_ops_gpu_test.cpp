// The model's smaller ops on CUDA (gated_rmsnorm, gdn_gates, qk_norm_rope, also with the keys
// in the same call, causal_conv1d, gated_delta, gdn_decode, also with raw gates and the output
// norm, router_topk, embedding, token_candidates):
// every compiled instance (spec x arch) this device runs, against the CPU twins and the fp64
// references, over the spec's shapes (or several when they are dynamic), rows past the grid
// cap, y over x, strided heads, partial and full rotation, both norm-weight kinds, and a
// sequence conv'd (and run through the delta rule) in several calls through its state, q/k/v
// read straight out of the conv output, both value-head orders, every routing policy (also
// per token) with the shared-expert gate, the router's GEMV in the same call, every weight
// format of the embedding table and an id outside it. Tolerances: fp32 sums in another order
// (and fused multiply-adds) and the device's expf/log1pf (within 2 ulp) against the CPU's.
#include "gpu/gpu_main.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

#include "qflash/kernels/causal_conv1d/cpu.hpp"
#include "qflash/kernels/causal_conv1d/ref.hpp"
#include "qflash/kernels/common/stream_workspace.cuh"
#include "qflash/kernels/gated_delta/cpu.hpp"
#include "qflash/kernels/gated_delta/ref.hpp"
#include "qflash/kernels/gated_rmsnorm/cpu.hpp"
#include "qflash/kernels/gated_rmsnorm/ref.hpp"
#include "qflash/kernels/gdn_decode/cpu.hpp"
#include "qflash/kernels/gdn_decode/ref.hpp"
#include "qflash/kernels/gdn_gates/cpu.hpp"
#include "qflash/kernels/gdn_gates/ref.hpp"
#include "qflash/kernels/qk_norm_rope/cpu.hpp"
#include "qflash/kernels/qk_norm_rope/ref.hpp"
#include "qflash/kernels/embedding/cpu.hpp"
#include "qflash/kernels/router_topk/cpu.hpp"
#include "qflash/kernels/router_topk/ref.hpp"
#include "qflash/kernels/token_candidates/cpu.hpp"
#include "qflash/numeric/weight_encode.hpp"
#include "support/random.hpp"
#include "support/tolerance.hpp"

using namespace qflash;
using namespace qflash::kernels;
using test::all_close;
using test::Tolerance;
using test::gpu::DeviceArray;

namespace {

constexpr Tolerance kNorm{2e-5, 1e-5};
constexpr Tolerance kGates{1e-6, 1e-6};
// Against the fp64 reference: an fp32 angle pos * inv_freq (inv_freq <= 1, both rounded) is
// off by up to pos * 2^-23 radians, which moves an output by that fraction of its pair's size.
Tolerance rope_tolerance(std::int64_t max_pos, std::span<float const> want) {
  double max_out = 0;
  for (float v : want) max_out = std::max(max_out, std::fabs(static_cast<double>(v)));
  return {1e-5 + static_cast<double>(max_pos) * 0x1p-23 * max_out, 1e-5};
}
// The delta rule's state carries rounding from token to token (the op harness allows the
// CPU 5e-6 / 5e-5 against the fp64 reference over a few tokens; these run hundreds).
constexpr Tolerance kDelta{5e-5, 2e-4};

void synchronize() { QFLASH_TEST_CUDA(cudaDeviceSynchronize()); }

template <MoeSpec S, class Tag>
void check_gated_rmsnorm(std::int64_t rows, int cols, bool in_place) {
  CAPTURE(rows);
  CAPTURE(cols);
  CAPTURE(in_place);
  auto const x = test::random_floats(static_cast<std::size_t>(rows * cols), 31, -2, 2);
  auto const z = test::random_floats(x.size(), 32, -6, 6);
  auto const w = test::random_floats(static_cast<std::size_t>(cols), 33, 0.5f, 1.5f);
  auto args = [&](float const* xp, float const* zp, float const* wp, float* yp) {
    GatedRmsNormArgs a{};
    a.x = xp, a.z = zp, a.weight = wp, a.y = yp, a.n_rows = rows, a.n_cols = cols, a.eps = 1e-6f;
    return a;
  };
  std::vector<float> want(x.size()), cpu(x.size());
  ref::gated_rmsnorm(args(x.data(), z.data(), w.data(), want.data()));
  REQUIRE(launch_gated_rmsnorm<S>(arch::Cpu{}, args(x.data(), z.data(), w.data(), cpu.data())) == Status::kSuccess);
  DeviceArray<float> dx(x), dz(z), dw(w), dy(x.size());
  float* const y = in_place ? dx.get() : dy.get();
  REQUIRE(launch_gated_rmsnorm<S>(Tag{}, args(dx.get(), dz.get(), dw.get(), y), nullptr) == Status::kSuccess);
  synchronize();
  std::vector<float> const got = (in_place ? dx : dy).download();
  auto const c = all_close<float, float>(got, cpu, kNorm);
  CHECK_MESSAGE(c.ok, "GPU vs CPU twin: ", c.report);
  auto const r = all_close<float, float>(got, want, kNorm);
  CHECK_MESSAGE(r.ok, "GPU vs ref: ", r.report);
}

template <MoeSpec S, class Tag>
void check_gdn_gates(std::int64_t tokens, int heads) {
  CAPTURE(tokens);
  CAPTURE(heads);
  auto const b = test::random_floats(static_cast<std::size_t>(tokens * heads), 41, -8, 8);
  auto const a = test::random_floats(b.size(), 42, -10, 30);  // both sides of softplus's x > 20
  auto const dt_bias = test::random_floats(static_cast<std::size_t>(heads), 43, -1, 1);
  auto const neg_a = test::random_floats(static_cast<std::size_t>(heads), 44, -2, -0.01f);
  auto args = [&](float* beta, float* g, float const* dt, float const* na) {
    GdnGatesArgs x{};
    x.beta = beta, x.g = g, x.dt_bias = dt, x.neg_a = na, x.n_tokens = tokens, x.n_head_v = heads;
    return x;
  };
  auto beta_ref = b, g_ref = a, beta_cpu = b, g_cpu = a;
  ref::gdn_gates(args(beta_ref.data(), g_ref.data(), dt_bias.data(), neg_a.data()));
  REQUIRE(launch_gdn_gates<S>(arch::Cpu{}, args(beta_cpu.data(), g_cpu.data(), dt_bias.data(), neg_a.data())) ==
          Status::kSuccess);
  DeviceArray<float> beta(b), g(a), dt(dt_bias), na(neg_a);
  REQUIRE(launch_gdn_gates<S>(Tag{}, args(beta.get(), g.get(), dt.get(), na.get()), nullptr) == Status::kSuccess);
  synchronize();
  for (auto const& [got, cpu, want] : {std::tuple{beta.download(), beta_cpu, beta_ref}, std::tuple{g.download(), g_cpu, g_ref}}) {
    auto const c = all_close<float, float>(got, cpu, kGates);
    CHECK_MESSAGE(c.ok, "GPU vs CPU twin: ", c.report);
    auto const r = all_close<float, float>(got, want, kGates);
    CHECK_MESSAGE(r.ok, "GPU vs ref: ", r.report);
  }
}

struct RopeCase {
  std::int64_t tokens;
  int heads, d, rotary_dim;
  bool strided;  ///< heads 2d apart, as q inside qwen3_5_moe's [query | gate] rows
  NormWeight weight_kind;
  bool in_place;
};

template <MoeSpec S, class Tag>
void check_qk_norm_rope(RopeCase const& k) {
  CAPTURE(k.tokens);
  CAPTURE(k.heads);
  CAPTURE(k.d);
  CAPTURE(k.rotary_dim);
  CAPTURE(k.strided);
  CAPTURE(k.in_place);
  std::int64_t const hs = k.strided ? 2 * k.d : k.d;
  auto const x = test::random_floats(static_cast<std::size_t>(k.tokens * k.heads * hs), 51, -3, 3);
  auto const w = test::random_floats(static_cast<std::size_t>(k.d), 52, -0.5f, 0.5f);
  std::vector<std::int64_t> positions(static_cast<std::size_t>(k.tokens));
  for (std::size_t t = 0; t < positions.size(); ++t) positions[t] = static_cast<std::int64_t>(t * 997 % 100000);
  auto args = [&](float const* xp, float const* wp, float* yp, std::int64_t const* pos) {
    QkNormRopeArgs a{};
    a.x = xp, a.head_stride = hs, a.weight = wp, a.y = yp, a.positions = pos, a.n_tokens = k.tokens;
    a.n_head = k.heads, a.d_head = k.d, a.rotary_dim = k.rotary_dim, a.theta = 10000000.0f, a.eps = 1e-6f;
    a.weight_kind = k.weight_kind;
    return a;
  };
  std::size_t const out = static_cast<std::size_t>(k.tokens * k.heads * k.d);
  std::vector<float> want(out), cpu(out);
  ref::qk_norm_rope(args(x.data(), w.data(), want.data(), positions.data()));
  REQUIRE(launch_qk_norm_rope<S>(arch::Cpu{}, args(x.data(), w.data(), cpu.data(), positions.data())) ==
          Status::kSuccess);
  DeviceArray<float> dx(x), dw(w), dy(out);
  DeviceArray<std::int64_t> dpos(positions);
  float* const y = k.in_place ? dx.get() : dy.get();
  REQUIRE(launch_qk_norm_rope<S>(Tag{}, args(dx.get(), dw.get(), y, dpos.get()), nullptr) == Status::kSuccess);
  synchronize();
  std::vector<float> got = (k.in_place ? dx : dy).download();
  got.resize(out);
  auto const c = all_close<float, float>(got, cpu, kNorm);  // the same fp32 angles
  CHECK_MESSAGE(c.ok, "GPU vs CPU twin: ", c.report);
  auto const r = all_close<float, float>(got, want,
                                        rope_tolerance(*std::max_element(positions.begin(), positions.end()), want));
  CHECK_MESSAGE(r.ok, "GPU vs ref: ", r.report);
}

/// Queries out of [query | gate] rows and GQA keys in place, in one call (the model's): both
/// sets against the CPU twin's same call.
template <MoeSpec S, class Tag>
void check_qk_norm_rope_keys(std::int64_t tokens, int heads, int kv_heads, int d, int rotary_dim) {
  CAPTURE(tokens);
  CAPTURE(heads);
  CAPTURE(kv_heads);
  CAPTURE(d);
  auto const qg = test::random_floats(static_cast<std::size_t>(tokens * heads * 2 * d), 53, -3, 3);
  auto const k0 = test::random_floats(static_cast<std::size_t>(tokens * kv_heads * d), 54, -3, 3);
  auto const wq = test::random_floats(static_cast<std::size_t>(d), 55, -0.5f, 0.5f);
  auto const wk = test::random_floats(static_cast<std::size_t>(d), 56, -0.5f, 0.5f);
  std::vector<std::int64_t> positions(static_cast<std::size_t>(tokens));
  for (std::size_t t = 0; t < positions.size(); ++t) positions[t] = static_cast<std::int64_t>(t * 31 % 5000);
  auto args = [&](float const* x, float const* w_q, float* q, float* k, float const* w_k, std::int64_t const* pos) {
    QkNormRopeArgs a{};
    a.x = x, a.token_stride = std::int64_t{heads} * 2 * d, a.head_stride = 2 * d, a.weight = w_q, a.y = q;
    a.positions = pos, a.n_tokens = tokens, a.n_head = heads, a.d_head = d, a.rotary_dim = rotary_dim;
    a.theta = 1000000.0f, a.eps = 1e-6f;
    a.keys = {k, std::int64_t{kv_heads} * d, d, w_k, k, kv_heads};
    return a;
  };
  std::vector<float> q_cpu(static_cast<std::size_t>(tokens * heads * d)), k_cpu(k0);
  REQUIRE(launch_qk_norm_rope<S>(arch::Cpu{}, args(qg.data(), wq.data(), q_cpu.data(), k_cpu.data(), wk.data(),
                                                   positions.data())) == Status::kSuccess);
  DeviceArray<float> dqg(qg), dk(k0), dwq(wq), dwk(wk), dq(q_cpu.size());
  DeviceArray<std::int64_t> dpos(positions);
  REQUIRE(launch_qk_norm_rope<S>(Tag{}, args(dqg.get(), dwq.get(), dq.get(), dk.get(), dwk.get(), dpos.get()),
                                 nullptr) == Status::kSuccess);
  synchronize();
  auto const q = all_close<float, float>(dq.download(), q_cpu, kNorm);
  CHECK_MESSAGE(q.ok, "GPU vs CPU twin (queries): ", q.report);
  auto const k = all_close<float, float>(dk.download(), k_cpu, kNorm);
  CHECK_MESSAGE(k.ok, "GPU vs CPU twin (keys): ", k.report);
}

/// A sequence of `runs` tokens in order, conv'd call by call from a random state; y and the
/// final state against the CPU's and the reference's.
template <MoeSpec S, class Tag>
void check_causal_conv1d(int channels, int d_conv, std::vector<std::int64_t> const& runs, bool silu) {
  CAPTURE(channels);
  CAPTURE(d_conv);
  CAPTURE(runs.size());
  CAPTURE(silu);
  std::int64_t n = 0;
  for (auto r : runs) n += r;
  auto const x = test::random_floats(static_cast<std::size_t>(n * channels), 61, -2, 2);
  auto const w = test::random_floats(static_cast<std::size_t>(channels * d_conv), 62, -1, 1);
  auto const state0 = test::random_floats(static_cast<std::size_t>(channels * (d_conv - 1)), 63, -2, 2);
  auto args = [&](float const* xp, float const* wp, float* st, float* yp, std::int64_t tokens) {
    CausalConv1dArgs a{};
    a.x = xp, a.weight = wp, a.state = d_conv > 1 ? st : nullptr, a.y = yp, a.n_tokens = tokens;
    a.n_channels = channels, a.d_conv = d_conv, a.apply_silu = silu;
    return a;
  };
  std::vector<float> want(x.size()), cpu(x.size());
  auto state_ref = state0, state_cpu = state0;
  DeviceArray<float> dx(x), dw(w), dstate(state0), dy(x.size());
  std::int64_t t0 = 0;
  for (std::int64_t len : runs) {
    std::int64_t const off = t0 * channels;
    ref::causal_conv1d(args(x.data() + off, w.data(), state_ref.data(), want.data() + off, len));
    REQUIRE(launch_causal_conv1d<S>(arch::Cpu{}, args(x.data() + off, w.data(), state_cpu.data(), cpu.data() + off, len)) ==
            Status::kSuccess);
    REQUIRE(launch_causal_conv1d<S>(Tag{}, args(dx.get() + off, dw.get(), dstate.get(), dy.get() + off, len), nullptr) ==
            Status::kSuccess);
    t0 += len;
  }
  synchronize();
  for (auto const& [got, cpu_out, want_out] :
       {std::tuple{dy.download(), cpu, want}, std::tuple{dstate.download(), state_cpu, state_ref}}) {
    auto const c = all_close<float, float>(got, cpu_out, kNorm);
    CHECK_MESSAGE(c.ok, "GPU vs CPU twin: ", c.report);
    auto const r = all_close<float, float>(got, want_out, kNorm);
    CHECK_MESSAGE(r.ok, "GPU vs ref: ", r.report);
  }
}

struct DeltaCase {
  int n_head_k, n_head_v, d_k, d_v;
  std::vector<std::int64_t> runs;  ///< tokens per call
  bool tiled;                      ///< value head j reads q/k head j % n_head_k
  bool strided;                    ///< q, k, v inside one [q | k | v] row per token
  int chunk = 64;                  ///< the chunked form's chunk_size
  /// Decays near 1 (g in [-0.05, 0]) and q, k of one sign, as a trained layer's: a chunk's
  /// far products and deep substitution rows then weigh (with g down to -2 and keys of both
  /// signs they fade within a dozen tokens, and A is near the identity).
  bool long_memory = false;
};

template <MoeSpec S, class Tag>
void check_gated_delta(DeltaCase const& c) {
  CAPTURE(c.n_head_k);
  CAPTURE(c.n_head_v);
  CAPTURE(c.d_k);
  CAPTURE(c.d_v);
  CAPTURE(c.runs.size());
  CAPTURE(c.tiled);
  CAPTURE(c.strided);
  CAPTURE(c.chunk);
  CAPTURE(c.long_memory);
  float const qk_lo = c.long_memory ? 0.0f : -1.0f;
  std::int64_t n = 0;
  for (auto r : c.runs) n += r;
  std::int64_t const qk = std::int64_t{c.n_head_k} * c.d_k, vw = std::int64_t{c.n_head_v} * c.d_v;
  std::int64_t const row = c.strided ? 2 * qk + vw : 0;  // floats per token of the shared row
  std::vector<float> q, k, v;
  std::vector<float> qkv;
  if (c.strided) {
    qkv = test::random_floats(static_cast<std::size_t>(n * row), 71, qk_lo, 1);
  } else {
    q = test::random_floats(static_cast<std::size_t>(n * qk), 72, qk_lo, 1);
    k = test::random_floats(static_cast<std::size_t>(n * qk), 73, qk_lo, 1);
    v = test::random_floats(static_cast<std::size_t>(n * vw), 74, -1, 1);
  }
  auto const g = test::random_floats(static_cast<std::size_t>(n * c.n_head_v), 75, c.long_memory ? -0.05f : -2.0f,
                                     c.long_memory ? 0.0f : -0.001f);
  auto const beta = test::random_floats(g.size(), 76, 0.0f, 1.0f);
  auto const state0 = test::random_floats(static_cast<std::size_t>(c.n_head_v * c.d_k * c.d_v), 77, -0.5f, 0.5f);
  // Host and device operands: a base pointer per operand, offset per call below.
  struct Ops {
    float const *q, *k, *v, *g, *beta;
    float *state, *out;
  };
  auto args = [&](Ops o, std::int64_t t0, std::int64_t len, DeltaRuleForm form) {
    GatedDeltaArgs a{};
    std::int64_t const qs = c.strided ? row : qk, vs = c.strided ? row : vw;
    a.q = o.q + t0 * qs, a.k = o.k + t0 * qs, a.v = o.v + t0 * vs;
    a.g = o.g + t0 * c.n_head_v, a.beta = o.beta + t0 * c.n_head_v;
    a.state = o.state, a.out = o.out + t0 * vw, a.n_tokens = len;
    a.n_head_k = c.n_head_k, a.n_head_v = c.n_head_v, a.d_k = c.d_k, a.d_v = c.d_v;
    a.q_stride = c.strided ? row : 0, a.k_stride = a.q_stride, a.v_stride = a.q_stride;
    a.tiled_value_heads = c.tiled, a.form = form, a.chunk_size = c.chunk;
    return a;
  };
  auto host_ops = [&](std::vector<float>& state, std::vector<float>& out) {
    if (c.strided) return Ops{qkv.data(), qkv.data() + qk, qkv.data() + 2 * qk, g.data(), beta.data(), state.data(), out.data()};
    return Ops{q.data(), k.data(), v.data(), g.data(), beta.data(), state.data(), out.data()};
  };
  std::size_t const out_n = static_cast<std::size_t>(n * vw);
  std::vector<float> want(out_n), rec(out_n), chunk(out_n);
  auto state_ref = state0, state_rec = state0, state_chunk = state0;
  DeviceArray<float> dq(c.strided ? qkv : q), dk(k), dv(v), dg(g), dbeta(beta), dstate(state0),
      dout(out_n);
  Ops const dev = c.strided ? Ops{dq.get(), dq.get() + qk, dq.get() + 2 * qk, dg.get(), dbeta.get(), dstate.get(), dout.get()}
                            : Ops{dq.get(), dk.get(), dv.get(), dg.get(), dbeta.get(), dstate.get(), dout.get()};
  std::int64_t t0 = 0;
  for (std::int64_t len : c.runs) {
    ref::gated_delta(args(host_ops(state_ref, want), t0, len, DeltaRuleForm::kRecurrent));
    REQUIRE(launch_gated_delta<S>(arch::Cpu{}, args(host_ops(state_rec, rec), t0, len, DeltaRuleForm::kRecurrent)) ==
            Status::kSuccess);
    REQUIRE(launch_gated_delta<S>(arch::Cpu{}, args(host_ops(state_chunk, chunk), t0, len, DeltaRuleForm::kChunked)) ==
            Status::kSuccess);
    REQUIRE(launch_gated_delta<S>(Tag{}, args(dev, t0, len, DeltaRuleForm::kChunked), nullptr) == Status::kSuccess);
    t0 += len;
  }
  synchronize();
  std::vector<float> const got = dout.download(), got_state = dstate.download();
  for (auto const& [name, cpu_out, cpu_state] :
       {std::tuple{"CPU recurrent", rec, state_rec}, std::tuple{"CPU chunked", chunk, state_chunk},
        std::tuple{"ref", want, state_ref}}) {
    auto const o = all_close<float, float>(got, cpu_out, kDelta);
    CHECK_MESSAGE(o.ok, "GPU vs ", name, " (outputs): ", o.report);
    auto const st = all_close<float, float>(got_state, cpu_state, kDelta);
    CHECK_MESSAGE(st.ok, "GPU vs ", name, " (state): ", st.report);
  }
}

/// Kernels that count their CTAs on the legacy stream's counters left every one at zero.
void check_counters_clear() {
  unsigned* const counters = kernels::cuda::stream_counters(nullptr);
  REQUIRE(counters);
  std::vector<unsigned> host(kernels::cuda::kStreamCounters);
  QFLASH_TEST_CUDA(cudaMemcpy(host.data(), counters, host.size() * sizeof(unsigned), cudaMemcpyDeviceToHost));
  CHECK(std::count(host.begin(), host.end(), 0u) == static_cast<std::ptrdiff_t>(host.size()));
}

struct DecodeCase {
  int n_head_k, n_head_v, d_k, d_v, d_conv;
  bool tiled;
  int n_seqs;  ///< decoding sequences, rows 2 i + 1 of a batch of 2 n_seqs + 1 rows
  int steps;   ///< decode steps through the same states
  bool raw_gates = false;  ///< g and beta come as a and b; the op turns them into the gates
  bool norm = false;       ///< the op norms out (gated_rmsnorm)
};

/// gdn_decode on the device against its CPU twin and ref::gdn_decode, over several steps that
/// carry each sequence's conv and recurrent state; with raw gates, the gates it wrote too.
template <MoeSpec S, class Tag>
void check_gdn_decode(DecodeCase const& c) {
  CAPTURE(c.raw_gates);
  CAPTURE(c.norm);
  CAPTURE(c.n_head_k);
  CAPTURE(c.n_head_v);
  CAPTURE(c.d_k);
  CAPTURE(c.d_v);
  CAPTURE(c.d_conv);
  CAPTURE(c.tiled);
  CAPTURE(c.n_seqs);
  std::int64_t const cd = 2 * std::int64_t{c.n_head_k} * c.d_k + std::int64_t{c.n_head_v} * c.d_v;
  std::int64_t const vw = std::int64_t{c.n_head_v} * c.d_v, T = 2 * std::int64_t{c.n_seqs} + 1;
  std::int64_t const conv_n = cd * (c.d_conv - 1), state_n = std::int64_t{c.n_head_v} * c.d_k * c.d_v;
  std::vector<std::int64_t> rows;
  for (int i = 0; i < c.n_seqs; ++i) rows.push_back(2 * i + 1);
  auto const w = test::random_floats(static_cast<std::size_t>(cd * c.d_conv), 81, -0.5f, 0.5f);
  auto const dt_bias = test::random_floats(static_cast<std::size_t>(c.n_head_v), 84, -1, 1);
  auto const neg_a = test::random_floats(static_cast<std::size_t>(c.n_head_v), 85, -2, -0.01f);
  DeviceArray<float> ddt(dt_bias), dna(neg_a);
  auto const z = test::random_floats(static_cast<std::size_t>(T * vw), 86, -4, 4);
  auto const norm_w = test::random_floats(static_cast<std::size_t>(c.d_v), 87, 0.5f, 1.5f);
  DeviceArray<float> dz(z), dnw(norm_w);
  auto conv_ref = test::random_floats(static_cast<std::size_t>(c.n_seqs * conv_n), 82);
  auto state_ref = test::random_floats(static_cast<std::size_t>(c.n_seqs * state_n), 83, -0.3f, 0.3f);
  auto conv_cpu = conv_ref, state_cpu = state_ref;
  DeviceArray<float> dw(w), dconv(conv_ref), dstate(state_ref), dy(static_cast<std::size_t>(T * cd)),
      dout(static_cast<std::size_t>(T * vw));
  std::vector<float> y_ref(static_cast<std::size_t>(T * cd)), out_ref(static_cast<std::size_t>(T * vw));
  auto y_cpu = y_ref, out_cpu = out_ref;
  auto args = [&](float const* x, float* g, float* beta, float* y, float* out, float* conv, float* state,
                  std::vector<float*>& cp, std::vector<float*>& sp, float const* weight, float const* dt,
                  float const* na, float const* zp, float const* nw) {
    cp.clear();
    sp.clear();
    for (int i = 0; i < c.n_seqs; ++i) {
      cp.push_back(conv + i * conv_n);
      sp.push_back(state + i * state_n);
    }
    GdnDecodeArgs a{};
    a.x = x, a.g = g, a.beta = beta, a.conv_out = y, a.out = out, a.rows = rows.data();
    a.conv_state = cp.data(), a.state = sp.data(), a.conv_weight = weight, a.n_seqs = c.n_seqs;
    a.n_head_k = c.n_head_k, a.n_head_v = c.n_head_v, a.d_k = c.d_k, a.d_v = c.d_v, a.d_conv = c.d_conv;
    a.tiled_value_heads = c.tiled;
    if (c.raw_gates) a.dt_bias = dt, a.neg_a = na;
    if (c.norm) a.norm_weight = nw, a.z = zp, a.norm_eps = 1e-6f;
    return a;
  };
  std::vector<float*> cp, sp;
  for (int step = 0; step < c.steps; ++step) {
    auto const x = test::random_floats(static_cast<std::size_t>(T * cd), 90 + step);
    auto const g = c.raw_gates ? test::random_floats(static_cast<std::size_t>(T * c.n_head_v), 110 + step, -10, 30)
                               : test::random_floats(static_cast<std::size_t>(T * c.n_head_v), 110 + step, -1, 0);
    auto const beta = c.raw_gates ? test::random_floats(g.size(), 130 + step, -8, 8)
                                  : test::random_floats(g.size(), 130 + step, 0, 1);
    auto g_ref = g, beta_ref = beta, g_cpu = g, beta_cpu = beta;
    ref::gdn_decode(args(x.data(), g_ref.data(), beta_ref.data(), y_ref.data(), out_ref.data(), conv_ref.data(),
                         state_ref.data(), cp, sp, w.data(), dt_bias.data(), neg_a.data(), z.data(), norm_w.data()));
    REQUIRE(launch_gdn_decode<S>(arch::Cpu{}, args(x.data(), g_cpu.data(), beta_cpu.data(), y_cpu.data(),
                                                   out_cpu.data(), conv_cpu.data(), state_cpu.data(), cp, sp, w.data(),
                                                   dt_bias.data(), neg_a.data(), z.data(), norm_w.data())) ==
            Status::kSuccess);
    DeviceArray<float> dx(x), dg(g), dbeta(beta);
    REQUIRE(launch_gdn_decode<S>(Tag{}, args(dx.get(), dg.get(), dbeta.get(), dy.get(), dout.get(), dconv.get(),
                                             dstate.get(), cp, sp, dw.get(), ddt.get(), dna.get(), dz.get(), dnw.get()),
                                 nullptr) == Status::kSuccess);
    synchronize();
    // Whole arrays: rows the op must not write stay zero in all three.
    std::vector<float> const y = dy.download(), out = dout.download();
    for (auto const& [name, want_y, want_out] :
         {std::tuple{"CPU", y_cpu, out_cpu}, std::tuple{"ref", y_ref, out_ref}}) {
      auto const yc = all_close<float, float>(y, want_y, kNorm);
      CHECK_MESSAGE(yc.ok, "GPU vs ", name, " (conv output), step ", step, ": ", yc.report);
      auto const o = all_close<float, float>(out, want_out, kDelta);
      CHECK_MESSAGE(o.ok, "GPU vs ", name, " (outputs), step ", step, ": ", o.report);
    }
    for (auto const& [got, cpu, want] : {std::tuple{dg.download(), g_cpu, g_ref}, std::tuple{dbeta.download(), beta_cpu, beta_ref}}) {
      auto const gc = all_close<float, float>(got, cpu, kGates);  // raw: the gates; else untouched
      CHECK_MESSAGE(gc.ok, "GPU vs CPU (gates): ", gc.report);
      auto const gr = all_close<float, float>(got, want, kGates);
      CHECK_MESSAGE(gr.ok, "GPU vs ref (gates): ", gr.report);
    }
    check_counters_clear();
  }
  std::vector<float> const state = dstate.download(), conv = dconv.download();
  for (auto const& [name, want_state, want_conv] :
       {std::tuple{"CPU", state_cpu, conv_cpu}, std::tuple{"ref", state_ref, conv_ref}}) {
    auto const st = all_close<float, float>(state, want_state, kDelta);
    CHECK_MESSAGE(st.ok, "GPU vs ", name, " (state): ", st.report);
    auto const cs = all_close<float, float>(conv, want_conv, Tolerance{0, 0});
    CHECK_MESSAGE(cs.ok, "GPU vs ", name, " (conv state): ", cs.report);
  }
}

/// Routing of `tokens` tokens over n experts into k slots under `policy` (and, when
/// per_token, a policy per token cycling through three): experts equal the CPU's, weights and
/// the shared gate within fp32 rounding.
template <MoeSpec S, class Tag>
void check_router(std::int64_t tokens, int n, int k, RoutingPolicy policy, bool per_token, float lowest = -4.0f,
                  bool renormalize = true) {
  CAPTURE(tokens);
  CAPTURE(n);
  CAPTURE(k);
  CAPTURE(static_cast<int>(policy.kind));
  CAPTURE(per_token);
  CAPTURE(lowest);
  CAPTURE(renormalize);
  std::int64_t const stride = n + 1;  // the router's GEMV rows, then the shared-expert gate
  auto const logits = test::random_floats(static_cast<std::size_t>(tokens * stride), 81, lowest, 4);
  std::vector<RoutingPolicy> policies;
  if (per_token) {
    RoutingPolicy const choices[] = {{}, {RoutingPolicy::Kind::kTopP, 0.6f, 0.0f, 2, 0},
                                     {RoutingPolicy::Kind::kThreshold, 1.0f, 0.05f, 1, k - 1 > 0 ? k - 1 : 1}};
    for (std::int64_t t = 0; t < tokens; ++t) policies.push_back(choices[t % 3]);
  }
  auto args = [&](float const* l, std::int32_t* e, float* w, float* shared, RoutingPolicy const* per) {
    RouterTopkArgs a{};
    a.logits = l, a.logits_stride = stride, a.experts = e, a.weights = w, a.n_tokens = tokens;
    a.n_expert = n, a.n_expert_used = k, a.policy = policy, a.token_policies = per, a.shared_weights = shared;
    a.renormalize = renormalize;
    return a;
  };
  std::size_t const slots = static_cast<std::size_t>(tokens * k);
  std::vector<std::int32_t> e_cpu(slots);
  std::vector<float> w_cpu(slots), shared_cpu(static_cast<std::size_t>(tokens));
  REQUIRE(launch_router_topk<S>(arch::Cpu{}, args(logits.data(), e_cpu.data(), w_cpu.data(), shared_cpu.data(),
                                                  per_token ? policies.data() : nullptr)) == Status::kSuccess);
  DeviceArray<float> dl(logits), dw(slots), dshared(shared_cpu.size());
  DeviceArray<std::int32_t> de(slots);
  DeviceArray<RoutingPolicy> dpol(policies);
  REQUIRE(launch_router_topk<S>(Tag{}, args(dl.get(), de.get(), dw.get(), dshared.get(), per_token ? dpol.get() : nullptr),
                                nullptr) == Status::kSuccess);
  synchronize();
  CHECK(de.download() == e_cpu);
  auto const w = all_close<float, float>(dw.download(), w_cpu, kGates);
  CHECK_MESSAGE(w.ok, "weights, GPU vs CPU twin: ", w.report);
  auto const g = all_close<float, float>(dshared.download(), shared_cpu, kGates);
  CHECK_MESSAGE(g.ok, "shared-expert gate, GPU vs CPU twin: ", g.report);
}

/// Tokens whose logits hold a NaN, an infinity, only NaNs, only -infinity: every slot still
/// names an expert below n (or none), each once a token, on the device as on the CPU; the
/// weights of such tokens are not compared.
template <MoeSpec S, class Tag>
void check_router_non_finite(int n, int k) {
  CAPTURE(n);
  CAPTURE(k);
  constexpr std::int64_t kTokens = 4;
  std::int64_t const stride = n + 1;
  float const nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  auto logits = test::random_floats(static_cast<std::size_t>(kTokens * stride), 83, -4, 4);
  auto at = [&](std::int64_t t, int e) -> float& { return logits[static_cast<std::size_t>(t * stride + e)]; };
  at(0, n / 2) = nan;
  at(1, n / 3) = inf;
  for (int e = 0; e < n; ++e) at(2, e) = nan, at(3, e) = -inf;
  auto args = [&](float const* l, std::int32_t* e, float* w) {
    RouterTopkArgs a{};
    a.logits = l, a.logits_stride = stride, a.experts = e, a.weights = w, a.n_tokens = kTokens;
    a.n_expert = n, a.n_expert_used = k;
    return a;
  };
  std::size_t const slots = static_cast<std::size_t>(kTokens * k);
  std::vector<std::int32_t> e_cpu(slots);
  std::vector<float> w_cpu(slots);
  REQUIRE(launch_router_topk<S>(arch::Cpu{}, args(logits.data(), e_cpu.data(), w_cpu.data())) == Status::kSuccess);
  DeviceArray<float> dl(logits), dw(slots);
  DeviceArray<std::int32_t> de(slots);
  REQUIRE(launch_router_topk<S>(Tag{}, args(dl.get(), de.get(), dw.get()), nullptr) == Status::kSuccess);
  synchronize();
  for (auto const& [experts, side] : {std::pair(e_cpu, "CPU"), std::pair(de.download(), "GPU")})
    for (std::int64_t t = 0; t < kTokens; ++t) {
      CAPTURE(side);
      CAPTURE(t);
      std::vector<std::int32_t> named;
      for (int j = 0; j < k; ++j) {
        std::int32_t const e = experts[static_cast<std::size_t>(t * k + j)];
        CHECK((e == kNoExpert || (e >= 0 && e < n)));
        if (e != kNoExpert) named.push_back(e);
      }
      std::sort(named.begin(), named.end());
      CHECK(std::adjacent_find(named.begin(), named.end()) == named.end());
    }
}

/// The router's GEMV and the routing in one call (RouterGemv: one kernel on CUDA for up to 16
/// tokens of an element format, else two): logits against the CPU's within fp32 sums in
/// another order; experts equal to the CPU's routing of the device's own logits (so a near tie
/// the sums' order breaks otherwise cannot fail it), weights and the shared gate within
/// rounding. Each call runs twice over outputs set to garbage, so the second shows that the
/// first left its CTA counter at zero.
template <MoeSpec S, class Tag>
void check_router_gemv(std::int64_t tokens, int n, int k, WeightFormat f, std::int64_t d) {
  CAPTURE(tokens);
  CAPTURE(n);
  CAPTURE(k);
  CAPTURE(to_string(f));
  CAPTURE(d);
  std::int64_t const rows = n + 1;  // the experts', then the shared-expert gate
  auto const gate = test::random_floats(static_cast<std::size_t>(rows * d), 85, -0.5f, 0.5f);
  auto const x = test::random_floats(static_cast<std::size_t>(tokens * d), 86, -1, 1);
  OwnedMatrix const m = encode_matrix(f, gate.data(), rows, d);
  std::size_t const slots = static_cast<std::size_t>(tokens * k), n_logits = static_cast<std::size_t>(tokens * rows);
  auto args = [&](RouterGemv const* g, std::int32_t* e, float* w, float* shared) {
    RouterTopkArgs a{};
    a.gemv = g, a.experts = e, a.weights = w, a.n_tokens = tokens, a.n_expert = n, a.n_expert_used = k;
    a.shared_weights = shared;
    return a;
  };
  std::vector<float> l_cpu(n_logits), w_cpu(slots), shared_cpu(static_cast<std::size_t>(tokens));
  std::vector<std::int32_t> e_cpu(slots);
  RouterGemv const on_cpu{m.view, x.data(), l_cpu.data()};
  REQUIRE(launch_router_topk<S>(arch::Cpu{}, args(&on_cpu, e_cpu.data(), w_cpu.data(), shared_cpu.data())) ==
          Status::kSuccess);

  DeviceArray<std::byte> bytes(m.bytes);
  DeviceArray<float> scales(m.scales), dx(x), dl(n_logits), dw(slots), dshared(shared_cpu.size());
  DeviceArray<std::int32_t> de(slots);
  WeightView dgate = m.view;
  dgate.data = bytes.get();
  dgate.scales = f == WeightFormat::kFp8E4m3 ? scales.get() : nullptr;
  RouterGemv const on_gpu{dgate, dx.get(), dl.get()};
  for (int run = 0; run < 2; ++run) {
    CAPTURE(run);
    auto garbage = [](void* p, std::size_t bytes) { QFLASH_TEST_CUDA(cudaMemset(p, 0xFF, bytes)); };
    garbage(dl.get(), n_logits * sizeof(float));
    garbage(dw.get(), slots * sizeof(float));
    garbage(dshared.get(), shared_cpu.size() * sizeof(float));
    garbage(de.get(), slots * sizeof(std::int32_t));  // -1: no expert
    REQUIRE(launch_router_topk<S>(Tag{}, args(&on_gpu, de.get(), dw.get(), dshared.get()), nullptr) == Status::kSuccess);
    synchronize();
    auto const l_gpu = dl.download();
    // From 16 tokens linear's tensor cores compute the logits, and on a GPU they truncate
    // their sums (linear_gpu_test's tolerance).
    Tolerance const sums = tokens < 16 ? Tolerance{2e-5, 1e-5} : Tolerance{2e-4, 1e-4};
    auto const l = all_close<float, float>(l_gpu, l_cpu, sums);
    CHECK_MESSAGE(l.ok, "logits, GPU vs CPU twin: ", l.report);
    // The CPU's routing of the device's logits.
    RouterTopkArgs from_gpu = args(nullptr, e_cpu.data(), w_cpu.data(), shared_cpu.data());
    from_gpu.logits = l_gpu.data();
    from_gpu.logits_stride = rows;
    REQUIRE(launch_router_topk<S>(arch::Cpu{}, from_gpu) == Status::kSuccess);
    CHECK(de.download() == e_cpu);
    auto const w = all_close<float, float>(dw.download(), w_cpu, kGates);
    CHECK_MESSAGE(w.ok, "weights, GPU vs CPU twin: ", w.report);
    auto const g = all_close<float, float>(dshared.download(), shared_cpu, kGates);
    CHECK_MESSAGE(g.ok, "shared-expert gate, GPU vs CPU twin: ", g.report);
  }
}

/// Rows of a table in format f gathered by id, as the CPU gathers them; an id past the table
/// gives NaN.
template <MoeSpec S, class Tag>
void check_embedding(WeightFormat f, int cols) {
  CAPTURE(to_string(f));
  CAPTURE(cols);
  std::int64_t const vocab = 300;
  auto const values = test::random_floats(static_cast<std::size_t>(vocab * cols), 91, -2, 2);
  OwnedMatrix const m = encode_matrix(f, values.data(), vocab, cols);
  std::vector<std::int32_t> const ids{0, 299, 7, 7, 150, 1, 298};
  std::vector<float> cpu(ids.size() * static_cast<std::size_t>(cols));
  EmbeddingArgs a{m.view, ids.data(), cpu.data(), static_cast<std::int64_t>(ids.size())};
  REQUIRE(launch_embedding<S>(arch::Cpu{}, a) == Status::kSuccess);
  DeviceArray<std::byte> table(m.bytes);
  DeviceArray<float> scales(m.scales), y(cpu.size());
  std::vector<std::int32_t> ids_bad = ids;
  ids_bad.push_back(static_cast<std::int32_t>(vocab));
  DeviceArray<std::int32_t> dids(ids_bad);
  WeightView dv = m.view;
  dv.data = table.get();
  dv.scales = f == WeightFormat::kFp8E4m3 ? scales.get() : nullptr;
  REQUIRE(launch_embedding<S>(Tag{}, EmbeddingArgs{dv, dids.get(), y.get(), static_cast<std::int64_t>(ids.size())}, nullptr) ==
          Status::kSuccess);
  synchronize();
  auto const got = y.download();
  // The row dequantizers are the CPU's; only fused multiply-adds may round differently.
  auto const c = all_close<float, float>(got, cpu, Tolerance{1e-6, 1e-6});
  CHECK_MESSAGE(c.ok, "GPU vs CPU twin: ", c.report);
  DeviceArray<float> y_bad(cpu.size() + static_cast<std::size_t>(cols));
  REQUIRE(launch_embedding<S>(Tag{}, EmbeddingArgs{dv, dids.get(), y_bad.get(), static_cast<std::int64_t>(ids_bad.size())},
                              nullptr) == Status::kSuccess);
  synchronize();
  auto const bad = y_bad.download();
  CHECK(std::isnan(bad[ids.size() * static_cast<std::size_t>(cols)]));
  CHECK(std::isnan(bad.back()));
}

/// Candidates of `rows` logits rows of `vocab` (stride ld): ids and values equal the CPU's;
/// the sums are fp64 in another order (and expf within 2 ulp of the CPU's exp).
template <MoeSpec S, class Tag>
void check_token_candidates(std::int64_t rows, int vocab, int k, int n_excluded, bool temps) {
  CAPTURE(rows);
  CAPTURE(vocab);
  CAPTURE(k);
  CAPTURE(n_excluded);
  std::int64_t const ld = vocab + 3;
  std::mt19937_64 rng(static_cast<std::uint64_t>(vocab) * 7 + static_cast<std::uint64_t>(k));
  std::uniform_int_distribution<int> grid(-200, 200);  // ties across tiles and lists
  std::vector<float> logits(static_cast<std::size_t>(rows * ld));
  for (auto& v : logits) v = static_cast<float>(grid(rng)) * 0.05f;
  for (std::int64_t r = 0; r < rows; ++r) logits[static_cast<std::size_t>(r * ld + r % vocab)] = 30.0f;
  std::vector<std::int32_t> excluded;
  for (std::int32_t id = 0; id < vocab && static_cast<int>(excluded.size()) < n_excluded; ++id)
    if (rng() % 3 == 0 || n_excluded >= vocab) excluded.push_back(id);
  std::vector<float> temperature;
  if (temps)
    for (std::int64_t r = 0; r < rows; ++r) temperature.push_back(r % 2 ? 0.7f : 0.0f);
  auto args = [&](float const* l, float const* t, std::int32_t const* ex, std::int32_t* ids, float* values,
                  CandidateStats* stats) {
    TokenCandidatesArgs a{};
    a.logits = l, a.rows = rows, a.ld = ld, a.vocab = vocab, a.k = k;
    a.temperature = temps ? t : nullptr;
    a.excluded = ex, a.n_excluded = static_cast<int>(excluded.size());
    a.ids = ids, a.values = values, a.stats = stats;
    return a;
  };
  std::size_t const n = static_cast<std::size_t>(rows * k);
  std::vector<std::int32_t> ids(n);
  std::vector<float> values(n);
  std::vector<CandidateStats> stats(static_cast<std::size_t>(rows));
  REQUIRE(launch_token_candidates<S>(arch::Cpu{}, args(logits.data(), temperature.data(), excluded.data(), ids.data(),
                                                       values.data(), stats.data())) == Status::kSuccess);
  DeviceArray<float> dl(logits), dt(temperature), dv(n);
  DeviceArray<std::int32_t> dex(excluded), dids(n);
  DeviceArray<CandidateStats> dstats(stats.size());
  REQUIRE(launch_token_candidates<S>(Tag{}, args(dl.get(), dt.get(), dex.get(), dids.get(), dv.get(), dstats.get()),
                                     nullptr) == Status::kSuccess);
  synchronize();
  CHECK(dids.download() == ids);
  CHECK(dv.download() == values);
  std::vector<CandidateStats> const got = dstats.download();
  for (std::size_t r = 0; r < stats.size(); ++r) {
    CAPTURE(r);
    CHECK(got[r].max == stats[r].max);
    CHECK(got[r].non_finite == stats[r].non_finite);
    if (std::isinf(stats[r].log_norm))  // every id excluded: -inf on both (Approx(-inf) fails: inf - inf is NaN)
      CHECK(got[r].log_norm == stats[r].log_norm);
    else
      CHECK(got[r].log_norm == doctest::Approx(stats[r].log_norm).epsilon(1e-6));
    CHECK(got[r].mass == doctest::Approx(stats[r].mass).epsilon(1e-6));
  }
}

template <class Tag, std::size_t I>
void check_instance() {
  constexpr MoeSpec S = instances::kSpecs[I];
  CAPTURE(instances::kSpecNames[I]);
  CAPTURE(Tag::name);
  // Gated DeltaNet's ops: only specs with linear-attention layers (or dynamic ones).
  if constexpr (S.d_head_v_linear != 0) {
    std::vector<int> const widths = S.d_head_v_linear != kDynamic ? std::vector<int>{S.d_head_v_linear}
                                                                   : std::vector<int>{128, 33, 1000};
    for (int cols : widths)
      for (std::int64_t rows : {std::int64_t{1}, std::int64_t{7}, std::int64_t{300}}) check_gated_rmsnorm<S, Tag>(rows, cols, false);
    check_gated_rmsnorm<S, Tag>(5, widths.front(), true);
    if (test::gpu::kLargeCases) check_gated_rmsnorm<S, Tag>(600000, widths.front(), false);  // past the grid cap
    std::vector<int> const heads = S.n_head_v_linear != kDynamic ? std::vector<int>{S.n_head_v_linear}
                                                                  : std::vector<int>{32, 5};
    for (int h : heads)
      for (std::int64_t t : {std::int64_t{1}, std::int64_t{17}, std::int64_t{600000}})
        if (t < 600000 || test::gpu::kLargeCases) check_gdn_gates<S, Tag>(t, h);
    // The conv's channels: q, k and v of every linear-attention head.
    int const channels = S.d_head_v_linear != kDynamic
                             ? 2 * S.n_head_k_linear * S.d_head_k_linear + S.n_head_v_linear * S.d_head_v_linear
                             : 8192;
    std::vector<int> const widths_conv = S.d_conv != kDynamic ? std::vector<int>{S.d_conv} : std::vector<int>{4, 1, 2, 7};
    for (int k : widths_conv) {
      check_causal_conv1d<S, Tag>(channels, k, {1, 1, 5, 300, 1, 2}, true);  // decode and prefill calls
      check_causal_conv1d<S, Tag>(channels, k, {3, 40}, false);
    }
    if constexpr (S.d_conv == kDynamic) check_causal_conv1d<S, Tag>(8192, 4, {2100}, true);  // past the grid cap
    if constexpr (S.d_head_k_linear != kDynamic) {
      for (bool strided : {false, true})
        check_gated_delta<S, Tag>({S.n_head_k_linear, S.n_head_v_linear, S.d_head_k_linear, S.d_head_v_linear,
                                   {1, 1, 64, 3, 1}, false, strided});
    } else {
      // Qwen3.6's heads, then odd widths (partial warps and column blocks), one head pair.
      for (bool tiled : {false, true})
        check_gated_delta<S, Tag>({16, 32, 128, 128, {1, 1, 130, 1}, tiled, true});
      check_gated_delta<S, Tag>({2, 6, 40, 70, {5, 1, 33}, false, false});
      // Prefill in chunks: several groups of chunks (448 tokens here), a short last chunk, chunks
      // of 20 and of 100 (64 on the device), d_k 256 (chunks of 32 there).
      check_gated_delta<S, Tag>({16, 32, 128, 128, {1100, 40, 1, 17}, false, true});
      check_gated_delta<S, Tag>({2, 6, 40, 70, {77, 3, 150}, true, false, 20});
      check_gated_delta<S, Tag>({2, 4, 64, 64, {300}, false, false, 100});
      check_gated_delta<S, Tag>({1, 2, 256, 40, {130}, false, false});
      check_gated_delta<S, Tag>({1, 1, 256, 16, {200}, false, false});
      check_gated_delta<S, Tag>({1, 1, 17, 33, {1, 2, 3}, true, false});
      // Long memory: Qwen3.6's heads over a last chunk of one token (129 = 2 x 64 + 1), and
      // 300 tokens in chunks of 100 (64 on the device).
      check_gated_delta<S, Tag>({16, 32, 128, 128, {130, 1, 129}, true, true, 64, true});
      check_gated_delta<S, Tag>({2, 4, 64, 64, {300}, false, false, 100, true});
      // The chunked form with one warp (d_k 17) and with chunks of one token; exactly 16
      // tokens, the longest call the recurrence takes on the device.
      check_gated_delta<S, Tag>({1, 1, 17, 33, {40}, false, false, 64, true});
      check_gated_delta<S, Tag>({2, 2, 64, 32, {65}, false, false, 1});
      check_gated_delta<S, Tag>({2, 4, 64, 64, {16, 16}, false, false});
    }
    if constexpr (S.d_head_k_linear != kDynamic) {
      for (bool fused : {false, true})  // the model's decode step fuses both
        for (bool tiled : {false, true})  // GGUF checkpoints tile the value heads
          check_gdn_decode<S, Tag>({S.n_head_k_linear, S.n_head_v_linear, S.d_head_k_linear, S.d_head_v_linear,
                                    S.d_conv != kDynamic ? S.d_conv : 4, tiled, 3, 3, fused, fused});
    } else {
      for (bool tiled : {false, true}) check_gdn_decode<S, Tag>({16, 32, 128, 128, 4, tiled, 2, 3});
      check_gdn_decode<S, Tag>({2, 6, 40, 70, 3, false, 70, 2});  // two launches of sequences
      check_gdn_decode<S, Tag>({1, 1, 17, 33, 1, true, 3, 2});    // no conv state
      check_gdn_decode<S, Tag>({2, 6, 40, 70, 3, false, 70, 2, true, true});  // raw gates and the norm, two launches
      check_gdn_decode<S, Tag>({16, 32, 128, 128, 4, false, 3, 2, false, true});
      // Three tiled value heads a q/k head (the last CTA's gates and norms), 2 warps for 80 q/k channels.
      check_gdn_decode<S, Tag>({4, 12, 40, 70, 3, true, 5, 3, true, true});
      // 128 q/k heads: 32 sequences a launch on the 4096 counters, up to the last one.
      check_gdn_decode<S, Tag>({128, 128, 17, 33, 2, false, 33, 2, true, true});
      check_gdn_decode<S, Tag>({1, 2, 256, 40, 4, false, 3, 2, true, true});  // d_k 256: 8 warps
      check_gdn_decode<S, Tag>({2, 8, 17, 33, 1, true, 3, 2, true, true});    // no conv state; a warp norms 4 rows
    }
  }
  std::vector<int> const dims = S.d_head != kDynamic ? std::vector<int>{S.d_head} : std::vector<int>{256, 128, 40};
  int const heads = S.n_head != kDynamic ? S.n_head : 4;
  for (int d : dims)
    for (int rotary : {d / 4 / 2 * 2, d, 0})
      for (NormWeight kind : {NormWeight::kZeroCentered, NormWeight::kPlain}) {
        check_qk_norm_rope<S, Tag>({3, heads, d, rotary, true, kind, false});
        check_qk_norm_rope<S, Tag>({33, heads, d, rotary, false, kind, true});
      }
  if (test::gpu::kLargeCases)
    check_qk_norm_rope<S, Tag>({300000, 2, dims.front(), dims.front() / 2, false, NormWeight::kPlain, false});
  int const kv_heads = S.n_head_kv != kDynamic ? S.n_head_kv : 2;
  for (std::int64_t tokens : {std::int64_t{1}, std::int64_t{70}})
    check_qk_norm_rope_keys<S, Tag>(tokens, heads, kv_heads, dims.front(), dims.front() / 4 / 2 * 2);

  std::vector<std::pair<int, int>> const routes = S.n_expert != kDynamic
                                                      ? std::vector<std::pair<int, int>>{{S.n_expert, S.n_expert_used}}
                                                      : std::vector<std::pair<int, int>>{{256, 8}, {128, 8}, {40, 3}, {1000, 32}, {4, 4}};
  for (auto [n, k] : routes) {
    check_router<S, Tag>(37, n, k, {}, false);
    check_router<S, Tag>(37, n, k, {RoutingPolicy::Kind::kTopP, 0.5f, 0.0f, 1, 0}, false);
    check_router<S, Tag>(37, n, k, {}, true);
    // Logits spread over 300: most experts lie more than 87 below a token's best, where both
    // count e^-87 and tie (lower ids first); and the weights left as probabilities.
    check_router<S, Tag>(37, n, k, {}, false, -300.0f, false);
  }
  if (test::gpu::kLargeCases)
    check_router<S, Tag>(600000, routes.front().first, routes.front().second, {}, false);  // past the grid cap
  for (auto [n, k] : routes) check_router_non_finite<S, Tag>(n, k);
  std::int64_t const d_router = S.d_model != kDynamic ? S.d_model : 512;
  for (WeightFormat f : {WeightFormat::kBf16, WeightFormat::kFp8E4m3, WeightFormat::kF32, WeightFormat::kQ8_0}) {
    if ((S.weights != WeightFormat::kAny && S.weights != f) || !row_fits(f, d_router)) continue;
    auto const [n, k] = routes.front();
    for (std::int64_t tokens : {std::int64_t{1}, std::int64_t{16}, std::int64_t{40}})  // one kernel, one, two
      check_router_gemv<S, Tag>(tokens, n, k, f, d_router);
  }

  int const width = S.d_model != kDynamic ? static_cast<int>(S.d_model) : 512;
  for (WeightFormat f : kAllWeightFormats)
    if (row_fits(f, width) && (S.weights == WeightFormat::kAny || S.weights == f)) check_embedding<S, Tag>(f, width);
  if constexpr (S.d_model == kDynamic) check_embedding<S, Tag>(WeightFormat::kInt4, 200);  // a short last group

  // One tile and many (Qwen3.6's vocabulary: one merge round; a million ids: two), k of one to
  // the most, rows past the vocabulary's ids, excluded ids, every id excluded.
  if (test::gpu::kLargeCases) {
    check_token_candidates<S, Tag>(3, 248320, 64, 300, true);
    check_token_candidates<S, Tag>(2, 248320, 1, 0, false);
    check_token_candidates<S, Tag>(1, 1 << 20, 256, 10, true);
  }
  check_token_candidates<S, Tag>(16, 4096, 20, 5, true);
  check_token_candidates<S, Tag>(2, 50, 256, 7, false);
  check_token_candidates<S, Tag>(1, 5000, 64, 5000, false);
}

template <class Tag>
void check_arch() {
  test::gpu::check_each_instance<Tag>([]<std::size_t I>() { check_instance<Tag, I>(); });
}

}  // namespace

TEST_SUITE("gpu") {
  TEST_CASE("the layers' smaller ops: sm80 instances match the CPU") { check_arch<arch::Sm80>(); }
  TEST_CASE("the layers' smaller ops: sm90a instances match the CPU") { check_arch<arch::Sm90a>(); }
}
