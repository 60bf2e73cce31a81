/// @file
/// Dense projection on CUDA, shared by sm80.cuh and sm90a.cuh: the first, plain path of
/// issue 12's per-format GEMV/GEMM (no tensor cores yet). A warp owns one output row and a
/// tile of kTokens tokens, so each weight is read once per tile; lanes stride along the row
/// and the warp sums. Sums are fp32.
/// - Element formats (f32, bf16, f16, fp8 e4m3 with its 128x128 scales): 8 values per lane
///   step with 16-byte loads when rows and activations are aligned, else one at a time.
/// - Block formats (q8_0, q4_k, q6_k, int4): the activations are first rounded as the CPU
///   rounds them (ref::round_activations: q8_0 blocks of 32, q8_k blocks of 256) into a
///   workspace from the stream's pool allocator; each lane then decodes whole weight blocks
///   with the format's host-device dequantizer and multiplies them by the rounded activations,
///   which is the reference's definition. Decoding in registers (the idea of Marlin) and
///   integer dot products are the next step.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "qflash/kernels/common/cuda.cuh"
#include "qflash/kernels/linear/op.hpp"

namespace qflash::kernels::linear_cuda {

inline constexpr int kWarps = 8;
inline constexpr int kThreads = 32 * kWarps;
inline constexpr int kTokens = 4;  ///< tokens per warp pass
inline constexpr int kVec = 8;     ///< values per lane step on the aligned path
inline constexpr unsigned kMaxTokenTiles = 65535;

struct Params {
  WeightView w;
  float const* x;  // [n_tokens, xs]: the inputs, or the rounded activations [n_tokens, cols]
  float* y;
  std::int64_t n_tokens;
  std::int64_t xs;
  std::int64_t ys;
  bool accumulate;
};

/// Value i of an element-format row.
template <WeightFormat kF>
__device__ __forceinline__ float element(std::byte const* row, float const* scales, std::int64_t i) {
  if constexpr (kF == WeightFormat::kF32) return reinterpret_cast<float const*>(row)[i];
  if constexpr (kF == WeightFormat::kBf16) return to_float(Bf16{reinterpret_cast<std::uint16_t const*>(row)[i]});
  if constexpr (kF == WeightFormat::kF16) return to_float(Fp16{reinterpret_cast<std::uint16_t const*>(row)[i]});
  if constexpr (kF == WeightFormat::kFp8E4m3)
    return to_float(Fp8E4m3{reinterpret_cast<std::uint8_t const*>(row)[i]}) * scales[i / kFp8BlockSize];
  return 0.0f;
}

/// Values [i, i + kVec) of an element-format row whose start is 16-byte aligned.
template <WeightFormat kF>
__device__ __forceinline__ void elements8(std::byte const* row, float const* scales, std::int64_t i, float (&w)[kVec]) {
  if constexpr (kF == WeightFormat::kF32) {
    float4 const a = reinterpret_cast<float4 const*>(row)[i / 4];
    float4 const b = reinterpret_cast<float4 const*>(row)[i / 4 + 1];
    w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w, w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
  } else if constexpr (kF == WeightFormat::kBf16 || kF == WeightFormat::kF16) {
    uint4 const v = reinterpret_cast<uint4 const*>(row)[i / 8];
    std::uint32_t const words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      auto const bits = static_cast<std::uint16_t>(words[e / 2] >> (16 * (e % 2)));
      w[e] = kF == WeightFormat::kBf16 ? to_float(Bf16{bits}) : to_float(Fp16{bits});
    }
  } else {  // fp8: 8 codes in 8 bytes, one scale (kVec divides the 128-column scale blocks)
    uint2 const v = reinterpret_cast<uint2 const*>(row)[i / 8];
    float const s = scales[i / kFp8BlockSize];
#pragma unroll
    for (int e = 0; e < kVec; ++e)
      w[e] = to_float(Fp8E4m3{static_cast<std::uint8_t>((e < 4 ? v.x : v.y) >> (8 * (e % 4)))}) * s;
  }
}

