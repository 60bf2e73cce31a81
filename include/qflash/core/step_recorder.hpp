/// @file
/// Records the device work of a model's forward step and launches it as one unit: on CUDA a
/// graph (runtime/cuda/graph.hpp), so a decode step's many small kernels (73 on the synthetic
/// Qwen3.6 shape with 4 layers) cost one launch from the host. A CPU model has none.
#pragma once

#include <functional>
#include <string>

#include "qflash/core/config.hpp"

namespace qflash {

class StepRecorder {
 public:
  virtual ~StepRecorder() = default;
  /// Calls `enqueue`, which queues work on `stream`, recording that work, then launches the
  /// record on `stream`. False when it could not be recorded: then nothing was queued and
  /// the caller runs `enqueue` plainly (an error it throws again then is a real one).
  virtual bool run(stream_t stream, std::function<void()> const& enqueue) = 0;
  /// What it has done so far, in a line (e.g. how many steps were recorded).
  [[nodiscard]] virtual std::string summary() const = 0;
};

}  // namespace qflash
