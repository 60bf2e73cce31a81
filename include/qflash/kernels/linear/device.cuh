/// @file
/// Dense projection on CUDA, shared by sm80.cuh and sm90a.cuh. Over mma::kMinTokens tokens
/// or more, bf16 and fp8 weights take the tensor-core path (mma.cuh), and block formats theirs
/// (mma_blocks.cuh); the rest this plain GEMV/GEMM. A warp
/// owns kRows output rows and a tile of kTokens tokens, so each weight is read once per tile;
/// the lanes share each stretch of a row and the warp sums. Sums are fp32. Each lane keeps
/// several 16-byte weight loads in flight.
/// - Element formats (f32, bf16, f16, fp8 e4m3 with its 128x128 scales): 16 bytes per lane
///   step when rows and activations are aligned, else one value at a time.
/// - Block formats (q8_0, q4_k, q6_k, int4): the activations are first rounded to 8-bit codes
///   as the CPU rounds them (rounding.cuh: q8_0 blocks of 32, q8_k blocks of 256) into the
///   stream's workspace (common/stream_workspace.cuh), with each 32-column group's scale and
///   code sum; a lane then takes 16 columns at a time, reads their weight codes and spans
///   (block_codes.hpp) and sums the products of codes with dp4a, each span scaled.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "qflash/kernels/common/cuda.cuh"
#include "qflash/kernels/common/stream_workspace.cuh"
#include "qflash/kernels/linear/block_codes.hpp"
#include "qflash/kernels/linear/mma.cuh"
#include "qflash/kernels/linear/mma_blocks.cuh"
#include "qflash/kernels/linear/op.hpp"
#include "qflash/kernels/linear/rounding.cuh"

namespace qflash::kernels::linear_cuda {

inline constexpr int kWarps = 8;
inline constexpr int kThreads = 32 * kWarps;
inline constexpr int kTokens = 4;   ///< tokens per warp pass
inline constexpr int kRows = 2;     ///< output rows per warp in linear_kernel
inline constexpr unsigned kMaxTokenTiles = 65535;

/// Values of an element format in 16 bytes: one lane step of the aligned path.
template <WeightFormat kF>
inline constexpr int kLaneValues = 16 / static_cast<int>(row_bytes(kF, 1));
/// Lane steps whose loads are issued before their products.
template <WeightFormat kF>
inline constexpr int kSteps = kF == WeightFormat::kFp8E4m3 ? 2 : 4;
/// The activations of block formats: int8 codes (rounding.cuh).
using Codes8 = CodeRows<std::int8_t>;

struct Params {
  WeightView w;
  float const* x;  // [n_tokens, xs]
  float* y;
  std::int64_t n_tokens;
  std::int64_t xs;
  std::int64_t ys;
  bool accumulate;
};

/// Row `o` of a view, and its fp8 scales (null for the other formats).
struct RowRef {
  std::byte const* data;
  float const* scales;
};
template <WeightFormat kF>
__device__ __forceinline__ RowRef row_ref(WeightView const& w, std::int64_t o) {
  return {w.row(o), kF == WeightFormat::kFp8E4m3 ? w.scale_row(o) : nullptr};
}

/// Value i of an element-format row.
template <WeightFormat kF>
__device__ __forceinline__ float element(RowRef r, std::int64_t i) {
  if constexpr (kF == WeightFormat::kF32) return reinterpret_cast<float const*>(r.data)[i];
  if constexpr (kF == WeightFormat::kBf16) return to_float(Bf16{reinterpret_cast<std::uint16_t const*>(r.data)[i]});
  if constexpr (kF == WeightFormat::kF16) return to_float(Fp16{reinterpret_cast<std::uint16_t const*>(r.data)[i]});
  if constexpr (kF == WeightFormat::kFp8E4m3)
    return to_float(Fp8E4m3{reinterpret_cast<std::uint8_t const*>(r.data)[i]}) * r.scales[i / kFp8BlockSize];
  return 0.0f;
}

/// Two e4m3 codes (the first in the low byte) as floats, exactly. sm_89 and later convert
/// both in one instruction (cvt.rn.f16x2.e4m3x2, through CUDA's cuda_fp8.h; every e4m3
/// value is an f16 normal, and every f16 a float); sm_80 decodes each with integer and float
/// arithmetic (decode_e4m3_branchless). NaN codes give NaN (from sm_89 on, f16's canonical
/// NaN widened: another payload than the CPU's).
__device__ __forceinline__ float2 e4m3x2_to_float2(std::uint16_t codes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(codes, __NV_E4M3)));
#else
  return {to_float(Fp8E4m3{static_cast<std::uint8_t>(codes)}), to_float(Fp8E4m3{static_cast<std::uint8_t>(codes >> 8)})};
