/// @file
/// Problems, buffers and checks shared by the CPU and GPU add + RMSNorm tests.
///
/// Tolerances (tests/support/tolerance.hpp), against kernels::ref::add_rmsnorm (fp64 arithmetic, one
/// rounding to the output dtype):
/// - fp32 output, tol::f32 = {atol 1e-5, rtol 1e-5}: kernels add sum(h^2) in fp32 over at
///   most 4096 terms as 8-64 partial sums (scalar: 8 chains of <= 512 terms), whose error is
///   ~sqrt(512) * 2^-24 ~ 1.4e-6 relative for data of one sign (worst case 512 * 2^-24 = 3e-5,
///   not approached by independent roundings); inv_rms halves it and adds two correctly
///   rounded ops (sqrt, div), the output two products. rtol 1e-5 (~170 ulp) leaves a
///   25x margin over what the tests measure (max 3.9e-7 relative on every path, printed by
///   the test); atol covers outputs near 0 where the relative rule is meaningless.
/// - bf16 output, tol::bf16 = {atol 1e-3, rtol 2^-7}: the reference is rounded to bf16, the
///   kernel rounds its fp32 result once; the fp32 error above (<1e-5) can flip that rounding
///   by one bf16 ulp, which is at most 2^-7 |ref| for normal numbers.
/// - The residual written back (h = x + residual rounded to the dtype) must be bit-exact: an
///   fp32 sum of two bf16 (or fp32) values rounded once equals the correctly rounded sum.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "qflash/kernels/add_rmsnorm/op.hpp"
#include "qflash/kernels/add_rmsnorm/ref.hpp"
#include "qflash/kernels/common/bf16_bits.hpp"
#include "support/random.hpp"
#include "support/tolerance.hpp"

namespace qflash::test::add_rmsnorm {

using kernels::AddRmsNormArgs;
using kernels::bf16_bits;
using kernels::NormWeight;

/// Widths: 1, odd primes around warp/tile sizes (ggml's 31/71/129), the models' 2048, and 4096.
inline constexpr int kWidths[] = {1, 31, 71, 129, 2048, 4096};
inline constexpr std::int64_t kRows[] = {1, 3, 17};

/// Contiguous host memory of one dtype (kF32 or kBF16).
struct Buffer {
  DType dtype = DType::kF32;
  std::vector<std::uint32_t> storage;  // 4-byte words: aligned for either dtype
  std::size_t count = 0;

  Buffer() = default;
  Buffer(DType t, std::span<float const> values) : dtype(t), count(values.size()) {
    storage.assign((count * size_of(t) + 3) / 4, 0u);
    for (std::size_t i = 0; i < count; ++i) set(i, values[i]);
  }
  [[nodiscard]] std::size_t bytes() const { return count * size_of(dtype); }
  void* data() { return storage.data(); }
  [[nodiscard]] void const* data() const { return storage.data(); }
  void set(std::size_t i, float v) {
    if (dtype == DType::kF32)
      static_cast<float*>(data())[i] = v;
    else
      static_cast<bf16_bits*>(data())[i] = kernels::float_to_bf16(v);
  }
  [[nodiscard]] double get(std::size_t i) const {
    if (dtype == DType::kF32) return static_cast<float const*>(data())[i];
    return kernels::bf16_to_float(static_cast<bf16_bits const*>(data())[i]);
  }
  [[nodiscard]] std::vector<double> values() const {
    std::vector<double> out(count);
    for (std::size_t i = 0; i < count; ++i) out[i] = get(i);
    return out;
  }
  /// Bitwise equality of the stored elements.
  friend bool operator==(Buffer const& a, Buffer const& b) {
    return a.dtype == b.dtype && a.count == b.count &&
           (a.count == 0 || std::memcmp(a.data(), b.data(), a.bytes()) == 0);
  }
};

struct Case {
  DType dtype = DType::kF32;
  DType weight_dtype = DType::kF32;
  NormWeight weight_kind = NormWeight::kPlain;
  bool with_residual = true;
  std::int64_t n_rows = 1;
  int n_cols = 1;
};

inline std::string to_string(Case const& c) {
  return "{dtype=" + std::string(qflash::to_string(c.dtype)) +
         " weight=" + std::string(qflash::to_string(c.weight_dtype)) +
         (c.weight_kind == NormWeight::kZeroCentered ? " (1+w)" : " w") +
         (c.with_residual ? " residual" : " no-residual") + " rows=" + std::to_string(c.n_rows) +
         " cols=" + std::to_string(c.n_cols) + "}";
}

/// Every combination of dtypes, weight kinds and residual, over `widths` x `rows`.
inline std::vector<Case> all_cases(std::span<int const> widths = kWidths,
                                   std::span<std::int64_t const> rows = kRows) {
  std::vector<Case> out;
  for (DType t : {DType::kF32, DType::kBF16})
    for (DType wt : {DType::kF32, DType::kBF16})
      for (NormWeight k : {NormWeight::kPlain, NormWeight::kZeroCentered})
        for (bool res : {true, false})
          for (int n : widths)
            for (std::int64_t r : rows) out.push_back(Case{t, wt, k, res, r, n});
  return out;
}

/// Host buffers of one problem; values seeded from the case, so two calls give equal problems.
/// x, residual ~ U(-1, 1); w ~ U(0.5, 1.5), or U(-0.5, 0.5) for (1+w), so the effective scale
/// is the same for both kinds.
struct Problem {
  Case c;
  Buffer x, residual, weight, y;
  float eps = 1e-6f;

