/// @file
/// MoE routing (softmax, top-k, policy, renormalisation) for sm_90a (H100/H200): device.cuh's kernel with the Sm90a tag (own symbols).
/// Included only by the generated instance TUs `cuda_<spec>_sm90a.cu`.
#pragma once

#include "qflash/kernels/router_topk/device.cuh"

namespace qflash::kernels {

template <MoeSpec S>
Status launch_router_topk(arch::Sm90a, RouterTopkArgs const& args, stream_t stream) {
  return router_topk_cuda::launch<arch::Sm90a, S>(args, stream);
}

}  // namespace qflash::kernels
