/// @file
/// The gated delta rule of Gated DeltaNet (MODELS.md §3c.5-7) for one sequence, all heads.
///
/// Value head j reads q/k head floor(j / r), r = n_head_v / n_head_k ("grouped", Hugging Face's
/// order), or j mod n_head_k with `tiled_value_heads` (the order llama.cpp's converter stores).
/// Per value head, with the state S [d_k, d_v] (indexed [k-dim][v-dim]) and, for each token t in order,
///   q̂ = l2norm(q_t) / sqrt(d_k),  k̂ = l2norm(k_t),  l2norm(x) = x * rsqrt(sum(x^2) + eps)
///   S ← e^{g_t} S;  u = Sᵀk̂;  δ = β_t (v_t − u);  S ← S + k̂ δᵀ;  o_t = Sᵀq̂
/// i.e. S_t = (I − β_t k̂k̂ᵀ) e^{g_t} S_{t−1} + β_t k̂ v_tᵀ. `state` carries S between calls, so a
/// sequence split over several calls gives the same outputs as one call.
///
/// Two forms compute the same result up to fp32 rounding:
/// - kRecurrent: the per-token recurrence above (decode, and the reference for the other).
/// - kChunked: the chunkwise-parallel (WY) form used by FLA / transformers'
///   torch_chunk_gated_delta_rule. Within a chunk of C tokens, γ_i = Σ_{s≤i} g_s,
///   Γ_ij = e^{γ_i − γ_j} (j ≤ i), A = I + strictlower(diag(β) K Kᵀ ⊙ Γ),
///   U = A⁻¹ diag(β) V, W = A⁻¹ diag(β e^γ) K, V' = U − W S,
///   O = (Q ⊙ e^γ) S + ((Q Kᵀ) ⊙ Γ) V',  S ← e^{γ_C} S + (K ⊙ e^{γ_C − γ})ᵀ V'.
///   Chunks start at the first token of each call; a trailing partial chunk is handled as a
///   shorter chunk (equivalent to zero padding with β = 0, g = 0, which leaves S unchanged).
///   Γ is formed as products of per-token decays, so g must be <= 0 (as the model's
///   -exp(A_log) * softplus(.) is): g > 0 would let Γ and e^γ overflow.
/// Everything is fp32.
#pragma once

#include <cstdint>
#include <string_view>

#include "qflash/arch/arch.hpp"
#include "qflash/core/config.hpp"
#include "qflash/core/status.hpp"
#include "qflash/kernels/gated_delta/common.hpp"
#include "qflash/spec/moe_spec.hpp"

namespace qflash::kernels {

/// Largest chunk the chunked form accepts: scratch grows as chunk^2 and the A⁻¹ solve loses
/// accuracy on long chunks (FLA and transformers use 64).
inline constexpr int kMaxDeltaChunk = 1024;

enum class DeltaRuleForm : int {
  kRecurrent = 0,  ///< token by token; O(d_k d_v) per token and head
  kChunked = 1,    ///< chunkwise WY form; for prefill
};

constexpr std::string_view to_string(DeltaRuleForm f) {
  switch (f) {
    case DeltaRuleForm::kRecurrent: return "recurrent";
    case DeltaRuleForm::kChunked: return "chunked";
  }
  return "unknown";
}

struct GatedDeltaArgs {
  float const* q = nullptr;     // [n_tokens, n_head_k, d_k] raw (post-conv); kernel applies l2norm and 1/sqrt(d_k)
  float const* k = nullptr;     // [n_tokens, n_head_k, d_k] raw; kernel applies l2norm
  float const* v = nullptr;     // [n_tokens, n_head_v, d_v]
  float const* g = nullptr;     // [n_tokens, n_head_v] log decay, <= 0 (-exp(A_log) * softplus(a + dt_bias))
  float const* beta = nullptr;  // [n_tokens, n_head_v] (sigmoid(b))
  float* state = nullptr;       // [n_head_v, d_k, d_v] S per value head, in/out; zeros at sequence start
  float* out = nullptr;         // [n_tokens, n_head_v, d_v]; must not overlap any other operand
  std::int64_t n_tokens = 0;
  int n_head_k = 0;
  int n_head_v = 0;
  int d_k = 0;
  int d_v = 0;
  float l2norm_eps = 1e-6f;
  /// Floats between consecutive tokens of q, k, v (heads stay contiguous within a token);
  /// 0 = dense (n_head_k * d_k, n_head_k * d_k, n_head_v * d_v). Lets q, k, v be read straight
  /// out of the conv output [n_tokens, 2 * n_head_k * d_k + n_head_v * d_v].
  std::int64_t q_stride = 0;
  std::int64_t k_stride = 0;
  std::int64_t v_stride = 0;
  bool tiled_value_heads = false;  ///< value head j reads q/k head j % n_head_k (GGUF order)
  DeltaRuleForm form = DeltaRuleForm::kChunked;
  /// Tokens per chunk of the chunked form, in [1, kMaxDeltaChunk] (ignored by kRecurrent); a
  /// call shorter than one chunk runs as one chunk of n_tokens.
  int chunk_size = 64;

