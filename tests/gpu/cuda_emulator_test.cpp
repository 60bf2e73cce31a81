// The CUDA emulator's own semantics (tests/support/cuda_emulator), which the emulated GPU tests
// rest on: coordinates, __syncthreads, threads run again for each block and find its shared
// memory filled with 0xff bytes, the shuffles and __reduce_add_sync, the warp reductions as the
// shuffles' butterfly (several values at once too), mma.sync against a plain product, when
// cp.async copies land, the CUB collectives, launch refusals, stream capture's rules and graph
// updates, the schedule threads and blocks run in, and accesses past an allocation's end.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdint>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "qflash/kernels/common/cuda.cuh"
#include "qflash/kernels/linear/mma.cuh"
#include "qflash/numeric/bf16.hpp"

namespace {

/// A device copy of `host`, for the caller to free.
template <class T>
T* to_device(std::vector<T> const& host) {
  T* device = nullptr;
  REQUIRE(cudaMalloc(&device, host.size() * sizeof(T)) == cudaSuccess);
  REQUIRE(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
  return device;
}

/// n values of very different sizes (2^-12 to 2^12 times up to 500, either sign): the order of
/// additions shows in their sums.
std::vector<float> mixed_magnitudes(std::size_t n) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = std::ldexp(static_cast<float>(i * 2654435761u % 1000) - 500.0f, static_cast<int>(i % 7) * 4 - 12);
  return v;
}

template <class T>
std::vector<T> run_and_read(T* device, std::size_t n) {
  std::vector<T> host(n);
  REQUIRE(cudaMemcpy(host.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
  return host;
}

/// Each thread writes its global index after a barrier, in reverse order within its block.
__global__ void reverse_kernel(int* out) {
  __shared__ int s[64];
  s[threadIdx.x] = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = s[blockDim.x - 1 - threadIdx.x];
}

__global__ void shuffle_kernel(int* out) {
  int const lane = static_cast<int>(threadIdx.x % 32);
  int* o = out + 5 * threadIdx.x;
  o[0] = __shfl_xor_sync(0xffffffffu, lane, 5);
  o[1] = __shfl_sync(0xffffffffu, lane * 10, 7);
  o[2] = __shfl_down_sync(0xffffffffu, lane, 3);
  o[3] = __shfl_up_sync(0xffffffffu, lane, 2, 16);
  o[4] = __reduce_add_sync(0xffffffffu, lane);
}

/// Each lane's warp_sum, warp_max and warp_min (one collective each on the emulator) and the
/// same butterflies spelled as five shuffles.
__global__ void butterfly_kernel(float const* in, float* out) {
  namespace cuda = qflash::kernels::cuda;
  int const t = static_cast<int>(threadIdx.x);
  float const v = in[t];
  float* o = out + 6 * t;
  o[0] = cuda::warp_sum(v);
  o[1] = cuda::warp_max(v);
  o[2] = cuda::warp_min(v);
  float sum = v, max = v, min = v;
  for (int m = 16; m > 0; m /= 2) {
    sum += __shfl_xor_sync(0xffffffffu, sum, m);
    max = fmaxf(max, __shfl_xor_sync(0xffffffffu, max, m));
    min = fminf(min, __shfl_xor_sync(0xffffffffu, min, m));
  }
  o[3] = sum, o[4] = max, o[5] = min;
}

/// warp_sums over a 2x3 array and over 4 values (one collective each on the emulator), and the
/// same values' butterflies spelled as shuffles, one value after another.
__global__ void sums_kernel(float const* in, float* out) {
  namespace cuda = qflash::kernels::cuda;
  int const t = static_cast<int>(threadIdx.x);
  float grid[2][3], row[4];
  for (int i = 0; i < 6; ++i) grid[i / 3][i % 3] = in[(t + 7 * i) % 64] * static_cast<float>(i + 1);
  for (int i = 0; i < 4; ++i) row[i] = in[(t + 11 * i) % 64] - static_cast<float>(i);
  float* o = out + 20 * t;
  for (int i = 0; i < 10; ++i) {
    float v = i < 6 ? grid[i / 3][i % 3] : row[i - 6];
    for (int m = 16; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
    o[10 + i] = v;
  }
  cuda::warp_sums(grid);
  cuda::warp_sums(row);
  for (int i = 0; i < 6; ++i) o[i] = grid[i / 3][i % 3];
  for (int i = 0; i < 4; ++i) o[6 + i] = row[i];
}

/// Each thread reads its static shared slot before it writes it: what an earlier block or
/// launch wrote there must not show. kZero, a constant static, is not shared memory: it stays.
template <int kSlots>
__global__ void leftover_kernel(int* out) {
  static constexpr int kZero[4] = {};
  __shared__ int s[kSlots];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s[threadIdx.x] + kZero[threadIdx.x % 4];
  s[threadIdx.x] = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
}

/// leftover_kernel's reads and writes, of a lambda's static shared slots.
__global__ void lambda_leftover_kernel(int* out) {
  auto const slot = []() -> int& {
    __shared__ int s[64];
    return s[threadIdx.x];
  };
  out[blockIdx.x * blockDim.x + threadIdx.x] = slot();
  slot() = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
}

/// Threads past 16 per block index return at once; the others count themselves, meet at a
/// barrier, and write the count. Every block starts with all its threads.
__global__ void early_return_kernel(int* out) {
  __shared__ int kept;
  if (threadIdx.x == 0) kept = 0;
  __syncthreads();
  if (threadIdx.x >= 16 * (blockIdx.x + 1)) return;
  atomicAdd(&kept, 1);
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = kept;
}

/// A full warp's __reduce_add_sync, then two shuffles of lanes 0-15 only: those lanes can reach
/// their second shuffle before lanes 16-31 have read the reduction.
__global__ void partial_mask_kernel(int* out) {
  int const lane = static_cast<int>(threadIdx.x);
  int const total = __reduce_add_sync(0xffffffffu, lane);
  int x = lane;
  if (lane < 16) {
    x = __shfl_xor_sync(0x0000ffffu, x, 1);
    x = __shfl_xor_sync(0x0000ffffu, x, 2);
  }
  out[lane] = total;
  out[32 + lane] = x;
}

/// out[i] += 1 for i < n.
__global__ void increment_kernel(int* out, int n) {
  int const i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) out[i] += 1;
}

/// One m16n8k16 tile: A[i][k] = i + k, B[k][j] = k - j (exact in bf16), placed in the
/// fragments as the PTX ISA says.
__global__ void mma_kernel(float* out) {
  int const lane = static_cast<int>(threadIdx.x), g = lane >> 2, t = lane % 4;
  auto const pair = [](float lo, float hi) {
    return static_cast<std::uint32_t>(qflash::to_bf16(lo).bits) |
           static_cast<std::uint32_t>(qflash::to_bf16(hi).bits) << 16;
  };
  std::uint32_t a[4], b[2];
  for (int r = 0; r < 4; ++r) {
    int const i = g + 8 * (r % 2), k = 2 * t + 8 * (r / 2);
    a[r] = pair(static_cast<float>(i + k), static_cast<float>(i + k + 1));
  }
  for (int r = 0; r < 2; ++r) {
    int const k = 2 * t + 8 * r;
    b[r] = pair(static_cast<float>(k - g), static_cast<float>(k + 1 - g));
  }
  float c[4] = {1, 1, 1, 1};
  qflash::kernels::linear_cuda::mma::mma_bf16(c, a, b);
  for (int r = 0; r < 4; ++r) out[(g + 8 * (r / 2)) * 8 + 2 * t + r % 2] = c[r];
}

/// What shared memory holds before and after the wait for a cp.async copy.
__global__ void copy_kernel(int const* src, int* out) {
  __shared__ __align__(16) std::uint8_t stage[16];
  for (int i = 0; i < 16; ++i) stage[i] = 0;
  qflash::kernels::linear_cuda::mma::copy16(stage, src, true);
  qflash::kernels::linear_cuda::mma::copy_commit();
  out[0] = reinterpret_cast<int const*>(stage)[1];
  qflash::kernels::linear_cuda::mma::copy_wait<0>();
  out[1] = reinterpret_cast<int const*>(stage)[1];
}

__global__ void cub_kernel(int* scan, unsigned* keys_out, int* ids_out, float* sum) {
  using Scan = cub::BlockScan<int, 64>;
  using Sort = cub::BlockRadixSort<unsigned, 64, 2, int>;
  using Reduce = cub::BlockReduce<float, 64>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ typename Sort::TempStorage sort_storage;
  __shared__ typename Reduce::TempStorage reduce_storage;
  int const t = static_cast<int>(threadIdx.x);
  int prefix = 0, total = 0;
  Scan(scan_storage).ExclusiveSum(t % 3, prefix, total);
  scan[t] = prefix;
  if (t == 0) scan[64] = total;
  unsigned keys[2] = {static_cast<unsigned>((t * 37) % 16), static_cast<unsigned>((t * 11) % 16)};
  int ids[2] = {2 * t, 2 * t + 1};
  Sort(sort_storage).SortDescending(keys, ids);
  for (int i = 0; i < 2; ++i) keys_out[2 * t + i] = keys[i], ids_out[2 * t + i] = ids[i];
  float const s = Reduce(reduce_storage).Sum(static_cast<float>(t));
  if (t == 0) *sum = s;
}

/// Two block sums through one TempStorage, with or without the barrier CUB asks for between them.
__global__ void reused_reduce_kernel(float* sums, bool barrier) {
  using Reduce = cub::BlockReduce<float, 64>;
  __shared__ typename Reduce::TempStorage storage;
  float const first = Reduce(storage).Sum(1.0f);
  if (barrier) __syncthreads();
  float const second = Reduce(storage).Sum(2.0f);
  if (threadIdx.x == 0) sums[0] = first, sums[1] = second;
}

__global__ void empty_kernel() {}

/// out[i] = in[i] + 1 for each of the launch's threads.
__global__ void plus_one_kernel(float const* in, float* out) {
  int const i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  out[i] = in[i] + 1.0f;
}

/// The emulator's schedule set to `spec` for the scope, then back to what it was (the
/// environment's, when QFLASH_EMULATOR_SCHEDULE set it).
class ScheduleScope {
 public:
  explicit ScheduleScope(char const* spec) : before_(qflash::emulator::current_schedule()) {
    qflash::emulator::set_schedule(spec);
  }
  ScheduleScope(ScheduleScope const&) = delete;
  ScheduleScope& operator=(ScheduleScope const&) = delete;
  ~ScheduleScope() { qflash::emulator::set_schedule(before_.c_str()); }

 private:
  std::string before_;
};

/// How a child process running `body` ended: whether by SIGABRT, and what it wrote to stderr.
struct ChildEnd {
  bool aborted = false;
  std::string err;
};
ChildEnd in_child(std::function<void()> const& body) {
  int fds[2];
  REQUIRE(pipe(fds) == 0);
  pid_t const pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    std::signal(SIGABRT, SIG_DFL);  // not the test framework's crash report
    alarm(60);                      // a child that hangs ends, and the check fails
    dup2(fds[1], STDERR_FILENO);
    close(fds[0]);
    body();
    _exit(0);
  }
  close(fds[1]);
  ChildEnd end;
  char buf[512];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) end.err.append(buf, static_cast<std::size_t>(n));
  close(fds[0]);
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  end.aborted = WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
  return end;
}

/// Recurses n deep, some 300 bytes of stack a call, each call's bytes written: past a CUDA
/// thread's stack, into its guard page, for large n.
int deep(int n) {
  volatile char frame[256];
  for (int i = 0; i < 256; i += 64) frame[i] = static_cast<char>(n);
  return n > 0 ? deep(n - 1) + frame[0] : 0;
}
__global__ void deep_kernel(int* out, int n) { *out = deep(n); }

/// Records the order in which the threads (global indices) start, and then pass a barrier.
/// Fibers switch only at sync points, so the unguarded increments are exact on the emulator.
__global__ void order_kernel(int* started, int* passed, int* counts) {
  int const t = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  started[counts[0]++] = t;
  __syncthreads();
  passed[counts[1]++] = t;
}

/// A race: each thread reads its neighbour's shared value with no barrier after the writes.
__global__ void missing_barrier_kernel(int* out) {
  QFLASH_DYNAMIC_SMEM(int, s);  // 0xff bytes (-1) until written
  int const t = static_cast<int>(threadIdx.x), n = static_cast<int>(blockDim.x);
  s[t] = t;
  out[blockIdx.x * blockDim.x + threadIdx.x] = s[(t + 1) % n];
}

}  // namespace

