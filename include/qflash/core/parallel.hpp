/// @file
/// The one place CPU kernels get threads from: a persistent pool behind `parallel_for`.
///
/// Why not OpenMP: libgomp's workers spin-wait between regions, so when another process holds
/// a core a 2-thread decode collapsed (128 tokens: 2-17 s instead of 0.33 s with 1 thread), and
/// its wait policy can only be set in the environment before the program starts. Here idle
/// workers spin for at most kSpinNs, then sleep on a futex (std::atomic::wait), and so does the
/// caller waiting for them. Each region is split into one contiguous chunk per thread, which its
/// thread takes in batches of about 1/kBatchesPerChunk of it, in order. A thread that finishes
/// its chunk claims the chunks no thread has started, then takes batches left in the others:
/// when one core runs slower (shared with another process, or simply given less by its
/// hypervisor) the others finish its work, and a descheduled worker delays a region only by the
/// batch it is in the middle of. (2-core VM, Q4_K decode: the static split left each thread
/// waiting for the other for 5-7% of the step.)
///
/// One region runs at a time: a second thread calling parallel_for waits for the running region
/// to end (regions last microseconds to milliseconds), so the process never runs more threads
/// than the pool holds (so `fn` must not wait for another thread that calls parallel_for). A call
/// from inside a region (from `fn`) runs serially on its thread.
/// The pool is created on the first parallel region and joined at exit. Not fork-safe: a child
/// forked while the pool exists must not call parallel_for.
///
/// With QFLASH_PIN_THREADS=1, and when the pool fits in the CPUs the process may use, every pool
/// thread is pinned to its own CPU (one per physical core first): the workers, and the thread
/// that starts the pool, which takes the first. Off by default: on the 2-vCPU VMs measured it
/// gained nothing (Q4_K decode, default model, also beside a busy process), and pinning the
/// workers alone cost the default model's decode 10-20%.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

#include "qflash/core/error.hpp"
#include "qflash/core/log.hpp"

namespace qflash {

/// Below this much work (in multiply-adds or similar element operations) a parallel region
/// costs more than it saves: waking and joining threads takes a few microseconds, and far
/// more when the cores are shared.
inline constexpr std::int64_t kMinParallelWork = 32 * 1024;

/// The largest pool set_max_threads accepts.
inline constexpr int kMaxThreads = 1024;

namespace detail {

/// How long an idle worker, or a caller waiting for workers, spins before it sleeps: longer than
/// the serial gaps between a decode step's regions, so idle workers stay awake through a step,
/// and short enough that a process competing for a core loses little. 2-core EPYC, default
/// model, 512 tokens on 2 threads, tok/s: idle 1082 (20 us: 798; OpenMP 1084), beside a busy
/// process 765 (20 us: 742; OpenMP 335).
inline constexpr std::chrono::nanoseconds kSpinNs{100'000};

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

/// Spins until `done()` or for kSpinNs; returns done().
template <class Done>
bool spin_until(Done&& done) noexcept {
  auto const deadline = std::chrono::steady_clock::now() + kSpinNs;
  for (int i = 1;; ++i) {
    if (done()) return true;
    cpu_relax();
    if (i % 32 == 0 && std::chrono::steady_clock::now() >= deadline) return done();
  }
}

/// The first and one-past-last index of chunk `c` of [begin, end) split into `n` contiguous
/// chunks, the first (len % n) one longer (OpenMP's schedule(static)).
inline std::pair<std::int64_t, std::int64_t> chunk_bounds(std::int64_t begin, std::int64_t end,
                                                          std::int64_t n, std::int64_t c) {
  std::int64_t const len = end - begin, q = len / n, r = len % n;
  std::int64_t const lo = begin + c * q + std::min(c, r);
  return {lo, lo + q + (c < r ? 1 : 0)};
}

/// Batches a chunk is handed out in.
inline constexpr std::int64_t kBatchesPerChunk = 16;

/// True on pool workers always, and on a caller while it runs a region.
inline thread_local bool t_in_parallel_region = false;
/// The chunk this thread last claimed (parallel_slot()).
inline thread_local int t_slot = 0;

/// The CPUs this process may use (its affinity mask) and their physical cores.
struct CpuTopology {
  /// One CPU per physical core first (the lowest-numbered of each (package, core) in sysfs),
  /// then the others; in CPU order when the topology cannot be read.
  std::vector<int> cpus;
  int cores = 0;  ///< distinct (package, core) pairs; 0 when the topology cannot be read
};

inline CpuTopology cpu_topology() {
  CpuTopology topo;
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return topo;
  std::set<std::pair<long, long>> cores;
  std::vector<int> siblings;
  bool readable = true;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &set)) continue;
    std::string const dir = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
    std::ifstream package(dir + "physical_package_id"), core(dir + "core_id");
    long p = 0, c = 0;
    readable = readable && static_cast<bool>(package >> p) && static_cast<bool>(core >> c);
    if (!readable || cores.emplace(p, c).second)
      topo.cpus.push_back(cpu);
    else
      siblings.push_back(cpu);
  }
  topo.cpus.insert(topo.cpus.end(), siblings.begin(), siblings.end());
  if (readable)
    topo.cores = static_cast<int>(cores.size());
  else
    std::sort(topo.cpus.begin(), topo.cpus.end());
#endif
  return topo;
}

