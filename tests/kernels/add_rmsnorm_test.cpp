// add + RMSNorm on the CPU: every ISA path against kernels::ref::add_rmsnorm, and the op's properties.
// Tolerances and their origin: tests/kernels/add_rmsnorm_common.hpp.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "kernels/add_rmsnorm_common.hpp"
#include "qflash/arch/cpu_features.hpp"
#include "qflash/kernels/add_rmsnorm/cpu.hpp"
#include "qflash/kernels/add_rmsnorm/ref.hpp"
#include "qflash/runtime/dispatch.hpp"
#include "qflash/spec/presets.hpp"

using namespace qflash;
using namespace qflash::test::add_rmsnorm;
using arch::CpuIsa;
using kernels::launch_add_rmsnorm;

namespace {

/// The CPU paths: kAvx512Bf16 runs the AVX-512 code, so it is not a separate path.
constexpr CpuIsa kPaths[] = {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512};

bool supported(CpuIsa isa) {
  if (isa <= arch::detect_cpu_isa()) return true;
  MESSAGE("skipping the ", arch::to_string(isa), " path: this CPU lacks it");
  return false;
}

/// Runs a copy of `input` through the generic instance on `isa`.
Problem run_generic(Problem const& input, CpuIsa isa) {
  Problem p = input;
  REQUIRE(launch_add_rmsnorm<spec::generic>(arch::Cpu{}, isa, p.args()) == Status::kSuccess);
  return p;
}
Problem run_generic(Case const& c, CpuIsa isa) { return run_generic(Problem(c), isa); }

/// The reference result for a copy of `input`.
Problem reference_of(Problem const& input) {
  Problem p = input;
  REQUIRE(kernels::ref::add_rmsnorm(p.args()) == Status::kSuccess);
  return p;
}

}  // namespace

TEST_CASE("bf16 scalar conversions round to nearest even and keep NaN") {
  using kernels::bf16_to_float;
  using kernels::float_to_bf16;
  CHECK(float_to_bf16(1.0f) == 0x3f80);
  CHECK(float_to_bf16(1.0f + 0x1p-8f) == 0x3f80);          // tie, even stays
  CHECK(float_to_bf16(1.0f + 0x1p-7f + 0x1p-8f) == 0x3f82);  // tie, odd rounds up
  CHECK(float_to_bf16(1.0f + 0x1p-8f + 0x1p-20f) == 0x3f81);  // above the tie
  CHECK(float_to_bf16(-2.5f) == 0xc020);
  CHECK(float_to_bf16(std::numeric_limits<float>::infinity()) == 0x7f80);
  CHECK(float_to_bf16(std::numeric_limits<float>::max()) == 0x7f80);  // overflow to inf
  CHECK(float_to_bf16(0x1p-133f) == 0x0001);  // smallest bf16 subnormal: no flush to zero
  CHECK(float_to_bf16(0x1p-135f) == 0x0000);  // below half of it
  CHECK(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose payload lies only in the low 16 bits must not become infinity.
  CHECK(std::isnan(bf16_to_float(float_to_bf16(std::bit_cast<float>(0x7f800001u)))));
  int round_trip_errors = 0;
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    auto const h = static_cast<std::uint16_t>(b);
    if (!std::isnan(bf16_to_float(h)) && float_to_bf16(bf16_to_float(h)) != h) ++round_trip_errors;
  }
  CHECK(round_trip_errors == 0);
  // double -> bf16 in one rounding, not two: 1 + 2^-8 + 2^-40 is above the bf16 tie, but
  // rounds to the tie 1 + 2^-8 in fp32 and would then go down to 1.
  CHECK(kernels::ref::bf16_from_double(1.0 + 0x1p-8 + 0x1p-40) == 0x3f81);
  CHECK(kernels::ref::bf16_from_double(1.0 + 0x1p-8) == 0x3f80);
}

#if QFLASH_HAS_X86_SIMD
QFLASH_SIMD_BEGIN
namespace {
QFLASH_TARGET_AVX512 void convert_avx512(float const* in, std::uint16_t* out, std::size_t n) {
  for (std::size_t i = 0; i + 16 <= n; i += 16) kernels::simd::avx512_store(out + i, kernels::simd::avx512_load(in + i));
}
QFLASH_TARGET_AVX2 void convert_avx2(float const* in, std::uint16_t* out, std::size_t n) {
  for (std::size_t i = 0; i + 8 <= n; i += 8) kernels::simd::avx2_store(out + i, kernels::simd::avx2_load(in + i));
}
}  // namespace
QFLASH_SIMD_END

