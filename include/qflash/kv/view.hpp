/// @file
/// What a layer sees of a sequence's KV in one full-attention layer: the layer's block
/// arena, the sequence's block table, and each head's format and place inside a block. A
/// block holds `block_tokens` consecutive positions of every KV head, K and V: head h's keys
/// are `block_tokens` token-head vectors of `k_bytes` bytes from `k_offset`, its values
/// likewise from `v_offset` (numeric/kv_format.hpp has a vector's bytes). Plain data. For
/// the CUDA kernels `base` and `block_table` are device memory and `heads` host memory: the
/// launchers check the layouts and pass them by value (kernels/kv_append/device.cuh).
#pragma once

#include <cstdint>

#include "qflash/core/config.hpp"
#include "qflash/numeric/kv_format.hpp"

namespace qflash::kv {

/// One KV head's formats and place inside a block.
struct KvHeadLayout {
  KvFormat k_format = KvFormat::kF32;
  KvFormat v_format = KvFormat::kF32;
  std::int32_t k_bytes = 0;   ///< one token's key vector
  std::int32_t v_bytes = 0;   ///< one token's value vector
  std::int64_t k_offset = 0;  ///< from the block's start
  std::int64_t v_offset = 0;
};

struct KvView {
  std::uint8_t* base = nullptr;               ///< block 0 of this layer's arena
  std::int64_t block_bytes = 0;               ///< one block of this layer
  std::int32_t const* block_table = nullptr;  ///< block b holds positions [b, b + 1) * block_tokens
  std::int64_t n_blocks = 0;                  ///< entries of block_table
  int block_tokens = 0;
  int n_head_kv = 0;
  int d_head = 0;
  KvHeadLayout const* heads = nullptr;  ///< [n_head_kv]

  /// Positions the block table covers.
  [[nodiscard]] QFLASH_HD constexpr std::int64_t capacity() const { return n_blocks * block_tokens; }

  /// The block holding position `pos`, and pos's slot inside it.
  [[nodiscard]] QFLASH_HD std::uint8_t* block(std::int64_t pos) const {
    return base + static_cast<std::int64_t>(block_table[pos / block_tokens]) * block_bytes;
  }
  [[nodiscard]] QFLASH_HD std::uint8_t* key(std::int64_t pos, int head) const {
    KvHeadLayout const& h = heads[head];
    return block(pos) + h.k_offset + (pos % block_tokens) * h.k_bytes;
  }
  [[nodiscard]] QFLASH_HD std::uint8_t* value(std::int64_t pos, int head) const {
    KvHeadLayout const& h = heads[head];
    return block(pos) + h.v_offset + (pos % block_tokens) * h.v_bytes;
  }
};

/// Stores positions [start, start + n) of every head from fp32 k and v, each
/// [n, n_head_kv, d_head], one vector after another (kv_encode): the plain form of
/// kernels/kv_append.
QFLASH_HD inline void encode_positions(KvView const& view, float const* k, float const* v, std::int64_t start,
                                       std::int64_t n) {
  int const d = view.d_head;
  for (std::int64_t t = 0; t < n; ++t)
    for (int h = 0; h < view.n_head_kv; ++h) {
      std::int64_t const row = (t * view.n_head_kv + h) * d;
      kv_encode(view.heads[h].k_format, k + row, d, view.key(start + t, h));
      kv_encode(view.heads[h].v_format, v + row, d, view.value(start + t, h));
    }
}

}  // namespace qflash::kv
