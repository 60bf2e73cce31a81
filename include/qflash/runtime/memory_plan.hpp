/// @file
/// The memory planner behind `qflash budget`: what a model needs resident (its weights in the
/// chosen formats, the runtime's scratch) and what each sequence adds (its KV blocks, in the
/// chosen KV formats, and its Gated DeltaNet state, whatever its length), from the config
/// alone, and so how many sequences of a context fit in a memory size.
///
/// Only full-attention layers hold KV (Qwen3.6-35B-A3B: 10 of 40), K and V per KV head; the
/// linear-attention layers hold a fixed conv + recurrent state per sequence (fp32).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>

#include "qflash/core/error.hpp"
#include "qflash/core/memory.hpp"
#include "qflash/model/config.hpp"
#include "qflash/kv/block_pool.hpp"
#include "qflash/kv/map.hpp"

namespace qflash::runtime {

/// Tokens per KV block: a sequence's KV grows a block at a time.
inline constexpr int kKvBlockTokens = kv::kBlockTokens;
/// Tokens per prefill chunk the scratch estimate assumes.
inline constexpr int kDefaultChunkTokens = 512;

struct MemoryPlan {
  std::int64_t weights = 0;             ///< resident weight bytes
  std::int64_t scratch = 0;             ///< runtime activations (estimate, see scratch_bytes)
  std::int64_t kv_per_token = 0;        ///< K and V of every full-attention layer, one token
  std::int64_t state_per_sequence = 0;  ///< Gated DeltaNet conv + recurrent state, fp32

  /// KV bytes of one sequence of `context` tokens, in whole blocks.
  [[nodiscard]] std::int64_t kv_bytes(std::int64_t context) const {
    return (context + kKvBlockTokens - 1) / kKvBlockTokens * kKvBlockTokens * kv_per_token;
  }
  [[nodiscard]] std::int64_t per_sequence(std::int64_t context) const {
    return kv_bytes(context) + state_per_sequence;
  }
  /// Weights, scratch and `seqs` sequences of `context` tokens.
  [[nodiscard]] std::int64_t total(std::int64_t context, std::int64_t seqs) const {
    return weights + scratch + seqs * per_sequence(context);
  }
  /// How many sequences of `context` tokens fit in `memory` bytes beside the weights and
  /// scratch (0 when those alone do not fit).
  [[nodiscard]] std::int64_t sequences_that_fit(std::int64_t context, std::int64_t memory) const {
    std::int64_t const left = memory - weights - scratch;
    return left <= 0 ? 0 : left / per_sequence(context);
  }
};

/// K and V of every full-attention layer for one token, scales included.
inline std::int64_t kv_bytes_per_token(model::ModelConfig const& c, kv::KvMap const& map) {
  return map.bytes_per_token(c.d_head);
}

/// An estimate of the runtime's scratch for prefill chunks of `chunk` tokens: the fp32
/// activation buffers a forward keeps (residual, normed input and mixer output; attention's
/// gated q, k, v and output; DeltaNet's projections, conv output, z and gates; the router's
/// logits; gate and up rows of the routed and shared experts), each as wide as the widest
/// layer needs, plus one row of logits. Kernel-private buffers (quantized activations, the
/// per-thread tiles) are a few percent more.
inline std::int64_t scratch_bytes(model::ModelConfig const& c, std::int64_t chunk = kDefaultChunkTokens) {
  std::int64_t const attn_q = std::int64_t{c.n_head} * c.d_head * (c.attn_output_gate ? 2 : 1);
  std::int64_t const attn_kv = 2 * std::int64_t{c.n_head_kv} * c.d_head;
  std::int64_t const attn_o = std::int64_t{c.n_head} * c.d_head;
  std::int64_t const v_dim = std::int64_t{c.n_head_v_linear} * c.d_head_v_linear;
  std::int64_t const delta = c.d_conv == 0 ? 0 : 2 * c.linear_conv_dim() + 2 * v_dim + 2 * c.n_head_v_linear;
  std::int64_t const routed = std::int64_t{c.n_expert_used} + (c.d_ff_shared > 0 ? 1 : 0);
  std::int64_t const experts = 2 * routed * std::max(c.d_ff_expert, c.d_ff_shared) + c.n_expert;
  std::int64_t const per_token = 3 * std::int64_t{c.d_model} + attn_q + attn_kv + std::max(attn_o, delta) + experts;
  return 4 * (chunk * per_token + c.vocab);
}

/// What the forward steps of up to `tokens` tokens allocate on a device once running: the
/// scratch estimate, a quarter more for kernel-private buffers, and 32 MiB for the kernels'
/// per-stream workspaces.
inline std::int64_t device_step_reserve(model::ModelConfig const& c, std::int64_t tokens) {
  return scratch_bytes(c, tokens) * 5 / 4 + (std::int64_t{32} << 20);
}

/// The plan for a model whose weights take `weight_bytes` when resident.
inline MemoryPlan plan_memory(model::ModelConfig const& c, std::int64_t weight_bytes, kv::KvMap const& kv,
                              std::int64_t chunk = kDefaultChunkTokens) {
  MemoryPlan p;
  p.weights = weight_bytes;
  p.scratch = scratch_bytes(c, chunk);
  p.kv_per_token = kv_bytes_per_token(c, kv);
  p.state_per_sequence = c.linear_state_bytes_per_sequence(DType::kF32, DType::kF32);
  return p;
}

/// The share of a device's memory a served model fills (weights, runtime and KV cache) unless
/// told otherwise, as in vLLM.
inline constexpr double kDefaultGpuMemoryUtilization = 0.9;

/// Bytes left for the KV cache and state snapshots when a process may fill the share
/// `utilization` (in (0, 1]) of a device's memory: that share of `use.total`, less what is in
/// use now (`use.total - use.free`: the weights, the runtime, other processes) and `reserve`
/// (what the forward steps will still allocate). Throws, with the figures, when nothing is left.
inline std::int64_t kv_bytes_within(double utilization, Memory::DeviceUse use, std::int64_t reserve) {
  QFLASH_CHECK(utilization > 0 && utilization <= 1, "the GPU memory utilization must be in (0, 1], got ", utilization);
  QFLASH_CHECK(use.total > 0 && use.free >= 0 && use.free <= use.total, "the device reports ", use.free,
               " bytes free of ", use.total);
  auto const allowed = static_cast<std::int64_t>(utilization * static_cast<double>(use.total));
  std::int64_t const used = use.total - use.free;
  std::int64_t const left = allowed - used - reserve;
  if (left > 0) return left;
  auto gib = [](std::int64_t b) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(b) / static_cast<double>(1 << 30));
    return std::string(buf);
  };
  char share[16];
  std::snprintf(share, sizeof share, "%.2f", utilization);
  QFLASH_FAIL("a GPU memory utilization of ", share, " allows ", gib(allowed), " of the device's ", gib(use.total),
              "; ", gib(used), " are in use already (the weights, the runtime, other processes) and the forward steps "
              "need ", gib(reserve), " more, which leaves nothing for the KV cache (raise the utilization, free the "
              "device or choose smaller weight formats)");
}

}  // namespace qflash::runtime