TEST_CASE("CUDA emulator: coordinates, barriers and shared memory per block") {
  int* out = nullptr;
  REQUIRE(cudaMalloc(&out, 3 * 64 * sizeof(int)) == cudaSuccess);
  QFLASH_LAUNCH(3, 64, 0, nullptr, reverse_kernel)(out);
  REQUIRE(cudaGetLastError() == cudaSuccess);
  auto const got = run_and_read(out, 3 * 64);
  for (int b = 0; b < 3; ++b)
    for (int t = 0; t < 64; ++t) CHECK(got[static_cast<std::size_t>(b * 64 + t)] == b * 64 + 63 - t);
  cudaFree(out);
}

TEST_CASE("CUDA emulator: static shared memory holds 0xff bytes at each block's start") {
  constexpr int kBlocks = 5, kThreads = 64;
  int *out = nullptr, *other = nullptr;
  REQUIRE(cudaMalloc(&out, kBlocks * kThreads * sizeof(int)) == cudaSuccess);
  REQUIRE(cudaMalloc(&other, kBlocks * kThreads * sizeof(int)) == cudaSuccess);
  for (int launch = 0; launch < 3; ++launch) {
    CAPTURE(launch);
    QFLASH_LAUNCH(kBlocks, kThreads, 0, nullptr, leftover_kernel<kThreads>)(out);
    QFLASH_LAUNCH(kBlocks, kThreads, 0, nullptr, reverse_kernel)(other);  // other statics filled between
    REQUIRE(cudaGetLastError() == cudaSuccess);
    CHECK(std::ranges::count(run_and_read(out, kBlocks * kThreads), -1) == kBlocks * kThreads);  // 0xff bytes
    QFLASH_LAUNCH(kBlocks, kThreads, 0, nullptr, lambda_leftover_kernel)(out);
    REQUIRE(cudaGetLastError() == cudaSuccess);
    CHECK(std::ranges::count(run_and_read(out, kBlocks * kThreads), -1) == kBlocks * kThreads);
  }
  cudaFree(out);
  cudaFree(other);
}

