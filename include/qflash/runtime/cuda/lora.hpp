/// @file
/// A LoRA adapter (model/lora.hpp) copied to a CUDA device, so that a model there runs it
/// unmerged, per sequence, as on the CPU: every low-rank pair of the attention and Gated
/// DeltaNet projections, and the embedding and lm_head tables it replaces. The experts'
/// kernels run no adapter on a device yet: an adapter that updates them is refused with a
/// clear error (merged into the weights at load it runs anywhere: runtime::merge_lora).
///
/// Host code that calls the CUDA runtime API: include it only where CUDA is enabled and link
/// CUDA::cudart (host-only builds never see it).
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "qflash/core/error.hpp"
#include "qflash/io/progress.hpp"
#include "qflash/model/lora.hpp"
#include "qflash/runtime/cuda/device_weights.hpp"

namespace qflash::runtime {

/// `host` with its matrices on CUDA device `device` (an adapter there already comes back as it
/// is). Throws Error naming the adapter when it updates the experts or lives on another device.
inline std::shared_ptr<model::LoraAdapter const> upload_lora(std::shared_ptr<model::LoraAdapter const> host,
                                                             int device) {
  QFLASH_CHECK(host, "upload_lora: no adapter");
  if (host->device >= 0) {
    QFLASH_CHECK(host->device == device, "LoRA adapter '", host->name, "' is on CUDA device ", host->device,
                 ", the model on device ", device);
    return host;
  }
  QFLASH_CHECK(!host->touches_experts(), "LoRA adapter '", host->name, "' updates the experts, which run no adapter "
               "on a CUDA device yet: merge it into the weights (--lora-merge; runtime::merge_lora) or run on the CPU");
  auto storage = std::make_shared<DeviceWeightStorage>(device);
  io::Progress quiet("uploading LoRA adapter " + host->name, 0, /*enabled=*/false);
  detail::Uploader up(*storage, quiet);
  auto dev = std::make_shared<model::LoraAdapter>();
  dev->name = host->name;
  dev->layers.resize(host->layers.size());
  auto copy = [&](kernels::LowRank const& d) {
    return d.empty() ? d : kernels::LowRank{up.matrix(d.a), up.matrix(d.b)};
  };
  for (std::size_t l = 0; l < host->layers.size(); ++l) {
    model::LoraLayer const& h = host->layers[l];
    model::LoraLayer& d = dev->layers[l];
    for (auto const& p : model::kLoraProjections) d.*p.update = copy(h.*p.update);
  }
  auto table = [&](std::optional<WeightView> const& t) {
    return t ? std::optional<WeightView>(up.matrix(*t)) : std::nullopt;
  };
  dev->embed = table(host->embed);
  dev->lm_head = table(host->lm_head);
  storage->finish_uploads();
  dev->storage = std::move(storage);
  dev->device = device;
  return dev;
}

}  // namespace qflash::runtime