TEST_CASE("SIMD bf16 conversions give the scalar bits for every class of input") {
  // Every upper half with low halves around the rounding boundary: ties, NaN payloads,
  // subnormals, infinities, the overflow edge.
  std::vector<float> in;
  for (std::uint32_t hi = 0; hi < 0x10000; ++hi)
    for (std::uint32_t lo : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu})
      in.push_back(std::bit_cast<float>(hi << 16 | lo));
  std::vector<std::uint16_t> want(in.size());
  for (std::size_t i = 0; i < in.size(); ++i) want[i] = kernels::float_to_bf16(in[i]);
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (!supported(isa)) continue;
    CAPTURE(arch::to_string(isa));
    std::vector<std::uint16_t> got(in.size(), 0);
    if (isa == CpuIsa::kAvx512)
      convert_avx512(in.data(), got.data(), in.size());
    else
      convert_avx2(in.data(), got.data(), in.size());
    CHECK(got == want);
  }
}
#endif

TEST_CASE("kernels::ref::add_rmsnorm on a row worked by hand") {
  // x = [3, 4]: rms = sqrt((9 + 16) / 2) = sqrt(12.5); y = x / rms * w.
  float x[2] = {3.0f, 4.0f};
  float w[2] = {1.0f, 2.0f};
  float y[2] = {};
  AddRmsNormArgs a;
  a.x = x;
  a.weight = w;
  a.y = y;
  a.n_rows = 1;
  a.n_cols = 2;
  a.eps = 0.0f;
  REQUIRE(kernels::ref::add_rmsnorm(a) == Status::kSuccess);
  CHECK(y[0] == doctest::Approx(3.0 / std::sqrt(12.5)).epsilon(1e-7));
  CHECK(y[1] == doctest::Approx(8.0 / std::sqrt(12.5)).epsilon(1e-7));
  // (1 + w) with w = [0, 1] is the same scale.
  float wz[2] = {0.0f, 1.0f};
  a.weight = wz;
  a.weight_kind = NormWeight::kZeroCentered;
  float y2[2] = {};
  a.y = y2;
  REQUIRE(kernels::ref::add_rmsnorm(a) == Status::kSuccess);
  CHECK(y2[0] == y[0]);
  CHECK(y2[1] == y[1]);
}

TEST_CASE("every CPU path matches ref") {
  std::vector<CpuIsa> paths;
  for (CpuIsa isa : kPaths)
    if (supported(isa)) paths.push_back(isa);
  double worst[std::size(kPaths)][2] = {};  // [path][fp32, bf16]
  for (Case const& c : all_cases()) {
    CAPTURE(to_string(c));
    Problem const input(c);
    Problem const want = reference_of(input);
    for (CpuIsa isa : paths) {
      CAPTURE(arch::to_string(isa));
      Problem const got = run_generic(input, isa);
      check_matches_reference(got, want);
      double& w = worst[static_cast<int>(isa)][c.dtype == DType::kBF16 ? 1 : 0];
      w = std::max(w, max_rel_error(got, want));
    }
  }
  for (CpuIsa isa : paths)
    MESSAGE(arch::to_string(isa), ": max relative error vs ref: fp32 ", worst[static_cast<int>(isa)][0],
            ", bf16 ", worst[static_cast<int>(isa)][1]);
}

TEST_CASE("fused add + norm equals the add, then the norm of the stored residual") {
  for (CpuIsa isa : kPaths) {
    if (!supported(isa)) continue;
    for (Case c : all_cases(kWidths, std::span<std::int64_t const>(kRows).subspan(1, 1))) {
      if (!c.with_residual) continue;
      CAPTURE(arch::to_string(isa));
      CAPTURE(to_string(c));
      Problem const fused = run_generic(c, isa);

      // Add alone, by the reference (exact), then the norm with no residual.
      Problem split(c);
      for (std::size_t i = 0; i < split.x.count; ++i)
        split.residual.set(i, static_cast<float>(split.x.get(i) + split.residual.get(i)));
      CHECK(split.residual == fused.residual);
      Case norm_only = c;
      norm_only.with_residual = false;
      Problem norm(norm_only);
      norm.x = split.residual;
      REQUIRE(launch_add_rmsnorm<spec::generic>(arch::Cpu{}, isa, norm.args()) == Status::kSuccess);
      CHECK(norm.y == fused.y);  // bitwise: same values, same summation order
    }
  }
}