  explicit Problem(Case const& cs, std::uint64_t seed = 1) : c(cs) {
    std::size_t const n = static_cast<std::size_t>(c.n_rows) * static_cast<std::size_t>(c.n_cols);
    std::uint64_t const s = seed * 1000003u + static_cast<std::uint64_t>(c.n_cols) * 131u +
                            static_cast<std::uint64_t>(c.n_rows);
    x = Buffer(c.dtype, random_floats(n, s));
    residual = Buffer(c.dtype, random_floats(c.with_residual ? n : 0, s + 1));
    float const lo = c.weight_kind == NormWeight::kZeroCentered ? -0.5f : 0.5f;
    weight = Buffer(c.weight_dtype, random_floats(static_cast<std::size_t>(c.n_cols), s + 2, lo, lo + 1.0f));
    y = Buffer(c.dtype, std::vector<float>(n, 0.0f));
  }

  [[nodiscard]] AddRmsNormArgs args() {
    AddRmsNormArgs a;
    a.dtype = c.dtype;
    a.weight_dtype = c.weight_dtype;
    a.x = x.data();
    a.residual = c.with_residual ? residual.data() : nullptr;
    a.weight = weight.data();
    a.y = y.data();
    a.n_rows = c.n_rows;
    a.n_cols = c.n_cols;
    a.eps = eps;
    a.weight_kind = c.weight_kind;
    return a;
  }
};

/// The reference result of `c`.
inline Problem reference(Case const& c, std::uint64_t seed = 1) {
  Problem p(c, seed);
  REQUIRE(kernels::ref::add_rmsnorm(p.args()) == Status::kSuccess);
  return p;
}

inline Tolerance tolerance_for(DType t) { return t == DType::kBF16 ? tol::bf16 : tol::f32; }

/// Largest |got - want| / max(|want|, 1e-3) over y, for reporting the margin to the tolerance.
inline double max_rel_error(Problem const& got, Problem const& want) {
  double m = 0.0;
  for (std::size_t i = 0; i < got.y.count; ++i) {
    double const w = want.y.get(i);
    m = std::max(m, std::fabs(got.y.get(i) - w) / std::max(std::fabs(w), 1e-3));
  }
  return m;
}

/// y within tolerance of the reference on every element (no NaN); residual bit-exact; the
/// inputs were not degenerate.
inline void check_matches_reference(Problem const& got, Problem const& want) {
  double x_norm = 0.0;
  for (std::size_t i = 0; i < got.x.count; ++i) x_norm += std::fabs(got.x.get(i));
  REQUIRE(x_norm > 0.0);
  auto const g = got.y.values();
  auto const w = want.y.values();
  auto const close = all_close(std::span<double const>(g), std::span<double const>(w),
                               tolerance_for(got.c.dtype));
  CHECK_MESSAGE(close.ok, close.report);
  if (got.c.with_residual) CHECK_MESSAGE(got.residual == want.residual, "residual not x + residual");
}

}  // namespace qflash::test::add_rmsnorm
