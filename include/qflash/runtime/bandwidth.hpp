/// @file
/// This machine's memory read bandwidth, measured the way decode reads weights: every thread
/// of qflash's pool (core/parallel.hpp) streams its share of a buffer far larger than the
/// last-level cache with the widest loads the CPU has, and the best of several passes counts.
/// Bandwidth varies between machines and with other load (TOOLCHAIN.md: 18-75 GB/s on
/// machines of one kind), so a bench measures it in the same run, with the same threads, and
/// reports its speeds as a fraction of it. Host only.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define QFLASH_BANDWIDTH_X86 1
#else
#define QFLASH_BANDWIDTH_X86 0
#endif

#include "qflash/arch/cpu_features.hpp"
#include "qflash/core/error.hpp"
#include "qflash/core/parallel.hpp"

namespace qflash::runtime {

/// The last-level cache of one CPU in bytes (L3, else L2), or 0 when the system does not say.
inline std::int64_t last_level_cache_bytes() {
#if defined(_SC_LEVEL3_CACHE_SIZE)
  if (long const l3 = ::sysconf(_SC_LEVEL3_CACHE_SIZE); l3 > 0) return l3;
  if (long const l2 = ::sysconf(_SC_LEVEL2_CACHE_SIZE); l2 > 0) return l2;
#endif
  return 0;
}

/// The probe's buffer: 1 GiB, or 8x the last-level cache when that is larger, so caches hold
/// at most an eighth of it.
inline std::int64_t read_bandwidth_buffer_bytes() {
  return std::max<std::int64_t>(std::int64_t{1} << 30, 8 * last_level_cache_bytes());
}

struct ReadBandwidth {
  double gbs = 0;              ///< best pass, in GB/s (1e9 bytes per second)
  std::int64_t buffer_bytes = 0;
  int threads = 0;             ///< pool threads that read
  arch::CpuIsa isa{};          ///< the loads used
};

namespace detail {

/// Sums 64-bit words (the sum keeps the loads from being optimised away).
inline std::uint64_t sum_words_scalar(std::uint64_t const* p, std::size_t n) {
  std::uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  for (std::size_t i = 0; i + 4 <= n; i += 4) {
    a0 += p[i];
    a1 += p[i + 1];
    a2 += p[i + 2];
    a3 += p[i + 3];
  }
  return a0 + a1 + a2 + a3;
}

#if QFLASH_BANDWIDTH_X86
/// Four independent 32-byte loads per step, so several cache-line misses stay in flight.
/// @param p  32-byte aligned; n a multiple of 16 words
__attribute__((target("avx2"))) inline std::uint64_t sum_words_avx2(std::uint64_t const* p, std::size_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (std::size_t i = 0; i + 16 <= n; i += 16) {
    a0 = _mm256_add_epi64(a0, _mm256_load_si256(reinterpret_cast<__m256i const*>(p + i)));
    a1 = _mm256_add_epi64(a1, _mm256_load_si256(reinterpret_cast<__m256i const*>(p + i + 4)));
    a2 = _mm256_add_epi64(a2, _mm256_load_si256(reinterpret_cast<__m256i const*>(p + i + 8)));
    a3 = _mm256_add_epi64(a3, _mm256_load_si256(reinterpret_cast<__m256i const*>(p + i + 12)));
  }
  __m256i const s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
  alignas(32) std::uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), s);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

/// The same with 64-byte loads: on some CPUs one core needs them to reach DRAM speed.
/// @param p  64-byte aligned; n a multiple of 32 words
__attribute__((target("avx512f"))) inline std::uint64_t sum_words_avx512(std::uint64_t const* p, std::size_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (std::size_t i = 0; i + 32 <= n; i += 32) {
    a0 = _mm512_add_epi64(a0, _mm512_load_si512(p + i));
    a1 = _mm512_add_epi64(a1, _mm512_load_si512(p + i + 8));
    a2 = _mm512_add_epi64(a2, _mm512_load_si512(p + i + 16));
    a3 = _mm512_add_epi64(a3, _mm512_load_si512(p + i + 24));
  }
  // Stored and added by hand: GCC 12 warns falsely inside _mm512_reduce_add_epi64.
  alignas(64) std::uint64_t lanes[8];
  _mm512_store_si512(lanes, _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
  std::uint64_t total = 0;
  for (auto v : lanes) total += v;
  return total;
}
#endif

inline std::uint64_t sum_words(arch::CpuIsa isa, std::uint64_t const* p, std::size_t n) {
#if QFLASH_BANDWIDTH_X86
  if (isa >= arch::CpuIsa::kAvx512) return sum_words_avx512(p, n);
  if (isa >= arch::CpuIsa::kAvx2) return sum_words_avx2(p, n);
#endif
  (void)isa;
  return sum_words_scalar(p, n);
}

struct FreeAligned {
  void operator()(std::uint64_t* p) const { std::free(p); }
};

}  // namespace detail

/// Read bandwidth with the pool's current threads (max_threads()): each thread first writes,
/// then in every pass sums, its own contiguous share of a `buffer_bytes` buffer (0:
/// read_bandwidth_buffer_bytes()); the fastest of `passes` passes gives the bandwidth. The
/// buffer is freed on return. Loads are AVX-512 or AVX2 where arch::cpu_isa() allows.
/// @throws Error when the buffer cannot be allocated
inline ReadBandwidth measure_read_bandwidth(int passes = 5, std::int64_t buffer_bytes = 0) {
  using Clock = std::chrono::steady_clock;
  constexpr std::size_t kAlign = 64, kShareWords = 32;  // shares: whole 256-byte steps
  if (buffer_bytes <= 0) buffer_bytes = read_bandwidth_buffer_bytes();
  int const threads = max_threads();
  std::size_t const words = static_cast<std::size_t>(buffer_bytes) / sizeof(std::uint64_t);
  std::size_t const share = words / static_cast<std::size_t>(threads) / kShareWords * kShareWords;
  QFLASH_CHECK(share > 0, "read bandwidth: a buffer of ", buffer_bytes, " bytes is too small for ", threads, " threads");
  std::size_t const bytes = share * static_cast<std::size_t>(threads) * sizeof(std::uint64_t);
  std::unique_ptr<std::uint64_t, detail::FreeAligned> buffer(
      static_cast<std::uint64_t*>(std::aligned_alloc(kAlign, bytes)));
  QFLASH_CHECK(buffer, "read bandwidth: cannot allocate a ", bytes, "-byte buffer");

  // Each thread's pages are written (made resident) by the thread that will read them.
  parallel_for(0, threads, [&](std::int64_t t) {
    std::memset(buffer.get() + static_cast<std::size_t>(t) * share, static_cast<int>(t + 1),
                share * sizeof(std::uint64_t));
  });
  arch::CpuIsa const isa = arch::cpu_isa();
  std::vector<std::uint64_t> sums(static_cast<std::size_t>(threads));
  double best = 0;
  for (int pass = 0; pass < std::max(1, passes); ++pass) {
    auto const t0 = Clock::now();
    parallel_for(0, threads, [&](std::int64_t t) {
      sums[static_cast<std::size_t>(t)] = detail::sum_words(isa, buffer.get() + static_cast<std::size_t>(t) * share, share);
    });
    double const secs = std::chrono::duration<double>(Clock::now() - t0).count();
    if (secs > 0) best = std::max(best, static_cast<double>(bytes) / secs / 1e9);
  }
  // The sums are observed, so no pass can be optimised away.
  std::uint64_t checksum = 0;
  for (auto s : sums) checksum += s;
  asm volatile("" : : "r"(checksum) : "memory");
  return {best, static_cast<std::int64_t>(bytes), threads, isa};
}

}  // namespace qflash::runtime
