/// @file
/// A loaded model on a CUDA device: its weights uploaded (device_weights.hpp), its working
/// state in the device's memory (memory.hpp), run as `Model<S, arch::Sm90a | arch::Sm80>`,
/// the best compiled arch the device runs (arch/select.hpp).
///
/// Host code that calls the CUDA runtime API: include it only where CUDA is enabled and link
/// CUDA::cudart and the CUDA instances (host-only builds never see it).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include "qflash/arch/select.hpp"
#include "qflash/core/error.hpp"
#include "qflash/runtime/cuda/device_weights.hpp"
#include "qflash/runtime/cuda/graph.hpp"
#include "qflash/runtime/cuda/lora.hpp"
#include "qflash/runtime/cuda/memory.hpp"
#include "qflash/runtime/dispatch.hpp"
#include "qflash/runtime/load_model.hpp"

namespace qflash::runtime {

/// Whether the build compiled arch `id` (QFLASH_CUDA_ARCHS).
constexpr bool compiled_arch(arch::ArchId id) {
  for (arch::ArchId a : instances::kArchs)
    if (a == id) return true;
  return false;
}

/// The best arch among `compiled_archs` (default: the build's, QFLASH_CUDA_ARCHS) that runs on CUDA
/// device `device`; throws naming the device and those archs when none does.
inline arch::ArchId cuda_arch_for(int device, std::span<arch::ArchId const> compiled_archs = instances::kArchs) {
  int n = 0;
  cudaError_t const e = cudaGetDeviceCount(&n);
  QFLASH_CHECK(e == cudaSuccess && n > 0, "no CUDA device is available (",
               e == cudaSuccess ? "none found" : cudaGetErrorString(e), ")");
  QFLASH_CHECK(device >= 0 && device < n, "CUDA device ", device, " does not exist (", n, " found)");
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, device), "querying CUDA device " + std::to_string(device));
  std::optional<arch::ArchId> const a = arch::select_cuda_arch(compiled_archs, prop.major, prop.minor);
  std::string compiled;
  for (arch::ArchId id : compiled_archs)
    if (id != arch::ArchId::kCpu) compiled += (compiled.empty() ? "" : ", ") + std::string(arch::to_string(id));
  QFLASH_CHECK(a.has_value(), "CUDA device ", device, " (", prop.name, ", compute capability ", prop.major, ".",
               prop.minor, ") runs none of the compiled archs (", compiled.empty() ? "none" : compiled,
               "); rebuild with QFLASH_CUDA_ARCHS including one it runs");
  return *a;
}

/// Whether forward steps run as CUDA graphs (runtime/cuda/graph.hpp): only when the
/// environment sets QFLASH_CUDA_GRAPHS=1, until they have run on a GPU (none has yet).
inline bool cuda_graphs_enabled() {
  char const* v = std::getenv("QFLASH_CUDA_GRAPHS");
  return v && std::string(v) == "1";
}

/// `m` as Model<S, Arch> on CUDA device `device`: weights uploaded (a progress bar when asked),
/// working memory on the device (it replaces any opts.memory). Its steps are recorded as CUDA
/// graphs by opts.recorder, or by a CudaGraphRecorder when cuda_graphs_enabled(), on the
/// memory's stream unless opts.stream names one; without a recorder its work goes on
/// opts.stream (default: the legacy stream). A LoRA adapter in opts.lora is uploaded
/// (upload_lora). The host copy of the weights is dropped.
template <MoeSpec S, class Arch>
  requires(Arch::is_cuda)
std::unique_ptr<model::Model<S, Arch>> make_cuda_model(LoadedModel m, int device, model::ModelOptions opts,
                                                      bool progress) {
  auto memory = std::make_shared<CudaManagedMemory>(device);
  memory->activate();
  if (!opts.recorder && cuda_graphs_enabled()) opts.recorder = std::make_shared<CudaGraphRecorder>();
  if (opts.recorder && !opts.stream) opts.stream = memory->stream();  // the legacy stream is not recorded
  if (opts.lora) opts.lora = upload_lora(std::move(opts.lora), device);
  DeviceModelWeights dw = upload_weights(m.weights, device, progress);
  m.weights = {};
  m.storage.reset();
  opts.memory = std::move(memory);
  return std::make_unique<model::Model<S, Arch>>(std::move(m.config), std::move(dw.weights), std::move(dw.storage),
                                                 opts);
}

/// fn(Arch{}) for the best compiled arch CUDA device `device` runs (cuda_arch_for); returns
/// fn's Status.
template <class Fn>
Status on_cuda_arch(int device, Fn&& fn) {
  arch::ArchId const chosen = cuda_arch_for(device);
  Status s = Status::kErrorArchMismatch;
  if constexpr (compiled_arch(arch::ArchId::kSm90a))
    if (chosen == arch::ArchId::kSm90a) s = fn(arch::Sm90a{});
  if constexpr (compiled_arch(arch::ArchId::kSm80))
    if (chosen == arch::ArchId::kSm80) s = fn(arch::Sm80{});
  return s;
}

/// with_model() on CUDA device `device`: builds the model as the compiled spec that runs it,
/// for the best compiled arch the device runs, and calls fn(model).
template <class Fn>
void with_cuda_model(LoadedModel m, int device, model::ModelOptions const& opts, bool progress, Fn&& fn) {
  MoeSpec const rt = m.spec();
  std::string const source = m.config.source;
  Status const s = on_cuda_arch(device, [&]<class Arch>(Arch) {
    return dispatch_spec(rt, [&](auto spec) {
      auto model = make_cuda_model<decltype(spec)::value, Arch>(std::move(m), device, opts, progress);
      fn(*model);
      return Status::kSuccess;
    });
  });
  QFLASH_CHECK(s == Status::kSuccess, source, ": no compiled instance runs this model on ",
               arch::to_string(cuda_arch_for(device)), " (", to_string(s), "); compiled specs: ",
               compiled_spec_names());
}

}  // namespace qflash::runtime