TEST_CASE("CUDA emulator: threads run again for each block, whether they returned early or not") {
  int* out = nullptr;
  REQUIRE(cudaMalloc(&out, 4 * 64 * sizeof(int)) == cudaSuccess);  // 0xff bytes: -1
  QFLASH_LAUNCH(4, 64, 0, nullptr, early_return_kernel)(out);
  REQUIRE(cudaGetLastError() == cudaSuccess);
  auto const got = run_and_read(out, 4 * 64);
  for (int b = 0; b < 4; ++b)
    for (int t = 0; t < 64; ++t) {
      CAPTURE(b);
      CAPTURE(t);
      CHECK(got[static_cast<std::size_t>(b * 64 + t)] == (t < 16 * (b + 1) ? 16 * (b + 1) : -1));
    }
  cudaFree(out);
}

TEST_CASE("CUDA emulator: the schedule orders threads and blocks, and a missing barrier reads stale values") {
  constexpr int kBlocks = 3, kThreads = 64, kN = kBlocks * kThreads;
  int *started = nullptr, *passed = nullptr, *counts = nullptr, *out = nullptr;
  REQUIRE(cudaMalloc(&started, kN * sizeof(int)) == cudaSuccess);
  REQUIRE(cudaMalloc(&passed, kN * sizeof(int)) == cudaSuccess);
  REQUIRE(cudaMalloc(&counts, 2 * sizeof(int)) == cudaSuccess);
  REQUIRE(cudaMalloc(&out, kN * sizeof(int)) == cudaSuccess);
  struct Run {
    std::vector<int> started, passed;
    int stale = 0;  // reads that missed the neighbour's write
  };
  auto const run = [&](char const* schedule) {
    ScheduleScope const scope(schedule);
    REQUIRE(cudaMemset(counts, 0, 2 * sizeof(int)) == cudaSuccess);
    QFLASH_LAUNCH(kBlocks, kThreads, 0, nullptr, order_kernel)(started, passed, counts);
    QFLASH_LAUNCH(kBlocks, kThreads, kThreads * sizeof(int), nullptr, missing_barrier_kernel)(out);
    REQUIRE(cudaGetLastError() == cudaSuccess);
    Run r{run_and_read(started, kN), run_and_read(passed, kN)};
    for (int v : run_and_read(out, kN)) r.stale += v == -1;
    return r;
  };
  // in_order / reversed: every thread's start; past the barrier, the last to arrive goes on
  // first and the others follow in the same order.
  std::vector<int> in_order(kN), reversed(kN), in_order_past(kN), reversed_past(kN);
  for (int i = 0; i < kN; ++i) {
    int const b = i / kThreads, j = i % kThreads;
    in_order[i] = i;
    reversed[i] = kN - 1 - i;
    in_order_past[i] = b * kThreads + (j == 0 ? kThreads - 1 : j - 1);
    reversed_past[i] = (kBlocks - 1 - b) * kThreads + (j == 0 ? 0 : kThreads - j);
  }
  std::string const before = qflash::emulator::current_schedule();
  Run const forward = run("in-order");
  CHECK(forward.started == in_order);
  CHECK(forward.passed == in_order_past);
  CHECK(forward.stale == kBlocks * (kThreads - 1));  // every reader but the last ran before its writer
  Run const backward = run("reversed");
  CHECK(backward.started == reversed);
  CHECK(backward.passed == reversed_past);
  CHECK(backward.stale == kBlocks);  // only the last thread, reading thread 0, ran first

  Run const shuffled = run("shuffled:7");
  CHECK(run("shuffled:7").started == shuffled.started);  // seeded: the same order again
  CHECK(run("shuffled:8").started != shuffled.started);
  for (auto const* order : {&shuffled.started, &shuffled.passed}) {
    std::vector<int> sorted = *order;
    std::sort(sorted.begin(), sorted.end());
    CHECK(sorted == in_order);  // each thread once
    CHECK(*order != in_order);
    CHECK(*order != reversed);
  }
  CHECK(shuffled.passed != shuffled.started);  // each release takes a new order
  // A race shows either way round: about half the reads are stale.
  CHECK(shuffled.stale > kN / 4);
  CHECK(shuffled.stale < 3 * kN / 4);
  CHECK(qflash::emulator::current_schedule() == before);  // each run's scope set it back
  for (int* p : {started, passed, counts, out}) cudaFree(p);
}

