/// @file
/// Which format each weight matrix gets: `--weights` names a scheme (one format everywhere,
/// or a mix such as q4_k_m), and `format_for` turns (scheme, the matrix's role, its width,
/// the format it is stored in) into the format it is bound in. f32 and bf16 convert every
/// matrix (what casting the model gives); in the quantized schemes the router and the
/// shared-expert gate keep the checkpoint's precision. A format a row width
/// cannot hold (GGUF blocks need whole blocks of 32 or 256) falls back as llama.cpp's
/// quantizer does: q4_k/q6_k -> q8_0 -> bf16. `plan_weights` applies the same rules to a
/// config alone, so `inspect` can size a model without its weights.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "qflash/core/error.hpp"
#include "qflash/model/config.hpp"
#include "qflash/numeric/weight_format.hpp"

namespace qflash::runtime {

enum class WeightScheme { kAuto, kF32, kBf16, kFp8, kQ8_0, kQ4K, kQ6K, kQ4KM, kInt4 };

inline constexpr std::array<std::pair<WeightScheme, std::string_view>, 9> kWeightSchemes{{
    {WeightScheme::kAuto, "auto"},
    {WeightScheme::kF32, "f32"},
    {WeightScheme::kBf16, "bf16"},
    {WeightScheme::kFp8, "fp8"},
    {WeightScheme::kQ8_0, "q8_0"},
    {WeightScheme::kQ4K, "q4_k"},
    {WeightScheme::kQ6K, "q6_k"},
    {WeightScheme::kQ4KM, "q4_k_m"},
    {WeightScheme::kInt4, "int4"},
}};

constexpr std::string_view to_string(WeightScheme s) {
  for (auto const& [k, name] : kWeightSchemes)
    if (k == s) return name;
  return "unknown";
}

/// "auto", "bf16", "q4_k_m", ...; throws Error listing the choices otherwise.
inline WeightScheme parse_weight_scheme(std::string_view name) {
  std::string choices;
  for (auto const& [k, n] : kWeightSchemes) {
    if (n == name) return k;
    choices += (choices.empty() ? "" : ", ") + std::string(n);
  }
  QFLASH_CHECK(false, "unknown weight scheme '", name, "' (expected one of: ", choices, ")");
  return WeightScheme::kAuto;
}

/// What a matrix does, which is what a mixed scheme decides by.
enum class WeightRole {
  kEmbedding,
  kLmHead,
  kAttentionQkv,     ///< q_proj, k_proj (full attention)
  kAttentionV,       ///< v_proj
  kAttentionOut,     ///< o_proj
  kDeltaNetIn,       ///< in_proj_qkv, in_proj_z, in_proj_a, in_proj_b
  kDeltaNetOut,      ///< out_proj
  kRouter,           ///< mlp.gate and shared_expert_gate: kept as stored when quantizing
  kExpert,           ///< routed experts' gate/up/down
  kSharedExpert,     ///< the shared expert's gate/up/down
};

namespace detail {
/// The scheme's choice before the row-width check.
constexpr WeightFormat wanted_format(WeightScheme s, WeightRole role, WeightFormat stored) {
  bool const quantized = s != WeightScheme::kAuto && s != WeightScheme::kF32 && s != WeightScheme::kBf16;
  if (role == WeightRole::kRouter && quantized)
    return stored == WeightFormat::kFp8E4m3 ? WeightFormat::kBf16 : stored;
  switch (s) {
    case WeightScheme::kAuto: return stored;
    case WeightScheme::kF32: return WeightFormat::kF32;
    case WeightScheme::kBf16: return WeightFormat::kBf16;
    case WeightScheme::kFp8:  // Qwen's FP8 checkpoints keep the embedding and lm_head in bf16
      return role == WeightRole::kEmbedding || role == WeightRole::kLmHead ? WeightFormat::kBf16
                                                                         : WeightFormat::kFp8E4m3;
    case WeightScheme::kQ8_0: return WeightFormat::kQ8_0;
    case WeightScheme::kQ4K: return WeightFormat::kQ4K;
    case WeightScheme::kQ6K: return WeightFormat::kQ6K;
    case WeightScheme::kQ4KM:
      switch (role) {
        case WeightRole::kEmbedding:
        case WeightRole::kLmHead:
        case WeightRole::kAttentionV:
        case WeightRole::kAttentionOut:
        case WeightRole::kDeltaNetOut:
        case WeightRole::kSharedExpert: return WeightFormat::kQ6K;
        default: return WeightFormat::kQ4K;
      }
    case WeightScheme::kInt4: return WeightFormat::kInt4;
  }
  return stored;
}
}  // namespace detail

/// The format a matrix of `cols` columns stored as `stored` is bound in under scheme `s`.
constexpr WeightFormat format_for(WeightScheme s, WeightRole role, std::int64_t cols, WeightFormat stored) {
  WeightFormat f = detail::wanted_format(s, role, stored);
  if ((f == WeightFormat::kQ4K || f == WeightFormat::kQ6K) && !row_fits(f, cols)) f = WeightFormat::kQ8_0;
  if (f == WeightFormat::kQ8_0 && !row_fits(f, cols)) f = WeightFormat::kBf16;
  return f;
}

/// Resident bytes of a model's matrices per format, from its config alone.
struct WeightPlan {
  std::map<WeightFormat, std::int64_t> bytes;     ///< matrix bytes (fp8 scales included)
  std::map<WeightFormat, std::int64_t> matrices;  ///< matrix count
  std::int64_t vector_bytes = 0;                  ///< norms, conv, gate parameters (fp32)

