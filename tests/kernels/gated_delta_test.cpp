// The gated delta rule on the CPU: both forms on every ISA path against kernels::ref::gated_delta
// (the literal recurrence in fp64), chunked == recurrent, split calls == one call, edge cases.
//
// Tolerances (|y - ref| <= atol + rtol |ref| on every element, no NaN), inputs q, k, v, S0 in
// [-1, 1], beta in [0, 1], g in [-0.5, 0] unless a case says otherwise:
// - kDeltaTol = {atol 5e-6, rtol 5e-5} for outputs and final states against the fp64 reference.
//   Each token's update is a few fp32 dot products and axpys of length <= 128 (error ~sqrt(d_k)
//   2^-24 ~ 1e-6 relative to the terms, which are O(1)); the recurrence does not amplify earlier
//   errors (I - β k̂k̂ᵀ has eigenvalues in [0, 1] and e^g <= 1); the chunked form adds a forward
//   substitution over <= 64 rows with |A_ij| < 1, whose inverse stays bounded for the same
//   reason (it builds a product of such contractions). Measured: max 2.4e-7 absolute on every
//   path and form (printed with -s), so the bound leaves ~20x margin; atol dominates because
//   outputs and state entries are O(0.1-1) and cancellation puts some near 0.
// - Chunked vs recurrent: the same bound (both are compared with the same truth).
// - Splitting a recurrent call, and the state when beta = 0 and g = 0: bit-exact (the per-token
//   arithmetic does not depend on where a call starts; e^0 = 1 and δ = 0 leave S untouched).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/kernels/gated_delta/cpu.hpp"
#include "qflash/kernels/gated_delta/ref.hpp"
#include "qflash/spec/presets.hpp"
#include "support/random.hpp"
#include "support/tolerance.hpp"

using namespace qflash;
using test::max_abs_diff;
using arch::CpuIsa;
using kernels::DeltaRuleForm;
using kernels::GatedDeltaArgs;
using qflash::test::all_close;
using qflash::test::Tolerance;

namespace {

template <MoeSpec S>
Status launch_form(GatedDeltaArgs a, DeltaRuleForm form, int chunk = 64) {
  a.form = form;
  a.chunk_size = chunk;
  return kernels::launch_gated_delta<S>(arch::Cpu{}, a);
}

constexpr Tolerance kDeltaTol{5e-6, 5e-5};

/// kAvx512Bf16 runs the AVX-512 code, so it is not a separate path.
constexpr CpuIsa kPaths[] = {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512};

bool supported(CpuIsa isa) { return isa <= arch::detect_cpu_isa(); }

struct Shape {
  std::int64_t n_tokens;
  int n_head_k, n_head_v, d_k, d_v;
};

std::string to_string(Shape const& s) {
  std::ostringstream os;
  os << "{T=" << s.n_tokens << " Hk=" << s.n_head_k << " Hv=" << s.n_head_v << " dk=" << s.d_k
     << " dv=" << s.d_v << "}";
  return os.str();
}

/// Seeded inputs of one sequence plus its state and output buffers.
struct Problem {
  Shape sh;
  std::vector<float> q, k, v, g, beta, state, out;

  Problem(Shape s, std::uint64_t seed, bool zero_state = false, float g_min = -0.5f)
      : sh(s),
        q(test::random_floats(size_qk(), seed + 1)),
        k(test::random_floats(size_qk(), seed + 2)),
        v(test::random_floats(size_v(), seed + 3)),
        g(test::random_floats(size_gb(), seed + 4, g_min, 0.0f)),
        beta(test::random_floats(size_gb(), seed + 5, 0.0f, 1.0f)),
        state(zero_state ? std::vector<float>(size_state(), 0.0f)
                         : test::random_floats(size_state(), seed + 6)),
        out(size_v(), -999.0f) {}

  std::size_t size_qk() const { return static_cast<std::size_t>(sh.n_tokens * sh.n_head_k * sh.d_k); }
  std::size_t size_v() const { return static_cast<std::size_t>(sh.n_tokens * sh.n_head_v * sh.d_v); }
  std::size_t size_gb() const { return static_cast<std::size_t>(sh.n_tokens * sh.n_head_v); }
  std::size_t size_state() const { return static_cast<std::size_t>(sh.n_head_v) * sh.d_k * sh.d_v; }

