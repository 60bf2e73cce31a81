// Our own MoE spec and the two fusion variants we compare (main.cpp; kernels_*.cu for CUDA).
#pragma once

#include <qflash/model/fusion.hpp>
#include <qflash/spec/moe_spec.hpp>

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
using Fused = qflash::fusion::Variant<qflash::fusion::AddInNorm, qflash::fusion::SwiGluInExperts>;
using Unfused = qflash::fusion::Variant<qflash::fusion::AddInProjection, qflash::fusion::SwiGluSeparate>;
