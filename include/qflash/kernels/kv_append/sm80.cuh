/// @file
/// KV quantize-append for sm_80 (A100 class; newer GPUs run it through its PTX).
/// Included only by the generated instance TUs `cuda_<spec>_sm80.cu`; consumers include
/// op.hpp and link the instances.
#pragma once

#include "qflash/kernels/kv_append/device.cuh"

namespace qflash::kernels {

template <MoeSpec S>
Status launch_kv_append(arch::Sm80, KvAppendArgs const& args, stream_t stream) {
  return kv_cuda::launch<arch::Sm80, S>(args, stream);
}

}  // namespace qflash::kernels
