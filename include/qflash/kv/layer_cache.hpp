/// @file
/// One attention layer's paged KV outside a model, in its own pool: appended from fp32 rows,
/// read as a KvView. For kernel tests, benches and research code that drive attention alone.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "qflash/kv/block_pool.hpp"

namespace qflash::kv {

class LayerCache {
 public:
  /// Room for `capacity` positions of `heads.size()` KV heads of d_head.
  LayerCache(std::vector<KvFormats> heads, int d_head, std::int64_t capacity, int block_tokens = kBlockTokens)
      : n_head_kv_(static_cast<int>(heads.size())),
        pool_(KvLayout(KvMap({std::move(heads)}), n_head_kv_, d_head, block_tokens),
              (capacity + block_tokens - 1) / block_tokens) {}

  /// Every head in `f`.
  LayerCache(int n_head_kv, int d_head, KvFormats f, std::int64_t capacity, int block_tokens = kBlockTokens)
      : LayerCache(std::vector<KvFormats>(static_cast<std::size_t>(n_head_kv), f), d_head, capacity, block_tokens) {}

  /// Appends n positions of K and V, each [n, n_head_kv, d_head] fp32.
  void append(float const* k, float const* v, std::int64_t n) {
    pool_.allocate(pool_.blocks_for(n_ + n) - static_cast<std::int64_t>(table_.size()), table_);
    encode_positions(view(), k, v, n_, n);
    n_ += n;
  }

  [[nodiscard]] KvView view() { return pool_.view(0, table_); }
  [[nodiscard]] std::int64_t size() const { return n_; }
  [[nodiscard]] KvBlockPool& pool() { return pool_; }
  [[nodiscard]] std::vector<std::int32_t> const& block_table() const { return table_; }

 private:
  int n_head_kv_;
  KvBlockPool pool_;
  std::vector<std::int32_t> table_;
  std::int64_t n_ = 0;
};

}  // namespace qflash::kv
