/// @file
/// A LoRA adapter (model/lora.hpp) copied to a CUDA device, so that a model there runs it
/// unmerged, per sequence, as on the CPU: every low-rank pair of the attention, Gated DeltaNet
/// and shared-expert projections, the routed experts' (each projection's stacked at one rank,
/// as CUDA's expert kernels read them: kernels/expert_ffn/stacked.hpp), and the embedding and
/// lm_head tables it replaces.
///
/// Host code that calls the CUDA runtime API: include it only where CUDA is enabled and link
/// CUDA::cudart (host-only builds never see it).
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "qflash/core/error.hpp"
#include "qflash/io/progress.hpp"
#include "qflash/kernels/expert_ffn/stacked.hpp"
#include "qflash/model/lora.hpp"
#include "qflash/runtime/cuda/device_weights.hpp"

namespace qflash::runtime {

/// `host` with its matrices on CUDA device `device` (an adapter there already comes back as it
/// is). Throws Error naming the adapter when it lives on another device.
inline std::shared_ptr<model::LoraAdapter const> upload_lora(std::shared_ptr<model::LoraAdapter const> host,
                                                             int device) {
  QFLASH_CHECK(host, "upload_lora: no adapter");
  if (host->device >= 0) {
    QFLASH_CHECK(host->device == device, "LoRA adapter '", host->name, "' is on CUDA device ", host->device,
                 ", the model on device ", device);
    return host;
  }
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
    for (auto const& p : model::kLoraExpertProjections) {
      kernels::StackedLowRank const s = kernels::stack_low_rank(h.*p.updates);
      if (s.rank == 0) continue;
      auto const n = static_cast<std::int64_t>((h.*p.updates).size());
      WeightView const a = up.matrix({WeightFormat::kF32, s.a.data(), n * s.rank, s.n_in}),
                       b = up.matrix({WeightFormat::kF32, s.b.data(), n * s.n_out, s.rank});
      auto& updates = d.*p.updates;
      updates.resize(static_cast<std::size_t>(n));
      for (std::int64_t e = 0; e < n; ++e)
        updates[static_cast<std::size_t>(e)] = {a.slice_rows(e * s.rank, s.rank), b.slice_rows(e * s.n_out, s.n_out)};
    }
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