TEST_CASE("CUDA emulator: shuffles and __reduce_add_sync take the lanes the ISA names") {
  int* out = nullptr;
  REQUIRE(cudaMalloc(&out, 64 * 5 * sizeof(int)) == cudaSuccess);
  QFLASH_LAUNCH(1, 64, 0, nullptr, shuffle_kernel)(out);
  auto const got = run_and_read(out, 64 * 5);
  for (int t = 0; t < 64; ++t) {
    int const lane = t % 32;
    auto const* o = &got[static_cast<std::size_t>(5 * t)];
    CHECK(o[0] == (lane ^ 5));
    CHECK(o[1] == 70);
    CHECK(o[2] == (lane + 3 < 32 ? lane + 3 : lane));
    CHECK(o[3] == (lane % 16 >= 2 ? lane - 2 : lane));
    CHECK(o[4] == 31 * 32 / 2);
  }
  cudaFree(out);
}

TEST_CASE("CUDA emulator: warp_sum, warp_max and warp_min are the shuffles' butterfly, bit for bit") {
  // A NaN among them: fmaxf/fminf pass it over.
  std::vector<float> in = mixed_magnitudes(64);
  in[37] = NAN;
  float* const d_in = to_device(in);
  float* d_out = nullptr;
  REQUIRE(cudaMalloc(&d_out, in.size() * 6 * sizeof(float)) == cudaSuccess);
  QFLASH_LAUNCH(1, 64, 0, nullptr, butterfly_kernel)(d_in, d_out);
  auto const got = run_and_read(d_out, in.size() * 6);
  auto const bits = [](float x) { return std::bit_cast<std::uint32_t>(x); };
  for (std::size_t t = 0; t < in.size(); ++t) {
    CAPTURE(t);
    float const* o = &got[6 * t];
    for (int op = 0; op < 3; ++op) CHECK(bits(o[op]) == bits(o[op + 3]));
  }
  CHECK(std::isnan(got[6 * 32]));  // the second warp's sum has the NaN; fmaxf/fminf pass it over
  std::vector<float> others(in.begin() + 32, in.end());
  others.erase(others.begin() + 5);
  CHECK(got[6 * 32 + 1] == *std::max_element(others.begin(), others.end()));
  CHECK(got[6 * 32 + 2] == *std::min_element(others.begin(), others.end()));
  cudaFree(d_in);
  cudaFree(d_out);
}

