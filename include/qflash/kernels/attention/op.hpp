/// @file
/// Causal grouped-query attention of one sequence's new tokens over its cached keys/values:
/// token t sits at position p = n_ctx - n_tokens + t and, for query head h (kv head
/// h / (n_head / n_head_kv)):
///   out[t, h] = sum_{s <= p} softmax_s(scale * q[t, h] . k[s, kv]) * v[s, kv]
/// Softmax in fp32. Keys are cached after their norm and RoPE.
#pragma once

#include <cstdint>

#include "qflash/arch/arch.hpp"
#include "qflash/core/config.hpp"
#include "qflash/core/status.hpp"
#include "qflash/spec/moe_spec.hpp"

namespace qflash::kernels {

struct AttentionArgs {
  float const* q = nullptr;  // [n_tokens, n_head, d_head]
  float const* k = nullptr;  // [n_ctx, n_head_kv, d_head]
  float const* v = nullptr;  // [n_ctx, n_head_kv, d_head]
  float* out = nullptr;      // [n_tokens, n_head, d_head]
  std::int64_t n_tokens = 0;
  std::int64_t n_ctx = 0;  ///< cached positions incl. the new tokens
  int n_head = 0;
  int n_head_kv = 0;
  int d_head = 0;
  float scale = 1.0f;
};

[[nodiscard]] inline Status can_implement_attention(AttentionArgs const& a) {
  if (!a.q || !a.k || !a.v || !a.out || a.n_tokens < 0 || a.n_ctx < a.n_tokens ||
      a.n_head <= 0 || a.n_head_kv <= 0 || a.d_head <= 0 || a.n_head % a.n_head_kv != 0)
    return Status::kErrorInvalidProblem;
  return Status::kSuccess;
}

template <MoeSpec S>
Status launch_attention(arch::Cpu, AttentionArgs const& args, stream_t stream = nullptr);

}  // namespace qflash::kernels
