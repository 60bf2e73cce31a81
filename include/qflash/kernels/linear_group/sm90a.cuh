/// @file
/// Several projections of one input (kernels/linear_group) for sm_90a (H100/H200): one launch
/// for every part when they share a format and linear's GEMV path, else linear's launches
/// (device.cuh).
/// Included only by the generated instance TUs `cuda_<spec>_sm90a.cu`; consumers include
/// op.hpp and link the instances.
#pragma once

#include "qflash/kernels/linear/sm90a.cuh"
#include "qflash/kernels/linear_group/device.cuh"

namespace qflash::kernels {

template <MoeSpec S>
Status launch_linear_group(arch::Sm90a, LinearGroupArgs const& args, stream_t stream) {
  return linear_group_cuda::launch<arch::Sm90a, S>(args, stream);
}

}  // namespace qflash::kernels