  [[nodiscard]] std::int64_t total_bytes() const {
    std::int64_t n = vector_bytes;
    for (auto const& [f, b] : bytes) n += b;
    return n;
  }
};

/// The format a config says its checkpoint's matrices are stored in (its torch_dtype; f32
/// when absent, PyTorch's default): what plan_weights takes as `stored` without the files.
inline WeightFormat stored_format(model::ModelConfig const& c) {
  return c.dtype == DType::kBF16 ? WeightFormat::kBf16 : c.dtype == DType::kF16 ? WeightFormat::kF16 : WeightFormat::kF32;
}

/// Bytes of one [rows, cols] matrix in format f, as bound (fp8 with its fp32 scale grid).
constexpr std::int64_t matrix_bytes(WeightFormat f, std::int64_t rows, std::int64_t cols) {
  std::int64_t b = rows * row_bytes(f, cols);
  if (f == WeightFormat::kFp8E4m3) b += fp8_scale_blocks(rows) * fp8_scale_blocks(cols) * 4;
  return b;
}

/// The plan for `cfg` under scheme `s`, with every matrix stored as `stored` (the checkpoint's
/// dtype; bf16 for a config alone).
inline WeightPlan plan_weights(model::ModelConfig const& c, WeightScheme s, WeightFormat stored) {
  WeightPlan p;
  auto add = [&](WeightRole role, std::int64_t rows, std::int64_t cols, std::int64_t count = 1) {
    WeightFormat const f = format_for(s, role, cols, stored);
    p.bytes[f] += count * matrix_bytes(f, rows, cols);
    p.matrices[f] += count;
  };
  std::int64_t const d = c.d_model;
  add(WeightRole::kEmbedding, c.vocab, d);
  if (!c.tie_word_embeddings) add(WeightRole::kLmHead, c.vocab, d);
  p.vector_bytes += 4 * d;
  for (int l = 0; l < c.n_layer; ++l) {
    p.vector_bytes += 8 * d;
    if (c.layer_types[static_cast<std::size_t>(l)] == model::LayerKind::kFullAttention) {
      std::int64_t const q = std::int64_t{c.n_head} * c.d_head, kv = std::int64_t{c.n_head_kv} * c.d_head;
      add(WeightRole::kAttentionQkv, q * (c.attn_output_gate ? 2 : 1), d);
      add(WeightRole::kAttentionQkv, kv, d);
      add(WeightRole::kAttentionV, kv, d);
      add(WeightRole::kAttentionOut, d, q);
      p.vector_bytes += 8 * std::int64_t{c.d_head};
    } else {
      std::int64_t const value = c.linear_value_dim(), conv = c.linear_conv_dim();
      add(WeightRole::kDeltaNetIn, conv, d);
      add(WeightRole::kDeltaNetIn, value, d);
      add(WeightRole::kDeltaNetIn, c.n_head_v_linear, d, 2);
      add(WeightRole::kDeltaNetOut, d, value);
      p.vector_bytes += 4 * (conv * c.d_conv + 2 * c.n_head_v_linear + c.d_head_v_linear);
    }
    add(WeightRole::kRouter, c.n_expert + (c.d_ff_shared > 0 ? 1 : 0), d);
    add(WeightRole::kExpert, c.d_ff_expert, d, 2 * std::int64_t{c.n_expert});
    add(WeightRole::kExpert, d, c.d_ff_expert, c.n_expert);
    if (c.d_ff_shared > 0) {
      add(WeightRole::kSharedExpert, c.d_ff_shared, d, 2);
      add(WeightRole::kSharedExpert, d, c.d_ff_shared);
    }
  }
  return p;
}

}  // namespace qflash::runtime