  /// Arguments for tokens [t0, t0 + n) (the whole sequence by default).
  GatedDeltaArgs args(std::int64_t t0 = 0, std::int64_t n = -1) {
    if (n < 0) n = sh.n_tokens - t0;
    GatedDeltaArgs a;
    a.q = q.data() + t0 * sh.n_head_k * sh.d_k;
    a.k = k.data() + t0 * sh.n_head_k * sh.d_k;
    a.v = v.data() + t0 * sh.n_head_v * sh.d_v;
    a.g = g.data() + t0 * sh.n_head_v;
    a.beta = beta.data() + t0 * sh.n_head_v;
    a.state = state.data();
    a.out = out.data() + t0 * sh.n_head_v * sh.d_v;
    a.n_tokens = n;
    a.n_head_k = sh.n_head_k;
    a.n_head_v = sh.n_head_v;
    a.d_k = sh.d_k;
    a.d_v = sh.d_v;
    return a;
  }
};

Problem reference(Problem p) {
  kernels::ref::gated_delta(p.args());
  return p;
}

Problem run(Problem p, CpuIsa isa, DeltaRuleForm form, int chunk = 64) {
  REQUIRE(kernels::cpu::gated_delta(isa, p.args(), form, chunk) == Status::kSuccess);
  return p;
}


/// Checks outputs and final state; returns the larger max abs error.
double check_close(Problem const& got, Problem const& want, Tolerance tol = kDeltaTol) {
  auto const o = all_close(std::span<float const>(got.out), std::span<float const>(want.out), tol);
  CHECK_MESSAGE(o.ok, "out: ", o.report);
  auto const s = all_close(std::span<float const>(got.state), std::span<float const>(want.state), tol);
  CHECK_MESSAGE(s.ok, "state: ", s.report);
  return std::max(max_abs_diff(got.out, want.out), max_abs_diff(got.state, want.state));
}

/// Token counts around the chunk of 64 (and 16); head layouts; small dims with d_k != d_v.
std::vector<Shape> small_shapes() {
  std::vector<Shape> v;
  for (std::int64_t t : {1, 5, 63, 64, 65, 130})
    for (auto [hk, hv] : {std::pair{1, 1}, std::pair{2, 4}, std::pair{16, 32}})
      v.push_back({t, hk, hv, 16, 8});
  v.push_back({17, 1, 3, 7, 33});   // odd dims: masked tails in every primitive
  v.push_back({9, 1, 2, 20, 80});   // a full and a partial state tile
  v.push_back({70, 1, 2, 128, 128});  // realistic head dims across a chunk boundary
  v.push_back({3, 16, 32, 128, 128});  // the Qwen3.6 layer shape, few tokens
  return v;
}

}  // namespace

TEST_CASE("gated_delta: ref recurrence on a 1-dim problem worked by hand") {
  // d_k = d_v = 1: k̂ = q̂·1 = sign(k) (eps = 0), S ← e^g S; δ = β (v − S k̂); S += k̂ δ; o = S q̂.
  float q[2] = {2.0f, -1.0f}, k[2] = {3.0f, 1.0f}, v[2] = {0.5f, -1.0f};
  float g[2] = {0.0f, std::log(0.5f)}, beta[2] = {0.5f, 1.0f};
  float state[1] = {1.0f}, out[2] = {};
  GatedDeltaArgs a;
  a.q = q;
  a.k = k;
  a.v = v;
  a.g = g;
  a.beta = beta;
  a.state = state;
  a.out = out;
  a.n_tokens = 2;
  a.n_head_k = a.n_head_v = a.d_k = a.d_v = 1;
  a.l2norm_eps = 0.0f;
  kernels::ref::gated_delta(a);
  // t0: S = 1; δ = 0.5 (0.5 − 1) = −0.25; S = 0.75; o = 0.75.
  // t1: S = 0.375; δ = 1 (−1 − 0.375) = −1.375; S = −1; o = −1 · (−1) = 1.
  CHECK(out[0] == doctest::Approx(0.75).epsilon(1e-6));
  CHECK(out[1] == doctest::Approx(1.0).epsilon(1e-6));
  CHECK(state[0] == doctest::Approx(-1.0).epsilon(1e-6));
}

