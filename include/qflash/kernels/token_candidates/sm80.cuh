/// @file
/// Token candidates for sm_80 (A100 class; newer GPUs run it through its PTX).
/// Included only by the generated instance TUs `cuda_<spec>_sm80.cu`; consumers include
/// op.hpp and link the instances.
#pragma once

#include "qflash/kernels/token_candidates/device.cuh"

namespace qflash::kernels {

template <MoeSpec S>
Status launch_token_candidates(arch::Sm80, TokenCandidatesArgs const& args, stream_t stream) {
  return token_candidates_cuda::launch<arch::Sm80, S>(args, stream);
}

}  // namespace qflash::kernels
