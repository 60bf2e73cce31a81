// kernels/gdn_decode on the CPU, every ISA path: several sequences' decode step against the fp64
// references of the ops it fuses (ref::gdn_decode), and against those ops' CPU kernels
// (causal_conv1d, then gated_delta's recurrent form per sequence) bit for bit: it runs their
// arithmetic in their order. Each also with raw gates, which go through gdn_gates first, and
// with the output norm, gated_rmsnorm after (bit for bit their CPU kernels). Rows the call does
// not name stay untouched.
//
// Tolerances against the fp64 reference (|y - ref| <= atol + rtol |ref|): gated_delta_test's
// kDeltaTol {5e-6, 5e-5} for the outputs and states (one recurrent step of O(1) terms); the
// conv's outputs {1e-6, 1e-5} (K fp32 products and one SiLU); the conv state is a copy (exact).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/kernels/causal_conv1d/cpu.hpp"
#include "qflash/kernels/gated_delta/cpu.hpp"
#include "qflash/kernels/gdn_decode/cpu.hpp"
#include "qflash/kernels/gdn_decode/ref.hpp"
#include "qflash/kernels/gated_rmsnorm/cpu.hpp"
#include "qflash/kernels/gdn_gates/cpu.hpp"
#include "qflash/spec/presets.hpp"
#include "support/random.hpp"
#include "support/tolerance.hpp"

using namespace qflash;
using namespace qflash::kernels;
using arch::CpuIsa;
using test::all_close;
using test::Tolerance;

namespace {

constexpr Tolerance kDeltaTol{5e-6, 5e-5};
constexpr Tolerance kConvTol{1e-6, 1e-5};
constexpr CpuIsa kPaths[] = {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512};

bool supported(CpuIsa isa) { return isa <= arch::detect_cpu_isa(); }

struct Shape {
  int n_head_k, n_head_v, d_k, d_v, d_conv;
  bool tiled;
  std::int64_t n_tokens;           ///< rows of the batch
  std::vector<std::int64_t> rows;  ///< each decoding sequence's row
};

/// A batch's rows and each decoding sequence's states.
struct Problem {
  Shape sh;
  std::int64_t cd;
  std::vector<float> x, w, g, beta, conv_out, out;
  std::vector<std::vector<float>> conv_state, state;
  bool raw_gates = false;  ///< g and beta hold a and b; the op turns them into the gates
  bool norm = false;       ///< the op norms out (gated_rmsnorm with z and norm_w)
  std::vector<float> dt_bias, neg_a, z, norm_w;

  Problem(Shape s, std::uint64_t seed, bool raw = false, bool with_norm = false)
      : sh(std::move(s)),
        cd(2 * std::int64_t{sh.n_head_k} * sh.d_k + std::int64_t{sh.n_head_v} * sh.d_v),
        x(test::random_floats(static_cast<std::size_t>(sh.n_tokens * cd), seed + 1)),
        w(test::random_floats(static_cast<std::size_t>(cd * sh.d_conv), seed + 2, -0.5f, 0.5f)),
        g(test::random_floats(static_cast<std::size_t>(sh.n_tokens * sh.n_head_v), seed + 3, -0.5f, 0.0f)),
        beta(test::random_floats(static_cast<std::size_t>(sh.n_tokens * sh.n_head_v), seed + 4, 0.0f, 1.0f)),
        conv_out(static_cast<std::size_t>(sh.n_tokens * cd), -999.0f),
        out(static_cast<std::size_t>(sh.n_tokens * sh.n_head_v * sh.d_v), -999.0f),
        raw_gates(raw),
        dt_bias(test::random_floats(static_cast<std::size_t>(sh.n_head_v), seed + 5, -1.0f, 1.0f)),
        neg_a(test::random_floats(static_cast<std::size_t>(sh.n_head_v), seed + 6, -2.0f, -0.1f)),
        z(test::random_floats(static_cast<std::size_t>(sh.n_tokens * sh.n_head_v * sh.d_v), seed + 7, -4.0f, 4.0f)),
        norm_w(test::random_floats(static_cast<std::size_t>(sh.d_v), seed + 8, 0.5f, 1.5f)) {
    norm = with_norm;
    if (raw_gates) {  // a and b as the projections give them, either sign; softplus's linear tail too
      g = test::random_floats(g.size(), seed + 3, -6.0f, 6.0f);
      beta = test::random_floats(beta.size(), seed + 4, -4.0f, 4.0f);
      g[0] = 25.0f;
    }
    for (std::size_t i = 0; i < sh.rows.size(); ++i) {
      conv_state.push_back(test::random_floats(static_cast<std::size_t>(cd * (sh.d_conv - 1)), seed + 10 + i));
      state.push_back(test::random_floats(static_cast<std::size_t>(sh.n_head_v) * sh.d_k * sh.d_v, seed + 40 + i,
                                          -0.3f, 0.3f));
    }
  }

