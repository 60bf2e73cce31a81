/// @file
/// KV quantize-append: the new tokens' keys (after norm and RoPE) and values written into a
/// sequence's paged blocks, each head in its own format (numeric/kv_format.hpp's kv_encode):
///   for t < n_tokens, h < n_head_kv:
///     encode(k[t, h]) -> kv.key(start + t, h),  encode(v[t, h]) -> kv.value(start + t, h)
/// The block table must already cover start + n_tokens positions.
#pragma once

#include <cstdint>

#include "qflash/arch/arch.hpp"
#include "qflash/core/config.hpp"
#include "qflash/core/status.hpp"
#include "qflash/kv/map.hpp"
#include "qflash/kv/view.hpp"
#include "qflash/spec/moe_spec.hpp"

namespace qflash::kernels {

struct KvAppendArgs {
  kv::KvView kv;
  float const* k = nullptr;  // [n_tokens, n_head_kv, d_head]
  float const* v = nullptr;  // [n_tokens, n_head_kv, d_head]
  std::int64_t n_tokens = 0;
  std::int64_t start = 0;  ///< position of the first new token
};

/// Checks that the view is whole, covers the new positions, and holds only formats the
/// spec's KV scheme compiles; head count and d_head are the spec's when static.
template <MoeSpec S>
[[nodiscard]] constexpr Status can_implement_kv_view(kv::KvView const& v, std::int64_t positions) {
  if (!v.base || !v.heads || v.block_tokens <= 0 || v.n_head_kv <= 0 || v.d_head <= 0 || positions < 0 ||
      positions > v.capacity() || (v.n_blocks > 0 && !v.block_table))
    return Status::kErrorInvalidProblem;
  if ((S.d_head != kDynamic && v.d_head != S.d_head) || (S.n_head_kv != kDynamic && v.n_head_kv != S.n_head_kv))
    return Status::kErrorInvalidProblem;
  for (int h = 0; h < v.n_head_kv; ++h)
    if (!kv::allows(S.kv, v.heads[h].k_format) || !kv::allows(S.kv, v.heads[h].v_format))
      return Status::kErrorNotSupported;
  return Status::kSuccess;
}

template <MoeSpec S>
[[nodiscard]] constexpr Status can_implement_kv_append(KvAppendArgs const& a) {
  if (!a.k || !a.v || a.n_tokens < 0 || a.start < 0) return Status::kErrorInvalidProblem;
  return can_implement_kv_view<S>(a.kv, a.start + a.n_tokens);
}

/// Launchers, one overload per arch tag: cpu.hpp, and sm80.cuh / sm90a.cuh (device memory
/// for every pointer but the view's head layouts, which stay on the host).
template <MoeSpec S>
Status launch_kv_append(arch::Cpu, KvAppendArgs const& args, stream_t stream = nullptr);
template <MoeSpec S>
Status launch_kv_append(arch::Sm80, KvAppendArgs const& args, stream_t stream);
template <MoeSpec S>
Status launch_kv_append(arch::Sm90a, KvAppendArgs const& args, stream_t stream);
template <MoeSpec S, class Arch>
  requires(!arch::implemented_by<Arch, arch::Cpu, arch::Sm80, arch::Sm90a>)
Status launch_kv_append(Arch, KvAppendArgs const&, stream_t = nullptr) {
  static_assert(dependent_false<Arch>, "kernels/kv_append: no implementation for this arch");
  return Status::kErrorArchMismatch;
}

}  // namespace qflash::kernels
