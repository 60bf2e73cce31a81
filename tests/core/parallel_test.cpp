// core/parallel.hpp: the thread pool behind parallel_for.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

#include "qflash/core/error.hpp"
#include "qflash/core/parallel.hpp"

using namespace qflash;

namespace {

/// Restores the default pool size when a test case ends, however it ends.
struct DefaultThreadsAfter {
  ~DefaultThreadsAfter() { set_max_threads(0); }
};

/// Counts, per index of [begin, end), how often parallel_for visited it.
std::vector<int> visit_counts(std::int64_t begin, std::int64_t end, std::int64_t work_per_item) {
  std::vector<std::atomic<int>> hits(static_cast<std::size_t>(end - begin));
  parallel_for(begin, end, work_per_item, [&](std::int64_t i) {
    hits[static_cast<std::size_t>(i - begin)].fetch_add(1, std::memory_order_relaxed);
  });
  std::vector<int> out;
  for (auto& h : hits) out.push_back(h.load());
  return out;
}

#if defined(__linux__)
/// The CPUs the calling thread may run on.
std::set<int> this_thread_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  REQUIRE(sched_getaffinity(0, sizeof set, &set) == 0);
  std::set<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.insert(c);
  return cpus;
}

/// Each pool worker's CPUs, from a new pool of `threads` (the caller's chunk is slow, so every
/// worker runs items).
std::map<std::thread::id, std::set<int>> worker_cpus(int threads) {
  set_max_threads(1);  // drops the pool, so the next region starts one as the environment says
  set_max_threads(threads);
  auto const caller = std::this_thread::get_id();
  std::map<std::thread::id, std::set<int>> seen;
  std::mutex m;
  parallel_for(0, 16 * threads, [&](std::int64_t i) {
    if (i < 16) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    if (std::this_thread::get_id() == caller) return;
    std::set<int> cpus = this_thread_cpus();
    std::lock_guard lock(m);
    seen[std::this_thread::get_id()] = std::move(cpus);
  });
  return seen;
}

/// Lets the calling thread run on `cpus` again.
void unpin_this_thread(std::set<int> const& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  REQUIRE(sched_setaffinity(0, sizeof set, &set) == 0);
}

/// Sets an environment variable for one scope.
struct ScopedEnv {
  ScopedEnv(char const* name, char const* value) : name_(name) {
    if (char const* old = std::getenv(name)) old_ = old, had_ = true;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_)
      setenv(name_, old_.c_str(), 1);
    else
      unsetenv(name_);
  }
  char const* name_;
  std::string old_;
  bool had_ = false;
};
#endif

}  // namespace

TEST_CASE("parallel_for visits every index exactly once for every pool size") {
  DefaultThreadsAfter restore;
  int const over = 2 * available_cpus() + 3;
  for (int threads : {1, 2, 3, 7, over}) {
    set_max_threads(threads);
    CHECK(max_threads() == threads);
    for (auto [begin, end] : {std::pair<std::int64_t, std::int64_t>{0, 0}, {0, 1}, {5, 6}, {0, 2},
                              {0, 3}, {-7, 6}, {0, 31}, {3, 71}, {0, 129}, {10, 10007}}) {
      CAPTURE(threads);
      CAPTURE(begin);
      CAPTURE(end);
      // Every item worth a region (parallel) and items too small to be (serial).
      for (std::int64_t work : {kMinParallelWork, std::int64_t{1}}) {
        auto const hits = visit_counts(begin, end, work);
        CHECK(std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; }));
      }
    }
  }
}

TEST_CASE("each thread takes a chunk's items in order") {
  DefaultThreadsAfter restore;
  set_max_threads(3);
  // The split of 48 over 3: [0,16) [16,32) [32,48). Threads may share a chunk, but each one
  // takes the items of a chunk front to back.
  std::vector<std::pair<std::thread::id, std::int64_t>> order;
  std::mutex m;
  parallel_for(0, 48, [&](std::int64_t i) {
    std::lock_guard lock(m);
    order.emplace_back(std::this_thread::get_id(), i);
  });
  REQUIRE(order.size() == 48);
  for (auto const& [id, i] : order)
    for (auto const& [id2, j] : order) {
      if (&j == &i) break;  // j was recorded before i
      if (id2 == id && j / 16 == i / 16) CHECK(j < i);
    }
}