/// Whether QFLASH_PIN_THREADS asks for pinning ("1").
inline bool pinning_enabled() {
  char const* v = std::getenv("QFLASH_PIN_THREADS");
  return v && std::string(v) == "1";
}

/// Pins the calling thread to `cpu`; false when the system refuses.
inline bool pin_this_thread(int cpu) {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return sched_setaffinity(0, sizeof set, &set) == 0;
#else
  (void)cpu;
  return false;
#endif
}

/// Threads waiting for regions. Region protocol, for epoch e (starting at 1):
/// - the caller writes the job and each chunk's counters, sets remaining_ = n, claims chunk 0,
///   publishes epoch_ = e, bumps wake_;
/// - every other chunk's tag is e - 1; whoever CASes it from e - 1 to e owns the chunk: it takes
///   the chunk's batches, then claims or takes batches of the other chunks, and on leaving
///   subtracts the chunks it claimed from remaining_; the caller returns when remaining_ is 0.
///   So every thread that reads the job holds a claim, and the job outlives every claim;
/// - a worker that wakes late reads a newer epoch or finds every tag claimed, so it never
///   touches a finished region's job.
class ThreadPool {
 public:
  /// Starts n_threads - 1 workers (the caller is thread 0); fewer when the system refuses.
  explicit ThreadPool(int n_threads) : chunks_(static_cast<std::size_t>(n_threads)) {
    std::vector<int> cpus;
    if (pinning_enabled()) cpus = cpu_topology().cpus;
    if (static_cast<int>(cpus.size()) < n_threads) cpus.clear();  // does not fit: nobody pinned
    if (!cpus.empty()) pin_this_thread(cpus[0]);
    workers_.reserve(static_cast<std::size_t>(n_threads - 1));
    for (int t = 1; t < n_threads; ++t) {
      try {
        int const cpu = cpus.empty() ? -1 : cpus[static_cast<std::size_t>(t)];
        workers_.emplace_back([this, t, cpu] {
          if (cpu >= 0) pin_this_thread(cpu);
          worker_loop(t);
        });
      } catch (std::system_error const& e) {
        QFLASH_LOG_WARN("thread pool: started ", t, " of ", n_threads, " threads (", e.what(), ")");
        break;
      }
    }
    n_ = static_cast<int>(workers_.size()) + 1;
  }

  ThreadPool(ThreadPool const&) = delete;
  ThreadPool& operator=(ThreadPool const&) = delete;

  ~ThreadPool() {
    stop_.store(true, std::memory_order_relaxed);
    wake_.fetch_add(1, std::memory_order_seq_cst);
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }

  /// Threads, the caller included.
  [[nodiscard]] int size() const noexcept { return n_; }

