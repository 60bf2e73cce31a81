/// @file
/// Gated RMSNorm for sm_90a (H100/H200): device.cuh's kernel with the Sm90a tag (own symbols).
/// Included only by the generated instance TUs `cuda_<spec>_sm90a.cu`.
#pragma once

#include "qflash/kernels/gated_rmsnorm/device.cuh"

namespace qflash::kernels {

template <MoeSpec S>
Status launch_gated_rmsnorm(arch::Sm90a, GatedRmsNormArgs const& args, stream_t stream) {
  return gated_rmsnorm_cuda::launch<arch::Sm90a, S>(args, stream);
}

}  // namespace qflash::kernels