#endif
}

/// The kLaneValues<kF> values in 16 loaded bytes that start at value i (fp8: scaled; the
/// 128-column scale blocks hold whole lane steps).
template <WeightFormat kF>
__device__ __forceinline__ void unpack(uint4 v, RowRef r, std::int64_t i, float (&w)[kLaneValues<kF>]) {
  std::uint32_t const words[4] = {v.x, v.y, v.z, v.w};
  if constexpr (kF == WeightFormat::kF32) {
#pragma unroll
    for (int e = 0; e < 4; ++e) w[e] = __uint_as_float(words[e]);
  } else if constexpr (kF == WeightFormat::kBf16 || kF == WeightFormat::kF16) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      auto const bits = static_cast<std::uint16_t>(words[e / 2] >> (16 * (e % 2)));
      w[e] = kF == WeightFormat::kBf16 ? to_float(Bf16{bits}) : to_float(Fp16{bits});
    }
  } else {
    float const s = r.scales[i / kFp8BlockSize];
#pragma unroll
    for (int e = 0; e < 16; e += 2) {
      float2 const pair = e4m3x2_to_float2(static_cast<std::uint16_t>(words[e / 4] >> (8 * (e % 4))));
      w[e] = pair.x * s;
      w[e + 1] = pair.y * s;
    }
  }
}

/// Four consecutive activations from p (16-byte aligned) into v.
__device__ __forceinline__ void load4(float const* p, float* v) {
  float4 const a = *reinterpret_cast<float4 const*>(p);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
}

/// This lane's share of row[r] · x[tt] for the first nt of kTokens tokens, added to acc[r][tt];
/// the warp's sums of acc are the dot products. Element formats: kLaneValues columns per lane
/// step when kAligned (16-byte aligned rows and activations, cols a multiple of kLaneValues),
/// else one column. x[tt] for tt >= nt must still point at readable memory (a valid token's
/// row).
template <WeightFormat kF, bool kAligned, int kR>
__device__ __forceinline__ void lane_dot(RowRef const (&row)[kR], std::int64_t cols, float const* const (&x)[kTokens],
                                         int nt, int lane, float (&acc)[kR][kTokens]) {
  if constexpr (block_values(kF) == 1) {
    if constexpr (kAligned) {
      constexpr int kV = kLaneValues<kF>, kU = kSteps<kF>;
      constexpr std::int64_t kStride = 32 * kV;
      for (std::int64_t i0 = static_cast<std::int64_t>(lane) * kV; i0 < cols; i0 += kStride * kU) {
        uint4 raw[kR][kU];
#pragma unroll
        for (int u = 0; u < kU; ++u)
          if (i0 + u * kStride < cols)
#pragma unroll
            for (int r = 0; r < kR; ++r) raw[r][u] = __ldg(reinterpret_cast<uint4 const*>(row[r].data) + (i0 + u * kStride) / kV);
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          std::int64_t const i = i0 + u * kStride;
          if (i >= cols) break;
          float wv[kR][kV];
#pragma unroll
          for (int r = 0; r < kR; ++r) unpack<kF>(raw[r][u], row[r], i, wv[r]);
#pragma unroll
          for (int tt = 0; tt < kTokens; ++tt) {
            if (tt >= nt) break;
            float xv[kV];
#pragma unroll
            for (int e = 0; e < kV; e += 4) load4(x[tt] + i + e, xv + e);
#pragma unroll
            for (int r = 0; r < kR; ++r)
#pragma unroll
              for (int e = 0; e < kV; ++e) acc[r][tt] = fmaf(wv[r][e], xv[e], acc[r][tt]);
          }
        }
      }
    } else {
      for (std::int64_t i = lane; i < cols; i += 32) {
        float wv[kR];
#pragma unroll
        for (int r = 0; r < kR; ++r) wv[r] = element<kF>(row[r], i);
#pragma unroll
        for (int tt = 0; tt < kTokens; ++tt) {
          if (tt >= nt) break;
          float const xv = x[tt][i];
#pragma unroll
          for (int r = 0; r < kR; ++r) acc[r][tt] = fmaf(wv[r], xv, acc[r][tt]);
        }
      }
    }
  }
}