  /// The op's arguments; `ptrs` holds the pointer arrays.
  GdnDecodeArgs args(std::vector<float*>& conv_ptrs, std::vector<float*>& state_ptrs) {
    conv_ptrs.clear();
    state_ptrs.clear();
    for (auto& c : conv_state) conv_ptrs.push_back(c.data());
    for (auto& s : state) state_ptrs.push_back(s.data());
    GdnDecodeArgs a{};
    a.x = x.data();
    a.g = g.data();
    a.beta = beta.data();
    a.conv_out = conv_out.data();
    a.out = out.data();
    a.rows = sh.rows.data();
    a.conv_state = conv_ptrs.data();
    a.state = state_ptrs.data();
    a.conv_weight = w.data();
    a.n_seqs = static_cast<int>(sh.rows.size());
    a.n_head_k = sh.n_head_k;
    a.n_head_v = sh.n_head_v;
    a.d_k = sh.d_k;
    a.d_v = sh.d_v;
    a.d_conv = sh.d_conv;
    a.tiled_value_heads = sh.tiled;
    if (raw_gates) a.dt_bias = dt_bias.data(), a.neg_a = neg_a.data();
    if (norm) a.norm_weight = norm_w.data(), a.z = z.data(), a.norm_eps = 1e-6f;
    return a;
  }
};

Problem reference(Problem p) {
  std::vector<float*> c, s;
  ref::gdn_decode(p.args(c, s));
  return p;
}

Problem fused(Problem p, CpuIsa isa) {
  std::vector<float*> c, s;
  REQUIRE(cpu::gdn_decode(isa, p.args(c, s)) == Status::kSuccess);
  return p;
}

/// The ops it replaces, one sequence at a time, on path `isa`.
Problem separate(Problem p, CpuIsa isa) {
  std::int64_t const key_dim = std::int64_t{p.sh.n_head_k} * p.sh.d_k;
  for (std::size_t i = 0; i < p.sh.rows.size(); ++i) {
    std::int64_t const r = p.sh.rows[i];
    if (p.raw_gates) {
      GdnGatesArgs const ga{p.beta.data() + r * p.sh.n_head_v, p.g.data() + r * p.sh.n_head_v, p.dt_bias.data(),
                            p.neg_a.data(), 1, p.sh.n_head_v};
      REQUIRE(cpu::gdn_gates<kDynamic>(isa, ga) == Status::kSuccess);
    }
    CausalConv1dArgs c{};
    c.x = p.x.data() + r * p.cd;
    c.weight = p.w.data();
    c.state = p.sh.d_conv > 1 ? p.conv_state[i].data() : nullptr;
    c.y = p.conv_out.data() + r * p.cd;
    c.n_tokens = 1;
    c.n_channels = static_cast<int>(p.cd);
    c.d_conv = p.sh.d_conv;
    REQUIRE(cpu::causal_conv1d(isa, c) == Status::kSuccess);
    GatedDeltaArgs d{};
    d.q = c.y;
    d.k = c.y + key_dim;
    d.v = c.y + 2 * key_dim;
    d.q_stride = d.k_stride = d.v_stride = p.cd;
    d.g = p.g.data() + r * p.sh.n_head_v;
    d.beta = p.beta.data() + r * p.sh.n_head_v;
    d.state = p.state[i].data();
    d.out = p.out.data() + r * p.sh.n_head_v * p.sh.d_v;
    d.n_tokens = 1;
    d.n_head_k = p.sh.n_head_k;
    d.n_head_v = p.sh.n_head_v;
    d.d_k = p.sh.d_k;
    d.d_v = p.sh.d_v;
    d.tiled_value_heads = p.sh.tiled;
    REQUIRE(cpu::gated_delta(isa, d, DeltaRuleForm::kRecurrent) == Status::kSuccess);
    if (p.norm) {
      std::int64_t const at = r * p.sh.n_head_v * p.sh.d_v;
      GatedRmsNormArgs const n{d.out, p.z.data() + at, p.norm_w.data(), d.out, p.sh.n_head_v, p.sh.d_v, 1e-6f};
      REQUIRE(cpu::gated_rmsnorm(isa, n) == Status::kSuccess);
    }
  }
  return p;
}

void check_close(Problem const& got, Problem const& want) {
  auto close = [](std::vector<float> const& a, std::vector<float> const& b, Tolerance t, char const* what) {
    auto const o = all_close(std::span<float const>(a), std::span<float const>(b), t);
    CHECK_MESSAGE(o.ok, what, ": ", o.report);
  };
  close(got.out, want.out, kDeltaTol, "out");
  close(got.conv_out, want.conv_out, kConvTol, "conv_out");
  close(got.g, want.g, kConvTol, "g");  // raw gates: softplus and sigmoid in fp32
  close(got.beta, want.beta, kConvTol, "beta");
  for (std::size_t i = 0; i < got.state.size(); ++i) {
    close(got.state[i], want.state[i], kDeltaTol, "state");
    close(got.conv_state[i], want.conv_state[i], Tolerance{0, 0}, "conv state");
  }
}

void check_equal(Problem const& got, Problem const& want) {
  CHECK(got.out == want.out);
  CHECK(got.conv_out == want.conv_out);
  CHECK(got.g == want.g);
  CHECK(got.beta == want.beta);
  CHECK(got.state == want.state);
  CHECK(got.conv_state == want.conv_state);
}

std::vector<Shape> shapes() {
  return {
      {16, 32, 128, 128, 4, false, 3, {2, 0}},             // Qwen3.6-35B-A3B's layer, two sequences
      {16, 32, 128, 128, 4, true, 2, {1}},                 // GGUF's tiled value heads
      {2, 6, 40, 70, 4, false, 7, {6, 1, 3, 0}},           // odd dims, a partial state tile
      {2, 6, 40, 70, 3, true, 5, {4, 2}},                  // another conv width
      {1, 1, 17, 33, 1, false, 2, {1}},                    // no conv state
      {2, 4, 16, 8, 4, false, 40, {39, 0, 17, 5, 8, 12}},  // many sequences
  };
}

}  // namespace