TEST_CASE("gated_delta: recurrent and chunked forms match ref on every ISA path") {
  double worst[3][3] = {};  // [isa][recurrent, chunk 64, chunk 16]
  std::uint64_t seed = 100;
  for (Shape const& sh : small_shapes())
    for (bool zero_state : {true, false}) {
      if (zero_state && sh.d_k * sh.d_v > 4096) continue;  // big heads: the harder case only
      Problem const p(sh, seed += 10, zero_state);
      Problem const want = reference(p);
      for (int i = 0; i < 3; ++i) {
        CpuIsa const isa = kPaths[i];
        if (!supported(isa)) continue;
        CAPTURE(arch::to_string(isa));
        CAPTURE(to_string(sh));
        CAPTURE(zero_state);
        worst[i][0] = std::max(worst[i][0], check_close(run(p, isa, DeltaRuleForm::kRecurrent), want));
        worst[i][1] = std::max(worst[i][1], check_close(run(p, isa, DeltaRuleForm::kChunked, 64), want));
        worst[i][2] = std::max(worst[i][2], check_close(run(p, isa, DeltaRuleForm::kChunked, 16), want));
      }
    }
  for (int i = 0; i < 3; ++i) {
    if (!supported(kPaths[i])) {
      MESSAGE("skipped the ", arch::to_string(kPaths[i]), " path: this CPU lacks it");
      continue;
    }
    MESSAGE(arch::to_string(kPaths[i]), ": max abs error vs ref: recurrent ", worst[i][0],
            ", chunk 64 ", worst[i][1], ", chunk 16 ", worst[i][2]);
  }
}

TEST_CASE("gated_delta: chunked equals recurrent, for any chunk size and a non-zero state") {
  CpuIsa const isa = arch::cpu_isa();
  double worst = 0;
  for (Shape sh : {Shape{130, 2, 4, 16, 8}, Shape{65, 1, 2, 128, 128}})
    for (int chunk : {1, 2, 16, 63, 64, 65, 200}) {
      CAPTURE(to_string(sh));
      CAPTURE(chunk);
      Problem const p(sh, 7 + static_cast<std::uint64_t>(chunk));
      Problem const rec = run(p, isa, DeltaRuleForm::kRecurrent);
      worst = std::max(worst, check_close(run(p, isa, DeltaRuleForm::kChunked, chunk), rec));
    }
  MESSAGE("max abs difference chunked vs recurrent: ", worst);
}

TEST_CASE("gated_delta: strong decay (g down to -20) underflows cleanly in both forms") {
  for (Shape sh : {Shape{130, 2, 4, 16, 8}, Shape{65, 1, 1, 128, 128}}) {
    CAPTURE(to_string(sh));
    Problem const p(sh, 31, false, -20.0f);
    Problem const want = reference(p);
    check_close(run(p, arch::cpu_isa(), DeltaRuleForm::kRecurrent), want);
    check_close(run(p, arch::cpu_isa(), DeltaRuleForm::kChunked, 64), want);
  }
}