TEST_CASE("CUDA emulator: warp_sums of several values are each value's shuffles' butterfly, bit for bit") {
  std::vector<float> const in = mixed_magnitudes(64);
  float* const d_in = to_device(in);
  float* d_out = nullptr;
  REQUIRE(cudaMalloc(&d_out, in.size() * 20 * sizeof(float)) == cudaSuccess);
  QFLASH_LAUNCH(1, 64, 0, nullptr, sums_kernel)(d_in, d_out);
  auto const got = run_and_read(d_out, in.size() * 20);
  for (std::size_t t = 0; t < in.size(); ++t)
    for (int i = 0; i < 10; ++i) {
      CAPTURE(t);
      CAPTURE(i);
      CHECK(std::bit_cast<std::uint32_t>(got[20 * t + i]) == std::bit_cast<std::uint32_t>(got[20 * t + 10 + i]));
    }
  // Lane 0's first value is the sum of in[0..31]: within the butterfly's rounding (5 fp32
  // additions deep, each value's error under 5u / (1 - 5u) of the magnitudes) of the exact sum.
  double exact = 0, magnitude = 0;
  for (std::size_t l = 0; l < 32; ++l) exact += in[l], magnitude += std::fabs(in[l]);
  CHECK(std::fabs(got[0] - exact) <= 6 * 0x1p-24 * magnitude);
  cudaFree(d_in);
  cudaFree(d_out);
}

TEST_CASE("CUDA emulator: lanes outside a partial mask read their collective's results intact") {
  int* out = nullptr;
  REQUIRE(cudaMalloc(&out, 64 * sizeof(int)) == cudaSuccess);
  QFLASH_LAUNCH(1, 32, 0, nullptr, partial_mask_kernel)(out);
  auto const got = run_and_read(out, 64);
  for (int lane = 0; lane < 32; ++lane) {
    CAPTURE(lane);
    CHECK(got[static_cast<std::size_t>(lane)] == 31 * 32 / 2);
    CHECK(got[static_cast<std::size_t>(32 + lane)] == (lane < 16 ? lane ^ 3 : lane));
  }
  cudaFree(out);
}

TEST_CASE("CUDA emulator: mma.sync m16n8k16 equals the plain product") {
  float* out = nullptr;
  REQUIRE(cudaMalloc(&out, 16 * 8 * sizeof(float)) == cudaSuccess);
  QFLASH_LAUNCH(1, 32, 0, nullptr, mma_kernel)(out);
  auto const got = run_and_read(out, 16 * 8);
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 8; ++j) {
      int want = 1;
      for (int k = 0; k < 16; ++k) want += (i + k) * (k - j);
      CHECK(got[static_cast<std::size_t>(i * 8 + j)] == static_cast<float>(want));
    }
  cudaFree(out);
}

TEST_CASE("CUDA emulator: a cp.async copy lands at its wait, or shuffled, at its commit at random") {
  int* src = nullptr;
  int* out = nullptr;
  REQUIRE(cudaMalloc(&src, 4 * sizeof(int)) == cudaSuccess);
  REQUIRE(cudaMalloc(&out, 2 * sizeof(int)) == cudaSuccess);
  int const values[4] = {10, 11, 12, 13};
  REQUIRE(cudaMemcpy(src, values, sizeof values, cudaMemcpyHostToDevice) == cudaSuccess);
  auto const run = [&] {
    QFLASH_LAUNCH(1, 1, 0, nullptr, copy_kernel)(src, out);
    return run_and_read(out, 2);
  };
  {
    ScheduleScope const scope("in-order");
    CHECK(run() == std::vector<int>{0, 11});
  }
  ScheduleScope const scope("shuffled");
  int at_commit = 0;
  for (int i = 0; i < 64; ++i) {
    auto const got = run();
    CHECK(got[1] == 11);
    CHECK((got[0] == 0 || got[0] == 11));  // before the wait: landed at the commit or not yet
    at_commit += got[0] == 11;
  }
  CHECK(at_commit > 8);
  CHECK(at_commit < 56);
  cudaFree(src);
  cudaFree(out);
}

