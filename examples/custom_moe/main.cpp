// A research build: our own MoE spec (not a preset, spec.hpp), instantiated as a whole model in
// two fusion variants, run on the same random weights, checked to agree, and timed: on the CPU,
// and on a GPU too where qflash is built with CUDA (kernels_sm80.cu, kernels_sm90a.cu).
#include <qflash/kernels/cpu.hpp>  // every CPU kernel, compiled here for kMoe
#include <qflash/runtime/research.hpp>
#if QFLASH_EXAMPLE_CUDA
#include <qflash/runtime/cuda/research.hpp>
#endif

#include "spec.hpp"

int main() {
  namespace research = qflash::research;
  auto const model = research::random_model<kMoe>({.n_layer = 4, .vocab = 2048});
  // Under the model's top-4, then routed token by token: the experts with probability >= 0.05
  // (random routers spread theirs near 1/32 each), at least 2.
  research::CompareOptions const top_k{.prompt = 128, .decode = 32};
  research::CompareOptions const dynamic{
      .prompt = 128, .decode = 32, .routing = qflash::routing::Threshold{.threshold = 0.05f, .k_min = 2}};
  bool agree = true;
  auto report = [&](research::Comparison const& c) {
    research::print(c);
    agree = agree && c.agree();
  };
  for (auto const& o : {top_k, dynamic}) {
    report(research::compare<kMoe, Fused, Unfused>(model, o));
#if QFLASH_EXAMPLE_CUDA  // the same on CUDA device 0, when there is one
    if (research::cuda_device_count() > 0) report(research::compare_on_cuda<kMoe, Fused, Unfused>(model, 0, o));
#endif
  }
  return agree ? 0 : 1;
}