TEST_CASE("threads that finish their chunk take what is left of a slow one") {
  DefaultThreadsAfter restore;
  set_max_threads(2);
  // The caller's chunk [0, 32) is slow; the worker's [32, 64) is instant. Both threads run
  // items of the slow chunk: the worker once its own are done.
  auto const caller = std::this_thread::get_id();
  std::vector<std::thread::id> who(64);
  parallel_for(0, 64, [&](std::int64_t i) {
    who[static_cast<std::size_t>(i)] = std::this_thread::get_id();
    if (i < 32) std::this_thread::sleep_for(std::chrono::milliseconds(3));
  });
  CHECK(std::find(who.begin(), who.begin() + 32, caller) != who.begin() + 32);
  auto const helped = std::count_if(who.begin(), who.begin() + 32, [&](auto id) { return id != caller; });
  CHECK(helped > 0);
}

TEST_CASE("a parallel_for inside parallel_for runs serially and correctly") {
  DefaultThreadsAfter restore;
  set_max_threads(4);
  constexpr std::int64_t kOuter = 16, kInner = 100;
  std::vector<std::atomic<int>> hits(kOuter * kInner);
  std::atomic<int> inner_on_other_thread{0};
  parallel_for(0, kOuter, [&](std::int64_t o) {
    auto const me = std::this_thread::get_id();
    parallel_for(0, kInner, [&](std::int64_t i) {
      if (std::this_thread::get_id() != me) inner_on_other_thread.fetch_add(1);
      hits[static_cast<std::size_t>(o * kInner + i)].fetch_add(1);
    });
  });
  CHECK(inner_on_other_thread.load() == 0);
  for (auto& h : hits) CHECK(h.load() == 1);
}

TEST_CASE("set_max_threads(0) restores default_threads(); negative counts throw") {
  DefaultThreadsAfter restore;
  set_max_threads(5);
  CHECK(max_threads() == 5);
  set_max_threads(0);
  CHECK(max_threads() == default_threads());
  CHECK(default_threads() >= 1);
  CHECK_THROWS_AS(set_max_threads(-1), Error);
  CHECK_THROWS_AS(set_max_threads(kMaxThreads + 1), Error);
  CHECK(max_threads() == default_threads());
}

TEST_CASE("set_max_threads inside a region throws instead of deadlocking") {
  DefaultThreadsAfter restore;
  set_max_threads(2);
  std::atomic<int> threw{0};
  parallel_for(0, 2, [&](std::int64_t) {
    try {
      set_max_threads(3);
    } catch (Error const&) {
      threw.fetch_add(1);
    }
  });
  CHECK(threw.load() == 2);
  CHECK(max_threads() == 2);
}

TEST_CASE("CPU counts: 1 <= physical_cores() <= available_cpus(); the default pool is one thread per core") {
  CHECK(available_cpus() >= 1);
  CHECK(physical_cores() >= 1);
  CHECK(physical_cores() <= available_cpus());
  if (!std::getenv("QFLASH_NUM_THREADS") && !std::getenv("OMP_NUM_THREADS"))
    CHECK(default_threads() == std::min(physical_cores(), kMaxThreads));
}

#if defined(__linux__)
TEST_CASE("QFLASH_PIN_THREADS=1 pins each pool thread to its own CPU when the pool fits") {
  DefaultThreadsAfter restore;
  ScopedEnv pin("QFLASH_PIN_THREADS", "1");
  std::set<int> const process = this_thread_cpus();
  int const threads = std::min(4, static_cast<int>(process.size()));
  if (threads < 2) {
    MESSAGE("one CPU available: no worker to pin");
    return;
  }
  auto const workers = worker_cpus(threads);
  CHECK(static_cast<int>(workers.size()) == threads - 1);
  std::set<int> used;
  for (auto const& [id, cpus] : workers) {
    REQUIRE(cpus.size() == 1);
    CHECK(process.count(*cpus.begin()) == 1);
    used.insert(*cpus.begin());
  }
  std::set<int> const caller = this_thread_cpus();  // the thread that started the pool
  REQUIRE(caller.size() == 1);
  used.insert(*caller.begin());
  CHECK(used.size() == workers.size() + 1);  // no two pool threads share a CPU
  unpin_this_thread(process);
}