TEST_CASE("CUDA emulator: CUB's block scan, stable descending radix sort and reduction") {
  int *scan = nullptr, *ids = nullptr;
  unsigned* keys = nullptr;
  float* sum = nullptr;
  REQUIRE(cudaMalloc(&scan, 65 * sizeof(int)) == cudaSuccess);
  REQUIRE(cudaMalloc(&keys, 128 * sizeof(unsigned)) == cudaSuccess);
  REQUIRE(cudaMalloc(&ids, 128 * sizeof(int)) == cudaSuccess);
  REQUIRE(cudaMalloc(&sum, sizeof(float)) == cudaSuccess);
  QFLASH_LAUNCH(1, 64, 0, nullptr, cub_kernel)(scan, keys, ids, sum);
  auto const s = run_and_read(scan, 65);
  int running = 0;
  for (int t = 0; t < 64; ++t) {
    CHECK(s[static_cast<std::size_t>(t)] == running);
    running += t % 3;
  }
  CHECK(s[64] == running);
  std::vector<std::pair<unsigned, int>> want;  // (key, id) in blocked order, sorted stably
  for (int t = 0; t < 64; ++t) {
    want.push_back({static_cast<unsigned>((t * 37) % 16), 2 * t});
    want.push_back({static_cast<unsigned>((t * 11) % 16), 2 * t + 1});
  }
  std::stable_sort(want.begin(), want.end(), [](auto const& a, auto const& b) { return a.first > b.first; });
  auto const k = run_and_read(keys, 128);
  auto const i = run_and_read(ids, 128);
  for (std::size_t n = 0; n < 128; ++n) {
    CHECK(k[n] == want[n].first);
    CHECK(i[n] == want[n].second);
  }
  CHECK(run_and_read(sum, 1)[0] == 63.0f * 64 / 2);

  // Without the barrier the threads that go on first (in-order: the last to reach the
  // reduction's barrier) store their next item before thread 0 has summed the first.
  float* sums_out = nullptr;
  REQUIRE(cudaMalloc(&sums_out, 2 * sizeof(float)) == cudaSuccess);
  for (bool barrier : {true, false}) {
    ScheduleScope const scope("in-order");
    QFLASH_LAUNCH(1, 64, 0, nullptr, reused_reduce_kernel)(sums_out, barrier);
    auto const sums = run_and_read(sums_out, 2);
    CHECK(sums[0] == (barrier ? 64.0f : 65.0f));
    CHECK(sums[1] == 128.0f);
  }
  cudaFree(sums_out);
  cudaFree(scan);
  cudaFree(keys);
  cudaFree(ids);
  cudaFree(sum);
}

TEST_CASE("CUDA emulator: launches a GPU would refuse are refused") {
  static_cast<void>(cudaGetLastError());
  QFLASH_LAUNCH(1, 2048, 0, nullptr, empty_kernel)();  // more than 1024 threads a block
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
  QFLASH_LAUNCH(1, 32, 64 * 1024, nullptr, empty_kernel)();  // above 48 KiB without the opt-in
  CHECK(cudaGetLastError() == cudaErrorInvalidValue);
  REQUIRE(cudaFuncSetAttribute(empty_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024) == cudaSuccess);
  QFLASH_LAUNCH(1, 32, 64 * 1024, nullptr, empty_kernel)();
  CHECK(cudaGetLastError() == cudaSuccess);
  CHECK(cudaFuncSetAttribute(empty_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024) ==
        cudaErrorInvalidValue);  // beyond an A100's 163 KiB
}

TEST_CASE("CUDA emulator: a kernel's access past an allocation or its stack is reported") {
  // 256 floats: the allocation ends at a guard page.
  static_cast<void>(cudaGetLastError());
  float *in = nullptr, *out = nullptr;
  REQUIRE(cudaMalloc(&in, 256 * sizeof(float)) == cudaSuccess);
  REQUIRE(cudaMalloc(&out, 512 * sizeof(float)) == cudaSuccess);
  REQUIRE(cudaMemset(in, 0, 256 * sizeof(float)) == cudaSuccess);
  QFLASH_LAUNCH(2, 128, 0, nullptr, plus_one_kernel)(in, out);  // in bounds
  CHECK(cudaGetLastError() == cudaSuccess);
  CHECK(run_and_read(out, 256) == std::vector<float>(256, 1.0f));

  ChildEnd const read_past = in_child([&] { QFLASH_LAUNCH(3, 128, 0, nullptr, plus_one_kernel)(in, out); });
  CHECK(read_past.aborted);
  // The first of block 2's threads to run (the schedule's choice), thread t, reads offset 1024 + 4 t.
  int thread = -1, offset = -1;
  auto const at = read_past.err.find("block (2, 0, 0)");
  REQUIRE_MESSAGE(at != std::string::npos, read_past.err);
  CHECK(std::sscanf(read_past.err.c_str() + at, "block (2, 0, 0), thread (%d, 0, 0) accesses offset %d of", &thread,
                    &offset) == 2);
  CHECK(offset == 1024 + 4 * thread);
  CHECK_MESSAGE(read_past.err.find("of an allocation of 1024 bytes, past its end") != std::string::npos, read_past.err);

  // 100 floats lie in 512 bytes at the end of a page: writes just past them or before them are
  // found when the allocation is freed.
  float* small = nullptr;
  REQUIRE(cudaMalloc(&small, 100 * sizeof(float)) == cudaSuccess);
  ChildEnd const write_past = in_child([&] {
    QFLASH_LAUNCH(1, 101, 0, nullptr, plus_one_kernel)(in, small);
    cudaFree(small);
  });
  CHECK(write_past.aborted);
  CHECK_MESSAGE(write_past.err.find("freeing an allocation of 400 bytes: its offset 400 was written, past its end") !=
                    std::string::npos,
                write_past.err);
  ChildEnd const write_before = in_child([&] {
    QFLASH_LAUNCH(1, 1, 0, nullptr, plus_one_kernel)(in, small - 3);
    cudaFree(small);
  });
  CHECK(write_before.aborted);
  int written = 0;  // the float at offsets -12 to -9: the nearest of its bytes
  auto const freeing = write_before.err.find("freeing an allocation of 400 bytes");
  REQUIRE_MESSAGE(freeing != std::string::npos, write_before.err);
  CHECK(std::sscanf(write_before.err.c_str() + freeing,
                    "freeing an allocation of 400 bytes: its offset %d was written, before its start", &written) == 1);
  CHECK(written == -9);
  QFLASH_LAUNCH(1, 100, 0, nullptr, plus_one_kernel)(in, small);
  CHECK(cudaFree(small) == cudaSuccess);

  // A CUDA thread's stack overflow is reported as such.
  int* depth = nullptr;
  REQUIRE(cudaMalloc(&depth, sizeof(int)) == cudaSuccess);
  QFLASH_LAUNCH(1, 1, 0, nullptr, deep_kernel)(depth, 16);
  CHECK(run_and_read(depth, 1)[0] == 16 * 17 / 2);
  ChildEnd const overflow = in_child([&] { QFLASH_LAUNCH(1, 1, 0, nullptr, deep_kernel)(depth, 8000); });
  CHECK(overflow.aborted);
  CHECK_MESSAGE(overflow.err.find("block (0, 0, 0), thread (0, 0, 0) accesses beyond its stack of 512 KiB") !=
                    std::string::npos,
                overflow.err);
  cudaFree(depth);
  cudaFree(in);
  cudaFree(out);
}

