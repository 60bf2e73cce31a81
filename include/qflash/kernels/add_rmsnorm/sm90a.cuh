/// @file
/// add + RMSNorm for sm_90a (H100/H200). Included only by the generated instance TUs
/// `cuda_<spec>_sm90a.cu`, compiled for sm_90a alone. A bandwidth-bound row op gains
/// nothing from wgmma or TMA, so the kernels are device.cuh's, instantiated with the Sm90a tag
/// (own symbols, own policy: policy.hpp).
#pragma once

#include "qflash/kernels/add_rmsnorm/device.cuh"

namespace qflash::kernels {

/// @tparam S  the spec; a static d_model selects the register-resident kernel
/// @return can_implement_add_rmsnorm's status, or kErrorCuda when the launch failed
///         (e.g. no kernel image for this device: sm_90a code runs on cc 9.0 only)
template <MoeSpec S>
Status launch_add_rmsnorm(arch::Sm90a, AddRmsNormArgs const& args, stream_t stream) {
  return add_rmsnorm_cuda::launch<arch::Sm90a, S>(args, stream);
}

}  // namespace qflash::kernels
