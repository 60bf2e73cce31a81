/// @file
/// Block formats' activations on CUDA, rounded as ref::round_activations rounds them (q8_0
/// blocks of 32 for q8_0 and int4, q8_k blocks of 256 for q4_k and q6_k) to 8-bit codes:
/// block_codes gives a warp's codes of one block; quantize_kernel writes them with each group's
/// scale and code sum (CodeRows), as int8 for the GEMV and bf16 for the tensor cores.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "qflash/kernels/common/cuda.cuh"
#include "qflash/kernels/common/stream_workspace.cuh"
#include "qflash/kernels/linear/block_codes.hpp"
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

/// Activations as codes, for rows of k values (k whole groups): codes [rows][k] (Code: int8 for
/// the GEMV's dp4a, bf16 for the tensor cores), and for group g of kGroup columns the scale
/// and scaled code sum of each row at g * stride.
template <class Code>
struct CodeRows {
  Code* codes;
  float* scales;
  float* sums;
  std::int64_t rows, k, stride;

  /// Bytes of rows x k codes and their groups' scales and sums.
  static std::size_t size(std::int64_t rows, std::int64_t k) {
    return static_cast<std::size_t>(rows * k) * sizeof(Code) +
           2 * static_cast<std::size_t>(rows * (k / kGroup)) * sizeof(float);
  }
  /// The arrays of `rows` rows in `bytes` (size(rows, k) of them, 16-byte aligned).
  static CodeRows in(void* bytes, std::int64_t rows, std::int64_t k) {
    auto* const codes = static_cast<Code*>(bytes);
    auto* const scales = reinterpret_cast<float*>(codes + rows * k);
    return {codes, scales, scales + rows * (k / kGroup), rows, k, rows};
  }
  /// Rows [row0, row0 + n) (row i of the slice is row row0 + i here).
  [[nodiscard]] CodeRows slice(std::int64_t row0, std::int64_t n) const {
    return {codes + row0 * k, scales + row0, sums + row0, n, k, stride};
  }
};

/// A code as Code: int8, or bf16 (exact).
template <class Code>
__device__ __forceinline__ Code code_as(int q) {
  if constexpr (sizeof(Code) == 1)
    return static_cast<Code>(q);
  else
    return static_cast<Code>(qflash::detail::bits_of(static_cast<float>(q)) >> 16);
}

/// One warp per activation block of x [a.rows, cols] (rows xs apart; a.k = padded_cols(cols)):
/// its codes (zeros past cols), and each of its groups' scale and scaled code sum.
template <class Arch, class Code>
__global__ void __launch_bounds__(32 * kRoundWarps) quantize_kernel(Rounding r, float const* x, std::int64_t xs,
                                                                    std::int64_t cols, CodeRows<Code> a) {
  static_assert(kLaneCodes * kGroup == gguf::kQ4KBlockSize && gguf::kQ8_0BlockSize == kGroup);
  int const bv = block_size(r), lane = static_cast<int>(threadIdx.x % 32);
  std::int64_t const blocks = (a.k + bv - 1) / bv;
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; i < a.rows * blocks;
       i += static_cast<std::int64_t>(gridDim.x) * kRoundWarps) {
    std::int64_t const t = i / blocks, b = (i % blocks) * bv;
    int q[kLaneCodes];
    float const d = block_codes(r, x + t * xs + b, static_cast<int>(std::min<std::int64_t>(bv, cols - b)), lane, q);
    auto const put = [&](int j) {  // value lane + 32 j is in group j of the block
      a.codes[t * a.k + b + lane + kGroup * j] = code_as<Code>(q[j]);
      int const sum = __reduce_add_sync(0xffffffffu, q[j]);
      if (lane == 0) {
        std::int64_t const at = (b / kGroup + j) * a.stride + t;
        a.scales[at] = d;
        a.sums[at] = d * static_cast<float>(sum);
      }
    };
    if (r == Rounding::kQ8_0) {
      put(0);
      continue;
    }
#pragma unroll
    for (int j = 0; j < kLaneCodes; ++j) put(j);
  }
}

/// x [a.rows, cols] (rows xs apart) as codes, rounded by r (not kNone).
template <class Arch, class Code>
Status quantize(Rounding r, float const* x, std::int64_t xs, std::int64_t cols, CodeRows<Code> const& a,
                cudaStream_t stream) {
  if (a.rows == 0) return Status::kSuccess;
  std::int64_t const work = a.rows * ((a.k + block_size(r) - 1) / block_size(r));
  auto const blocks = static_cast<unsigned>(std::min<std::int64_t>((work + kRoundWarps - 1) / kRoundWarps, 1 << 16));
  QFLASH_LAUNCH(blocks, 32 * kRoundWarps, 0, stream, quantize_kernel<Arch, Code>)(r, x, xs, cols, a);
  return cuda::last_launch_status();
}

/// CodeRows of rows x k in the stream's workspace, or kErrorCuda.
template <class Code>
Status workspace_codes(std::int64_t rows, std::int64_t k, cudaStream_t stream, CodeRows<Code>& a) {
  void* const ws = cuda::stream_workspace(stream, CodeRows<Code>::size(rows, k));
  if (!ws) return Status::kErrorCuda;
  a = CodeRows<Code>::in(ws, rows, k);
  return Status::kSuccess;
}

}  // namespace qflash::kernels::linear_cuda
