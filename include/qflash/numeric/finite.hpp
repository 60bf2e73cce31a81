/// @file
/// Finding NaN and Inf in float data fast enough to check every step's logits.
#pragma once

#include <cstddef>
#include <span>

namespace qflash {

/// True when no value is NaN or Inf. `v - v` is 0 for finite v and NaN otherwise; the
/// branch-free reduction vectorises (std::isfinite in a loop with an early exit does not).
inline bool all_finite(std::span<float const> x) {
  bool finite = true;
  for (float v : x) finite &= (v - v == 0.0f);
  return finite;
}

/// Index of the first NaN or Inf, or x.size().
inline std::size_t first_non_finite(std::span<float const> x) {
  if (all_finite(x)) return x.size();
  std::size_t i = 0;
  while (x[i] - x[i] == 0.0f) ++i;
  return i;
}

}  // namespace qflash
