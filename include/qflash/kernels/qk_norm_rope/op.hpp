/// @file
/// The per-head query/key norm of full attention fused with partial NeoX RoPE:
///   x̂ = x[t, h, :] * rsqrt(mean(x[t, h, :]^2) + eps) * w'     (w' = w or 1 + w, fp32)
///   y[t, h, :] = rope(x̂, positions[t])   on dims [0, rotary_dim), as kernels/rope/op.hpp
/// Input heads may be strided (q is read straight out of the [query | gate] projection rows);
/// the output is dense [n_tokens, n_head, d_head]. RoPE angles are fp32 products
/// position * inv_freq[j], as the reference model computes them.
/// A second set of heads (`keys`: attention's keys beside its queries) may ride in the same
/// call, with its own input, weight and output and the same positions, d_head, RoPE and eps:
/// the op then does for it what a call of its own would (keys_call()), in the same launch, so
/// one set's output may not overlap the other set's input or output.
#pragma once

#include <cstdint>

#include "qflash/arch/arch.hpp"
#include "qflash/core/config.hpp"
#include "qflash/core/status.hpp"
#include "qflash/kernels/add_rmsnorm/op.hpp"  // NormWeight
#include "qflash/kernels/gated_delta/common.hpp"  // gdn::ranges_overlap
#include "qflash/spec/moe_spec.hpp"

namespace qflash::kernels {

/// A second set of heads for one call (QkNormRopeArgs::keys): fields as the call's own.
struct QkNormRopeHeads {
  float const* x = nullptr;  ///< null: no second set
  std::int64_t token_stride = 0;
  std::int64_t head_stride = 0;
  float const* weight = nullptr;
  float* y = nullptr;
  int n_head = 0;
};

struct QkNormRopeArgs {
  float const* x = nullptr;       // [n_tokens, n_head, d_head], strided as below
  std::int64_t token_stride = 0;  ///< floats between tokens of x; 0: n_head * head_stride
  std::int64_t head_stride = 0;   ///< floats between heads of x; 0: d_head
  float const* weight = nullptr;  // [d_head] norm weight shared by the heads
  float* y = nullptr;             // [n_tokens, n_head, d_head]; may be x when x is dense
  std::int64_t const* positions = nullptr;  // [n_tokens]
  std::int64_t n_tokens = 0;
  int n_head = 0;
  int d_head = 0;
  int rotary_dim = 0;  ///< even, <= d_head; 0 skips RoPE
  float theta = 10000.0f;
  float eps = 1e-6f;
  NormWeight weight_kind = NormWeight::kPlain;
  QkNormRopeHeads keys;  ///< optional second set of heads

  /// head_stride and token_stride with their defaults resolved.
  [[nodiscard]] constexpr QFLASH_HD std::int64_t head_stride_or_default() const {
    return head_stride ? head_stride : d_head;
  }
  [[nodiscard]] constexpr QFLASH_HD std::int64_t token_stride_or_default() const {
    return token_stride ? token_stride : n_head * head_stride_or_default();
  }

  /// The call of its own that the second set stands for (its `keys` empty).
  [[nodiscard]] constexpr QFLASH_HD QkNormRopeArgs keys_call() const {
    QkNormRopeArgs k = *this;
    k.x = keys.x, k.token_stride = keys.token_stride, k.head_stride = keys.head_stride;
    k.weight = keys.weight, k.y = keys.y, k.n_head = keys.n_head;
    k.keys = {};
    return k;
  }
};

/// Checks arguments; d_head is the spec's when static.
template <MoeSpec S>
[[nodiscard]] inline Status can_implement_qk_norm_rope(QkNormRopeArgs const& a) {
  // The bytes a call reads and writes.
  auto in_bytes = [](QkNormRopeArgs const& c) {
    std::int64_t const last =
        (c.n_tokens - 1) * c.token_stride_or_default() + (c.n_head - 1) * c.head_stride_or_default();
    return c.n_tokens > 0 ? (last + c.d_head) * std::int64_t{sizeof(float)} : 0;
  };
  auto out_bytes = [](QkNormRopeArgs const& c) { return c.n_tokens * c.n_head * c.d_head * std::int64_t{sizeof(float)}; };
  using gdn::ranges_overlap;
  if (a.keys.x) {
    QkNormRopeArgs const k = a.keys_call();
    if (Status s = can_implement_qk_norm_rope<S>(k); s != Status::kSuccess) return s;
    // One set's writes must miss the other's.
    if (ranges_overlap(a.y, out_bytes(a), k.y, out_bytes(k)) || ranges_overlap(a.y, out_bytes(a), k.x, in_bytes(k)) ||
        ranges_overlap(k.y, out_bytes(k), a.x, in_bytes(a)))
      return Status::kErrorInvalidProblem;
  }
  if (!a.x || !a.weight || !a.y || !a.positions || a.n_tokens < 0 || a.n_head <= 0 ||
      a.d_head <= 0 || a.rotary_dim < 0 || a.rotary_dim % 2 != 0 || a.rotary_dim > a.d_head ||
      !(a.theta > 0) || !(a.eps >= 0))
    return Status::kErrorInvalidProblem;
  std::int64_t const hs = a.head_stride_or_default(), ts = a.token_stride_or_default();
  if (hs < a.d_head || ts < (a.n_head - 1) * hs + a.d_head) return Status::kErrorInvalidProblem;
  // In place: y is x, dense; otherwise apart.
  if (a.y == a.x ? hs != a.d_head || ts != a.n_head * hs : ranges_overlap(a.y, out_bytes(a), a.x, in_bytes(a)))
    return Status::kErrorInvalidProblem;
  if (S.d_head != kDynamic && a.d_head != S.d_head) return Status::kErrorInvalidProblem;
  return Status::kSuccess;
}

/// Launchers, one overload per arch tag: cpu.hpp, and sm80.cuh / sm90a.cuh (device pointers).
template <MoeSpec S>
Status launch_qk_norm_rope(arch::Cpu, QkNormRopeArgs const& args, stream_t stream = nullptr);
template <MoeSpec S>
Status launch_qk_norm_rope(arch::Sm80, QkNormRopeArgs const& args, stream_t stream);
template <MoeSpec S>
Status launch_qk_norm_rope(arch::Sm90a, QkNormRopeArgs const& args, stream_t stream);
template <MoeSpec S, class Arch>
  requires(!arch::implemented_by<Arch, arch::Cpu, arch::Sm80, arch::Sm90a>)
Status launch_qk_norm_rope(Arch, QkNormRopeArgs const&, stream_t = nullptr) {
  static_assert(dependent_false<Arch>, "kernels/qk_norm_rope: no implementation for this arch");
  return Status::kErrorArchMismatch;
}

}  // namespace qflash::kernels