TEST_CASE("gated_delta: a sequence split over two calls equals one call") {
  for (Shape sh : {Shape{130, 2, 4, 16, 8}, Shape{70, 1, 2, 128, 128}}) {
    Problem const p(sh, 55);
    Problem const want = reference(p);
    for (std::int64_t prefix : {std::int64_t{1}, std::int64_t{64}, sh.n_tokens - 1})
      for (CpuIsa isa : kPaths) {
        if (sh.d_k == 128 && prefix != 64) continue;  // keep the ASan run short
        if (!supported(isa)) continue;
        CAPTURE(arch::to_string(isa));
        CAPTURE(to_string(sh));
        CAPTURE(prefix);
        for (DeltaRuleForm form : {DeltaRuleForm::kRecurrent, DeltaRuleForm::kChunked}) {
          CAPTURE(kernels::to_string(form));
          Problem const whole = run(p, isa, form);
          Problem split = p;
          REQUIRE(kernels::cpu::gated_delta(isa, split.args(0, prefix), form) == Status::kSuccess);
          REQUIRE(kernels::cpu::gated_delta(isa, split.args(prefix), form) == Status::kSuccess);
          check_close(split, want);
          if (form == DeltaRuleForm::kRecurrent) {
            CHECK(split.out == whole.out);  // bit-exact: per-token arithmetic is the same
            CHECK(split.state == whole.state);
          } else {
            check_close(split, whole);
          }
        }
        // Prefill chunked, then decode token by token (the model's pattern).
        Problem mixed = p;
        REQUIRE(kernels::cpu::gated_delta(isa, mixed.args(0, prefix), DeltaRuleForm::kChunked) ==
                Status::kSuccess);
        for (std::int64_t t = prefix; t < sh.n_tokens; ++t)
          REQUIRE(kernels::cpu::gated_delta(isa, mixed.args(t, 1), DeltaRuleForm::kRecurrent) ==
                  Status::kSuccess);
        check_close(mixed, want);
      }
  }
}

TEST_CASE("gated_delta: beta = 0 and g = 0 leave the state unchanged; g = 0 or beta = 1 alone") {
  for (CpuIsa isa : kPaths) {
    if (!supported(isa)) continue;
    for (Shape sh : {Shape{65, 2, 4, 16, 8}, Shape{5, 1, 2, 128, 128}}) {
      CAPTURE(arch::to_string(isa));
      CAPTURE(to_string(sh));
      Problem p(sh, 77);
      std::fill(p.g.begin(), p.g.end(), 0.0f);
      std::fill(p.beta.begin(), p.beta.end(), 0.0f);
      Problem const want = reference(p);
      for (DeltaRuleForm form : {DeltaRuleForm::kRecurrent, DeltaRuleForm::kChunked}) {
        CAPTURE(kernels::to_string(form));
        Problem const got = run(p, isa, form, 16);
        CHECK(got.state == p.state);  // bit-exact
        check_close(got, want);       // o_t = S0ᵀ q̂_t
      }
      Problem no_decay(sh, 78);
      std::fill(no_decay.g.begin(), no_decay.g.end(), 0.0f);
      Problem full_beta(sh, 79);
      std::fill(full_beta.beta.begin(), full_beta.beta.end(), 1.0f);
      for (Problem const& e : {no_decay, full_beta}) {
        Problem const w = reference(e);
        check_close(run(e, isa, DeltaRuleForm::kRecurrent), w);
        check_close(run(e, isa, DeltaRuleForm::kChunked, 64), w);
      }
    }
  }
}

TEST_CASE("gated_delta: q, k, v read with token strides straight from a conv output") {
  Shape const sh{65, 2, 4, 16, 8};
  Problem const dense(sh, 91);
  Problem const want = reference(dense);
  // Pack [q | k | v] per token like the conv output [T, 2 Hk dk + Hv dv].
  std::int64_t const qk_row = sh.n_head_k * sh.d_k, v_row = sh.n_head_v * sh.d_v;
  std::int64_t const row = 2 * qk_row + v_row;
  std::vector<float> packed(static_cast<std::size_t>(sh.n_tokens * row));
  for (std::int64_t t = 0; t < sh.n_tokens; ++t) {
    std::copy_n(dense.q.begin() + t * qk_row, qk_row, packed.begin() + t * row);
    std::copy_n(dense.k.begin() + t * qk_row, qk_row, packed.begin() + t * row + qk_row);
    std::copy_n(dense.v.begin() + t * v_row, v_row, packed.begin() + t * row + 2 * qk_row);
  }
  for (DeltaRuleForm form : {DeltaRuleForm::kRecurrent, DeltaRuleForm::kChunked}) {
    CAPTURE(kernels::to_string(form));
    Problem strided = dense;
    GatedDeltaArgs a = strided.args();
    a.q = packed.data();
    a.k = packed.data() + qk_row;
    a.v = packed.data() + 2 * qk_row;
    a.q_stride = a.k_stride = a.v_stride = row;
    REQUIRE(launch_form<spec::generic>(a, form) == Status::kSuccess);
    Problem d = dense;
    REQUIRE(launch_form<spec::generic>(d.args(), form) == Status::kSuccess);
    CHECK(strided.out == d.out);
    CHECK(strided.state == d.state);
    check_close(strided, want);
    Problem r = dense;
    GatedDeltaArgs ra = r.args();
    ra.q = a.q;
    ra.k = a.k;
    ra.v = a.v;
    ra.q_stride = ra.k_stride = ra.v_stride = row;
    kernels::ref::gated_delta(ra);
    CHECK(r.out == want.out);
  }
}

