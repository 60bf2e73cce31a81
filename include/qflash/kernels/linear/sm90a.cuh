/// @file
/// Dense projection (plain GEMV/GEMM path) for sm_90a (H100/H200): device.cuh's kernels with the Sm90a tag (own symbols);
/// wgmma/TMA paths are to come.
/// Included only by the generated instance TUs `cuda_<spec>_sm90a.cu`.
#pragma once

#include "qflash/kernels/linear/device.cuh"

namespace qflash::kernels {

template <MoeSpec S>
Status launch_linear(arch::Sm90a, LinearArgs const& args, stream_t stream) {
  return linear_cuda::launch<arch::Sm90a, S>(args, stream);
}

}  // namespace qflash::kernels
