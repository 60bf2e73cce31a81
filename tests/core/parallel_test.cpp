// core/parallel.hpp: the thread pool behind parallel_for.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <thread>
#include <vector>

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

TEST_CASE("parallel_for splits into contiguous chunks over the threads") {
  DefaultThreadsAfter restore;
  set_max_threads(3);
  // Each chunk runs on one thread, in order: record which thread ran each index.
  std::vector<std::thread::id> who(10);
  std::vector<std::int64_t> order;
  std::mutex m;
  parallel_for(0, 10, [&](std::int64_t i) {
    who[static_cast<std::size_t>(i)] = std::this_thread::get_id();
    std::lock_guard lock(m);
    order.push_back(i);
  });
  // OpenMP's static split of 10 over 3: [0,4) [4,7) [7,10).
  for (std::int64_t i : {1, 2, 3}) CHECK(who[static_cast<std::size_t>(i)] == who[0]);
  for (std::int64_t i : {5, 6}) CHECK(who[static_cast<std::size_t>(i)] == who[4]);
  for (std::int64_t i : {8, 9}) CHECK(who[static_cast<std::size_t>(i)] == who[7]);
  CHECK(order.size() == 10);
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

TEST_CASE("CPU counts: 1 <= physical_cores() <= available_cpus()") {
  CHECK(available_cpus() >= 1);
  CHECK(physical_cores() >= 1);
  CHECK(physical_cores() <= available_cpus());
}

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

TEST_CASE("parallel_slot is the item's chunk, whichever thread runs it; SlotScratch keeps buffers") {
  DefaultThreadsAfter restore;
  set_max_threads(3);
  CHECK(parallel_slot() == 0);
  SlotScratch<int> scratch;
  scratch.prepare();
  auto& sc = scratch;
  for (int round = 0; round < 50; ++round) {
    std::vector<int> slot(10, -1);
    std::vector<int*> buffer(10, nullptr);
    parallel_for(0, 10, [&](std::int64_t i) {
      slot[static_cast<std::size_t>(i)] = parallel_slot();
      buffer[static_cast<std::size_t>(i)] = sc.get(16);
    });
    // The split of 10 over 3: [0,4) [4,7) [7,10).
    CHECK(slot == std::vector<int>{0, 0, 0, 0, 1, 1, 1, 2, 2, 2});
    CHECK(buffer[0] == buffer[3]);
    CHECK(buffer[0] != buffer[4]);
    CHECK(buffer[4] != buffer[7]);
  }
  CHECK(parallel_slot() == 0);
}
