/// @file
/// Gated DeltaNet's gates for sm_90a (H100/H200): device.cuh's kernel with the Sm90a tag (own symbols).
/// Included only by the generated instance TUs `cuda_<spec>_sm90a.cu`.
#pragma once

#include "qflash/kernels/gdn_gates/device.cuh"

namespace qflash::kernels {

template <MoeSpec S>
Status launch_gdn_gates(arch::Sm90a, GdnGatesArgs const& args, stream_t stream) {
  return gdn_gates_cuda::launch<arch::Sm90a, S>(args, stream);
}

}  // namespace qflash::kernels
