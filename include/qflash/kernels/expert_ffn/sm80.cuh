/// @file
/// Routed experts (grouping, gate/up with SwiGLU, down, combine) for sm_80 (A100 class; newer GPUs run it through its PTX).
/// Included only by the generated instance TUs `cuda_<spec>_sm80.cu`; consumers include
/// op.hpp and link the instances.
#pragma once

#include "qflash/kernels/expert_ffn/device.cuh"

namespace qflash::kernels {

template <MoeSpec S>
Status launch_expert_ffn(arch::Sm80, ExpertFfnArgs const& args, stream_t stream) {
  return expert_ffn_cuda::launch<arch::Sm80, S>(args, stream);
}

}  // namespace qflash::kernels