TEST_CASE("CUDA emulator: a captured stream's work runs when its graph is launched, with updated arguments") {
  cudaStream_t s = nullptr;
  REQUIRE(cudaStreamCreate(&s) == cudaSuccess);
  constexpr int kN = 40;
  int *a = nullptr, *b = nullptr, *host = nullptr;
  REQUIRE(cudaMalloc(&a, kN * sizeof(int)) == cudaSuccess);
  REQUIRE(cudaMalloc(&b, kN * sizeof(int)) == cudaSuccess);
  REQUIRE(cudaMallocHost(&host, kN * sizeof(int)) == cudaSuccess);
  REQUIRE(cudaMemset(a, 0, kN * sizeof(int)) == cudaSuccess);
  REQUIRE(cudaMemset(b, 0, kN * sizeof(int)) == cudaSuccess);
  // The graph of what `enqueue` puts on s.
  auto capture = [&](auto enqueue) {
    REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed) == cudaSuccess);
    enqueue();
    cudaGraph_t g = nullptr;
    REQUIRE(cudaStreamEndCapture(s, &g) == cudaSuccess);
    REQUIRE(g != nullptr);
    return g;
  };
  auto increment = [&](int* target) { QFLASH_LAUNCH(2, 32, 0, s, increment_kernel)(target, kN); };
  auto copy = [&](int* to, int const* from) {
    REQUIRE(cudaMemcpyAsync(to, from, kN * sizeof(int), cudaMemcpyDefault, s) == cudaSuccess);
  };
  // Increments `target`, then copies it to the pinned host buffer.
  auto increment_and_copy_to_host = [&](int* target) {
    return capture([&] {
      increment(target);
      copy(host, target);
    });
  };
  cudaGraph_t const on_a = increment_and_copy_to_host(a);
  CHECK(run_and_read(a, kN)[0] == 0);  // captured, not run
  cudaGraphExec_t exec = nullptr;
  REQUIRE(cudaGraphInstantiate(&exec, on_a, 0) == cudaSuccess);
  REQUIRE(cudaGraphLaunch(exec, s) == cudaSuccess);
  REQUIRE(cudaGraphLaunch(exec, s) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  CHECK(run_and_read(a, kN)[kN - 1] == 2);
  CHECK(host[kN - 1] == 2);

  // The same nodes on `b`: the update takes the new arguments.
  cudaGraph_t const on_b = increment_and_copy_to_host(b);
  cudaGraphExecUpdateResultInfo info{};
  REQUIRE(cudaGraphExecUpdate(exec, on_b, &info) == cudaSuccess);
  CHECK(info.result == cudaGraphExecUpdateSuccess);
  REQUIRE(cudaGraphLaunch(exec, s) == cudaSuccess);
  CHECK(run_and_read(a, kN)[0] == 2);
  CHECK(run_and_read(b, kN)[0] == 1);

  // Another shape of work (one more node; a memcpy where a kernel was; a copy to device memory
  // where it went to the host) is refused, and the executable graph runs as before.
  auto refused_update = [&](cudaGraph_t g) {
    CHECK(cudaGraphExecUpdate(exec, g, &info) == cudaErrorGraphExecUpdateFailure);
    return info.result;
  };
  cudaGraph_t const longer = capture([&] {
    increment(b);
    increment(b);
    copy(host, b);
  });
  CHECK(refused_update(longer) == cudaGraphExecUpdateErrorTopologyChanged);
  CHECK(cudaGetLastError() == cudaErrorGraphExecUpdateFailure);
  cudaGraph_t const retyped = capture([&] {
    copy(a, b);
    copy(host, b);
  });
  CHECK(refused_update(retyped) == cudaGraphExecUpdateErrorNodeTypeChanged);
  cudaGraph_t const to_device = capture([&] {
    increment(b);
    copy(a, b);
  });
  CHECK(refused_update(to_device) == cudaGraphExecUpdateErrorParametersChanged);
  static_cast<void>(cudaGetLastError());

  REQUIRE(cudaGraphLaunch(exec, s) == cudaSuccess);  // still the update on b
  CHECK(run_and_read(b, kN)[0] == 2);
  CHECK(run_and_read(a, kN)[0] == 2);

  for (cudaGraph_t g : {on_a, on_b, longer, retyped, to_device}) cudaGraphDestroy(g);
  cudaGraphExecDestroy(exec);
  cudaFreeHost(host);
  cudaFree(a);
  cudaFree(b);
  cudaStreamDestroy(s);
}

