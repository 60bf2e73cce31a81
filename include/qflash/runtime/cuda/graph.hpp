/// @file
/// A StepRecorder for CUDA: each step's launches are captured from its stream into a graph,
/// which updates the executable graph of the step before (kernel arguments change from step
/// to step, the shape of the work does not) or, when the shape changed, replaces it; one
/// graph launch then runs the step, and the device runs its kernels back to back. Meant for
/// decode, where launching costs more than the kernels' work (on an H200 the default model,
/// whose kernels are tiny, took 0.74 ms a decode step).
/// Not yet run on a GPU: opt-in (runtime/cuda/model.hpp, QFLASH_CUDA_GRAPHS=1).
/// The model's stream is a blocking one (ordered after the legacy stream): while a step is
/// being captured, another thread's work on the same device's legacy stream fails, and the
/// capture with it (the step then runs plainly). One recorder serves one host thread. A step's
/// graph is launched on the stream it was captured from, once at a time: kernels that count
/// their CTAs on that stream's counters (kernels/common/stream_workspace.cuh) rely on it.
///
/// Host code that calls the CUDA runtime API: include it only where CUDA is enabled.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <string>

#include "qflash/core/error.hpp"
#include "qflash/core/step_recorder.hpp"
#include "qflash/runtime/cuda/memory.hpp"

namespace qflash::runtime {

class CudaGraphRecorder final : public StepRecorder {
 public:
  CudaGraphRecorder() = default;
  CudaGraphRecorder(CudaGraphRecorder const&) = delete;
  CudaGraphRecorder& operator=(CudaGraphRecorder const&) = delete;
  ~CudaGraphRecorder() override {
    if (exec_) cudaGraphExecDestroy(exec_);
  }

  bool run(stream_t stream_arg, std::function<void()> const& enqueue) override {
    auto const stream = static_cast<cudaStream_t>(stream_arg);
    if (!stream) return false;  // the legacy stream cannot be captured
    if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed) != cudaSuccess) return failed();
    cudaGraph_t graph = nullptr;
    try {
      enqueue();
    } catch (...) {
      cudaStreamEndCapture(stream, &graph);  // ends the capture; the graph, if any, is dropped
      if (graph) cudaGraphDestroy(graph);
      return failed();
    }
    if (cudaStreamEndCapture(stream, &graph) != cudaSuccess || !graph) return failed();
    bool ready = false;
    if (exec_) {
      cudaGraphExecUpdateResultInfo info{};
      ready = cudaGraphExecUpdate(exec_, graph, &info) == cudaSuccess;
      if (ready) {
        ++updates_;
      } else {
        cudaGetLastError();
        cudaGraphExecDestroy(exec_);
        exec_ = nullptr;
      }
    }
    if (!ready) {
      ready = cudaGraphInstantiate(&exec_, graph, 0) == cudaSuccess;
      if (ready) ++instantiations_;
    }
    cudaGraphDestroy(graph);
    if (!ready) {
      exec_ = nullptr;
      return failed();
    }
    check_cuda(cudaGraphLaunch(exec_, stream), "launching a forward step's CUDA graph");
    return true;
  }

  /// Steps run as a graph that updated the one before / that needed a new executable graph /
  /// that could not be recorded (run plainly).
  [[nodiscard]] std::int64_t updates() const { return updates_; }
  [[nodiscard]] std::int64_t instantiations() const { return instantiations_; }
  [[nodiscard]] std::int64_t failures() const { return failures_; }
  [[nodiscard]] std::string summary() const override {
    return "CUDA graphs: " + std::to_string(updates_ + instantiations_) + " steps run as a graph (" +
           std::to_string(instantiations_) + " instantiated, " + std::to_string(updates_) + " updated), " +
           std::to_string(failures_) + " not recorded";
  }

 private:
  bool failed() {
    cudaGetLastError();  // the failed capture's error is not the next launch's
    ++failures_;
    return false;
  }

  cudaGraphExec_t exec_ = nullptr;
  std::int64_t updates_ = 0, instantiations_ = 0, failures_ = 0;
};

}  // namespace qflash::runtime
