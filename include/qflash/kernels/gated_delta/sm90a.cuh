/// @file
/// The gated delta rule, both forms, for sm_90a (H100/H200): device.cuh's kernels with the Sm90a tag (own symbols).
/// Included only by the generated instance TUs `cuda_<spec>_sm90a.cu`.
#pragma once

#include "qflash/kernels/gated_delta/device.cuh"

namespace qflash::kernels {

template <MoeSpec S>
Status launch_gated_delta(arch::Sm90a, GatedDeltaArgs const& args, stream_t stream) {
  return gated_delta_cuda::launch<arch::Sm90a, S>(args, stream);
}

}  // namespace qflash::kernels