  /// Calls fn(i) for i in [begin, end), one chunk per thread, shared as the file comment says;
  /// rethrows the first exception. Only one thread at a time may call run.
  template <class Fn>
  void run(std::int64_t begin, std::int64_t end, Fn& fn) {
    std::uint64_t const e = ++last_epoch_;
    for (int c = 0; c < n_; ++c) {
      Chunk& ch = chunks_[static_cast<std::size_t>(c)];
      auto const [lo, hi] = chunk_bounds(begin, end, n_, c);
      ch.next.store(lo, std::memory_order_relaxed);
      ch.end = hi;
      ch.batch = std::max<std::int64_t>(1, (hi - lo) / kBatchesPerChunk);
    }
    ctx_ = const_cast<void*>(static_cast<void const*>(std::addressof(fn)));
    invoke_ = [](void* ctx, std::int64_t lo, std::int64_t hi) {
      auto& f = *static_cast<Fn*>(ctx);
      for (std::int64_t i = lo; i < hi; ++i) f(i);
    };
    error_ = nullptr;
    remaining_.store(static_cast<std::uint32_t>(n_), std::memory_order_relaxed);
    chunks_[0].epoch.store(e, std::memory_order_relaxed);  // the caller's: it always takes part
    epoch_.store(e, std::memory_order_release);
    // An RMW, so that notify's check for sleepers cannot be ordered before the bump.
    wake_.fetch_add(1, std::memory_order_seq_cst);
    wake_.notify_all();

    run_chunks(e, 0, /*owns_first=*/true);
    auto const finished = [this] { return remaining_.load(std::memory_order_acquire) == 0; };
    if (!spin_until(finished)) {
      for (std::uint32_t r; (r = remaining_.load(std::memory_order_acquire)) != 0;)
        remaining_.wait(r, std::memory_order_acquire);
    }
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  struct alignas(64) Chunk {
    std::atomic<std::uint64_t> epoch{0};  // the last epoch the chunk was claimed for
    std::atomic<std::int64_t> next{0};    // its first item no thread has taken
    std::int64_t end = 0, batch = 1;      // the job's, as next
  };

  /// Claims every chunk of epoch e it can, starting at `first` (already its own when
  /// `owns_first`), and takes the batches of each; then, holding a claim, takes what is left in
  /// the other chunks.
  void run_chunks(std::uint64_t e, int first, bool owns_first = false) {
    int claimed = 0;
    for (int k = 0; k < n_; ++k) {
      int const c = (first + k) % n_;
      Chunk& ch = chunks_[static_cast<std::size_t>(c)];
      std::uint64_t expected = e - 1;
      bool const mine = (k == 0 && owns_first) ||
                        (ch.epoch.load(std::memory_order_relaxed) == expected &&
                         ch.epoch.compare_exchange_strong(expected, e, std::memory_order_acquire, std::memory_order_relaxed));
      if (!mine) continue;
      ++claimed;
      t_slot = c;  // this thread's alone until it claims another or leaves
      take_batches(ch);
    }
    if (claimed == 0) return;
    for (int k = 1; k < n_; ++k) take_batches(chunks_[static_cast<std::size_t>((t_slot + k) % n_)]);
    t_slot = 0;
    if (remaining_.fetch_sub(static_cast<std::uint32_t>(claimed), std::memory_order_acq_rel) ==
        static_cast<std::uint32_t>(claimed))
      remaining_.notify_one();
  }

  /// Runs batches of `ch` until none is left.
  void take_batches(Chunk& ch) {
    for (;;) {
      std::int64_t const lo = ch.next.fetch_add(ch.batch, std::memory_order_relaxed);
      if (lo >= ch.end) return;
      try {
        invoke_(ctx_, lo, std::min(lo + ch.batch, ch.end));
      } catch (...) {
        std::lock_guard lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
    }
  }

  void worker_loop(int t) {
    t_in_parallel_region = true;
    std::uint32_t seen = 0;
    for (;;) {
      auto const woken = [&] { return wake_.load(std::memory_order_acquire) != seen; };
      if (!spin_until(woken)) {
        while (wake_.load(std::memory_order_acquire) == seen)
          wake_.wait(seen, std::memory_order_acquire);
      }
      seen = wake_.load(std::memory_order_acquire);
      if (stop_.load(std::memory_order_relaxed)) return;
      run_chunks(epoch_.load(std::memory_order_acquire), t);
    }
  }

  int n_ = 1;
  std::vector<Chunk> chunks_;  // [n_threads]
  std::vector<std::thread> workers_;

  // The job; written by the caller before epoch_ is published, read after a claim.
  void* ctx_ = nullptr;
  void (*invoke_)(void*, std::int64_t, std::int64_t) = nullptr;
  std::exception_ptr error_;
  std::mutex error_mutex_;
  std::uint64_t last_epoch_ = 0;  // the caller's copy of epoch_

  alignas(64) std::atomic<std::uint64_t> epoch_{0};
  std::atomic<bool> stop_{false};
  alignas(64) std::atomic<std::uint32_t> wake_{0};       // futex word workers sleep on
  alignas(64) std::atomic<std::uint32_t> remaining_{0};  // chunks whose claimant has not left
};

/// Parses a positive thread count; `allow_list` accepts OpenMP's "N,M,..." (first level only).
inline int parse_thread_count(char const* s, bool allow_list) {
  if (!s || !*s) return 0;
  char* tail = nullptr;
  long const v = std::strtol(s, &tail, 10);
  if (tail == s || (*tail && !(allow_list && *tail == ','))) return 0;
  if (v < 1) return 0;
  return static_cast<int>(std::min<long>(v, kMaxThreads));
}

struct PoolState {
  std::mutex mutex;             // held by the running region and by set_max_threads
  std::atomic<int> threads{0};  // the configured pool size; 0 until first resolved
  std::unique_ptr<ThreadPool> pool;
};

inline PoolState& pool_state() {
  static PoolState state;
  return state;
}

}  // namespace detail

/// CPUs this process may run on (its affinity mask), at least 1.
inline int available_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

/// Physical cores among the available CPUs: distinct (package, core) pairs in sysfs topology;
/// available_cpus() when the topology cannot be read. At least 1.
inline int physical_cores() {
  int const cores = detail::cpu_topology().cores;
  return cores > 0 ? cores : available_cpus();
}

/// The default pool size: QFLASH_NUM_THREADS if a positive integer, else OMP_NUM_THREADS if
/// one, else physical_cores(); at most kMaxThreads.
inline int default_threads() {
  if (int n = detail::parse_thread_count(std::getenv("QFLASH_NUM_THREADS"), false)) return n;
  if (int n = detail::parse_thread_count(std::getenv("OMP_NUM_THREADS"), true)) return n;
  return std::min(physical_cores(), kMaxThreads);
}

/// Number of threads parallel_for uses.
inline int max_threads() {
  auto& s = detail::pool_state();
  int n = s.threads.load(std::memory_order_relaxed);
  if (n == 0) {
    int expected = 0;
    n = default_threads();
    if (!s.threads.compare_exchange_strong(expected, n, std::memory_order_relaxed)) n = expected;
  }
  return n;
}

/// Sets the pool size to `n` threads (the caller included), or back to default_threads() for
/// n == 0. Waits for a running region; the new pool starts on the next parallel region.
/// @throws Error for n < 0, n > kMaxThreads, or a call from inside a parallel region.
inline void set_max_threads(int n) {
  QFLASH_CHECK(n >= 0, "set_max_threads: thread count must be >= 0 (0 = default), got ", n);
  QFLASH_CHECK(n <= kMaxThreads, "set_max_threads: at most ", kMaxThreads, " threads, got ", n);
  QFLASH_CHECK(!detail::t_in_parallel_region, "set_max_threads: called inside parallel_for");
  auto& s = detail::pool_state();
  std::lock_guard lock(s.mutex);
  int const threads = n == 0 ? default_threads() : n;
  if (s.pool && s.pool->size() != threads) s.pool.reset();
  s.threads.store(threads, std::memory_order_relaxed);
}

/// Calls `fn(i)` for every i in [begin, end), split into one contiguous chunk per thread (shared
/// out in batches, see ThreadPool) when the items together hold at least kMinParallelWork of
/// `work_per_item`; serially otherwise, and when called from inside `fn` of another
/// parallel_for. Work items must be independent.
/// `fn` should not throw; if it does, the region still completes the other chunks, and the
/// first exception is rethrown here.
template <class Fn>
void parallel_for(std::int64_t begin, std::int64_t end, std::int64_t work_per_item, Fn&& fn) {
  std::int64_t const len = end - begin;
  bool const enough_work = len > 1 && work_per_item > 0 &&
                           len >= (kMinParallelWork + work_per_item - 1) / work_per_item;
  if (enough_work && !detail::t_in_parallel_region && max_threads() > 1) {
    auto& s = detail::pool_state();
    std::lock_guard lock(s.mutex);
    int const threads = s.threads.load(std::memory_order_relaxed);
    if (!s.pool) s.pool = std::make_unique<detail::ThreadPool>(threads);
    if (s.pool->size() > 1) {
      detail::t_in_parallel_region = true;
      struct Reset {
        ~Reset() { detail::t_in_parallel_region = false; }
      } reset;
      s.pool->run(begin, end, fn);
      return;
    }
  }
  for (std::int64_t i = begin; i < end; ++i) fn(i);
}

/// The slot of the calling thread: inside a parallel_for item, an index in [0, max_threads())
/// that no other thread uses until this item returns (the chunk its thread claimed last); 0
/// outside a region and in items run serially.
inline int parallel_slot() { return detail::t_slot; }

/// Scratch for parallel_for items, one buffer per slot: a slot's items run on one thread at a
/// time, so a buffer grows to the largest request of its slot's items, after which regions that
/// ask the same sizes allocate nothing (unlike a thread_local in the items, with no owner).
/// Owned by the thread that starts the region; items reach it through a pointer or reference.
template <class T>
class SlotScratch {
 public:
  /// Before the region: a buffer for every slot.
  void prepare() {
    if (slots_.size() < static_cast<std::size_t>(max_threads())) slots_.resize(static_cast<std::size_t>(max_threads()));
  }
  /// The calling item's buffer, at least n elements.
  T* get(std::size_t n) {
    auto& v = slots_[static_cast<std::size_t>(parallel_slot())];
    if (v.size() < n) v.resize(n);
    return v.data();
  }

 private:
  std::vector<std::vector<T>> slots_;
};

/// parallel_for for items that are each worth a parallel region on their own.
template <class Fn>
void parallel_for(std::int64_t begin, std::int64_t end, Fn&& fn) {
  parallel_for(begin, end, kMinParallelWork, static_cast<Fn&&>(fn));
}

}  // namespace qflash
