/// @file
/// Several projections of one input (kernels/linear_group) for sm_80 (A100 class; newer GPUs run it through its PTX): linear's
/// kernels, one launch per part (a step's graph holds them all).
/// Included only by the generated instance TUs `cuda_<spec>_sm80.cu`; consumers include
/// op.hpp and link the instances.
#pragma once

#include "qflash/kernels/linear/sm80.cuh"
#include "qflash/kernels/linear_group/op.hpp"

namespace qflash::kernels {

template <MoeSpec S>
Status launch_linear_group(arch::Sm80, LinearGroupArgs const& args, stream_t stream) {
  if (Status s = can_implement_linear_group<S>(args); s != Status::kSuccess) return s;
  for (LinearArgs const& part : args.used())
    if (Status s = launch_linear<S>(arch::Sm80{}, part, stream); s != Status::kSuccess) return s;
  return Status::kSuccess;
}

}  // namespace qflash::kernels
