/// @file
/// The truth for add + RMSNorm in tests: plain scalar host code, fp64 arithmetic, one rounding
/// to the output dtype at each store. Follows op.hpp's math exactly: h = x + residual is
/// rounded to the activation dtype (what a kernel stores back into `residual`) before it is
/// normed. Slow on purpose; not for production.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "qflash/kernels/add_rmsnorm/op.hpp"
#include "qflash/kernels/common/bf16_bits.hpp"

namespace qflash::kernels::ref {

/// `d` rounded once to the nearest bf16 (ties to even). Going through float with round-to-odd
/// makes the second rounding exact (binary32 keeps >= 2 more bits than bf16), so this equals
/// a direct double -> bf16 rounding, without double-rounding errors.
inline bf16_bits bf16_from_double(double d) {
  if (std::isnan(d)) return float_to_bf16(std::numeric_limits<float>::quiet_NaN());
  float f = static_cast<float>(d);  // round to nearest
  if (std::isfinite(f) && static_cast<double>(f) != d) {
    std::uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if ((u & 1u) == 0) {  // not odd: take the other neighbour of d, which is odd
      f = std::nextafter(f, d > static_cast<double>(f) ? std::numeric_limits<float>::infinity()
                                                       : -std::numeric_limits<float>::infinity());
    }
  }
  return float_to_bf16(f);
}

inline double to_double(float v) { return v; }
inline double to_double(bf16_bits v) { return bf16_to_float(v); }

/// Rounds `d` to T once.
template <class T>
T from_double(double d) {
  if constexpr (std::is_same_v<T, float>)
    return static_cast<float>(d);
  else
    return bf16_from_double(d);
}

/// Typed reference. Rows may alias (`y == x`): each row is computed before it is stored.
/// @tparam Act  float or bf16_bits (x, residual, y)
/// @tparam W    float or bf16_bits (weight)
template <class Act, class W>
void add_rmsnorm(Act const* x,         // [n_rows, n_cols]
                 Act* residual,        // [n_rows, n_cols] in/out; may be null
                 W const* weight,      // [n_cols]
                 Act* y,               // [n_rows, n_cols]
                 std::int64_t n_rows, int n_cols, float eps, NormWeight weight_kind) {
  std::size_t const n = static_cast<std::size_t>(n_cols);
  double const w_offset = weight_kind == NormWeight::kZeroCentered ? 1.0 : 0.0;
  std::vector<Act> h(n);
  for (std::int64_t r = 0; r < n_rows; ++r) {
    std::size_t const base = static_cast<std::size_t>(r) * n;
    double sum_sq = 0.0;
    for (std::size_t i = 0; i < n; ++i) {
      double v = to_double(x[base + i]);
      if (residual) v += to_double(residual[base + i]);
      h[i] = from_double<Act>(v);
      double const hv = to_double(h[i]);
      sum_sq += hv * hv;
    }
    double const inv_rms = 1.0 / std::sqrt(sum_sq / static_cast<double>(n) + static_cast<double>(eps));
    for (std::size_t i = 0; i < n; ++i) {
      if (residual) residual[base + i] = h[i];
      y[base + i] = from_double<Act>(to_double(h[i]) * inv_rms * (to_double(weight[i]) + w_offset));
    }
  }
}

/// Type-erased entry over AddRmsNormArgs, same checks as the generic kernels.
inline Status add_rmsnorm(AddRmsNormArgs const& a) {
  if (Status s = can_implement_add_rmsnorm<MoeSpec{}>(a); s != Status::kSuccess) return s;
  auto run = [&](auto const* w) {
    if (a.dtype == DType::kF32)
      add_rmsnorm(static_cast<float const*>(a.x), static_cast<float*>(a.residual), w,
                  static_cast<float*>(a.y), a.n_rows, a.n_cols, a.eps, a.weight_kind);
    else
      add_rmsnorm(static_cast<bf16_bits const*>(a.x), static_cast<bf16_bits*>(a.residual), w,
                  static_cast<bf16_bits*>(a.y), a.n_rows, a.n_cols, a.eps, a.weight_kind);
  };
  if (a.weight_dtype == DType::kF32)
    run(static_cast<float const*>(a.weight));
  else
    run(static_cast<bf16_bits const*>(a.weight));
  return Status::kSuccess;
}

}  // namespace qflash::kernels::ref
