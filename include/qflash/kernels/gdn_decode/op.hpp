/// @file
/// One decode step of Gated DeltaNet for several sequences at once: for each sequence's one
/// new token, the causal conv over q | k | v with its carried conv state and SiLU (as
/// kernels/causal_conv1d), then the gated delta rule's recurrent step on its state (as
/// kernels/gated_delta, kRecurrent), in one pass per q/k head and its value heads. It replaces
/// one causal_conv1d and one gated_delta call per decoding sequence, and gives their results:
/// the same arithmetic in the same order.
///
/// With dt_bias and neg_a set, g and beta come in as the rows' raw a and b projections, and the
/// op first turns them into the gates in place, as kernels/gdn_gates does (its arithmetic bit
/// for bit): a step of decoding sequences alone then needs no gdn_gates call. With norm_weight
/// and z set, each sequence's out row is then normed in place, as kernels/gated_rmsnorm does
/// (y = w ⊙ rmsnorm(o) ⊙ silu(z) per value head, its arithmetic bit for bit), so the step needs
/// no gated_rmsnorm call either.
///
/// Row r = rows[i] of x, g, beta, conv_out and out belongs to sequence i (rows distinct), whose
/// conv state and recurrent state are conv_state[i] and state[i]. The arrays of rows and state
/// pointers are host memory (a CUDA launcher passes them in the kernels' parameters); the rows
/// and states they point at are the arch's.
#pragma once

#include <cstdint>

#include "qflash/arch/arch.hpp"
#include "qflash/core/config.hpp"
#include "qflash/core/status.hpp"
#include "qflash/kernels/causal_conv1d/op.hpp"
#include "qflash/kernels/gated_delta/op.hpp"
#include "qflash/kernels/gated_rmsnorm/op.hpp"
#include "qflash/kernels/gdn_gates/op.hpp"
#include "qflash/spec/moe_spec.hpp"

namespace qflash::kernels {

struct GdnDecodeArgs {
  float const* x = nullptr;            // [.., conv_dim] pre-conv q | k | v rows, conv_dim = 2 n_head_k d_k + n_head_v d_v
  float* g = nullptr;                  // [.., n_head_v] log decay, <= 0 (kernels/gdn_gates); with dt_bias: a, in
  float* beta = nullptr;               // [.., n_head_v]; with dt_bias: b, in
  float* conv_out = nullptr;           // [.., conv_dim] the conv's output rows (q, k, v after SiLU)
  float* out = nullptr;                // [.., n_head_v d_v] o = Sᵀq̂ per value head
  std::int64_t const* rows = nullptr;  // [n_seqs] the row of each sequence's token
  float* const* conv_state = nullptr;  // [n_seqs] each [conv_dim, d_conv - 1], updated
  float* const* state = nullptr;       // [n_seqs] each [n_head_v, d_k, d_v], updated
  float const* conv_weight = nullptr;  // [conv_dim, d_conv]
  float const* dt_bias = nullptr;      // [n_head_v] null: g and beta are the gates already
  float const* neg_a = nullptr;        // [n_head_v] with dt_bias
  float const* norm_weight = nullptr;  // [d_v] null: out is left as the delta rule gives it
  float const* z = nullptr;            // [.., n_head_v d_v] the norm's gate rows, with norm_weight
  float norm_eps = 1e-6f;
  int n_seqs = 0;
  int n_head_k = 0;
  int n_head_v = 0;
  int d_k = 0;
  int d_v = 0;
  int d_conv = 0;
  float l2norm_eps = 1e-6f;
  bool tiled_value_heads = false;  ///< value head j reads q/k head j % n_head_k (GGUF order)

  /// The q/k head value head h reads, and the value head j of those reading q/k head kh
  /// (gdn::key_head, gdn::value_head).
  [[nodiscard]] constexpr QFLASH_HD int key_head(int h) const {
    return gdn::key_head(h, n_head_k, n_head_v, tiled_value_heads);
  }
  [[nodiscard]] constexpr QFLASH_HD int value_head(int kh, int j) const {
    return gdn::value_head(kh, j, n_head_k, n_head_v, tiled_value_heads);
  }
  /// 1 / sqrt(d_k) (gdn::q_scale).
  [[nodiscard]] QFLASH_HD float q_scale() const { return gdn::q_scale(d_k); }

  [[nodiscard]] QFLASH_HD std::int64_t conv_dim() const {
    return 2 * std::int64_t{n_head_k} * d_k + std::int64_t{n_head_v} * d_v;
  }

  /// The causal_conv1d call this op makes for the sequence whose token is row `row`, with conv
  /// state `state` (null when d_conv == 1).
  [[nodiscard]] QFLASH_HD CausalConv1dArgs conv_args(std::int64_t row, float* state) const {
    CausalConv1dArgs c{};
    c.x = x + row * conv_dim();
    c.weight = conv_weight;
    c.state = d_conv > 1 ? state : nullptr;
    c.y = conv_out + row * conv_dim();
    c.n_tokens = 1;
    c.n_channels = static_cast<int>(conv_dim());
    c.d_conv = d_conv;
    return c;
  }

  /// The gdn_gates call this op makes for row `row` when dt_bias is set.
  [[nodiscard]] QFLASH_HD GdnGatesArgs gates_args(std::int64_t row) const {
    return {beta + row * n_head_v, g + row * n_head_v, dt_bias, neg_a, 1, n_head_v};
  }

