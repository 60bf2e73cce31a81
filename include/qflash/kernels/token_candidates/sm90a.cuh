/// @file
/// Token candidates for sm_90a (H100 class).
/// Included only by the generated instance TUs `cuda_<spec>_sm90a.cu`; consumers include
/// op.hpp and link the instances.
#pragma once

#include "qflash/kernels/token_candidates/device.cuh"

namespace qflash::kernels {

template <MoeSpec S>
Status launch_token_candidates(arch::Sm90a, TokenCandidatesArgs const& args, stream_t stream) {
  return token_candidates_cuda::launch<arch::Sm90a, S>(args, stream);
}

}  // namespace qflash::kernels
