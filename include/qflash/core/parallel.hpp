/// @file
/// The one place CPU kernels get threads from: OpenMP when the build enables it, else serial.
#pragma once

#include <cstdint>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace qflash {

/// Number of threads parallel_for uses.
inline int max_threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

/// Calls `fn(i)` for every i in [begin, end), split statically over the threads.
/// Work items must be independent; `fn` must not throw.
template <class Fn>
void parallel_for(std::int64_t begin, std::int64_t end, Fn&& fn) {
#if defined(_OPENMP)
  if (end - begin > 1 && omp_get_max_threads() > 1 && !omp_in_parallel()) {
#pragma omp parallel for schedule(static)
    for (std::int64_t i = begin; i < end; ++i) fn(i);
    return;
  }
#endif
  for (std::int64_t i = begin; i < end; ++i) fn(i);
}

}  // namespace qflash
