/// @file
/// add + RMSNorm for sm_80 (A100 class; also runs on newer GPUs through the sm_80 build).
/// Included only by the generated instance TUs `cuda_<spec>_sm80.cu`, compiled for
/// sm_80 alone; consumers include op.hpp and link the instances.
#pragma once

#include "qflash/kernels/add_rmsnorm/device.cuh"

namespace qflash::kernels {

/// @tparam S  the spec; a static d_model selects the register-resident kernel
/// @return can_implement_add_rmsnorm's status, or kErrorCuda when the launch failed
///         (e.g. no kernel image for this device)
template <MoeSpec S>
Status launch_add_rmsnorm(arch::Sm80, AddRmsNormArgs const& args, stream_t stream) {
  return add_rmsnorm_cuda::launch<arch::Sm80, S>(args, stream);
}

}  // namespace qflash::kernels
