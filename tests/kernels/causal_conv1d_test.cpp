// Causal depthwise conv1d on the CPU: every ISA path against kernels::ref::causal_conv1d,
// tap orientation, state carry across calls, argument checks.
//
// Tolerance tol::f32 = {atol 1e-5, rtol 1e-5} on y against the fp64 reference: each output is
// a sum of d_conv <= 9 products of values in [-1, 1] (fp32 error <= 9 * 2^-24 * 9 ~ 5e-6
// absolute) followed by silu with the polynomial exp (a few ulp relative); measured max
// 4.8e-7 absolute (printed with -s).
// The state written back is a copy of inputs, so it must be bit-exact.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/kernels/causal_conv1d/cpu.hpp"
#include "qflash/kernels/causal_conv1d/ref.hpp"
#include "qflash/spec/presets.hpp"
#include "support/random.hpp"
#include "support/tolerance.hpp"

using namespace qflash;
using arch::CpuIsa;
using kernels::CausalConv1dArgs;
using qflash::test::all_close;

namespace {

constexpr CpuIsa kPaths[] = {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512};

bool supported(CpuIsa isa) { return isa <= arch::detect_cpu_isa(); }

struct ConvProblem {
  std::int64_t n_tokens;
  int n_channels, d_conv;
  bool silu;
  std::vector<float> x, w, state, y;

  ConvProblem(std::int64_t t, int c, int k, bool apply_silu, bool zero_state, std::uint64_t seed)
      : n_tokens(t),
        n_channels(c),
        d_conv(k),
        silu(apply_silu),
        x(test::random_floats(static_cast<std::size_t>(t * c), seed)),
        w(test::random_floats(static_cast<std::size_t>(c) * k, seed + 1)),
        state(zero_state ? std::vector<float>(static_cast<std::size_t>(c) * (k - 1), 0.0f)
                         : test::random_floats(static_cast<std::size_t>(c) * (k - 1), seed + 2)),
        y(static_cast<std::size_t>(t * c), -999.0f) {}

  /// Arguments for tokens [t0, t0 + n).
  CausalConv1dArgs args(std::int64_t t0 = 0, std::int64_t n = -1) {
    if (n < 0) n = n_tokens - t0;
    CausalConv1dArgs a;
    a.x = x.data() + t0 * n_channels;
    a.weight = w.data();
    a.state = d_conv > 1 ? state.data() : nullptr;
    a.y = y.data() + t0 * n_channels;
    a.n_tokens = n;
    a.n_channels = n_channels;
    a.d_conv = d_conv;
    a.apply_silu = silu;
    return a;
  }
  std::string name() const {
    std::ostringstream os;
    os << "{T=" << n_tokens << " C=" << n_channels << " K=" << d_conv << " silu=" << silu << "}";
    return os.str();
  }
};

void check_same(ConvProblem const& got, ConvProblem const& want) {
  auto const r = all_close(std::span<float const>(got.y), std::span<float const>(want.y), test::tol::f32);
  CHECK_MESSAGE(r.ok, "y: ", r.report);
  CHECK(got.state == want.state);
}

}  // namespace

TEST_CASE("causal_conv1d: weight[c][d_conv-1] taps the current token, weight[c][0] the oldest") {
  // Channel 0 passes the current input, channel 1 the input 3 tokens back (zeros before the
  // sequence start); no silu, so y is exactly the tapped input.
  ConvProblem p(6, 2, 4, false, true, 1);
  std::fill(p.w.begin(), p.w.end(), 0.0f);
  p.w[0 * 4 + 3] = 1.0f;
  p.w[1 * 4 + 0] = 1.0f;
  ConvProblem r = p;
  kernels::ref::causal_conv1d(r.args());
  REQUIRE(kernels::launch_causal_conv1d<spec::generic>(arch::Cpu{}, p.args()) == Status::kSuccess);
  for (std::int64_t t = 0; t < 6; ++t) {
    CAPTURE(t);
    CHECK(p.y[t * 2 + 0] == p.x[t * 2 + 0]);
    CHECK(p.y[t * 2 + 1] == (t >= 3 ? p.x[(t - 3) * 2 + 1] : 0.0f));
    CHECK(r.y[t * 2 + 0] == p.y[t * 2 + 0]);
    CHECK(r.y[t * 2 + 1] == p.y[t * 2 + 1]);
  }
  // The state is the last three inputs, oldest first.
  for (int c = 0; c < 2; ++c)
    for (int i = 0; i < 3; ++i) CHECK(p.state[c * 3 + i] == p.x[(3 + i) * 2 + c]);
}