__device__ __forceinline__ void store(Params const& p, std::int64_t t, std::int64_t o, float v) {
  float& out = p.y[t * p.ys + o];
  out = p.accumulate ? v + out : v;
}

/// This lane's share of W[o] · x[tt] for the first nt of kTokens tokens, added to acc[tt]; the
/// warp's sum of acc is the dot product. Element formats: kVec columns per lane step when
/// kAligned (16-byte aligned rows and activations, cols a multiple of kVec), else one column;
/// block formats: whole blocks per lane, over activations already rounded (round_kernel).
/// x[tt] for tt >= nt must still point at readable memory (a valid token's row).
template <WeightFormat kF, bool kAligned>
__device__ __forceinline__ void lane_dot(WeightView const& w, std::int64_t o, float const* const (&x)[kTokens], int nt,
                                         int lane, float (&acc)[kTokens]) {
  std::int64_t const cols = w.cols;
  std::byte const* row = w.row(o);
  if constexpr (block_values(kF) == 1) {
    float const* scales = kF == WeightFormat::kFp8E4m3 ? w.scale_row(o) : nullptr;
    if constexpr (kAligned) {
      for (std::int64_t i = static_cast<std::int64_t>(lane) * kVec; i < cols; i += 32 * kVec) {
        float wv[kVec];
        elements8<kF>(row, scales, i, wv);
#pragma unroll
        for (int tt = 0; tt < kTokens; ++tt) {
          if (tt >= nt) break;
          float4 const a = reinterpret_cast<float4 const*>(x[tt] + i)[0], b = reinterpret_cast<float4 const*>(x[tt] + i)[1];
          float const xv[kVec] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[tt] = fmaf(wv[e], xv[e], acc[tt]);
        }
      }
    } else {
      for (std::int64_t i = lane; i < cols; i += 32) {
        float const wv = element<kF>(row, scales, i);
#pragma unroll
        for (int tt = 0; tt < kTokens; ++tt)
          if (tt < nt) acc[tt] = fmaf(wv, x[tt][i], acc[tt]);
      }
    }
  } else {
    constexpr int kBV = block_values(kF);
    std::int64_t const n_blocks = (cols + kBV - 1) / kBV;
    for (std::int64_t b = lane; b < n_blocks; b += 32) {
      int const n = static_cast<int>(std::min<std::int64_t>(kBV, cols - b * kBV));
      float wv[kBV];
      if constexpr (kF == WeightFormat::kQ8_0)
        gguf::dequantize_row_q8_0(reinterpret_cast<gguf::BlockQ8_0 const*>(row) + b, static_cast<std::size_t>(n), wv);
      else if constexpr (kF == WeightFormat::kQ4K)
        gguf::dequantize_row_q4_k(reinterpret_cast<gguf::BlockQ4K const*>(row) + b, static_cast<std::size_t>(n), wv);
      else if constexpr (kF == WeightFormat::kQ6K)
        gguf::dequantize_row_q6_k(reinterpret_cast<gguf::BlockQ6K const*>(row) + b, static_cast<std::size_t>(n), wv);
      else
        dequantize_row_int4_g128(reinterpret_cast<BlockInt4G128 const*>(row) + b, static_cast<std::size_t>(n), wv);
      for (int tt = 0; tt < kTokens; ++tt) {
        if (tt >= nt) break;
        float const* xb = x[tt] + b * kBV;
        for (int e = 0; e < n; ++e) acc[tt] = fmaf(wv[e], xb[e], acc[tt]);
      }
    }
  }
}

/// Grid: x rows by kWarps, y token tiles (strided). Block formats read p.x rounded.
template <class Arch, WeightFormat kF, bool kAligned>
__global__ void __launch_bounds__(kThreads) linear_kernel(Params const p) {
  int const lane = static_cast<int>(threadIdx.x % 32);
  std::int64_t const o = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (o >= p.w.rows) return;
  for (std::int64_t t0 = static_cast<std::int64_t>(blockIdx.y) * kTokens; t0 < p.n_tokens;
       t0 += static_cast<std::int64_t>(gridDim.y) * kTokens) {
    int const nt = static_cast<int>(std::min<std::int64_t>(kTokens, p.n_tokens - t0));
    float const* x[kTokens];
#pragma unroll
    for (int tt = 0; tt < kTokens; ++tt) x[tt] = p.x + (t0 + (tt < nt ? tt : 0)) * p.xs;
    float acc[kTokens] = {};
    lane_dot<kF, kAligned>(p.w, o, x, nt, lane, acc);
#pragma unroll
    for (int tt = 0; tt < kTokens; ++tt) {
      float const s = cuda::warp_sum(acc[tt]);
      if (lane == 0 && tt < nt) store(p, t0 + tt, o, s);
    }
  }
}

