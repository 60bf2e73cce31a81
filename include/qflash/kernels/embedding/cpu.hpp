/// @file
/// CPU kernels/embedding: rows decoded by the format's dequantization (the reference
/// itself: a lookup has nothing to reorder), threaded over tokens.
#pragma once

#include "qflash/core/parallel.hpp"
#include "qflash/kernels/embedding/op.hpp"

namespace qflash::kernels::cpu {

/// The op (no spec field changes it); arguments already checked.
inline Status embedding(EmbeddingArgs const& a) {
  std::int64_t const d = a.table.cols;
  parallel_for(0, a.n_tokens, d, [&](std::int64_t t) { dequantize_row(a.table, a.tokens[t], a.y + t * d); });
  return Status::kSuccess;
}

}  // namespace qflash::kernels::cpu

namespace qflash::kernels {

template <MoeSpec S>
Status launch_embedding(arch::Cpu, EmbeddingArgs const& a, stream_t) {
  if (Status s = can_implement_embedding<S>(a); s != Status::kSuccess) return s;
  return cpu::embedding(a);
}

}  // namespace qflash::kernels
