/// @file
/// Token embedding lookup: y[t, :] = decode(table row tokens[t]), for a table in any
/// WeightFormat (numeric/weight_format.hpp).
#pragma once

#include <cstdint>

#include "qflash/arch/arch.hpp"
#include "qflash/core/config.hpp"
#include "qflash/core/status.hpp"
#include "qflash/numeric/weight_format.hpp"
#include "qflash/spec/moe_spec.hpp"

namespace qflash::kernels {

struct EmbeddingArgs {
  WeightView table;                      // [vocab, d_model]
  std::int32_t const* tokens = nullptr;  // [n_tokens], each in [0, vocab)
  float* y = nullptr;                    // [n_tokens, d_model]
  std::int64_t n_tokens = 0;
};

/// Checks everything but the token ids (which a CUDA launch cannot read on the host);
/// d_model is the spec's when static.
template <MoeSpec S>
[[nodiscard]] constexpr Status can_implement_embedding_shape(EmbeddingArgs const& a) {
  if (!a.table.data || !a.tokens || !a.y || a.n_tokens < 0 || a.table.rows <= 0 ||
      !row_fits(a.table.format, a.table.cols) ||
      (a.table.format == WeightFormat::kFp8E4m3 && !a.table.scales))
    return Status::kErrorInvalidProblem;
  if (S.d_model != kDynamic && a.table.cols != S.d_model) return Status::kErrorInvalidProblem;
  return Status::kSuccess;
}

/// Checks arguments, token ids included (host memory).
template <MoeSpec S>
[[nodiscard]] constexpr Status can_implement_embedding(EmbeddingArgs const& a) {
  if (Status s = can_implement_embedding_shape<S>(a); s != Status::kSuccess) return s;
  for (std::int64_t t = 0; t < a.n_tokens; ++t)
    if (a.tokens[t] < 0 || a.tokens[t] >= a.table.rows) return Status::kErrorInvalidProblem;
  return Status::kSuccess;
}

/// Launchers, one overload per arch tag: cpu.hpp (checks the ids), and sm80.cuh / sm90a.cuh
/// (device pointers; the ids are not read on the host: an id outside the table gives a row
/// of NaN, which the model's check of its logits reports).
template <MoeSpec S>
Status launch_embedding(arch::Cpu, EmbeddingArgs const& args, stream_t stream = nullptr);
template <MoeSpec S>
Status launch_embedding(arch::Sm80, EmbeddingArgs const& args, stream_t stream);
template <MoeSpec S>
Status launch_embedding(arch::Sm90a, EmbeddingArgs const& args, stream_t stream);
template <MoeSpec S, class Arch>
  requires(!arch::implemented_by<Arch, arch::Cpu, arch::Sm80, arch::Sm90a>)
Status launch_embedding(Arch, EmbeddingArgs const&, stream_t = nullptr) {
  static_assert(dependent_false<Arch>, "kernels/embedding: no implementation for this arch");
  return Status::kErrorArchMismatch;
}

}  // namespace qflash::kernels
