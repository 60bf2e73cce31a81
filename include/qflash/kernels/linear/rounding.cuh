/// @file
/// Block formats' activations on CUDA, rounded as ref::round_activations rounds them (q8_0
/// blocks of 32 for q8_0 and int4, q8_k blocks of 256 for q4_k and q6_k): block_codes gives a
/// warp's codes of one block, which round_kernel writes back as values (linear's GEMV path)
/// and mma_blocks.cuh as codes (its tensor-core path).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "qflash/kernels/common/cuda.cuh"
#include "qflash/numeric/fp16.hpp"
#include "qflash/numeric/gguf_blocks.hpp"
#include "qflash/numeric/weight_format.hpp"

namespace qflash::kernels::linear_cuda {

/// How a weight format's activations are rounded before its products (ref::round_activations).
enum class Rounding { kNone, kQ8_0, kQ8K };
__host__ __device__ constexpr Rounding rounding(WeightFormat f) {
  if (f == WeightFormat::kQ4K || f == WeightFormat::kQ6K) return Rounding::kQ8K;
  return f == WeightFormat::kQ8_0 || f == WeightFormat::kInt4 ? Rounding::kQ8_0 : Rounding::kNone;
}
/// Values of one activation block.
__host__ __device__ constexpr int block_size(Rounding r) {
  return r == Rounding::kQ8K ? gguf::kQ4KBlockSize : gguf::kQ8_0BlockSize;
}

/// A lane's codes of an activation block: q8_0 one (value lane), q8_k eight (values lane + 32 j).
inline constexpr int kLaneCodes = gguf::kQ4KBlockSize / 32;

/// The codes of a lane's values of the activation block at `in` (r != kNone; len values, the
/// rest zeros: q8_0's may be short), into q; returns the block's scale (value = scale * code).
/// q8_0: scale amax / 127 as fp16, codes of v 127 / amax rounded half to even; q8_k: the first
/// value of largest magnitude maps to -127 and sets the signed scale, codes clamp at 127.
__device__ __forceinline__ float block_codes(Rounding r, float const* in, int len, int lane, int (&q)[kLaneCodes]) {
  if (r == Rounding::kQ8_0) {
    float const v = lane < len ? in[lane] : 0.0f;
    float const amax = cuda::warp_max(fabsf(v));
    float const id = amax != 0.0f ? 127.0f / amax : 0.0f;
    q[0] = static_cast<std::int8_t>(qflash::detail::round_half_even(v * id));
    return to_float(to_fp16(amax / 127.0f));
  }
  float v[kLaneCodes];
  float amax = 0.0f, max = 0.0f;
  int first = INT_MAX;
#pragma unroll
  for (int j = 0; j < kLaneCodes; ++j) {
    v[j] = in[lane + 32 * j];
    float const a = fabsf(v[j]);
    if (a > amax) amax = a, max = v[j], first = lane + 32 * j;
  }
#pragma unroll
  for (int m = 16; m > 0; m /= 2) {
    float const oa = __shfl_xor_sync(0xffffffffu, amax, m);
    float const om = __shfl_xor_sync(0xffffffffu, max, m);
    int const of = __shfl_xor_sync(0xffffffffu, first, m);
    if (oa > amax || (oa == amax && of < first)) amax = oa, max = om, first = of;
  }
  float const iscale = amax != 0.0f ? -127.0f / max : 0.0f;
#pragma unroll
  for (int j = 0; j < kLaneCodes; ++j) {
    int const c = qflash::detail::round_half_even(iscale * v[j]);
    q[j] = static_cast<std::int8_t>(c < 127 ? c : 127);
  }
  return amax != 0.0f ? 1.0f / iscale : 0.0f;
}

inline constexpr int kRoundWarps = 8;

/// Activations rounded as ref::round_activations rounds them, from x [n_tokens, cols] (rows xs
/// apart) into xr (rows xrs apart): one warp per activation block (int4's short last q8_0
/// block padded with zeros).
template <class Arch>
__global__ void __launch_bounds__(32 * kRoundWarps) round_kernel(Rounding r, float const* x, std::int64_t xs,
                                                                 std::int64_t n_tokens, std::int64_t cols, float* xr,
                                                                 std::int64_t xrs) {
  int const bv = block_size(r);
  int const lane = static_cast<int>(threadIdx.x % 32);
  std::int64_t const blocks = (cols + bv - 1) / bv;
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; i < n_tokens * blocks;
       i += static_cast<std::int64_t>(gridDim.x) * kRoundWarps) {
    std::int64_t const t = i / blocks, b = (i % blocks) * bv;
    int const len = static_cast<int>(std::min<std::int64_t>(bv, cols - b));
    float* out = xr + t * xrs + b;
    int q[kLaneCodes];
    float const d = block_codes(r, x + t * xs + b, len, lane, q);
    if (r == Rounding::kQ8_0) {
      if (lane < len) out[lane] = static_cast<float>(q[0]) * d;
      continue;
    }
#pragma unroll
    for (int j = 0; j < kLaneCodes; ++j) out[lane + 32 * j] = d * static_cast<float>(q[j]);
  }
}

/// Launches round_kernel over n_tokens rows (r != kNone).
template <class Arch>
Status round_rows(Rounding r, float const* x, std::int64_t xs, std::int64_t n_tokens, std::int64_t cols, float* xr,
                  std::int64_t xrs, cudaStream_t stream) {
  if (n_tokens == 0) return Status::kSuccess;
  int const bv = block_size(r);
  std::int64_t const work = n_tokens * ((cols + bv - 1) / bv);
  auto const blocks = static_cast<unsigned>(std::min<std::int64_t>((work + kRoundWarps - 1) / kRoundWarps, 1 << 16));
  round_kernel<Arch><<<blocks, 32 * kRoundWarps, 0, stream>>>(r, x, xs, n_tokens, cols, xr, xrs);
  return cuda::last_launch_status();
}

}  // namespace qflash::kernels::linear_cuda
