/// @file
/// The one place the CLI chooses where a loaded model runs: the CPU, or the CUDA device that
/// --device names (a CUDA build: QFLASH_CLI_CUDA, args.hpp).
#pragma once

#include <unistd.h>

#include <optional>
#include <utility>

#include "args.hpp"
#include "qflash/runtime/load_model.hpp"
#include "qflash/runtime/with_model.hpp"
#if QFLASH_CLI_CUDA
#include "qflash/runtime/cuda/model.hpp"
#endif

namespace qflash::cli {

/// Throws, before anything loads, when `device` is a CUDA device that is missing or runs none
/// of the compiled archs. A build without CUDA never gets here with one (check_cuda_build).
inline void check_device_usable([[maybe_unused]] std::optional<int> device) {
#if QFLASH_CLI_CUDA
  if (device) (void)runtime::cuda_arch_for(*device);
#endif
}

/// fn(model) with `m` built as the compiled spec that fits it, on CUDA device `device` (weights
/// uploaded with a progress bar on a terminal) or, without one, on the CPU.
template <class Fn>
void with_model_on([[maybe_unused]] std::optional<int> device, runtime::LoadedModel m,
                   model::ModelOptions const& opts, Fn&& fn) {
#if QFLASH_CLI_CUDA
  if (device) return runtime::with_cuda_model(std::move(m), *device, opts, ::isatty(2) != 0, std::forward<Fn>(fn));
#endif
  runtime::with_model(std::move(m), opts, std::forward<Fn>(fn));
}

}  // namespace qflash::cli
