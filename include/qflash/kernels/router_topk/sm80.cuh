/// @file
/// MoE routing (softmax, top-k, policy, renormalisation) for sm_80 (A100 class; newer GPUs run it through its PTX).
/// Included only by the generated instance TUs `cuda_<spec>_sm80.cu`; consumers include
/// op.hpp and link the instances.
#pragma once

#include "qflash/kernels/router_topk/device.cuh"

namespace qflash::kernels {

template <MoeSpec S>
Status launch_router_topk(arch::Sm80, RouterTopkArgs const& args, stream_t stream) {
  return router_topk_cuda::launch<arch::Sm80, S>(args, stream);
}

}  // namespace qflash::kernels
