/// @file
/// One Gated DeltaNet decode step for several sequences (kernels/gdn_decode) for sm_90a (H100/H200).
/// Included only by the generated instance TUs `cuda_<spec>_sm90a.cu`; consumers include
/// op.hpp and link the instances.
#pragma once

#include "qflash/kernels/gdn_decode/device.cuh"

namespace qflash::kernels {

template <MoeSpec S>
Status launch_gdn_decode(arch::Sm90a, GdnDecodeArgs const& args, stream_t stream) {
  return gdn_decode_cuda::launch<arch::Sm90a, S>(args, stream);
}

}  // namespace qflash::kernels