TEST_CASE("gated_delta: can_implement rejects bad arguments; static specs check dims") {
  Problem p(Shape{4, 2, 4, 16, 8}, 3);
  auto launch = [](GatedDeltaArgs const& a, DeltaRuleForm f = DeltaRuleForm::kChunked, int chunk = 64) {
    return launch_form<spec::generic>(a, f, chunk);
  };
  CHECK(launch(p.args()) == Status::kSuccess);
  GatedDeltaArgs a = p.args();
  a.q = nullptr;
  CHECK(launch(a) == Status::kErrorInvalidProblem);
  a = p.args();
  a.state = nullptr;
  CHECK(launch(a) == Status::kErrorInvalidProblem);
  a = p.args();
  a.n_tokens = 0;
  CHECK(launch(a) == Status::kErrorInvalidProblem);
  a = p.args();
  a.d_v = 0;
  CHECK(launch(a) == Status::kErrorInvalidProblem);
  a = p.args();
  a.n_head_k = 3;  // 4 % 3 != 0
  CHECK(launch(a) == Status::kErrorInvalidProblem);
  a = p.args();
  a.out = p.v.data();  // out must not overlap v
  CHECK(launch(a) == Status::kErrorInvalidProblem);
  a = p.args();
  a.g = p.state.data();  // the state is written while g and beta are read: apart
  CHECK(launch(a) == Status::kErrorInvalidProblem);
  a = p.args();
  a.beta = p.state.data() + 5;
  CHECK(launch(a) == Status::kErrorInvalidProblem);
  a = p.args();
  a.q_stride = 5;  // shorter than a token row
  CHECK(launch(a) == Status::kErrorInvalidProblem);
  CHECK(launch(p.args(), static_cast<DeltaRuleForm>(2)) == Status::kErrorInvalidProblem);  // no such form
  a = p.args();
  a.chunk_size = 0;  // checked by can_implement, which every arch's launcher calls
  CHECK(kernels::can_implement_gated_delta<spec::generic>(a) == Status::kErrorInvalidProblem);
  CHECK(launch(p.args(), DeltaRuleForm::kChunked, 0) == Status::kErrorInvalidProblem);
  CHECK(launch(p.args(), DeltaRuleForm::kChunked, kernels::kMaxDeltaChunk + 1) == Status::kErrorInvalidProblem);
  CHECK(launch(p.args(), DeltaRuleForm::kRecurrent, 0) == Status::kSuccess);  // chunk unused
  // qwen3_6_35b_a3b fixes (16, 32, 128, 128).
  auto launch_q36 = [](GatedDeltaArgs const& x) {
    return launch_form<spec::qwen3_6_35b_a3b>(x, DeltaRuleForm::kRecurrent);
  };
  CHECK(launch_q36(p.args()) == Status::kErrorInvalidProblem);
  Problem q36(Shape{2, 16, 32, 128, 128}, 4);
  Problem q36_generic = q36;
  REQUIRE(launch_q36(q36.args()) == Status::kSuccess);
  REQUIRE(launch_form<spec::generic>(q36_generic.args(),
                                                     DeltaRuleForm::kRecurrent) == Status::kSuccess);
  CHECK(q36.out == q36_generic.out);
}

