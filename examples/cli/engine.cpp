#include "engine.hpp"

#include <unistd.h>

#include <utility>

#include "qflash/runtime/batch_engine.hpp"
#if QFLASH_CLI_CUDA
#include "qflash/runtime/cuda/engine.hpp"
#endif

namespace qflash::cli {

std::unique_ptr<runtime::Engine> make_engine_on([[maybe_unused]] std::optional<int> device, runtime::LoadedModel m,
                                                io::Tokenizer tokenizer, runtime::EngineOptions options,
                                                std::string model_id) {
#if QFLASH_CLI_CUDA
  if (device)
    return runtime::make_cuda_engine(std::move(m), *device, std::move(tokenizer), std::move(options),
                                     std::move(model_id), ::isatty(2) != 0);
#endif
  return runtime::make_engine(std::move(m), std::move(tokenizer), std::move(options), std::move(model_id));
}

}  // namespace qflash::cli
