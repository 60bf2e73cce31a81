/// @file
/// The one place the CLI builds a serving engine (serve, chat): on the CUDA device --device
/// names, or on the CPU. Defined in engine.cpp, a translation unit of its own: it instantiates
/// the engine for every compiled spec and arch, which main.cpp then need not compile too.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "qflash/io/tokenizer.hpp"
#include "qflash/runtime/engine.hpp"
#include "qflash/runtime/load_model.hpp"

namespace qflash::cli {

/// The engine over `m` on CUDA device `device` (weights uploaded with a progress bar on a
/// terminal) or, without one, on the CPU.
std::unique_ptr<runtime::Engine> make_engine_on(std::optional<int> device, runtime::LoadedModel m,
                                                io::Tokenizer tokenizer, runtime::EngineOptions options,
                                                std::string model_id);

}  // namespace qflash::cli
