/// @file
/// One Gated DeltaNet decode step for several sequences (kernels/gdn_decode) for sm_80 (A100 class; newer GPUs run it through its PTX).
/// Included only by the generated instance TUs `cuda_<spec>_sm80.cu`; consumers include
/// op.hpp and link the instances.
#pragma once

#include "qflash/kernels/gdn_decode/device.cuh"

namespace qflash::kernels {

template <MoeSpec S>
Status launch_gdn_decode(arch::Sm80, GdnDecodeArgs const& args, stream_t stream) {
  return gdn_decode_cuda::launch<arch::Sm80, S>(args, stream);
}

}  // namespace qflash::kernels
