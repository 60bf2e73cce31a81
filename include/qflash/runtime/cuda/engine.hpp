/// @file
/// The serving engine (runtime/batch_engine.hpp) over a model on a CUDA device: the model as
/// runtime/cuda/model.hpp builds it, its KV pool and states in the device's memory, the KV
/// budget from the device's free memory (EngineOptions::gpu_memory_utilization).
///
/// Host code that calls the CUDA runtime API: include it only where CUDA is enabled and link
/// CUDA::cudart and the CUDA instances (host-only builds never see it).
#pragma once

#include <memory>
#include <string>
#include <utility>

#include "qflash/runtime/batch_engine.hpp"
#include "qflash/runtime/cuda/lora.hpp"
#include "qflash/runtime/cuda/model.hpp"

namespace qflash::runtime {

/// make_engine() with the model on CUDA device `device` (weights uploaded with a progress bar
/// when asked, and the LoRA adapters requests may name: upload_lora), as the best compiled arch
/// the device runs.
inline std::unique_ptr<Engine> make_cuda_engine(LoadedModel model, int device, io::Tokenizer tokenizer,
                                                EngineOptions options, std::string model_id, bool progress) {
  for (auto& adapter : options.adapters)
    if (adapter) adapter = upload_lora(std::move(adapter), device);
  std::unique_ptr<Engine> engine;
  Status const s = on_cuda_arch(device, [&]<class Arch>(Arch) {
    engine = make_engine_as<Arch>(std::move(model), std::move(tokenizer), std::move(options), std::move(model_id),
                                  [&](auto spec, LoadedModel m, model::ModelOptions const& o) {
                                    return make_cuda_model<decltype(spec)::value, Arch>(std::move(m), device, o,
                                                                                        progress);
                                  });
    return Status::kSuccess;
  });
  QFLASH_CHECK(s == Status::kSuccess, "CUDA device ", device, ": no compiled arch runs it (", to_string(s), ")");
  return engine;
}

}  // namespace qflash::runtime
