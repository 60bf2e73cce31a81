/// @file
/// The gated delta rule, both forms, for sm_80 (A100 class; newer GPUs run it through its PTX).
/// Included only by the generated instance TUs `cuda_<spec>_sm80.cu`; consumers include
/// op.hpp and link the instances.
#pragma once

#include "qflash/kernels/gated_delta/device.cuh"

namespace qflash::kernels {

template <MoeSpec S>
Status launch_gated_delta(arch::Sm80, GatedDeltaArgs const& args, stream_t stream) {
  return gated_delta_cuda::launch<arch::Sm80, S>(args, stream);
}

}  // namespace qflash::kernels