/// lane_dot for block format kF over the activations' codes `a`, rows token[tt]: the lane takes
/// 16 columns at a time, 512 apart (block_codes.hpp's add_sixteen). token[tt] for tt >= nt
/// must still be a row of a.
template <WeightFormat kF, int kR>
__device__ __forceinline__ void lane_dot_codes(RowRef const (&row)[kR], Codes8 const& a,
                                               std::int64_t const (&token)[kTokens], int nt, int lane,
                                               float (&acc)[kR][kTokens]) {
  using C = Codes<kF>;
#pragma unroll 2  // two steps' loads in flight
  for (std::int64_t c = static_cast<std::int64_t>(lane) * 16; c < a.k; c += 32 * 16) {
    std::int64_t const g = c / kGroup;
    std::uint32_t w[kR][4];
    Affine span[kR];
#pragma unroll
    for (int r = 0; r < kR; ++r) {
      words16<kF>(row[r].data, c, w[r]);
      span[r] = C::affine(row[r].data, c / C::kSpan * C::kSpan);
    }
#pragma unroll
    for (int tt = 0; tt < kTokens; ++tt) {
      if (tt >= nt) break;
      uint4 const q = *reinterpret_cast<uint4 const*>(a.codes + token[tt] * a.k + c);
      std::uint32_t const qa[4] = {q.x, q.y, q.z, q.w};
      std::int64_t const at = g * a.stride + token[tt];
      float const scale = a.scales[at], sum = a.sums[at];
#pragma unroll
      for (int r = 0; r < kR; ++r) acc[r][tt] = add_sixteen(acc[r][tt], w[r], qa, scale, sum, span[r], c);
    }
  }
}

__device__ __forceinline__ void store(Params const& p, std::int64_t t, std::int64_t o, float v) {
  float& out = p.y[t * p.ys + o];
  out = p.accumulate ? v + out : v;
}

/// Rows [o0, o0 + kRows) of p, o0 from the CTA's index among p's CTAs (`block`), for every
/// token tile of the CTA's column (blockIdx.y, strided): linear_kernel's body, and each part's
/// in linear_group_kernel. Block formats read `codes` (x as codes, a row per token).
template <WeightFormat kF, bool kAligned>
__device__ __forceinline__ void linear_rows(Params const& p, Codes8 const& codes, std::int64_t block) {
  int const lane = static_cast<int>(threadIdx.x % 32);
  std::int64_t const o0 = (block * kWarps + threadIdx.x / 32) * kRows;
  if (o0 >= p.w.rows) return;
  RowRef rows[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) rows[r] = row_ref<kF>(p.w, std::min<std::int64_t>(o0 + r, p.w.rows - 1));
  for (std::int64_t t0 = static_cast<std::int64_t>(blockIdx.y) * kTokens; t0 < p.n_tokens;
       t0 += static_cast<std::int64_t>(gridDim.y) * kTokens) {
    int const nt = static_cast<int>(std::min<std::int64_t>(kTokens, p.n_tokens - t0));
    float acc[kRows][kTokens] = {};
    if constexpr (reads_codes(kF)) {
      std::int64_t token[kTokens];
#pragma unroll
      for (int tt = 0; tt < kTokens; ++tt) token[tt] = t0 + (tt < nt ? tt : 0);
      lane_dot_codes<kF>(rows, codes, token, nt, lane, acc);
    } else {
      float const* x[kTokens];
#pragma unroll
      for (int tt = 0; tt < kTokens; ++tt) x[tt] = p.x + (t0 + (tt < nt ? tt : 0)) * p.xs;
      lane_dot<kF, kAligned>(rows, p.w.cols, x, nt, lane, acc);
    }
    cuda::warp_sums(acc);
    if (lane == 0)
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int tt = 0; tt < kTokens; ++tt)
          if (tt < nt && o0 + r < p.w.rows) store(p, t0 + tt, o0 + r, acc[r][tt]);
  }
}

/// Grid: x rows by kWarps * kRows, y token tiles (strided).
template <class Arch, WeightFormat kF, bool kAligned>
__global__ void __launch_bounds__(kThreads) linear_kernel(Params const p) {
  linear_rows<kF, kAligned>(p, Codes8{}, blockIdx.x);
}

/// linear_kernel for block formats, over x as codes.
template <class Arch, WeightFormat kF>
__global__ void __launch_bounds__(kThreads, 2) linear_codes_kernel(Params const p, Codes8 const codes) {
  linear_rows<kF, false>(p, codes, blockIdx.x);
}

