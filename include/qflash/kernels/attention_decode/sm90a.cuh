/// @file
/// One attention decode step for several sequences (kernels/attention_decode) for sm_90a (H100/H200).
/// Included only by the generated instance TUs `cuda_<spec>_sm90a.cu`; consumers include
/// op.hpp and link the instances.
#pragma once

#include "qflash/kernels/attention_decode/device.cuh"

namespace qflash::kernels {

template <MoeSpec S>
Status launch_attention_decode(arch::Sm90a, AttentionDecodeArgs const& args, stream_t stream) {
  return attention_decode_cuda::launch<arch::Sm90a, S>(args, stream);
}

}  // namespace qflash::kernels
