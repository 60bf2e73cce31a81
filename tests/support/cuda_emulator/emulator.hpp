// The CUDA emulator: qflash's kernels (device.cuh, compiled as C++) run on the CPU, every CUDA
// thread a fiber, so that CI runs the GPU tests' code paths without a GPU. Force-included
// (-include) before any other header of an emulated TU; emulator.cpp holds the scheduler and
// the CUDA runtime calls qflash makes.
//
// What it models:
// - a block's threads run as fibers switched only at __syncthreads, __syncwarp and warp
//   collectives (shuffles, mma.sync), so every sync point's arrivals are checked (a thread
//   missing from a barrier or a warp collective is reported as a deadlock, not hung on);
// - blocks run one after another; the threads released together, and the blocks, run in a
//   seeded shuffled order (set_schedule), so that a thread that reads what another writes
//   with no sync point between them often reads it stale, and a test fails;
// - cp.async copies land at their cp.async.wait_group or, at random, at their commit: both a
//   read before the wait and a refill of a stage that others still read show;
// - shared memory holds 0xff bytes at each block's start (static shared memory: the variables
//   of the kernel itself, which emulator.cpp finds in the executable's symbol table), and device
//   allocations at theirs (a read before a write shows as NaN); a kernel's access past an
//   allocation's size rounded up to 256 bytes faults in a guard page and is reported with the
//   thread's coordinates (a CUDA thread's stack overflow too), and a write into the bytes
//   beside it that a guard page does not cover is found when it is freed;
// - mma.sync places fragments as tests/support/mma_emulator.hpp (the PTX ISA's tables);
// - streams run their work at once, or record it while captured: what stream capture forbids
//   (the legacy stream while a blocking stream is captured, a synchronization of what is
//   captured) fails and breaks the capture as on a GPU, and a graph update takes only nodes
//   of the same types.
// What it does not: timing, the memory model (no reordering of loads and stores, no two
// blocks at once: races show only through the schedule), the arch-specific paths behind
// __CUDA_ARCH__ (the host fallbacks run), or whether the PTX itself is right.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#define QFLASH_CUDA_EMULATOR 1

// Static shared memory is function-local statics (blocks run one at a time).
#undef __shared__
#define __shared__ static
#define __launch_bounds__(...)

namespace qflash::emulator {

/// The running CUDA thread's coordinates.
struct Coordinates {
  uint3 thread_idx{};
  uint3 block_idx{};
  dim3 block_dim{};
  dim3 grid_dim{};
};
Coordinates const& self();

void sync_block();
void sync_warp(unsigned mask);
void* dynamic_shared();

/// Runs body as every thread of every block (or records it, on a stream being captured); sm: the
/// arch the kernel was compiled for (80 or 90, for sm_90a).
void launch(dim3 grid, dim3 block, std::size_t dynamic_smem, cudaStream_t stream, int sm, void const* kernel,
            std::function<void()> body);
/// The order in which threads released together (a block's start, a barrier, a warp
/// collective) and a launch's blocks run: "shuffled" (the default: a random order each time,
/// from seed 0, and each group of cp.async copies lands at its commit or its wait at random),
/// "shuffled:SEED", "in-order" or "reversed" (copies land at their wait). The environment
/// variable QFLASH_EMULATOR_SCHEDULE sets it for a process. A shuffled order depends on the
/// launches before it in the process: a test run alone may not see a failure's order again.
void set_schedule(char const* spec);
/// The schedule in use, in set_schedule's form ("shuffled:0" for the default).
std::string current_schedule();
/// cudaFuncSetAttribute's dynamic shared memory limit for a kernel.
void set_smem_limit(void const* kernel, int bytes);

/// One kernel launch's configuration; called with the kernel's arguments, it runs the kernel.
template <class... P>
struct Launch {
  dim3 grid, block;
  std::size_t smem;
  cudaStream_t stream;
  int sm;
  void (*kernel)(P...);
  template <class... A>
  void operator()(A&&... args) const {
    launch(grid, block, smem, stream, sm, reinterpret_cast<void const*>(kernel),
           [k = kernel, params = std::tuple<P...>(std::forward<A>(args)...)] { std::apply(k, params); });
  }
};
template <class... P>
Launch<P...> launcher(dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream, int sm, void (*kernel)(P...)) {
  return {grid, block, smem, stream, sm, kernel};
}

void async_copy(void* dst, void const* src, int bytes, int src_bytes);
void async_commit();
void async_wait(int pending);

void mma_bf16(float (&c)[4], std::uint32_t const (&a)[4], std::uint32_t const (&b)[2]);
void mma_tf32(float (&c)[4], float const (&a)[4], float const (&b)[2]);

enum ShuffleKind { kShuffleIndex, kShuffleXor, kShuffleUp, kShuffleDown };
/// __shfl_*_sync of `bytes` (up to 48) at v: the source lane's bytes, valid until this lane's
/// next warp collective.
void const* shuffle(unsigned mask, void const* v, std::size_t bytes, ShuffleKind kind, int arg, int width);
template <class T>
T shuffle(unsigned mask, T const& v, ShuffleKind kind, int arg, int width) {
  static_assert(sizeof(T) <= 48 && std::is_trivially_copyable_v<T>);
  T out;
  std::memcpy(&out, shuffle(mask, &v, sizeof(T), kind, arg, width), sizeof(T));
  return out;
}
/// __reduce_add_sync: the 32-bit sum over the lanes in mask, to each of them.
std::uint32_t reduce_add(unsigned mask, std::uint32_t v);

/// A whole warp's xor butterfly (kernels/common/cuda.cuh's warp_sum, warp_max, warp_min) as one
/// collective instead of five shuffles: each lane's result is what the five steps
/// `v = op(v, __shfl_xor_sync(~0u, v, m))` for m = 16, 8, 4, 2, 1 give it, bit for bit.
enum ButterflyOp { kButterflySum, kButterflyMax, kButterflyMin };
float warp_butterfly(float v, ButterflyOp op);
inline constexpr int kMaxButterflyValues = 16;
/// The butterfly of each of n values (kernels/common/cuda.cuh's warp_sums), in place, as one
/// collective of the whole warp; every lane brings the same n, 1 to kMaxButterflyValues.
void warp_butterfly(float* v, int n, ButterflyOp op);

}  // namespace qflash::emulator