/// How a weight format's activations are rounded before its products (ref::round_activations).
enum class Rounding { kNone, kQ8_0, kQ8K };
__host__ __device__ constexpr Rounding rounding(WeightFormat f) {
  if (f == WeightFormat::kQ4K || f == WeightFormat::kQ6K) return Rounding::kQ8K;
  return f == WeightFormat::kQ8_0 || f == WeightFormat::kInt4 ? Rounding::kQ8_0 : Rounding::kNone;
}

/// Activations rounded as ref::round_activations rounds them, from x [n_tokens, cols] (rows xs
/// apart) into xr (rows xrs apart): one warp per activation block. q8_0 blocks of 32 (a lane
/// per value; int4's short last block padded with zeros), q8_k blocks of 256 (8 values per
/// lane; the first value of largest magnitude sets the signed scale).
template <class Arch>
__global__ void __launch_bounds__(kThreads) round_kernel(Rounding r, float const* x, std::int64_t xs, std::int64_t n_tokens,
                                                         std::int64_t cols, float* xr, std::int64_t xrs) {
  bool const q8_k = r == Rounding::kQ8K;
  int const bv = q8_k ? gguf::kQ4KBlockSize : gguf::kQ8_0BlockSize;
  int const lane = static_cast<int>(threadIdx.x % 32);
  std::int64_t const blocks = (cols + bv - 1) / bv;
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32; i < n_tokens * blocks;
       i += static_cast<std::int64_t>(gridDim.x) * kWarps) {
    std::int64_t const t = i / blocks, b = (i % blocks) * bv;
    float const* in = x + t * xs + b;
    float* out = xr + t * xrs + b;
    if (!q8_k) {
      int const len = static_cast<int>(std::min<std::int64_t>(bv, cols - b));
      float const v = lane < len ? in[lane] : 0.0f;
      float const amax = cuda::warp_max(fabsf(v));
      float const d = to_float(to_fp16(amax / 127.0f));
      float const id = amax != 0.0f ? 127.0f / amax : 0.0f;
      auto const q = static_cast<std::int8_t>(qflash::detail::round_half_even(v * id));
      if (lane < len) out[lane] = static_cast<float>(q) * d;
      continue;
    }
  constexpr int kPer = gguf::kQ4KBlockSize / 32;
    float v[kPer];
    float amax = 0.0f, max = 0.0f;
    int first = INT_MAX;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
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
    float const d = amax != 0.0f ? 1.0f / iscale : 0.0f;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      int const q = qflash::detail::round_half_even(iscale * v[j]);
      out[lane + 32 * j] = d * static_cast<float>(static_cast<std::int8_t>(q < 127 ? q : 127));
    }
  }
}

/// Launches round_kernel over n_tokens rows (r != kNone).
template <class Arch>
Status round_rows(Rounding r, float const* x, std::int64_t xs, std::int64_t n_tokens, std::int64_t cols, float* xr,
                  std::int64_t xrs, cudaStream_t stream) {
  if (n_tokens == 0) return Status::kSuccess;
  int const bv = r == Rounding::kQ8K ? gguf::kQ4KBlockSize : gguf::kQ8_0BlockSize;
  std::int64_t const work = n_tokens * ((cols + bv - 1) / bv);
  auto const blocks = static_cast<unsigned>(std::min<std::int64_t>((work + kWarps - 1) / kWarps, 1 << 16));
  round_kernel<Arch><<<blocks, kThreads, 0, stream>>>(r, x, xs, n_tokens, cols, xr, xrs);
  return cuda::last_launch_status();
}

