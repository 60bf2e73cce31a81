/// @file
/// Seeded test data, so that failures reproduce.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace qflash::test {

inline std::vector<float> random_floats(std::size_t n, std::uint64_t seed, float lo = -1.0f,
                                        float hi = 1.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

}  // namespace qflash::test
