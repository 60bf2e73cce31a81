/// @file
/// Routed experts for sm_90a (H100/H200): device.cuh's kernels with the Sm90a tag (own symbols).
/// Included only by the generated instance TUs `cuda_<spec>_sm90a.cu`.
#pragma once

#include "qflash/kernels/expert_ffn/device.cuh"

namespace qflash::kernels {

template <MoeSpec S>
Status launch_expert_ffn(arch::Sm90a, ExpertFfnArgs const& args, stream_t stream) {
  return expert_ffn_cuda::launch<arch::Sm90a, S>(args, stream);
}

}  // namespace qflash::kernels
