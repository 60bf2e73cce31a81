/// @file
/// Dense projection (plain GEMV/GEMM path) for sm_80 (A100 class; newer GPUs run it through its PTX).
/// Included only by the generated instance TUs `cuda_<spec>_sm80.cu`; consumers include
/// op.hpp and link the instances.
#pragma once

#include "qflash/kernels/linear/device.cuh"

namespace qflash::kernels {

template <MoeSpec S>
Status launch_linear(arch::Sm80, LinearArgs const& args, stream_t stream) {
  return linear_cuda::launch<arch::Sm80, S>(args, stream);
}

}  // namespace qflash::kernels
