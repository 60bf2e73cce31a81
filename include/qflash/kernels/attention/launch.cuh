/// @file
/// The body of `launch_attention<S>(Arch, args, stream)` for a CUDA arch tag, shared by
/// sm80.cuh and sm90a.cuh: the tensor-core path (mma.cuh) for prefill rows of heads it takes,
/// else the warp-per-row kernel (device.cuh).
#pragma once

#include "qflash/kernels/attention/device.cuh"
#include "qflash/kernels/attention/mma.cuh"

namespace qflash::kernels::attention_cuda {

template <class Arch, MoeSpec S>
Status launch(AttentionArgs const& a, stream_t stream) {
  if (Status s = can_implement_attention<S>(a); s != Status::kSuccess) return s;
  if (a.d_head > kMaxHeadDim) return Status::kErrorNotSupported;
  DeviceKv kv{};
  if (Status s = kv_cuda::to_device(a.kv, kv); s != Status::kSuccess) return s;
  if (a.n_tokens == 0) return Status::kSuccess;
  Params const p = params_of(a);
  auto const s = static_cast<cudaStream_t>(stream);
  if constexpr (S.d_head != kDynamic) {
    if constexpr (S.d_head <= mma::kWidestHead)
      if (mma::usable(a)) return mma::launch<Arch, S.kv, mma::head_bucket(S.d_head)>(kv, p, a.n_head_kv, s);
    return launch_per_lane<Arch, S.kv, per_lane(S.d_head)>(kv, p, a.n_head_kv, s);
  } else {
    if (mma::usable(a)) {
      switch (mma::head_bucket(a.d_head)) {
        case 64: return mma::launch<Arch, S.kv, 64>(kv, p, a.n_head_kv, s);
        case 128: return mma::launch<Arch, S.kv, 128>(kv, p, a.n_head_kv, s);
        default: return mma::launch<Arch, S.kv, 256>(kv, p, a.n_head_kv, s);
      }
    }
    switch (per_lane(a.d_head)) {
      case 1: return launch_per_lane<Arch, S.kv, 1>(kv, p, a.n_head_kv, s);
      case 2: return launch_per_lane<Arch, S.kv, 2>(kv, p, a.n_head_kv, s);
      case 4: return launch_per_lane<Arch, S.kv, 4>(kv, p, a.n_head_kv, s);
      case 8: return launch_per_lane<Arch, S.kv, 8>(kv, p, a.n_head_kv, s);
      default: return launch_per_lane<Arch, S.kv, 16>(kv, p, a.n_head_kv, s);
    }
  }
}

}  // namespace qflash::kernels::attention_cuda