#define threadIdx (::qflash::emulator::self().thread_idx)
#define blockIdx (::qflash::emulator::self().block_idx)
#define blockDim (::qflash::emulator::self().block_dim)
#define gridDim (::qflash::emulator::self().grid_dim)

// The arch a TU's kernels are compiled for: the emulated instance TUs set it (80, or 90 for sm_90a).
#ifndef QFLASH_CUDA_EMULATOR_SM
#define QFLASH_CUDA_EMULATOR_SM 80
#endif
#define QFLASH_LAUNCH(grid, block, smem, stream, ...) \
  ::qflash::emulator::launcher(grid, block, smem, stream, QFLASH_CUDA_EMULATOR_SM, __VA_ARGS__)
#define QFLASH_DYNAMIC_SMEM(T, name) T* const name = static_cast<T*>(::qflash::emulator::dynamic_shared())

inline void __syncthreads() { ::qflash::emulator::sync_block(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::qflash::emulator::sync_warp(mask); }
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  using namespace ::qflash::emulator;
  return shuffle(mask, v, kShuffleXor, lane_mask, width);
}
template <class T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  using namespace ::qflash::emulator;
  return shuffle(mask, v, kShuffleIndex, src_lane, width);
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  using namespace ::qflash::emulator;
  return shuffle(mask, v, kShuffleDown, static_cast<int>(delta), width);
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  using namespace ::qflash::emulator;
  return shuffle(mask, v, kShuffleUp, static_cast<int>(delta), width);
}
template <class T>
T __reduce_add_sync(unsigned mask, T v) {
  static_assert(sizeof(T) == 4 && std::is_integral_v<T>);
  return static_cast<T>(::qflash::emulator::reduce_add(mask, static_cast<std::uint32_t>(v)));
}

// One host thread runs every fiber, and switches only at sync points: plain read-modify-writes
// are atomic here; fences have nothing to order.
template <class T>
T atomicAdd(T* p, T v) {
  T const old = *p;
  *p = old + v;
  return old;
}
template <class T>
T atomicMax(T* p, T v) {
  T const old = *p;
  *p = std::max(old, v);
  return old;
}
template <class T>
T atomicExch(T* p, T v) {
  T const old = *p;
  *p = v;
  return old;
}
inline void __threadfence() {}
inline void __threadfence_block() {}

template <class T>
T __ldg(T const* p) {
  return *p;
}
template <class T>
T __ldcg(T const* p) {
  return *p;
}
template <class T>
T __ldca(T const* p) {
  return *p;
}
template <class T>
T __ldcs(T const* p) {
  return *p;
}
template <class T>
void __stcg(T* p, T v) {
  *p = v;
}
template <class T>
void __stcs(T* p, T v) {
  *p = v;
}

inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }
inline float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return std::fmin(std::fmax(x, 0.0f), 1.0f); }
inline int __popc(unsigned x) { return std::popcount(x); }
inline int __clz(unsigned x) { return std::countl_zero(x); }
inline int __ffs(unsigned x) { return x ? std::countr_zero(x) + 1 : 0; }
/// Four signed 8-bit products summed into c.
inline int __dp4a(int a, int b, int c) {
  for (int i = 0; i < 4; ++i)
    c += static_cast<std::int8_t>(static_cast<unsigned>(a) >> (8 * i)) *
         static_cast<std::int8_t>(static_cast<unsigned>(b) >> (8 * i));
  return c;
}
inline unsigned __cvta_generic_to_shared(void const* p) {
  return static_cast<unsigned>(reinterpret_cast<std::uintptr_t>(p));
}
// What device code finds in the global namespace.
using std::isfinite;
using std::isinf;
using std::isnan;
using std::max;
using std::min;

template <class... P>
cudaError_t cudaFuncSetAttribute(void (*kernel)(P...), cudaFuncAttribute attr, int value) {
  return cudaFuncSetAttribute(reinterpret_cast<void const*>(kernel), attr, value);
}

#include "cuda_emulator/cub.hpp"
