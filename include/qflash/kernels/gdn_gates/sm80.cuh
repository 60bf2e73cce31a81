/// @file
/// Gated DeltaNet's gates for sm_80 (A100 class; newer GPUs run it through its PTX).
/// Included only by the generated instance TUs `cuda_<spec>_sm80.cu`; consumers include
/// op.hpp and link the instances.
#pragma once

#include "qflash/kernels/gdn_gates/device.cuh"

namespace qflash::kernels {

template <MoeSpec S>
Status launch_gdn_gates(arch::Sm80, GdnGatesArgs const& args, stream_t stream) {
  return gdn_gates_cuda::launch<arch::Sm80, S>(args, stream);
}

}  // namespace qflash::kernels
