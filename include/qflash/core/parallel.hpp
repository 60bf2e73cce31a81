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

/// Below this much work (in multiply-adds or similar element operations) a parallel region
/// costs more than it saves: waking and joining threads takes a few microseconds, and far
/// more when the cores are shared.
inline constexpr std::int64_t kMinParallelWork = 32 * 1024;

/// Calls `fn(i)` for every i in [begin, end), split statically over the threads when the
/// items together hold at least kMinParallelWork of `work_per_item`.
/// Work items must be independent; `fn` must not throw.
template <class Fn>
void parallel_for(std::int64_t begin, std::int64_t end, std::int64_t work_per_item, Fn&& fn) {
#if defined(_OPENMP)
  if (end - begin > 1 && (end - begin) * work_per_item >= kMinParallelWork &&
      omp_get_max_threads() > 1 && !omp_in_parallel()) {
#pragma omp parallel for schedule(static)
    for (std::int64_t i = begin; i < end; ++i) fn(i);
    return;
  }
#endif
  for (std::int64_t i = begin; i < end; ++i) fn(i);
}

/// parallel_for for items that are each worth a parallel region on their own.
template <class Fn>
void parallel_for(std::int64_t begin, std::int64_t end, Fn&& fn) {
  parallel_for(begin, end, kMinParallelWork, static_cast<Fn&&>(fn));
}

}  // namespace qflash
