/// @file
/// Causal depthwise conv1d with state for sm_80 (A100 class; newer GPUs run it through its PTX).
/// Included only by the generated instance TUs `cuda_<spec>_sm80.cu`; consumers include
/// op.hpp and link the instances.
#pragma once

#include "qflash/kernels/causal_conv1d/device.cuh"

namespace qflash::kernels {

template <MoeSpec S>
Status launch_causal_conv1d(arch::Sm80, CausalConv1dArgs const& args, stream_t stream) {
  return causal_conv1d_cuda::launch<arch::Sm80, S>(args, stream);
}

}  // namespace qflash::kernels