TEST_CASE("compile-time width (static spec) gives the generic instance's bits") {
  // 1 row runs on the calling thread, 17 x 2048 is split over threads.
  for (Case c : all_cases(std::array{2048}, std::array<std::int64_t, 2>{1, 17})) {
    CAPTURE(to_string(c));
    Problem const input(c);
    Problem const want = reference_of(input);
    for (CpuIsa isa : kPaths) {
      if (!supported(isa)) continue;
      CAPTURE(arch::to_string(isa));
      Problem const generic = run_generic(input, isa);
      Problem a = input, b = input;
      REQUIRE(launch_add_rmsnorm<spec::qwen3_6_35b_a3b>(arch::Cpu{}, isa, a.args()) == Status::kSuccess);
      REQUIRE(launch_add_rmsnorm<spec::qwen3_30b_a3b>(arch::Cpu{}, isa, b.args()) == Status::kSuccess);
      CHECK(a.y == generic.y);
      CHECK(b.y == generic.y);
      CHECK(a.residual == generic.residual);
      check_matches_reference(a, want);
    }
  }
}

TEST_CASE("threads do not change the result; y may alias x") {
  // 32 rows x 2048 spans several chunks (kMinElementsPerThread), one row runs alone.
  for (CpuIsa isa : kPaths) {
    if (!supported(isa)) continue;
    for (DType t : {DType::kF32, DType::kBF16}) {
      CAPTURE(arch::to_string(isa));
      CAPTURE(qflash::to_string(t));
      Case c{t, DType::kBF16, NormWeight::kZeroCentered, true, 32, 2048};
      Problem const all = run_generic(c, isa);
      Problem rows(c);
      for (std::int64_t r = 0; r < c.n_rows; ++r) {
        AddRmsNormArgs a = rows.args();
        std::size_t const off = static_cast<std::size_t>(r) * 2048 * size_of(t);
        a.x = static_cast<char const*>(a.x) + off;
        a.residual = static_cast<char*>(a.residual) + off;
        a.y = static_cast<char*>(a.y) + off;
        a.n_rows = 1;
        REQUIRE(launch_add_rmsnorm<spec::generic>(arch::Cpu{}, isa, a) == Status::kSuccess);
      }
      CHECK(rows.y == all.y);
      CHECK(rows.residual == all.residual);

      Problem in_place(c);
      AddRmsNormArgs a = in_place.args();
      a.y = in_place.x.data();
      REQUIRE(launch_add_rmsnorm<spec::generic>(arch::Cpu{}, isa, a) == Status::kSuccess);
      CHECK(in_place.x == all.y);
    }
  }
}

TEST_CASE("spec-level checks: static widths, dtypes, pointers") {
  Problem p(Case{DType::kBF16, DType::kBF16, NormWeight::kZeroCentered, true, 3, 2048});
  AddRmsNormArgs a = p.args();
  CHECK(launch_add_rmsnorm<spec::qwen3_6_35b_a3b>(arch::Cpu{}, a) == Status::kSuccess);
  check_matches_reference(p, reference(p.c));

  Problem q(Case{DType::kF32, DType::kF32, NormWeight::kPlain, true, 3, 1000});
  a = q.args();
  CHECK(launch_add_rmsnorm<spec::qwen3_6_35b_a3b>(arch::Cpu{}, a) == Status::kErrorInvalidProblem);
  CHECK(launch_add_rmsnorm<spec::qwen3_30b_a3b>(arch::Cpu{}, a) == Status::kErrorInvalidProblem);
  CHECK(launch_add_rmsnorm<spec::generic>(arch::Cpu{}, a) == Status::kSuccess);
  check_matches_reference(q, reference(q.c));

  AddRmsNormArgs bad = q.args();
  bad.dtype = DType::kF16;
  CHECK(launch_add_rmsnorm<spec::generic>(arch::Cpu{}, bad) == Status::kErrorNotSupported);
  bad = q.args();
  bad.weight_dtype = DType::kFp8E4m3;
  CHECK(launch_add_rmsnorm<spec::generic>(arch::Cpu{}, bad) == Status::kErrorNotSupported);
  bad = q.args();
  bad.y = nullptr;
  CHECK(launch_add_rmsnorm<spec::generic>(arch::Cpu{}, bad) == Status::kErrorInvalidProblem);
  bad = q.args();
  bad.n_cols = 0;
  CHECK(launch_add_rmsnorm<spec::generic>(arch::Cpu{}, bad) == Status::kErrorInvalidProblem);
  bad = q.args();
  bad.eps = std::numeric_limits<float>::quiet_NaN();
  CHECK(launch_add_rmsnorm<spec::generic>(arch::Cpu{}, bad) == Status::kErrorInvalidProblem);

  // Zero rows: nothing to do, nothing written.
  Problem z(Case{DType::kF32, DType::kF32, NormWeight::kPlain, true, 1, 64});
  Problem const z0 = z;
  a = z.args();
  a.n_rows = 0;
  CHECK(launch_add_rmsnorm<spec::generic>(arch::Cpu{}, a) == Status::kSuccess);
  CHECK(z.y == z0.y);
  CHECK(z.residual == z0.residual);

  // An ISA level above this CPU's is refused, not run.
  if (arch::detect_cpu_isa() < CpuIsa::kAvx512Bf16)
    CHECK(launch_add_rmsnorm<spec::generic>(arch::Cpu{}, CpuIsa::kAvx512Bf16, q.args()) ==
          Status::kErrorNotSupported);
  else
    CHECK(launch_add_rmsnorm<spec::generic>(arch::Cpu{}, CpuIsa::kAvx512Bf16, q.args()) ==
          Status::kSuccess);
}

