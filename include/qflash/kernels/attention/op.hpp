/// @file
/// Causal grouped-query attention of one sequence's new tokens over its paged, possibly
/// compressed keys/values (kv/view.hpp; each head read in its own format):
/// token t sits at position p = n_ctx - n_tokens + t and, for query head h (kv head
/// h / (n_head / n_head_kv)):
///   out[t, h] = sum_{s <= p} softmax_s(scale * q[t, h] . k[s, kv]) * v[s, kv]
/// with k and v the stored vectors decoded (kv_decode). Softmax in fp32. Keys are cached after
/// their norm and RoPE. With a gate (qwen3_5_moe's
/// attention output gate), out[t, h] is then multiplied elementwise by sigmoid(gate[t, h]).
#pragma once

#include <cstdint>

#include "qflash/arch/arch.hpp"
#include "qflash/core/config.hpp"
#include "qflash/core/status.hpp"
#include "qflash/kernels/kv_append/op.hpp"
#include "qflash/kv/view.hpp"
#include "qflash/spec/moe_spec.hpp"

namespace qflash::kernels {

struct AttentionArgs {
  float const* q = nullptr;  // [n_tokens, n_head, d_head]
  kv::KvView kv;             ///< positions [0, n_ctx) written; n_head_kv and d_head as below
  float* out = nullptr;      // [n_tokens, n_head, d_head]
  std::int64_t n_tokens = 0;
  std::int64_t n_ctx = 0;  ///< cached positions incl. the new tokens
  int n_head = 0;
  int n_head_kv = 0;
  int d_head = 0;
  float scale = 1.0f;
  float const* gate = nullptr;         // [n_tokens, n_head, d_head] strided; null: no gate
  std::int64_t gate_token_stride = 0;  ///< floats between tokens of gate
  std::int64_t gate_head_stride = 0;   ///< floats between heads of gate; 0: d_head

  [[nodiscard]] constexpr QFLASH_HD std::int64_t gate_head_stride_or_default() const {
    return gate_head_stride ? gate_head_stride : d_head;
  }
};

/// Checks arguments; head counts and d_head are the spec's when static.
template <MoeSpec S>
[[nodiscard]] constexpr Status can_implement_attention(AttentionArgs const& a) {
  if (!a.q || !a.out || a.n_tokens < 0 || a.n_ctx < a.n_tokens || a.n_head <= 0 || a.n_head_kv <= 0 ||
      a.d_head <= 0 || a.n_head % a.n_head_kv != 0 || a.kv.n_head_kv != a.n_head_kv || a.kv.d_head != a.d_head)
    return Status::kErrorInvalidProblem;
  if (Status s = can_implement_kv_view<S>(a.kv, a.n_ctx); s != Status::kSuccess) return s;
  if (a.gate && (a.gate_head_stride < 0 || (a.gate_head_stride && a.gate_head_stride < a.d_head) ||
                 a.gate_token_stride < (a.n_head - 1) * a.gate_head_stride_or_default() + a.d_head))
    return Status::kErrorInvalidProblem;
  if ((S.d_head != kDynamic && a.d_head != S.d_head) || (S.n_head != kDynamic && a.n_head != S.n_head) ||
      (S.n_head_kv != kDynamic && a.n_head_kv != S.n_head_kv))
    return Status::kErrorInvalidProblem;
  return Status::kSuccess;
}

/// Launchers, one overload per arch tag: cpu.hpp, and sm80.cuh / sm90a.cuh (device memory
/// for every pointer but the view's head layouts, which stay on the host).
template <MoeSpec S>
Status launch_attention(arch::Cpu, AttentionArgs const& args, stream_t stream = nullptr);
template <MoeSpec S>
Status launch_attention(arch::Sm80, AttentionArgs const& args, stream_t stream);
template <MoeSpec S>
Status launch_attention(arch::Sm90a, AttentionArgs const& args, stream_t stream);
template <MoeSpec S, class Arch>
  requires(!arch::implemented_by<Arch, arch::Cpu, arch::Sm80, arch::Sm90a>)
Status launch_attention(Arch, AttentionArgs const&, stream_t = nullptr) {
  static_assert(dependent_false<Arch>, "kernels/attention: no implementation for this arch");
  return Status::kErrorArchMismatch;
}

}  // namespace qflash::kernels
