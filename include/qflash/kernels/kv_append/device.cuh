/// @file
/// KV quantize-append on CUDA: the kernel and launcher body shared by sm80.cuh and sm90a.cuh,
/// and `DeviceKv`, the device side of a KvView that kernels/attention reads too.
///
/// On CUDA a KvView's `base` and `block_table` are device memory and its `heads` host memory:
/// the launcher checks the head layouts on the host and passes them to the kernel by value.
///
/// One warp encodes one (token, head, K|V) vector. The encoding is numeric/kv_format.hpp's:
/// maxima and minima are reduced across the warp (order-free), and every scale, min and code
/// comes from the same host-device functions with IEEE division, so the GPU writes the bytes
/// the CPU writes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "qflash/kernels/common/cuda.cuh"
#include "qflash/kernels/kv_append/op.hpp"
#include "qflash/kv/map.hpp"

namespace qflash::kernels::kv_cuda {

/// KV heads a launch takes by value (kernel parameters).
inline constexpr int kMaxKvHeads = 32;

/// A KvView with its head layouts copied in: what a kernel reads.
struct DeviceKv {
  std::uint8_t* base;
  std::int64_t block_bytes;
  std::int32_t const* block_table;
  int block_tokens;
  int n_head_kv;
  int d_head;
  kv::KvHeadLayout heads[kMaxKvHeads];

