/// @file
/// Attention over paged, compressed KV for sm_90a (H100/H200): device.cuh's kernels with the Sm90a tag (own symbols).
/// Included only by the generated instance TUs `cuda_<spec>_sm90a.cu`.
#pragma once

#include "qflash/kernels/attention/launch.cuh"

namespace qflash::kernels {

template <MoeSpec S>
Status launch_attention(arch::Sm90a, AttentionArgs const& args, stream_t stream) {
  return attention_cuda::launch<arch::Sm90a, S>(args, stream);
}

}  // namespace qflash::kernels