TEST_CASE("gated_delta: tiled value heads equal grouped ones with the heads permuted") {
  // GGUF stores value head j' = H_k * r + g for HF's head j = r_ratio * g + r. Running the
  // tiled order on permuted inputs must give the grouped result, permuted the same way.
  Shape const sh{37, 2, 6, 16, 8};
  int const ratio = sh.n_head_v / sh.n_head_k;
  auto tiled_of = [&](int j) { return sh.n_head_k * (j % ratio) + j / ratio; };
  Problem const grouped(sh, 71);
  Problem tiled = grouped;
  std::int64_t const dv = sh.d_v, dkv = std::int64_t{sh.d_k} * sh.d_v;
  for (std::int64_t t = 0; t < sh.n_tokens; ++t)
    for (int j = 0; j < sh.n_head_v; ++j) {
      std::int64_t const src = t * sh.n_head_v + j, dst = t * sh.n_head_v + tiled_of(j);
      std::copy_n(grouped.v.begin() + src * dv, dv, tiled.v.begin() + dst * dv);
      tiled.g[static_cast<std::size_t>(dst)] = grouped.g[static_cast<std::size_t>(src)];
      tiled.beta[static_cast<std::size_t>(dst)] = grouped.beta[static_cast<std::size_t>(src)];
    }
  for (int j = 0; j < sh.n_head_v; ++j)
    std::copy_n(grouped.state.begin() + j * dkv, dkv, tiled.state.begin() + tiled_of(j) * dkv);
  Problem const want = reference(grouped);
  for (auto form : {DeltaRuleForm::kRecurrent, DeltaRuleForm::kChunked})
    for (CpuIsa isa : kPaths) {
      if (!supported(isa)) continue;
      CAPTURE(kernels::to_string(form));
      CAPTURE(arch::to_string(isa));
      Problem p = tiled;
      GatedDeltaArgs a = p.args();
      a.tiled_value_heads = true;
      REQUIRE(kernels::cpu::gated_delta(isa, a, form, 16) == Status::kSuccess);
      Problem r = tiled;
      GatedDeltaArgs ra = r.args();
      ra.tiled_value_heads = true;
      kernels::ref::gated_delta(ra);
      check_close(p, r);
      // Un-permute the kernel's result and compare with the grouped reference.
      Problem back = want;
      for (std::int64_t t = 0; t < sh.n_tokens; ++t)
        for (int j = 0; j < sh.n_head_v; ++j)
          std::copy_n(p.out.begin() + (t * sh.n_head_v + tiled_of(j)) * dv, dv, back.out.begin() + (t * sh.n_head_v + j) * dv);
      for (int j = 0; j < sh.n_head_v; ++j)
        std::copy_n(p.state.begin() + tiled_of(j) * dkv, dkv, back.state.begin() + j * dkv);
      check_close(back, want);
    }
}

TEST_CASE("exp_nonpositive_f32: within 2 ulp of std::exp on [-87, 0], clamped below, NaN stays NaN") {
  for (float x = -87.0f; x <= 0.0f; x += 0.0137f) {
    CAPTURE(x);
    float const want = std::exp(x), got = kernels::gdn::exp_nonpositive_f32(x);
    CHECK(std::fabs(got - want) <= 2.0f * (std::nextafter(want, INFINITY) - want));
  }
  CHECK(kernels::gdn::exp_nonpositive_f32(0.0f) == 1.0f);
  // Below -87 (-inf included) every input gives e^-87's value.
  float const floor = kernels::gdn::exp_nonpositive_f32(-87.0f);
  CHECK(kernels::gdn::exp_nonpositive_f32(-1000.0f) == floor);
  CHECK(kernels::gdn::exp_nonpositive_f32(-INFINITY) == floor);
  // NaN propagates, with no conversion of NaN to an integer on the way (UBSan checks that).
  CHECK(std::isnan(kernels::gdn::exp_nonpositive_f32(NAN)));
  CHECK(std::isnan(kernels::gdn::exp_nonpositive_f32(-NAN)));
}