inline bool aligned16(void const* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

/// Whether lane_dot's vector path may read w's rows with activations at x, rows xs apart.
inline bool vector_path(WeightView const& w, void const* x, std::int64_t xs) {
  return block_values(w.format) == 1 && w.cols % kVec == 0 && aligned16(w.data) && w.row_bytes() % 16 == 0 &&
         aligned16(x) && xs % 4 == 0;
}

template <class Arch, WeightFormat kF>
Status launch_format(Params p, cudaStream_t stream) {
  dim3 const grid(static_cast<unsigned>((p.w.rows + kWarps - 1) / kWarps),
                  static_cast<unsigned>(std::min<std::int64_t>((p.n_tokens + kTokens - 1) / kTokens, kMaxTokenTiles)));
  if constexpr (block_values(kF) == 1) {
    if (vector_path(p.w, p.x, p.xs))
      linear_kernel<Arch, kF, true><<<grid, kThreads, 0, stream>>>(p);
    else
      linear_kernel<Arch, kF, false><<<grid, kThreads, 0, stream>>>(p);
    return cuda::last_launch_status();
  } else {
    std::int64_t const cols = p.w.cols;
    void* rounded = nullptr;
    if (cudaMallocAsync(&rounded, static_cast<std::size_t>(p.n_tokens * cols) * sizeof(float), stream) != cudaSuccess)
      return Status::kErrorCuda;
    Status status = round_rows<Arch>(rounding(kF), p.x, p.xs, p.n_tokens, cols, static_cast<float*>(rounded), cols, stream);
    if (status == Status::kSuccess) {
      p.x = static_cast<float const*>(rounded);
      p.xs = cols;
      linear_kernel<Arch, kF, false><<<grid, kThreads, 0, stream>>>(p);
      status = cuda::last_launch_status();
    }
    if (cudaFreeAsync(rounded, stream) != cudaSuccess) status = Status::kErrorCuda;
    return status;
  }
}

/// f.template operator()<kF>() for format f when spec S compiles it; else kErrorNotSupported.
template <MoeSpec S, class F>
Status with_format(WeightFormat format, F&& f) {
  auto run = [&]<WeightFormat kF>() -> Status {
    if constexpr (S.weights == WeightFormat::kAny || S.weights == kF)
      return f.template operator()<kF>();
    else
      return Status::kErrorNotSupported;
  };
  switch (format) {
    case WeightFormat::kF32: return run.template operator()<WeightFormat::kF32>();
    case WeightFormat::kBf16: return run.template operator()<WeightFormat::kBf16>();
    case WeightFormat::kF16: return run.template operator()<WeightFormat::kF16>();
    case WeightFormat::kFp8E4m3: return run.template operator()<WeightFormat::kFp8E4m3>();
    case WeightFormat::kQ8_0: return run.template operator()<WeightFormat::kQ8_0>();
    case WeightFormat::kQ4K: return run.template operator()<WeightFormat::kQ4K>();
    case WeightFormat::kQ6K: return run.template operator()<WeightFormat::kQ6K>();
    case WeightFormat::kInt4: return run.template operator()<WeightFormat::kInt4>();
    case WeightFormat::kAny: break;
  }
  return Status::kErrorNotSupported;
}

/// The body of `launch_linear<S>(Arch, args, stream)` for a CUDA arch tag.
template <class Arch, MoeSpec S>
Status launch(LinearArgs const& a, stream_t stream) {
  if (Status s = can_implement_linear<S>(a); s != Status::kSuccess) return s;
  if (a.n_tokens == 0) return Status::kSuccess;
  Params const p{a.w, a.x, a.y, a.n_tokens, a.x_stride ? a.x_stride : a.w.cols, a.y_stride ? a.y_stride : a.w.rows,
                 a.accumulate};
  return with_format<S>(a.w.format,
                        [&]<WeightFormat kF>() { return launch_format<Arch, kF>(p, static_cast<cudaStream_t>(stream)); });
}

}  // namespace qflash::kernels::linear_cuda