TEST_CASE("gdn_decode: several sequences' decode step equals the fp64 references, every ISA path") {
  std::uint64_t seed = 100;
  for (Shape const& sh : shapes())
    for (bool raw : {false, true})
      for (bool norm : {false, true}) {
        Problem const p(sh, seed += 100, raw, norm);
        Problem const want = reference(p);
        for (CpuIsa isa : kPaths) {
          if (!supported(isa)) continue;
          CAPTURE(static_cast<int>(isa));
          CAPTURE(sh.d_k);
          CAPTURE(sh.rows.size());
          CAPTURE(raw);
          CAPTURE(norm);
          check_close(fused(p, isa), want);
        }
      }
}

TEST_CASE("gdn_decode: bit for bit the ops it fuses, causal_conv1d then gated_delta per sequence") {
  std::uint64_t seed = 7;
  for (Shape const& sh : shapes())
    for (auto [raw, norm] : {std::pair{false, false}, std::pair{true, false}, std::pair{false, true}, std::pair{true, true}}) {
      Problem const p(sh, seed += 100, raw, norm);
      for (CpuIsa isa : kPaths) {
        if (!supported(isa)) continue;
        CAPTURE(static_cast<int>(isa));
        CAPTURE(sh.d_k);
        CAPTURE(raw);
        CAPTURE(norm);
        Problem const got = fused(p, isa);
        check_equal(got, separate(p, isa));
        // Rows no sequence names keep what they held.
        for (std::int64_t r = 0; r < sh.n_tokens; ++r)
          if (std::find(sh.rows.begin(), sh.rows.end(), r) == sh.rows.end())
            CHECK(got.out[static_cast<std::size_t>(r * sh.n_head_v * sh.d_v)] == -999.0f);
      }
    }
}