TEST_CASE("causal_conv1d: matches ref on every ISA path") {
  double worst[3] = {};
  std::uint64_t seed = 10;
  for (std::int64_t t : {1, 2, 5, 63, 64, 65, 130})
    for (int c : {1, 17, 129})
      for (int k : {1, 2, 4, 9})  // 9: above the unrolled widths (kMaxFixedConv)
        for (bool silu : {true, false})
          for (bool zero_state : {true, false}) {
            ConvProblem const p(t, c, k, silu, zero_state, seed += 3);
            ConvProblem want = p;
            kernels::ref::causal_conv1d(want.args());
            for (int i = 0; i < 3; ++i) {
              CpuIsa const isa = kPaths[i];
              if (!supported(isa)) continue;
              CAPTURE(arch::to_string(isa));
              CAPTURE(p.name());
              CAPTURE(zero_state);
              ConvProblem got = p;
              REQUIRE(kernels::cpu::causal_conv1d(isa, got.args()) == Status::kSuccess);
              check_same(got, want);
              for (std::size_t j = 0; j < got.y.size(); ++j)
                worst[i] = std::max(worst[i], std::fabs(double{got.y[j]} - want.y[j]));
            }
          }
  for (int i = 0; i < 3; ++i)
    if (supported(kPaths[i])) MESSAGE(arch::to_string(kPaths[i]), ": max abs error vs ref ", worst[i]);
}

TEST_CASE("causal_conv1d: a sequence split over calls (prefill, then decode) equals one call") {
  for (CpuIsa isa : kPaths) {
    if (!supported(isa)) continue;
    for (int k : {2, 4, 9})
      for (std::int64_t prefix : {1, 2, 3, 64}) {
        ConvProblem const p(70, 129, k, true, false, 99);
        CAPTURE(arch::to_string(isa));
        CAPTURE(p.name());
        CAPTURE(prefix);
        ConvProblem whole = p;
        REQUIRE(kernels::cpu::causal_conv1d(isa, whole.args()) == Status::kSuccess);
        ConvProblem split = p;
        REQUIRE(kernels::cpu::causal_conv1d(isa, split.args(0, prefix)) == Status::kSuccess);
        REQUIRE(kernels::cpu::causal_conv1d(isa, split.args(prefix, 5)) == Status::kSuccess);
        for (std::int64_t t = prefix + 5; t < p.n_tokens; ++t)
          REQUIRE(kernels::cpu::causal_conv1d(isa, split.args(t, 1)) == Status::kSuccess);
        CHECK(split.y == whole.y);  // bit-exact: same taps, same order
        CHECK(split.state == whole.state);
      }
  }
}

TEST_CASE("causal_conv1d: can_implement rejects bad arguments; static specs check d_conv") {
  ConvProblem p(4, 8, 4, true, false, 5);
  auto launch = [](CausalConv1dArgs const& a) {
    return kernels::launch_causal_conv1d<spec::generic>(arch::Cpu{}, a);
  };
  CHECK(launch(p.args()) == Status::kSuccess);
  CausalConv1dArgs a = p.args();
  a.x = nullptr;
  CHECK(launch(a) == Status::kErrorInvalidProblem);
  a = p.args();
  a.state = nullptr;  // needed when d_conv > 1
  CHECK(launch(a) == Status::kErrorInvalidProblem);
  a = p.args();
  a.n_tokens = 0;
  CHECK(launch(a) == Status::kErrorInvalidProblem);
  a = p.args();
  a.d_conv = 0;
  CHECK(launch(a) == Status::kErrorInvalidProblem);
  a = p.args();
  a.y = p.x.data() + 1;  // overlaps x
  CHECK(launch(a) == Status::kErrorInvalidProblem);
  a = p.args();
  a.state = p.x.data() + 2;  // overlaps x, which the state is rewritten from
  CHECK(launch(a) == Status::kErrorInvalidProblem);
  CHECK(kernels::launch_causal_conv1d<spec::qwen3_6_35b_a3b>(arch::Cpu{}, p.args()) == Status::kSuccess);
  ConvProblem k3(4, 8, 3, true, false, 6);
  CHECK(kernels::launch_causal_conv1d<spec::qwen3_6_35b_a3b>(arch::Cpu{}, k3.args()) ==
        Status::kErrorInvalidProblem);
}