  /// The gated_rmsnorm call this op makes for row `row` when norm_weight is set.
  [[nodiscard]] QFLASH_HD GatedRmsNormArgs norm_args(std::int64_t row) const {
    std::int64_t const at = row * n_head_v * std::int64_t{d_v};
    return {out + at, z + at, norm_weight, out + at, n_head_v, d_v, norm_eps};
  }

  /// The recurrent gated_delta call this op makes for the sequence whose token is row `row`,
  /// with recurrent state `s`: q, k and v read from that row of conv_out.
  [[nodiscard]] QFLASH_HD GatedDeltaArgs delta_args(std::int64_t row, float* s) const {
    std::int64_t const cd = conv_dim(), key_dim = std::int64_t{n_head_k} * d_k;
    GatedDeltaArgs d{};
    d.q = conv_out + row * cd;
    d.k = d.q + key_dim;
    d.v = d.q + 2 * key_dim;
    d.q_stride = d.k_stride = d.v_stride = cd;
    d.g = g + row * n_head_v;
    d.beta = beta + row * n_head_v;
    d.state = s;
    d.out = out + row * std::int64_t{n_head_v} * d_v;
    d.n_tokens = 1;
    d.n_head_k = n_head_k;
    d.n_head_v = n_head_v;
    d.d_k = d_k;
    d.d_v = d_v;
    d.l2norm_eps = l2norm_eps;
    d.tiled_value_heads = tiled_value_heads;
    d.form = DeltaRuleForm::kRecurrent;
    return d;
  }
};

/// Checks arguments (not the rows' or states' extents, which live behind the pointer arrays):
/// every sequence has its own row, state and conv state (sequences sharing one would race);
/// head counts and dims must equal the spec's linear-attention fields when those are static.
template <MoeSpec S>
[[nodiscard]] inline Status can_implement_gdn_decode(GdnDecodeArgs const& a) {
  if (a.n_seqs < 0) return Status::kErrorInvalidProblem;
  if (a.n_seqs == 0) return Status::kSuccess;
  if (!a.x || !a.g || !a.beta || !a.conv_out || !a.out || !a.rows || !a.state || !a.conv_weight ||
      (a.d_conv > 1 && !a.conv_state))
    return Status::kErrorInvalidProblem;
  if (a.n_head_k <= 0 || a.n_head_v <= 0 || a.d_k <= 0 || a.d_v <= 0 || a.d_conv <= 0 ||
      a.n_head_v % a.n_head_k != 0 || !(a.l2norm_eps >= 0.0f))
    return Status::kErrorInvalidProblem;
  if (a.x == a.conv_out || a.out == a.conv_out || a.out == a.x) return Status::kErrorInvalidProblem;
  for (int i = 0; i < a.n_seqs; ++i)
    if (a.rows[i] < 0 || !a.state[i] || (a.d_conv > 1 && !a.conv_state[i])) return Status::kErrorInvalidProblem;
  if (!gdn::distinct(a.rows, a.n_seqs) || !gdn::distinct(a.state, a.n_seqs) ||
      (a.d_conv > 1 && !gdn::distinct(a.conv_state, a.n_seqs)))
    return Status::kErrorInvalidProblem;
  if (!a.dt_bias != !a.neg_a || (a.dt_bias && a.g == a.beta)) return Status::kErrorInvalidProblem;
  if (!a.norm_weight != !a.z || (a.norm_weight && !(a.norm_eps >= 0.0f))) return Status::kErrorInvalidProblem;
  // The norm's rows of z and out sit at the same offsets: one row's overlap is every row's.
  if (std::int64_t const row_bytes = std::int64_t{a.n_head_v} * a.d_v * std::int64_t{sizeof(float)};
      a.norm_weight && gdn::ranges_overlap(a.out, row_bytes, a.z, row_bytes))
    return Status::kErrorInvalidProblem;
  if ((S.n_head_k_linear != kDynamic && a.n_head_k != S.n_head_k_linear) ||
      (S.n_head_v_linear != kDynamic && a.n_head_v != S.n_head_v_linear) ||
      (S.d_head_k_linear != kDynamic && a.d_k != S.d_head_k_linear) ||
      (S.d_head_v_linear != kDynamic && a.d_v != S.d_head_v_linear) ||
      (S.d_conv != kDynamic && a.d_conv != S.d_conv))
    return Status::kErrorInvalidProblem;
  return Status::kSuccess;
}

/// Launchers, one overload per arch tag: cpu.hpp, and sm80.cuh / sm90a.cuh (device rows and
/// states, host arrays of them).
template <MoeSpec S>
Status launch_gdn_decode(arch::Cpu, GdnDecodeArgs const& args, stream_t stream = nullptr);
template <MoeSpec S>
Status launch_gdn_decode(arch::Sm80, GdnDecodeArgs const& args, stream_t stream);
template <MoeSpec S>
Status launch_gdn_decode(arch::Sm90a, GdnDecodeArgs const& args, stream_t stream);
template <MoeSpec S, class Arch>
  requires(!arch::implemented_by<Arch, arch::Cpu, arch::Sm80, arch::Sm90a>)
Status launch_gdn_decode(Arch, GdnDecodeArgs const&, stream_t = nullptr) {
  static_assert(dependent_false<Arch>, "kernels/gdn_decode: no implementation for this arch");
  return Status::kErrorArchMismatch;
}

}  // namespace qflash::kernels