/// Projections of one input in one launch (kernels/linear_group): parts of one format, sharing
/// x, xs and n_tokens; part i owns the CTAs from first_block[i] on.
struct GroupParams {
  static constexpr int kMaxParts = 4;
  Params part[kMaxParts];
  Codes8 codes;  ///< block formats: x as codes
  unsigned first_block[kMaxParts];
  int n_parts;
};

/// Grid: x every part's rows by kWarps * kRows, one part after another; y token tiles.
template <class Arch, WeightFormat kF, bool kAligned>
__global__ void __launch_bounds__(kThreads, 2) linear_group_kernel(__grid_constant__ GroupParams const g) {
  int i = 0;
  while (i + 1 < g.n_parts && blockIdx.x >= g.first_block[i + 1]) ++i;
  linear_rows<kF, kAligned>(g.part[i], g.codes, blockIdx.x - g.first_block[i]);
}

/// Whether linear of `w` over n_tokens takes a tensor-core path.
inline bool tensor_cores(WeightView const& w, std::int64_t n_tokens) {
  return mma::usable(w, n_tokens) || mma_blocks::usable(w, n_tokens);
}

inline bool aligned16(void const* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

/// Whether lane_dot's vector path may read w's rows with activations at x, rows xs apart.
inline bool vector_path(WeightView const& w, void const* x, std::int64_t xs) {
  return block_values(w.format) == 1 && w.cols * row_bytes(w.format, 1) % 16 == 0 && aligned16(w.data) &&
         w.row_bytes() % 16 == 0 && aligned16(x) && xs % 4 == 0;
}

template <class Arch, WeightFormat kF>
Status launch_format(Params p, cudaStream_t stream) {
  dim3 const grid(static_cast<unsigned>((p.w.rows + kWarps * kRows - 1) / (kWarps * kRows)),
                  static_cast<unsigned>(std::min<std::int64_t>((p.n_tokens + kTokens - 1) / kTokens, kMaxTokenTiles)));
  if constexpr (block_values(kF) == 1) {
    if constexpr (mma::weight_bytes(kF) > 0)
      if (mma::usable(p.w, p.n_tokens))
        return mma::launch<Arch, mma::weight_bytes(kF)>(p.w, p.x, p.xs, p.n_tokens, p.y, p.ys, p.accumulate, stream);
    if (vector_path(p.w, p.x, p.xs))
      QFLASH_LAUNCH(grid, kThreads, 0, stream, linear_kernel<Arch, kF, true>)(p);
    else
      QFLASH_LAUNCH(grid, kThreads, 0, stream, linear_kernel<Arch, kF, false>)(p);
    return cuda::last_launch_status();
  } else {
    if (mma_blocks::usable(p.w, p.n_tokens))
      return mma_blocks::launch<Arch, kF>(p.w, p.x, p.xs, p.n_tokens, p.y, p.ys, p.accumulate, stream);
    Codes8 codes{};
    if (Status s = workspace_codes(p.n_tokens, padded_cols(p.w.cols), stream, codes); s != Status::kSuccess) return s;
    if (Status s = quantize<Arch>(rounding(kF), p.x, p.xs, p.w.cols, codes, stream); s != Status::kSuccess) return s;
    QFLASH_LAUNCH(grid, kThreads, 0, stream, linear_codes_kernel<Arch, kF>)(p, codes);
    return cuda::last_launch_status();
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

/// The kernels' parameters for a call (strides defaulted).
inline Params params_of(LinearArgs const& a) {
  return {a.w, a.x, a.y, a.n_tokens, a.x_stride ? a.x_stride : a.w.cols, a.y_stride ? a.y_stride : a.w.rows,
          a.accumulate};
}

/// The body of `launch_linear<S>(Arch, args, stream)` for a CUDA arch tag.
template <class Arch, MoeSpec S>
Status launch(LinearArgs const& a, stream_t stream) {
  if (Status s = can_implement_linear<S>(a); s != Status::kSuccess) return s;
  if (!cuda::device_aligned(a.w)) return Status::kErrorMisalignedOperand;
  if (a.n_tokens == 0) return Status::kSuccess;
  Params const p = params_of(a);
  return with_format<S>(a.w.format,
                        [&]<WeightFormat kF>() { return launch_format<Arch, kF>(p, static_cast<cudaStream_t>(stream)); });
}

}  // namespace qflash::kernels::linear_cuda
