/// @file
/// Q/K head norm with partial RoPE for sm_90a (H100/H200): device.cuh's kernel with the Sm90a tag (own symbols).
/// Included only by the generated instance TUs `cuda_<spec>_sm90a.cu`.
#pragma once

#include "qflash/kernels/qk_norm_rope/device.cuh"

namespace qflash::kernels {

template <MoeSpec S>
Status launch_qk_norm_rope(arch::Sm90a, QkNormRopeArgs const& args, stream_t stream) {
  return qk_norm_rope_cuda::launch<arch::Sm90a, S>(args, stream);
}

}  // namespace qflash::kernels
