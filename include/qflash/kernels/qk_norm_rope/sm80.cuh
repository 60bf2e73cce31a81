/// @file
/// Q/K head norm with partial RoPE for sm_80 (A100 class; newer GPUs run it through its PTX).
/// Included only by the generated instance TUs `cuda_<spec>_sm80.cu`; consumers include
/// op.hpp and link the instances.
#pragma once

#include "qflash/kernels/qk_norm_rope/device.cuh"

namespace qflash::kernels {

template <MoeSpec S>
Status launch_qk_norm_rope(arch::Sm80, QkNormRopeArgs const& args, stream_t stream) {
  return qk_norm_rope_cuda::launch<arch::Sm80, S>(args, stream);
}

}  // namespace qflash::kernels
