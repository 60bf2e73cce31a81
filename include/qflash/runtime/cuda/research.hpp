/// @file
/// research::compare on a CUDA device: a project's own spec and two fusion variants run as
/// Model<S, Sm90a|Sm80, A|B> on the same uploaded weights.
///
/// The project compiles the CUDA ops for its spec on both archs, one nvcc TU per arch:
/// `#include <qflash/generated/cuda_sm90a.cuh>` then `QFLASH_CUDA_INSTANCES(kSpec, Sm90a)`
/// (examples/custom_moe). Host code that calls the CUDA runtime API: include it only where
/// CUDA is enabled and link CUDA::cudart.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <memory>
#include <string>

#include "qflash/runtime/cuda/device_weights.hpp"
#include "qflash/runtime/cuda/memory.hpp"
#include "qflash/runtime/cuda/model.hpp"
#include "qflash/runtime/research.hpp"

namespace qflash::research {

/// The number of CUDA devices this process can use (0 when there is none or no driver).
inline int cuda_device_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

/// compare<S, A, B>() on CUDA device `device`, as the arch it runs best (sm_90a on cc 9.0, else
/// sm_80): `m`'s weights are uploaded once and both variants read them.
template <MoeSpec S, fusion::FusionVariant A, fusion::FusionVariant B>
Comparison compare_on_cuda(runtime::LoadedModel const& m, int device, CompareOptions const& o = {}) {
  constexpr std::array kArchs{arch::ArchId::kSm80, arch::ArchId::kSm90a};  // the project compiles both
  arch::ArchId const chosen = runtime::cuda_arch_for(device, kArchs);
  cudaDeviceProp prop{};
  runtime::check_cuda(cudaGetDeviceProperties(&prop, device), "querying CUDA device " + std::to_string(device));

  auto memory = std::make_shared<runtime::CudaManagedMemory>(device);
  memory->activate();
  runtime::DeviceModelWeights const dw = runtime::upload_weights(m.weights, device, false);
  model::ModelOptions mo;
  mo.routing = o.routing;
  mo.memory = memory;
  auto run = [&]<class Arch>(Arch) {
    model::Model<S, Arch, A> ma(m.config, dw.weights, dw.storage, mo);
    model::Model<S, Arch, B> mb(m.config, dw.weights, dw.storage, mo);
    Comparison c = detail::compare_models(ma, mb, o);
    c.device = std::string(prop.name) + ", " + std::string(arch::to_string(Arch::id));
    return c;
  };
  return chosen == arch::ArchId::kSm90a ? run(arch::Sm90a{}) : run(arch::Sm80{});
}

}  // namespace qflash::research