TEST_CASE("gdn_decode: the launcher follows arch::cpu_isa(); no sequences is nothing to do; bad arguments") {
  Problem p({2, 4, 16, 8, 4, false, 3, {2, 0}}, 5);
  Problem const want = fused(p, arch::cpu_isa());
  std::vector<float*> c, s;
  GdnDecodeArgs a = p.args(c, s);
  REQUIRE(launch_gdn_decode<spec::generic>(arch::Cpu{}, a) == Status::kSuccess);
  check_equal(p, want);

  Problem q({2, 4, 16, 8, 4, false, 3, {2, 0}}, 5);
  GdnDecodeArgs none = q.args(c, s);
  none.n_seqs = 0;
  REQUIRE(launch_gdn_decode<spec::generic>(arch::Cpu{}, none) == Status::kSuccess);
  CHECK(q.out == std::vector<float>(q.out.size(), -999.0f));

  auto refused = [&](auto edit) {
    GdnDecodeArgs b = q.args(c, s);
    edit(b);
    return launch_gdn_decode<spec::generic>(arch::Cpu{}, b) == Status::kErrorInvalidProblem;
  };
  CHECK(refused([](GdnDecodeArgs& b) { b.n_head_v = 5; }));  // not a multiple of n_head_k
  CHECK(refused([](GdnDecodeArgs& b) { b.rows = nullptr; }));
  CHECK(refused([](GdnDecodeArgs& b) { b.conv_state = nullptr; }));
  CHECK(refused([](GdnDecodeArgs& b) { b.out = b.conv_out; }));
  CHECK(refused([](GdnDecodeArgs& b) { b.n_seqs = -1; }));
  CHECK(refused([&](GdnDecodeArgs& b) { b.dt_bias = q.dt_bias.data(); }));  // raw gates without neg_a
  CHECK(refused([&](GdnDecodeArgs& b) { b.dt_bias = q.dt_bias.data(), b.neg_a = q.neg_a.data(), b.beta = b.g; }));
  CHECK(refused([&](GdnDecodeArgs& b) { b.norm_weight = q.norm_w.data(); }));  // the norm without z
  CHECK(refused([&](GdnDecodeArgs& b) { b.norm_weight = q.norm_w.data(), b.z = b.out; }));
  CHECK(refused([&](GdnDecodeArgs& b) { b.norm_weight = q.norm_w.data(), b.z = b.out + 1; }));  // overlapping
  // Every sequence its own row, state and conv state: two sharing one would race.
  std::int64_t const same_row[] = {2, 2}, negative_row[] = {2, -1};
  std::vector<float*> const shared_state = {s[0], s[0]}, shared_conv = {c[1], c[1]};
  std::vector<float*> const no_state = {s[0], nullptr}, no_conv = {nullptr, c[1]};
  CHECK(refused([&](GdnDecodeArgs& b) { b.rows = same_row; }));
  CHECK(refused([&](GdnDecodeArgs& b) { b.rows = negative_row; }));
  CHECK(refused([&](GdnDecodeArgs& b) { b.state = shared_state.data(); }));
  CHECK(refused([&](GdnDecodeArgs& b) { b.conv_state = shared_conv.data(); }));
  CHECK(refused([&](GdnDecodeArgs& b) { b.state = no_state.data(); }));
  CHECK(refused([&](GdnDecodeArgs& b) { b.conv_state = no_conv.data(); }));
  // The check's own buffer: on the stack up to 256 sequences, on the heap past it.
  for (int n : {1, 256, 300}) {
    std::vector<std::int64_t> rows(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) rows[static_cast<std::size_t>(i)] = 3 * (n - i);
    CHECK(gdn::distinct(rows.data(), n));
    if (n == 1) continue;
    rows.back() = rows.front();
    CHECK_FALSE(gdn::distinct(rows.data(), n));
  }
  // A static spec takes its own shapes only.
  CHECK(launch_gdn_decode<spec::qwen3_6_35b_a3b>(arch::Cpu{}, q.args(c, s)) == Status::kErrorInvalidProblem);
}
