// The CUDA emulator's own semantics (tests/support/cuda_emulator), which the emulated GPU tests
// rest on: coordinates, __syncthreads, the shuffles and __reduce_add_sync, mma.sync against a
// plain product, cp.async landing only at its wait, the CUB collectives, launch refusals.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "qflash/kernels/common/cuda.cuh"
#include "qflash/kernels/linear/mma.cuh"
#include "qflash/numeric/bf16.hpp"

namespace {

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

__global__ void empty_kernel() {}

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

TEST_CASE("CUDA emulator: a cp.async copy lands at its wait, not before") {
  int* src = nullptr;
  int* out = nullptr;
  REQUIRE(cudaMalloc(&src, 4 * sizeof(int)) == cudaSuccess);
  REQUIRE(cudaMalloc(&out, 2 * sizeof(int)) == cudaSuccess);
  int const values[4] = {10, 11, 12, 13};
  REQUIRE(cudaMemcpy(src, values, sizeof values, cudaMemcpyHostToDevice) == cudaSuccess);
  QFLASH_LAUNCH(1, 1, 0, nullptr, copy_kernel)(src, out);
  auto const got = run_and_read(out, 2);
  CHECK(got[0] == 0);
  CHECK(got[1] == 11);
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
