/// @file
/// CPU kernels/attention_decode: one parallel region for every decoding sequence of a layer.
/// A work item is (sequence, KV head): it appends that head's new key and value (kv_append's
/// work item), then runs attention's work items for the head's query heads, which read only
/// that head's keys. Items own disjoint heads, so nothing is shared between threads, and the
/// arithmetic is the separate ops': their results bit for bit.
#pragma once

#include <cstdint>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/core/parallel.hpp"
#include "qflash/kernels/attention/cpu.hpp"
#include "qflash/kernels/attention_decode/op.hpp"
#include "qflash/kernels/kv_append/cpu.hpp"

namespace qflash::kernels::cpu {

/// The op for head width D (kDynamic: any) and KV scheme Scheme; arguments already checked.
template <int D, KvScheme Scheme = KvScheme::kAny>
Status attention_decode(arch::CpuIsa isa, AttentionDecodeArgs const& a) {
  int const d = dim<D>(a.d_head);
  if (d > kMaxHeadDim) return Status::kErrorNotSupported;
  if (a.n_seqs == 0) return Status::kSuccess;
  int const nkv = a.n_head_kv;
  std::int64_t keys = 0;
  for (int i = 0; i < a.n_seqs; ++i) keys += a.n_ctx[i];
  std::int64_t const cost = 2 * (keys / a.n_seqs) * d * (a.n_head / nkv);
  parallel_for(0, std::int64_t{a.n_seqs} * nkv, cost, [&](std::int64_t item) {
    int const i = static_cast<int>(item / nkv), h = static_cast<int>(item % nkv);
    kv_append_item<Scheme>(a.append_args(i), d, 0, h);
    AttentionArgs const at = a.attention_args(i);
    for (int pass = 0, passes = group_passes(at); pass < passes; ++pass) attention_item<Scheme>(isa, at, d, 0, h, pass);
  });
  return Status::kSuccess;
}

}  // namespace qflash::kernels::cpu

namespace qflash::kernels {

template <MoeSpec S>
Status launch_attention_decode(arch::Cpu, AttentionDecodeArgs const& a, stream_t) {
  if (Status s = can_implement_attention_decode<S>(a); s != Status::kSuccess) return s;
  return cpu::attention_decode<S.d_head, S.kv>(arch::cpu_isa(), a);
}

}  // namespace qflash::kernels
