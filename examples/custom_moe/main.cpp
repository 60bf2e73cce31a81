// A research build: our own MoE spec (not a preset), instantiated as a whole model on the CPU
// in two fusion variants, run on the same random weights, checked to agree, and timed.
#include <qflash/kernels/cpu.hpp>  // every CPU kernel, compiled here for kMoe
#include <qflash/runtime/research.hpp>

namespace fusion = qflash::fusion;

// A Qwen3.6-style model a quarter of the width, with 32 experts top-4 and bf16 weights.
constexpr qflash::MoeSpec kMoe{
    .family = qflash::ModelFamily::kQwen35Moe,
    .d_model = 512, .n_head = 8, .n_head_kv = 2, .d_head = 64,
    .n_expert = 32, .n_expert_used = 4, .d_ff_expert = 256, .d_ff_shared = 256,
    .n_head_k_linear = 4, .n_head_v_linear = 8, .d_head_k_linear = 64, .d_head_v_linear = 64, .d_conv = 4,
    .weights = qflash::WeightFormat::kBf16,
};
static_assert(qflash::valid(kMoe));

// The engine's fusion, and the same model with both fusions taken apart.
using Fused = fusion::Variant<fusion::AddInNorm, fusion::SwiGluInExperts>;
using Unfused = fusion::Variant<fusion::AddInProjection, fusion::SwiGluSeparate>;

int main() {
  namespace research = qflash::research;
  auto const model = research::random_model<kMoe>({.n_layer = 4, .vocab = 2048});
  // Under the model's top-4, then routed token by token: the experts with probability >= 0.05
  // (random routers spread theirs near 1/32 each), at least 2.
  auto const top_k = research::compare<kMoe, Fused, Unfused>(model, {.prompt = 128, .decode = 32});
  auto const dynamic = research::compare<kMoe, Fused, Unfused>(
      model, {.prompt = 128, .decode = 32, .routing = qflash::routing::Threshold{.threshold = 0.05f, .k_min = 2}});
  research::print(top_k);
  research::print(dynamic);
  return top_k.agree() && dynamic.agree() ? 0 : 1;
}
