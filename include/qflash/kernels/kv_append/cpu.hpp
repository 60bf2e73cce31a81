/// @file
/// CPU kernels/kv_append: one (token, head) pair per work item, each vector encoded by
/// kv_encode. Appending costs a few operations per value, next to the projections that
/// produced the values (d_model multiply-adds each).
#pragma once

#include "qflash/core/parallel.hpp"
#include "qflash/kernels/kv_append/op.hpp"

namespace qflash::kernels {

namespace cpu {

/// Work item (token t, head h) of the op under KV scheme Scheme, heads of d.
template <KvScheme Scheme>
void kv_append_item(KvAppendArgs const& a, int d, std::int64_t t, int h) {
  kv::KvHeadLayout const& hl = a.kv.heads[h];
  std::int64_t const row = (t * a.kv.n_head_kv + h) * d;
  kv_encode(kv::compiled_format(Scheme, hl.k_format), a.k + row, d, a.kv.key(a.start + t, h));
  kv_encode(kv::compiled_format(Scheme, hl.v_format), a.v + row, d, a.kv.value(a.start + t, h));
}

}  // namespace cpu

template <MoeSpec S>
Status launch_kv_append(arch::Cpu, KvAppendArgs const& a, stream_t) {
  if (Status s = can_implement_kv_append<S>(a); s != Status::kSuccess) return s;
  int const d = dim<S.d_head>(a.kv.d_head);
  int const nkv = dim<S.n_head_kv>(a.kv.n_head_kv);
  parallel_for(0, a.n_tokens * nkv, 16 * d, [&](std::int64_t item) {
    cpu::kv_append_item<S.kv>(a, d, item / nkv, static_cast<int>(item % nkv));
  });
  return Status::kSuccess;
}

}  // namespace qflash::kernels
