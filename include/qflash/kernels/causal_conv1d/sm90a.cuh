/// @file
/// Causal depthwise conv1d with state for sm_90a (H100/H200): device.cuh's kernels with the Sm90a tag (own symbols).
/// Included only by the generated instance TUs `cuda_<spec>_sm90a.cu`.
#pragma once

#include "qflash/kernels/causal_conv1d/device.cuh"

namespace qflash::kernels {

template <MoeSpec S>
Status launch_causal_conv1d(arch::Sm90a, CausalConv1dArgs const& args, stream_t stream) {
  return causal_conv1d_cuda::launch<arch::Sm90a, S>(args, stream);
}

}  // namespace qflash::kernels