  /// Token strides with 0 resolved to the dense rows.
  [[nodiscard]] constexpr QFLASH_HD std::int64_t q_stride_or_default() const {
    return q_stride ? q_stride : std::int64_t{n_head_k} * d_k;
  }
  [[nodiscard]] constexpr QFLASH_HD std::int64_t k_stride_or_default() const {
    return k_stride ? k_stride : std::int64_t{n_head_k} * d_k;
  }
  [[nodiscard]] constexpr QFLASH_HD std::int64_t v_stride_or_default() const {
    return v_stride ? v_stride : std::int64_t{n_head_v} * d_v;
  }
  /// The q/k head value head h reads (gdn::key_head).
  [[nodiscard]] constexpr QFLASH_HD int key_head(int h) const {
    return gdn::key_head(h, n_head_k, n_head_v, tiled_value_heads);
  }
  /// 1 / sqrt(d_k) (gdn::q_scale).
  [[nodiscard]] QFLASH_HD float q_scale() const { return gdn::q_scale(d_k); }
};

/// Checks arguments; head counts and dims must equal the spec's linear-attention fields when
/// those are static.
template <MoeSpec S>
[[nodiscard]] inline Status can_implement_gated_delta(GatedDeltaArgs const& a) {
  if (!a.q || !a.k || !a.v || !a.g || !a.beta || !a.state || !a.out)
    return Status::kErrorInvalidProblem;
  if (a.n_tokens <= 0 || a.n_head_k <= 0 || a.n_head_v <= 0 || a.d_k <= 0 || a.d_v <= 0 ||
      a.n_head_v % a.n_head_k != 0 || !(a.l2norm_eps >= 0.0f))
    return Status::kErrorInvalidProblem;
  if (a.form != DeltaRuleForm::kRecurrent && a.form != DeltaRuleForm::kChunked) return Status::kErrorInvalidProblem;
  if (a.form == DeltaRuleForm::kChunked && (a.chunk_size < 1 || a.chunk_size > kMaxDeltaChunk))
    return Status::kErrorInvalidProblem;
  std::int64_t const qk_row = std::int64_t{a.n_head_k} * a.d_k;
  std::int64_t const v_row = std::int64_t{a.n_head_v} * a.d_v;
  if (a.q_stride < 0 || a.k_stride < 0 || a.v_stride < 0 || (a.q_stride && a.q_stride < qk_row) ||
      (a.k_stride && a.k_stride < qk_row) || (a.v_stride && a.v_stride < v_row))
    return Status::kErrorInvalidProblem;
  if ((S.n_head_k_linear != kDynamic && a.n_head_k != S.n_head_k_linear) ||
      (S.n_head_v_linear != kDynamic && a.n_head_v != S.n_head_v_linear) ||
      (S.d_head_k_linear != kDynamic && a.d_k != S.d_head_k_linear) ||
      (S.d_head_v_linear != kDynamic && a.d_v != S.d_head_v_linear))
    return Status::kErrorInvalidProblem;
  // Extents in bytes of every operand, for the overlap rules.
  constexpr std::int64_t kF = sizeof(float);
  auto extent = [&](std::int64_t stride, std::int64_t row) { return ((a.n_tokens - 1) * stride + row) * kF; };
  std::int64_t const q_bytes = extent(a.q_stride_or_default(), qk_row);
  std::int64_t const k_bytes = extent(a.k_stride_or_default(), qk_row);
  std::int64_t const v_bytes = extent(a.v_stride_or_default(), v_row), out_bytes = a.n_tokens * v_row * kF;
  std::int64_t const gb_bytes = a.n_tokens * a.n_head_v * kF;
  std::int64_t const state_bytes = std::int64_t{a.n_head_v} * a.d_k * a.d_v * kF;
  using gdn::ranges_overlap;
  if (ranges_overlap(a.out, out_bytes, a.q, q_bytes) || ranges_overlap(a.out, out_bytes, a.k, k_bytes) ||
      ranges_overlap(a.out, out_bytes, a.v, v_bytes) || ranges_overlap(a.out, out_bytes, a.g, gb_bytes) ||
      ranges_overlap(a.out, out_bytes, a.beta, gb_bytes) ||
      ranges_overlap(a.out, out_bytes, a.state, state_bytes) ||
      ranges_overlap(a.state, state_bytes, a.q, q_bytes) ||
      ranges_overlap(a.state, state_bytes, a.k, k_bytes) ||
      ranges_overlap(a.state, state_bytes, a.v, v_bytes) || ranges_overlap(a.state, state_bytes, a.g, gb_bytes) ||
      ranges_overlap(a.state, state_bytes, a.beta, gb_bytes))
    return Status::kErrorInvalidProblem;
  return Status::kSuccess;
}

/// Runs the delta rule in `args.form`: on the CPU (cpu.hpp), and on CUDA (sm80.cuh /
/// sm90a.cuh, device pointers, d_k <= 256; a call of at most 16 tokens runs the recurrence,
/// and chunks there hold at most 64 tokens: device.cuh). Any other arch stops the build.
template <MoeSpec S>
Status launch_gated_delta(arch::Cpu, GatedDeltaArgs const& args, stream_t stream = nullptr);
template <MoeSpec S>
Status launch_gated_delta(arch::Sm80, GatedDeltaArgs const& args, stream_t stream);
template <MoeSpec S>
Status launch_gated_delta(arch::Sm90a, GatedDeltaArgs const& args, stream_t stream);
template <MoeSpec S, class Arch>
  requires(!arch::implemented_by<Arch, arch::Cpu, arch::Sm80, arch::Sm90a>)
Status launch_gated_delta(Arch, GatedDeltaArgs const&, stream_t = nullptr) {
  static_assert(dependent_false<Arch>, "kernels/gated_delta: no implementation for this arch");
  return Status::kErrorArchMismatch;
}

}  // namespace qflash::kernels
