/// @file
/// Per-dtype tolerances and the element-wise pass rule |y - ref| <= atol + rtol * |ref|.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <sstream>
#include <string>

namespace qflash::test {

struct Tolerance {
  double atol;
  double rtol;
};

namespace tol {
/// fp32 output vs an fp64-accumulated reference over rows up to 4096 wide: a few ulp of
/// accumulated rounding (reduction order differs between SIMD and scalar sums).
inline constexpr Tolerance f32{1e-5, 1e-5};
/// bf16 output vs the reference rounded to bf16: one bf16 ulp (2^-8 relative) for a
/// rounding flip at the last step, plus a small absolute floor near zero.
inline constexpr Tolerance bf16{1e-3, 1.0 / 128};
}  // namespace tol

/// The largest |a[i] - b[i]| in fp64: NaN when any difference is NaN, infinity when the sizes
/// differ, so that `max_abs_diff(a, b) <= limit` fails for either.
inline double max_abs_diff(std::span<float const> a, std::span<float const> b) {
  if (a.size() != b.size()) return HUGE_VAL;
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    double const d = std::fabs(static_cast<double>(a[i]) - b[i]);
    if (std::isnan(d)) return d;
    m = std::max(m, d);
  }
  return m;
}

/// Checks every element; on failure describes the first few mismatches.
struct CloseResult {
  bool ok = true;
  std::size_t n_bad = 0;
  std::string report;
  explicit operator bool() const { return ok; }
};

template <class A, class B>
CloseResult all_close(std::span<A const> y, std::span<B const> ref, Tolerance t) {
  CloseResult r;
  std::ostringstream os;
  if (y.size() != ref.size()) {
    r.ok = false;
    os << "size " << y.size() << " != " << ref.size();
    r.report = os.str();
    return r;
  }
  for (std::size_t i = 0; i < y.size(); ++i) {
    double const a = static_cast<double>(y[i]);
    double const b = static_cast<double>(ref[i]);
    bool const bad = std::isnan(a) || std::isnan(b) || !(std::fabs(a - b) <= t.atol + t.rtol * std::fabs(b));
    if (bad) {
      if (r.n_bad < 5) os << "[" << i << "] got " << a << " want " << b << "; ";
      ++r.n_bad;
      r.ok = false;
    }
  }
  if (!r.ok) os << r.n_bad << " of " << y.size() << " elements out of tolerance";
  r.report = os.str();
  return r;
}

/// Checks every element against its row's scale: |y - ref| <= atol + rtol * max |ref| over the
/// row (`row_len` elements). For outputs where one rounding step of an 8-bit intermediate
/// code moves a whole row by a fraction of its size, not of each element's.
template <class A, class B>
CloseResult rows_close(std::span<A const> y, std::span<B const> ref, std::size_t row_len, Tolerance t) {
  CloseResult r;
  std::ostringstream os;
  if (y.size() != ref.size() || row_len == 0 || ref.size() % row_len != 0) {
    r.ok = false;
    os << "size " << y.size() << " vs " << ref.size() << " in rows of " << row_len;
    r.report = os.str();
    return r;
  }
  for (std::size_t row = 0; row < ref.size(); row += row_len) {
    double scale = 0;
    for (std::size_t i = row; i < row + row_len; ++i) scale = std::max(scale, std::fabs(static_cast<double>(ref[i])));
    for (std::size_t i = row; i < row + row_len; ++i) {
      double const a = static_cast<double>(y[i]);
      double const b = static_cast<double>(ref[i]);
      bool const bad = std::isnan(a) || std::isnan(b) || !(std::fabs(a - b) <= t.atol + t.rtol * scale);
      if (bad) {
        if (r.n_bad < 5) os << "[" << i << "] got " << a << " want " << b << " (row scale " << scale << "); ";
        ++r.n_bad;
        r.ok = false;
      }
    }
  }
  if (!r.ok) os << r.n_bad << " of " << y.size() << " elements out of tolerance";
  r.report = os.str();
  return r;
}

}  // namespace qflash::test