  /// Position `pos` of the sequence whose block table is `table` (the arena's layout, another
  /// sequence's blocks).
  __device__ __forceinline__ std::uint8_t* block(std::int32_t const* table, std::int64_t pos) const {
    return base + static_cast<std::int64_t>(table[pos / block_tokens]) * block_bytes;
  }
  __device__ __forceinline__ std::uint8_t* key(std::int32_t const* table, std::int64_t pos, int h) const {
    return block(table, pos) + heads[h].k_offset + (pos % block_tokens) * heads[h].k_bytes;
  }
  __device__ __forceinline__ std::uint8_t* value(std::int32_t const* table, std::int64_t pos, int h) const {
    return block(table, pos) + heads[h].v_offset + (pos % block_tokens) * heads[h].v_bytes;
  }
  __device__ __forceinline__ std::uint8_t* key(std::int64_t pos, int h) const { return key(block_table, pos, h); }
  __device__ __forceinline__ std::uint8_t* value(std::int64_t pos, int h) const { return value(block_table, pos, h); }
};

/// kErrorNotSupported when the view has more heads than a launch takes.
inline Status to_device(kv::KvView const& v, DeviceKv& out) {
  if (v.n_head_kv > kMaxKvHeads) return Status::kErrorNotSupported;
  out.base = v.base;
  out.block_bytes = v.block_bytes;
  out.block_table = v.block_table;
  out.block_tokens = v.block_tokens;
  out.n_head_kv = v.n_head_kv;
  out.d_head = v.d_head;
  for (int h = 0; h < v.n_head_kv; ++h) out.heads[h] = v.heads[h];
  return Status::kSuccess;
}

/// kv_encode(f, x, d, out) by the 32 lanes of a warp.
__device__ __forceinline__ void encode_warp(KvFormat f, float const* x, int d, std::uint8_t* out, int lane) {
  switch (f) {
    case KvFormat::kF32:
      for (int i = lane; i < d; i += 32) detail::put_f32(out + 4 * i, x[i]);
      return;
    case KvFormat::kBf16:
      for (int i = lane; i < d; i += 32) detail::put_u16(out + 2 * i, to_bf16(x[i]).bits);
      return;
    case KvFormat::kFp8E4m3: {
      float amax = 0.0f;
      for (int i = lane; i < d; i += 32) amax = fmaxf(amax, fabsf(x[i]));
      float const scale = cuda::warp_max(amax) / kFp8E4m3Max;
      if (lane == 0) detail::put_f32(out, scale);
      for (int i = lane; i < d; i += 32) out[4 + i] = scale > 0.0f ? to_fp8_e4m3(x[i] / scale).bits : 0;
      return;
    }
    case KvFormat::kInt8:
    case KvFormat::kInt6: {
      int const levels = f == KvFormat::kInt8 ? 255 : kInt6Max;
      for (int g = 0; g * kKvGroup < d; ++g) {
        int const n = min(d - g * kKvGroup, kKvGroup);
        float const* xg = x + g * kKvGroup;
        float lo = INFINITY, hi = -INFINITY;
        for (int i = lane; i < n; i += 32) {
          lo = fminf(lo, xg[i]);
          hi = fmaxf(hi, xg[i]);
        }
        Int6Params const p = detail::kv_range_params(cuda::warp_min(lo), cuda::warp_max(hi), levels);
        if (lane == 0) {
          detail::put_u16(out + 4 * g, to_fp16(p.scale).bits);
          detail::put_u16(out + 4 * g + 2, to_fp16(p.min).bits);
        }
        std::uint8_t* codes = out + kv_group_codes_offset(f, d, g);
        if (f == KvFormat::kInt8) {
          for (int i = lane; i < n; i += 32) codes[i] = asym_quantize(xg[i], p, levels);
        } else {
          for (int i0 = lane * kInt6PerGroup; i0 < n; i0 += 32 * kInt6PerGroup) {
            std::uint8_t q[kInt6PerGroup] = {0, 0, 0, 0};
            for (int k = 0; k < kInt6PerGroup && i0 + k < n; ++k) q[k] = asym_quantize(xg[i0 + k], p, levels);
            int6_pack(q, kInt6PerGroup, codes + i0 / kInt6PerGroup * kInt6GroupBytes);
          }
        }
      }
      return;
    }
  }
}

inline constexpr int kAppendThreads = 128;

/// Warp w encodes vector w: token w / (2 n_head_kv), head (w / 2) % n_head_kv, K when w is even.
template <class Arch, KvScheme kScheme>
__global__ void __launch_bounds__(kAppendThreads)
    kv_append_kernel(DeviceKv const kv, float const* k, float const* v, std::int64_t n_tokens, std::int64_t start) {
  std::int64_t const w = (static_cast<std::int64_t>(blockIdx.x) * kAppendThreads + threadIdx.x) / 32;
  int const lane = static_cast<int>(threadIdx.x % 32);
  if (w >= n_tokens * kv.n_head_kv * 2) return;
  std::int64_t const item = w / 2;  // token * n_head_kv + head
  std::int64_t const t = item / kv.n_head_kv;
  int const h = static_cast<int>(item % kv.n_head_kv);
  int const d = kv.d_head;
  if (w % 2 == 0)
    encode_warp(kv::compiled_format(kScheme, kv.heads[h].k_format), k + item * d, d, kv.key(start + t, h), lane);
  else
    encode_warp(kv::compiled_format(kScheme, kv.heads[h].v_format), v + item * d, d, kv.value(start + t, h), lane);
}

/// The body of `launch_kv_append<S>(Arch, args, stream)` for a CUDA arch tag.
template <class Arch, MoeSpec S>
Status launch(KvAppendArgs const& a, stream_t stream) {
  if (Status s = can_implement_kv_append<S>(a); s != Status::kSuccess) return s;
  DeviceKv kv{};
  if (Status s = to_device(a.kv, kv); s != Status::kSuccess) return s;
  if (a.n_tokens == 0) return Status::kSuccess;
  std::int64_t const threads = a.n_tokens * a.kv.n_head_kv * 2 * 32;
  auto const blocks = static_cast<unsigned>((threads + kAppendThreads - 1) / kAppendThreads);
  QFLASH_LAUNCH(blocks, kAppendThreads, 0, static_cast<cudaStream_t>(stream), kv_append_kernel<Arch, S.kv>)(
      kv, a.k, a.v, a.n_tokens, a.start);
  return cuda::last_launch_status();
}

}  // namespace qflash::kernels::kv_cuda