TEST_CASE("CUDA emulator: calls a stream capture forbids fail, and break the capture") {
  cudaStream_t s = nullptr, other = nullptr, independent = nullptr;
  REQUIRE(cudaStreamCreate(&s) == cudaSuccess);
  REQUIRE(cudaStreamCreate(&other) == cudaSuccess);
  REQUIRE(cudaStreamCreateWithFlags(&independent, cudaStreamNonBlocking) == cudaSuccess);
  int* d = nullptr;
  REQUIRE(cudaMalloc(&d, 64 * sizeof(int)) == cudaSuccess);
  int host[64] = {};
  auto status = [&](cudaStream_t st) {
    cudaStreamCaptureStatus c = cudaStreamCaptureStatusNone;
    REQUIRE(cudaStreamIsCapturing(st, &c) == cudaSuccess);
    return c;
  };
  // Begins a capture of s with a kernel in it; `breaks` is the call under test and what it returns.
  auto check_breaks = [&](char const* what, auto breaks, cudaError_t returned) {
    CAPTURE(what);
    static_cast<void>(cudaGetLastError());
    REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed) == cudaSuccess);
    QFLASH_LAUNCH(1, 64, 0, s, increment_kernel)(d, 64);
    CHECK(breaks() == returned);
    CHECK(status(s) == cudaStreamCaptureStatusInvalidated);
    // Later work on the stream is refused, and the capture ends with an error and no graph.
    QFLASH_LAUNCH(1, 64, 0, s, increment_kernel)(d, 64);
    CHECK(cudaGetLastError() == cudaErrorStreamCaptureInvalidated);
    cudaGraph_t g = reinterpret_cast<cudaGraph_t>(&host);
    CHECK(cudaStreamEndCapture(s, &g) == cudaErrorStreamCaptureInvalidated);
    CHECK(g == nullptr);
    CHECK(status(s) == cudaStreamCaptureStatusNone);
    CHECK(cudaGetLastError() == cudaErrorStreamCaptureInvalidated);
  };
  check_breaks("the legacy stream's synchronous copy", [&] {
    return cudaMemcpy(host, d, sizeof host, cudaMemcpyDeviceToHost);
  }, cudaErrorStreamCaptureImplicit);
  check_breaks("a kernel on the legacy stream", [&] {
    QFLASH_LAUNCH(1, 64, 0, nullptr, increment_kernel)(d, 64);
    return cudaGetLastError();
  }, cudaErrorStreamCaptureImplicit);
  check_breaks("an async copy on the legacy stream", [&] {
    return cudaMemsetAsync(d, 0, sizeof host, nullptr);
  }, cudaErrorStreamCaptureImplicit);
  check_breaks("synchronizing the captured stream", [&] { return cudaStreamSynchronize(s); },
               cudaErrorStreamCaptureUnsupported);
  check_breaks("synchronizing the device", [&] { return cudaDeviceSynchronize(); },
               cudaErrorStreamCaptureUnsupported);
  cudaEvent_t e = nullptr;
  REQUIRE(cudaEventCreate(&e) == cudaSuccess);
  check_breaks("synchronizing an event recorded in the capture", [&] {
    REQUIRE(cudaEventRecord(e, s) == cudaSuccess);
    return cudaEventSynchronize(e);
  }, cudaErrorStreamCaptureUnsupported);

  // Nothing of the broken captures ran: d holds what cudaMalloc left (0xff bytes).
  auto const untouched = run_and_read(d, 64);
  CHECK(std::all_of(untouched.begin(), untouched.end(), [](int v) { return v == -1; }));

  // Other streams go on: a blocking one that is not captured, and a non-blocking one with the
  // legacy stream; a capture of a non-blocking stream lets the legacy stream be used.
  REQUIRE(cudaMemset(d, 0, 64 * sizeof(int)) == cudaSuccess);
  REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed) == cudaSuccess);
  QFLASH_LAUNCH(1, 64, 0, other, increment_kernel)(d, 64);
  CHECK(cudaGetLastError() == cudaSuccess);
  CHECK(cudaStreamSynchronize(other) == cudaSuccess);
  CHECK(cudaEventSynchronize(e) == cudaSuccess);  // recorded in an earlier capture of s
  cudaStreamCaptureStatus legacy = cudaStreamCaptureStatusNone;
  CHECK(cudaStreamIsCapturing(nullptr, &legacy) == cudaErrorStreamCaptureImplicit);  // fails, breaks nothing
  CHECK(status(s) == cudaStreamCaptureStatusActive);
  static_cast<void>(cudaGetLastError());
  cudaGraph_t g = nullptr;
  REQUIRE(cudaStreamEndCapture(s, &g) == cudaSuccess);
  cudaGraphDestroy(g);
  REQUIRE(cudaStreamBeginCapture(independent, cudaStreamCaptureModeRelaxed) == cudaSuccess);
  CHECK(cudaMemcpy(host, d, sizeof host, cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(host[0] == 1);
  REQUIRE(cudaStreamEndCapture(independent, &g) == cudaSuccess);
  cudaGraphDestroy(g);
  CHECK(cudaStreamEndCapture(s, &g) == cudaErrorIllegalState);  // not capturing
  static_cast<void>(cudaGetLastError());

  cudaEventDestroy(e);
  cudaFree(d);
  for (cudaStream_t st : {s, other, independent}) cudaStreamDestroy(st);
}