TEST_CASE("runtime::dispatch_spec reaches the CPU instances") {
  set_log_sink({});  // dispatch logs the generic fallback once per process
  auto cpu = [](AddRmsNormArgs const& a) {
    return [a](auto s) { return launch_add_rmsnorm<decltype(s)::value>(arch::Cpu{}, a); };
  };

  Problem p(Case{DType::kBF16, DType::kF32, NormWeight::kZeroCentered, true, 17, 2048});
  CHECK(runtime::dispatch_spec(spec::qwen3_6_35b_a3b, cpu(p.args())) == Status::kSuccess);
  check_matches_reference(p, reference(p.c));

  // A model the build has no static spec for runs on the generic instance at any width...
  MoeSpec custom = spec::qwen3_30b_a3b;
  custom.d_model = 1000;
  Problem q(Case{DType::kF32, DType::kBF16, NormWeight::kPlain, true, 3, 1000});
  bool const generic_compiled = runtime::select_spec(instances::kSpecs, custom) >= 0;
  Status const st = runtime::dispatch_spec(custom, cpu(q.args()));
  if (generic_compiled) {
    CHECK(st == Status::kSuccess);
    check_matches_reference(q, reference(q.c));
  } else {
    CHECK(st == Status::kErrorNotSupported);
  }
  // ...while a width that contradicts the spec is refused by the static instance.
  Problem r(Case{DType::kF32, DType::kF32, NormWeight::kPlain, true, 3, 1000});
  CHECK(runtime::dispatch_spec(spec::qwen3_30b_a3b, cpu(r.args())) == Status::kErrorInvalidProblem);
  set_log_sink(detail::default_log_sink);
}

// Also run by ctest with QFLASH_CPU_ISA=scalar and =avx2 (tests/kernels/CMakeLists.txt).
TEST_CASE("the plain launcher runs the level arch::cpu_isa() names, capped by QFLASH_CPU_ISA") {
  CpuIsa const detected = arch::detect_cpu_isa();
  CpuIsa expected = detected;
  CpuIsa cap;
  if (char const* env = std::getenv("QFLASH_CPU_ISA"); env && arch::parse_cpu_isa(env, cap))
    expected = std::min(cap, detected);
  CHECK(arch::cpu_isa() == expected);
  MESSAGE("cpu_isa() = ", arch::to_string(arch::cpu_isa()), " (detected ", arch::to_string(detected), ")");

  for (Case c : all_cases(std::array{71, 2048}, std::array<std::int64_t, 1>{3})) {
    CAPTURE(to_string(c));
    Problem const explicit_level = run_generic(c, arch::cpu_isa());
    Problem plain(c);
    REQUIRE(launch_add_rmsnorm<spec::generic>(arch::Cpu{}, plain.args()) == Status::kSuccess);
    CHECK(plain.y == explicit_level.y);
  }
}
