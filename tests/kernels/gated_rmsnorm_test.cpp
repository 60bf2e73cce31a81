// Gated RMSNorm (the GDN output norm) on the CPU: every ISA path against
// kernels::ref::gated_rmsnorm, a row worked by hand, in-place use, argument checks.
//
// Tolerance tol::f32 = {atol 1e-5, rtol 1e-5} against the fp64 reference: the fp32 sum of
// squares over <= 129 terms (error ~sqrt(129) * 2^-24 relative, halved by the rsqrt), a few
// correctly rounded ops, and silu with the polynomial exp (a few ulp); measured max 5.2e-7
// relative (printed with -s).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/kernels/gated_rmsnorm/cpu.hpp"
#include "qflash/kernels/gated_rmsnorm/ref.hpp"
#include "qflash/spec/presets.hpp"
#include "support/random.hpp"
#include "support/tolerance.hpp"

using namespace qflash;
using arch::CpuIsa;
using kernels::GatedRmsNormArgs;
using qflash::test::all_close;

namespace {

constexpr CpuIsa kPaths[] = {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512};

bool supported(CpuIsa isa) { return isa <= arch::detect_cpu_isa(); }

struct NormProblem {
  std::int64_t n_rows;
  int n_cols;
  std::vector<float> x, z, w, y;

  NormProblem(std::int64_t rows, int cols, std::uint64_t seed)
      : n_rows(rows),
        n_cols(cols),
        x(test::random_floats(static_cast<std::size_t>(rows * cols), seed, -2.0f, 2.0f)),
        z(test::random_floats(static_cast<std::size_t>(rows * cols), seed + 1, -6.0f, 6.0f)),
        w(test::random_floats(static_cast<std::size_t>(cols), seed + 2, 0.5f, 1.5f)),
        y(static_cast<std::size_t>(rows * cols), -999.0f) {}

  GatedRmsNormArgs args() {
    GatedRmsNormArgs a;
    a.x = x.data();
    a.z = z.data();
    a.weight = w.data();
    a.y = y.data();
    a.n_rows = n_rows;
    a.n_cols = n_cols;
    return a;
  }
};

}  // namespace

TEST_CASE("gated_rmsnorm: a row worked by hand") {
  // x = [3, 4]: rms = sqrt(12.5). z = [0, 1]: silu = [0, 1 / (1 + e^-1)]. w = [2, 3].
  float x[2] = {3.0f, 4.0f}, z[2] = {0.0f, 1.0f}, w[2] = {2.0f, 3.0f}, y[2] = {};
  GatedRmsNormArgs a;
  a.x = x;
  a.z = z;
  a.weight = w;
  a.y = y;
  a.n_rows = 1;
  a.n_cols = 2;
  a.eps = 0.0f;
  REQUIRE(kernels::launch_gated_rmsnorm<spec::generic>(arch::Cpu{}, a) == Status::kSuccess);
  CHECK(y[0] == 0.0f);
  CHECK(y[1] == doctest::Approx(3.0 * 4.0 / std::sqrt(12.5) / (1.0 + std::exp(-1.0))).epsilon(1e-6));
}

TEST_CASE("gated_rmsnorm: matches ref on every ISA path; y may alias x") {
  for (CpuIsa isa : kPaths) {
    if (!supported(isa)) {
      MESSAGE("skipping the ", arch::to_string(isa), " path: this CPU lacks it");
      continue;
    }
    double worst = 0;
    std::uint64_t seed = 20;
    for (std::int64_t rows : {1, 5, 64, 130})
      for (int cols : {1, 7, 16, 128, 129}) {
        CAPTURE(arch::to_string(isa));
        CAPTURE(rows);
        CAPTURE(cols);
        NormProblem p(rows, cols, seed += 3);
        NormProblem want = p;
        kernels::ref::gated_rmsnorm(want.args());
        NormProblem got = p;
        REQUIRE(kernels::cpu::gated_rmsnorm(isa, got.args()) == Status::kSuccess);
        auto const r = all_close(std::span<float const>(got.y), std::span<float const>(want.y), test::tol::f32);
        CHECK_MESSAGE(r.ok, r.report);
        for (std::size_t i = 0; i < got.y.size(); ++i)
          worst = std::max(worst, std::fabs(double{got.y[i]} - want.y[i]) / (1e-3 + std::fabs(double{want.y[i]})));
        // In place: y = x.
        NormProblem in_place = p;
        GatedRmsNormArgs a = in_place.args();
        a.y = in_place.x.data();
        REQUIRE(kernels::cpu::gated_rmsnorm(isa, a) == Status::kSuccess);
        CHECK(in_place.x == got.y);
      }
    MESSAGE(arch::to_string(isa), ": max relative error vs ref ", worst);
  }
}

TEST_CASE("gated_rmsnorm: can_implement rejects bad arguments; static specs check d_v") {
  NormProblem p(4, 128, 3);
  auto launch = [](GatedRmsNormArgs const& a) {
    return kernels::launch_gated_rmsnorm<spec::generic>(arch::Cpu{}, a);
  };
  CHECK(launch(p.args()) == Status::kSuccess);
  GatedRmsNormArgs a = p.args();
  a.z = nullptr;
  CHECK(launch(a) == Status::kErrorInvalidProblem);
  a = p.args();
  a.n_rows = 0;
  CHECK(launch(a) == Status::kErrorInvalidProblem);
  a = p.args();
  a.y = p.x.data() + 1;  // overlaps x without being x
  CHECK(launch(a) == Status::kErrorInvalidProblem);
  a = p.args();
  a.y = p.z.data();  // must not overlap the gate
  CHECK(launch(a) == Status::kErrorInvalidProblem);
  a = p.args();
  a.eps = -1.0f;
  CHECK(launch(a) == Status::kErrorInvalidProblem);
  CHECK(kernels::launch_gated_rmsnorm<spec::qwen3_6_35b_a3b>(arch::Cpu{}, p.args()) == Status::kSuccess);
  NormProblem narrow(4, 64, 4);
  CHECK(kernels::launch_gated_rmsnorm<spec::qwen3_6_35b_a3b>(arch::Cpu{}, narrow.args()) ==
        Status::kErrorInvalidProblem);
}
