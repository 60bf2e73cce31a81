// One causal attention call's shape for the attention tests (paged_attention_test,
// attention_mma_tile_test, kv_attention_gpu_test), and its AttentionArgs.
#pragma once

#include <cstdint>

#include "qflash/kernels/attention/op.hpp"
#include "qflash/kv/view.hpp"

namespace qflash::test {

struct AttentionProblem {
  int n_head, n_kv, d;
  std::int64_t n_ctx, n_tokens;
  bool gate = false;  ///< with the output gate
};

/// The call of p over `view` at scale 0.3. gate_rows: null, or the [query | gate] rows of
/// qwen3_5_moe's layout (each head's query, then its gate), read from the first gate on.
inline kernels::AttentionArgs attention_args(AttentionProblem const& p, kv::KvView view, float const* q, float* out,
                                             float const* gate_rows = nullptr) {
  kernels::AttentionArgs a{};
  a.q = q;
  a.kv = view;
  a.out = out;
  a.n_tokens = p.n_tokens;
  a.n_ctx = p.n_ctx;
  a.n_head = p.n_head;
  a.n_head_kv = p.n_kv;
  a.d_head = p.d;
  a.scale = 0.3f;
  if (gate_rows) {
    a.gate = gate_rows + p.d;
    a.gate_head_stride = 2 * p.d;
    a.gate_token_stride = 2 * static_cast<std::int64_t>(p.n_head) * p.d;
  }
  return a;
}

}  // namespace qflash::test