TEST_CASE("threads are not pinned by default, nor when the pool exceeds the CPUs") {
  DefaultThreadsAfter restore;
  std::set<int> const process = this_thread_cpus();
  {
    ScopedEnv off("QFLASH_PIN_THREADS", "0");
    for (auto const& [id, cpus] : worker_cpus(2)) CHECK(cpus == process);
    CHECK(this_thread_cpus() == process);
  }
  ScopedEnv on("QFLASH_PIN_THREADS", "1");
  for (auto const& [id, cpus] : worker_cpus(static_cast<int>(process.size()) + 1)) CHECK(cpus == process);
  CHECK(this_thread_cpus() == process);
}
#endif

TEST_CASE("two threads calling parallel_for concurrently both get correct results") {
  DefaultThreadsAfter restore;
  set_max_threads(3);
  constexpr std::int64_t kN = 5000;
  constexpr int kRounds = 300;
  auto caller = [&](std::int64_t salt, bool& ok) {
    std::vector<std::int64_t> y(kN);
    for (int r = 0; r < kRounds; ++r) {
      parallel_for(0, kN, kMinParallelWork, [&](std::int64_t i) { y[static_cast<std::size_t>(i)] = i * salt + r; });
      for (std::int64_t i = 0; i < kN; ++i) ok = ok && y[static_cast<std::size_t>(i)] == i * salt + r;
    }
  };
  bool ok_a = true, ok_b = true;
  std::thread a(caller, 3, std::ref(ok_a));
  std::thread b(caller, -5, std::ref(ok_b));
  a.join();
  b.join();
  CHECK(ok_a);
  CHECK(ok_b);
}

TEST_CASE("100k short regions in a row complete (no lost wake-up)") {
  DefaultThreadsAfter restore;
  for (int threads : {2, available_cpus() + 1}) {
    set_max_threads(threads);
    CAPTURE(threads);
    std::int64_t sum = 0;
    std::vector<std::int64_t> part(static_cast<std::size_t>(threads));
    for (int r = 0; r < 100'000; ++r) {
      parallel_for(0, threads, [&](std::int64_t t) { part[static_cast<std::size_t>(t)] = t + r; });
      sum += std::accumulate(part.begin(), part.end(), std::int64_t{0});
    }
    // sum over r of (threads * r + threads * (threads - 1) / 2)
    std::int64_t const n = threads, rounds = 100'000;
    CHECK(sum == n * rounds * (rounds - 1) / 2 + rounds * n * (n - 1) / 2);
  }
}

TEST_CASE("an exception from fn is rethrown on the caller after the region") {
  DefaultThreadsAfter restore;
  set_max_threads(3);
  std::atomic<int> ran{0};
  CHECK_THROWS_WITH_AS(parallel_for(0, 30,
                                    [&](std::int64_t i) {
                                      ran.fetch_add(1);
                                      if (i == 25) throw std::runtime_error("item 25");
                                    }),
                       "item 25", std::runtime_error);
  // The pool still works afterwards.
  auto const hits = visit_counts(0, 100, kMinParallelWork);
  CHECK(std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; }));
}

TEST_CASE("no two threads use one parallel_slot at once; SlotScratch keeps buffers") {
  DefaultThreadsAfter restore;
  set_max_threads(3);
  CHECK(parallel_slot() == 0);
  SlotScratch<int> scratch;
  scratch.prepare();
  auto& sc = scratch;
  std::vector<std::atomic<int>> in_use(3);
  std::atomic<int> overlaps{0}, out_of_range{0};
  std::vector<int*> first(3, nullptr);
  for (int round = 0; round < 50; ++round) {
    std::vector<int*> buffer(30, nullptr);
    std::vector<int> slot(30, -1);
    parallel_for(0, 30, [&](std::int64_t i) {
      int const s = parallel_slot();
      if (s < 0 || s >= 3) {
        out_of_range.fetch_add(1);
        return;
      }
      if (in_use[static_cast<std::size_t>(s)].fetch_add(1) != 0) overlaps.fetch_add(1);
      slot[static_cast<std::size_t>(i)] = s;
      buffer[static_cast<std::size_t>(i)] = sc.get(16);
      if (i % 3 == 0) std::this_thread::yield();
      in_use[static_cast<std::size_t>(s)].fetch_sub(1);
    });
    // A slot's buffer stays where it was (it never needs to grow).
    for (std::size_t i = 0; i < buffer.size(); ++i) {
      if (slot[i] < 0) continue;
      int*& f = first[static_cast<std::size_t>(slot[i])];
      if (!f) f = buffer[i];
      CHECK(buffer[i] == f);
    }
  }
  CHECK(overlaps.load() == 0);
  CHECK(out_of_range.load() == 0);
  CHECK(parallel_slot() == 0);
}
