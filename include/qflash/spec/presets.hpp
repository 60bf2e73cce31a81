/// @file
/// Named specs. Values are the published configs (see MODELS.md); each is checked valid here.
#pragma once

#include "qflash/spec/moe_spec.hpp"

namespace qflash::spec {

/// Qwen3.6-35B-A3B (qwen3_5_moe text model): every KV scheme and weight format.
inline constexpr MoeSpec qwen3_6_35b_a3b{
    .family = ModelFamily::kQwen35Moe,
    .d_model = 2048,
    .n_head = 16,
    .n_head_kv = 2,
    .d_head = 256,
    .n_expert = 256,
    .n_expert_used = 8,
    .d_ff_expert = 512,
    .d_ff_shared = 512,
    .n_head_k_linear = 16,
    .n_head_v_linear = 32,
    .d_head_k_linear = 128,
    .d_head_v_linear = 128,
    .d_conv = 4,
    .kv = KvScheme::kAny,
    .weights = WeightFormat::kAny,
};

/// Qwen3-30B-A3B (qwen3_moe): every KV scheme and weight format.
inline constexpr MoeSpec qwen3_30b_a3b{
    .family = ModelFamily::kQwen3Moe,
    .d_model = 2048,
    .n_head = 32,
    .n_head_kv = 4,
    .d_head = 128,
    .n_expert = 128,
    .n_expert_used = 8,
    .d_ff_expert = 768,
    .d_ff_shared = 0,
    .n_head_k_linear = 0,
    .n_head_v_linear = 0,
    .d_head_k_linear = 0,
    .d_head_v_linear = 0,
    .d_conv = 0,
    .kv = KvScheme::kAny,
    .weights = WeightFormat::kAny,
};

/// The embedded default model, models/qwen3_5_moe-micro.
inline constexpr MoeSpec qwen3_5_moe_micro{
    .family = ModelFamily::kQwen35Moe,
    .d_model = 192,
    .n_head = 4,
    .n_head_kv = 2,
    .d_head = 64,
    .n_expert = 16,
    .n_expert_used = 2,
    .d_ff_expert = 40,
    .d_ff_shared = 128,
    .n_head_k_linear = 4,
    .n_head_v_linear = 8,
    .d_head_k_linear = 32,
    .d_head_v_linear = 32,
    .d_conv = 4,
    .kv = KvScheme::kAny,
    .weights = WeightFormat::kAny,
};

/// The transformers fixture tests/fixtures/qwen3_5_moe_tiny (MODELS.md §7's tiny model with
/// hidden 32): a static instance the tests compare with the generic one.
inline constexpr MoeSpec qwen3_5_moe_tiny{
    .family = ModelFamily::kQwen35Moe,
    .d_model = 32,
    .n_head = 4,
    .n_head_kv = 2,
    .d_head = 32,
    .n_expert = 8,
    .n_expert_used = 2,
    .d_ff_expert = 16,
    .d_ff_shared = 32,
    .n_head_k_linear = 2,
    .n_head_v_linear = 4,
    .d_head_k_linear = 16,
    .d_head_v_linear = 16,
    .d_conv = 4,
    .kv = KvScheme::kAny,
    .weights = WeightFormat::kAny,
};

/// Every field dynamic: runs any shape; the fallback every arch instantiates.
inline constexpr MoeSpec generic{};

static_assert(valid(qwen3_6_35b_a3b), "qwen3_6_35b_a3b preset is invalid");
static_assert(valid(qwen3_30b_a3b), "qwen3_30b_a3b preset is invalid");
static_assert(valid(qwen3_5_moe_micro) && valid(qwen3_5_moe_tiny));
static_assert(valid(generic) && !is_static(generic));
static_assert(is_static(qwen3_6_35b_a3b) && is_static(qwen3_30b_a3b) &&
              is_static(qwen3_5_moe_micro) && is_static(qwen3_5_moe_tiny));

}  // namespace qflash::spec
