/// @file
/// One attention decode step for several sequences at once: for each sequence i's one new
/// token (row rows[i] of q, k, v, gate and out), its key and value are appended at position
/// n_ctx[i] - 1 of its paged cache (as kernels/kv_append) and the token attends over
/// positions [0, n_ctx[i]) (as kernels/attention). It replaces one kv_append and one
/// attention call per decoding sequence and gives their results: bit for bit on the CPU; on
/// CUDA within rounding (the keys are split for the whole launch, so sums run in another order).
///
/// The sequences share the layer's KV arena and head layouts (`kv`); each has its own block
/// table, and their rows are distinct (each writes its own out row). The arrays of rows,
/// tables and lengths are host memory (a CUDA launcher passes them in the kernels'
/// parameters); the rows and tables they point at are the arch's.
#pragma once

#include <cstdint>

#include "qflash/arch/arch.hpp"
#include "qflash/core/config.hpp"
#include "qflash/core/status.hpp"
#include "qflash/kernels/attention/op.hpp"
#include "qflash/kernels/kv_append/op.hpp"
#include "qflash/kv/view.hpp"
#include "qflash/spec/moe_spec.hpp"

namespace qflash::kernels {

struct AttentionDecodeArgs {
  float const* q = nullptr;  // [.., n_head, d_head] rows, after norm and RoPE
  float const* k = nullptr;  // [.., n_head_kv, d_head] the new tokens' keys, after norm and RoPE
  float const* v = nullptr;  // [.., n_head_kv, d_head]
  float* out = nullptr;      // [.., n_head, d_head]
  float const* gate = nullptr;         // [.., n_head, d_head] strided; null: no gate
  std::int64_t gate_token_stride = 0;  ///< floats between rows of gate
  std::int64_t gate_head_stride = 0;   ///< floats between heads of gate; 0: d_head
  kv::KvView kv;  ///< the layer's arena and head layouts; its block_table and n_blocks are not read
  std::int64_t const* rows = nullptr;               // [n_seqs] the row of each sequence's token
  std::int32_t const* const* block_tables = nullptr;  // [n_seqs] each sequence's block table
  std::int64_t const* n_blocks = nullptr;           // [n_seqs] entries of each table
  std::int64_t const* n_ctx = nullptr;              // [n_seqs] cached positions incl. the new token
  int n_seqs = 0;
  int n_head = 0;
  int n_head_kv = 0;
  int d_head = 0;
  float scale = 1.0f;

  /// Sequence i's view of the layer's cache.
  [[nodiscard]] kv::KvView view(int i) const {
    kv::KvView v = kv;
    v.block_table = block_tables[i];
    v.n_blocks = n_blocks[i];
    return v;
  }

  /// The kv_append call this op makes for sequence i.
  [[nodiscard]] KvAppendArgs append_args(int i) const {
    KvAppendArgs a{};
    a.kv = view(i);
    a.k = k + rows[i] * std::int64_t{n_head_kv} * d_head;
    a.v = v + rows[i] * std::int64_t{n_head_kv} * d_head;
    a.n_tokens = 1;
    a.start = n_ctx[i] - 1;
    return a;
  }

  /// The attention call this op makes for sequence i (after its append).
  [[nodiscard]] AttentionArgs attention_args(int i) const {
    std::int64_t const q_width = std::int64_t{n_head} * d_head;
    AttentionArgs a{};
    a.q = q + rows[i] * q_width;
    a.kv = view(i);
    a.out = out + rows[i] * q_width;
    a.n_tokens = 1;
    a.n_ctx = n_ctx[i];
    a.n_head = n_head;
    a.n_head_kv = n_head_kv;
    a.d_head = d_head;
    a.scale = scale;
    if (gate) {
      a.gate = gate + rows[i] * gate_token_stride;
      a.gate_token_stride = gate_token_stride;
      a.gate_head_stride = gate_head_stride;
    }
    return a;
  }
};

/// Checks arguments, every sequence's view and call included (the arrays are host memory);
/// head counts and d_head are the spec's when static.
template <MoeSpec S>
[[nodiscard]] constexpr Status can_implement_attention_decode(AttentionDecodeArgs const& a) {
  if (a.n_seqs < 0) return Status::kErrorInvalidProblem;
  if (a.n_seqs == 0) return Status::kSuccess;
  if (!a.q || !a.k || !a.v || !a.out || !a.rows || !a.block_tables || !a.n_blocks || !a.n_ctx)
    return Status::kErrorInvalidProblem;
  for (int i = 0; i < a.n_seqs; ++i) {
    if (a.rows[i] < 0 || a.n_ctx[i] < 1) return Status::kErrorInvalidProblem;
    if (Status s = can_implement_kv_append<S>(a.append_args(i)); s != Status::kSuccess) return s;
    if (Status s = can_implement_attention<S>(a.attention_args(i)); s != Status::kSuccess) return s;
  }
  return Status::kSuccess;
}

/// Launchers, one overload per arch tag: cpu.hpp, and sm80.cuh / sm90a.cuh (device rows,
/// tables and arena; host arrays of them and host head layouts).
template <MoeSpec S>
Status launch_attention_decode(arch::Cpu, AttentionDecodeArgs const& args, stream_t stream = nullptr);
template <MoeSpec S>
Status launch_attention_decode(arch::Sm80, AttentionDecodeArgs const& args, stream_t stream);
template <MoeSpec S>
Status launch_attention_decode(arch::Sm90a, AttentionDecodeArgs const& args, stream_t stream);
template <MoeSpec S, class Arch>
  requires(!arch::implemented_by<Arch, arch::Cpu, arch::Sm80, arch::Sm90a>)
Status launch_attention_decode(Arch, AttentionDecodeArgs const&, stream_t = nullptr) {
  static_assert(dependent_false<Arch>, "kernels/attention_decode: no implementation for this arch");
  return Status::kErrorArchMismatch;
}

}  // namespace qflash::kernels
