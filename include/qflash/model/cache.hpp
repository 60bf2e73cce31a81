/// @file
/// Per-sequence caches, owned by the caller (the runtime), read and written by layers through
/// the model's forward: a block table into a paged KV pool (kv/block_pool.hpp) for the
/// full-attention layers, and conv and recurrent state for Gated DeltaNet layers. Layers see
/// a KvView per layer, never the pool. A sequence may start from blocks it shares with others
/// (a cached prefix), be forked, and have its linear state saved and restored (prefix hits of
/// hybrid models). Block tables and states live in the pool's Memory, where the model's
/// kernels read them (a device's for a model on one).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/core/memory.hpp"
#include "qflash/kv/block_pool.hpp"
#include "qflash/kv/prefix_cache.hpp"
#include "qflash/model/config.hpp"
#include "qflash/numeric/bf16.hpp"

namespace qflash::model {

/// Gated DeltaNet state of one layer: the last d_conv-1 conv inputs [conv_dim, d_conv-1] and
/// the recurrent state [n_head_v, d_k, d_v], both fp32, in one memory resource.
struct LinearState {
  MemoryVector<float> conv;
  MemoryVector<float> recurrent;
};

/// A pool for `n_sequences` sequences of up to cfg.max_position_embeddings tokens each, its
/// arenas grown as blocks are first used. Sequences decoding from one pool share their
/// attention calls (kernels/attention_decode).
inline std::shared_ptr<kv::KvBlockPool> kv_pool_for(ModelConfig const& cfg, kv::KvMap map, std::int64_t n_sequences,
                                                    std::shared_ptr<Memory> memory = host_memory()) {
  QFLASH_CHECK(n_sequences >= 1, "a KV pool for ", n_sequences, " sequences");
  kv::KvLayout layout(cfg, std::move(map));
  std::int64_t const blocks = (cfg.max_position_embeddings + layout.block_tokens() - 1) / layout.block_tokens();
  return std::make_shared<kv::KvBlockPool>(std::move(layout), n_sequences * blocks,
                                           kv::KvBlockPool::Allocation::kOnDemand, std::move(memory));
}

/// A private pool for one sequence (kv_pool_for).
inline std::shared_ptr<kv::KvBlockPool> private_kv_pool(ModelConfig const& cfg, kv::KvMap map,
                                                        std::shared_ptr<Memory> memory = host_memory()) {
  return kv_pool_for(cfg, std::move(map), 1, std::move(memory));
}

class SequenceState {
 public:
  /// A sequence whose KV lives in `pool` (shared with other sequences or its own).
  SequenceState(ModelConfig const& cfg, std::shared_ptr<kv::KvBlockPool> pool)
      : max_positions_(cfg.max_position_embeddings), pool_(std::move(pool)) {
    QFLASH_CHECK(pool_, "a sequence needs a KV pool");
    MemoryAllocator<float> const in_pool(pool_->memory().get());
    blocks_ = MemoryVector<std::int32_t>(in_pool);
    linear_.assign(cfg.layer_types.size(), LinearState{MemoryVector<float>(in_pool), MemoryVector<float>(in_pool)});
    kv::KvLayout const& lay = pool_->layout();
    QFLASH_CHECK(lay.n_layer() == cfg.layer_types.size() && lay.d_head() == cfg.d_head &&
                     lay.n_head_kv() == cfg.n_head_kv,
                 "KV pool laid out for ", lay.n_layer(), " layers of ", lay.n_head_kv(), " KV heads of ", lay.d_head(),
                 ", the model has ", cfg.layer_types.size(), " of ", cfg.n_head_kv, " of ", cfg.d_head);
    std::size_t const conv_dim = static_cast<std::size_t>(cfg.linear_conv_dim());
    for (std::size_t l = 0; l < linear_.size(); ++l)
      if (cfg.layer_types[l] == LayerKind::kLinearAttention) {
        linear_[l].conv.assign(conv_dim * static_cast<std::size_t>(cfg.d_conv - 1), 0.0f);
        linear_[l].recurrent.assign(static_cast<std::size_t>(cfg.n_head_v_linear) *
                                        static_cast<std::size_t>(cfg.d_head_k_linear) *
                                        static_cast<std::size_t>(cfg.d_head_v_linear),
                                    0.0f);
      }
  }
  SequenceState(SequenceState&& o) noexcept = default;
  SequenceState& operator=(SequenceState&& o) noexcept {
    if (this != &o) {
      release_blocks();
      n_past_ = o.n_past_;
      max_positions_ = o.max_positions_;
      blocks_ = std::move(o.blocks_);  // the old buffers go back to the memory pool_ still keeps
      linear_ = std::move(o.linear_);
      pool_ = std::move(o.pool_);
    }
    return *this;
  }
  SequenceState(SequenceState const&) = delete;
  SequenceState& operator=(SequenceState const&) = delete;
  ~SequenceState() { release_blocks(); }

  /// Tokens already processed; the next token's position.
  [[nodiscard]] std::int64_t n_past() const { return n_past_; }
  void advance(std::int64_t n) { n_past_ += n; }
  [[nodiscard]] std::int64_t max_positions() const { return max_positions_; }

  /// Layer `layer`'s KV (a full-attention layer), covering the blocks held now.
  [[nodiscard]] kv::KvView kv(std::size_t layer) const { return pool_->view(layer, blocks_); }
  LinearState& linear(std::size_t layer) { return linear_[layer]; }
  [[nodiscard]] kv::KvBlockPool& pool() const { return *pool_; }
  [[nodiscard]] std::span<std::int32_t const> blocks() const { return blocks_; }

  /// Blocks for `positions` tokens (capped at max_positions), taken from the pool now, so
  /// that running up to there allocates nothing; throws when the pool has too few free,
  /// holding what it held.
  void reserve(std::int64_t positions) {
    std::int64_t const need = pool_->blocks_for(std::min(positions, max_positions_));
    pool_->allocate(need - static_cast<std::int64_t>(blocks_.size()), blocks_);
  }

  /// Back to an empty sequence: blocks go back to the pool, states to zero.
  void reset() {
    n_past_ = 0;
    release_blocks();
    if (!pool_) return;  // moved from
    Memory& m = *pool_->memory();
    for_each_linear(*this, [&](float* v, std::size_t count) { m.zero(v, count * sizeof(float), nullptr); });
    m.synchronize(nullptr);
  }

  /// Starts an empty sequence from `blocks`, which hold its first `n_tokens` positions and on
  /// which the caller has taken a reference for it (a prefix cache match); its linear state,
  /// if any, must be restored to the state after those tokens.
  void adopt_prefix(std::span<std::int32_t const> blocks, std::int64_t n_tokens) {
    QFLASH_CHECK(n_past_ == 0 && blocks_.empty(), "adopt_prefix: the sequence is not empty");
    QFLASH_CHECK(n_tokens == static_cast<std::int64_t>(blocks.size()) * pool_->layout().block_tokens(),
                 "adopt_prefix: ", blocks.size(), " blocks do not hold ", n_tokens, " positions");
    blocks_.assign(blocks.begin(), blocks.end());
    n_past_ = n_tokens;
  }

  /// A copy that goes its own way from here: whole blocks are shared (one more reference each),
  /// the partly filled last block is copied, linear states too. Throws, changing nothing, when
  /// the pool has no block for the copy.
  [[nodiscard]] SequenceState fork() const {
    SequenceState c(max_positions_, pool_, linear_);
    std::int64_t const full = n_past_ / pool_->layout().block_tokens();
    if (static_cast<std::int64_t>(blocks_.size()) > full) {
      pool_->allocate(1, c.blocks_);
      pool_->copy_block(blocks_[static_cast<std::size_t>(full)], c.blocks_.back());
    }
    std::vector<std::int32_t> shared(blocks_.begin(), blocks_.begin() + std::min<std::ptrdiff_t>(full, blocks_.size()));
    for (std::int32_t b : shared) pool_->retain(b);
    c.blocks_.insert(c.blocks_.begin(), shared.begin(), shared.end());
    c.n_past_ = n_past_;
    return c;
  }

  /// The linear layers' conv and recurrent states, in bf16 (half the bytes; restoring them
  /// rounds the state) or fp32 (exact).
  [[nodiscard]] std::shared_ptr<kv::StateSnapshot> snapshot_linear(bool bf16) const {
    auto snap = std::make_shared<kv::StateSnapshot>();
    std::size_t const n = linear_floats();
    snap->bytes.resize(n * (bf16 ? sizeof(Bf16) : sizeof(float)) + 1);
    snap->bytes[0] = std::byte{bf16};
    std::byte* out = snap->bytes.data() + 1;
    for_each_linear(*this, [&](float const* v, std::size_t count) {
      if (bf16) {
        for (std::size_t i = 0; i < count; ++i, out += sizeof(Bf16)) {
          Bf16 const h = to_bf16(v[i]);
          std::memcpy(out, &h, sizeof h);
        }
      } else {
        std::memcpy(out, v, count * sizeof(float));
        out += count * sizeof(float);
      }
    });
    return snap;
  }
  /// Sets the linear states from snapshot_linear's bytes (of a sequence of the same model).
  void restore_linear(kv::StateSnapshot const& snap) {
    bool const bf16 = !snap.bytes.empty() && snap.bytes[0] == std::byte{1};
    QFLASH_CHECK(snap.bytes.size() == linear_floats() * (bf16 ? sizeof(Bf16) : sizeof(float)) + 1,
                 "restore_linear: the snapshot is of another model");
    std::byte const* in = snap.bytes.data() + 1;
    for_each_linear(*this, [&](float* v, std::size_t count) {
      if (bf16) {
        for (std::size_t i = 0; i < count; ++i, in += sizeof(Bf16)) {
          Bf16 h;
          std::memcpy(&h, in, sizeof h);
          v[i] = to_float(h);
        }
      } else {
        std::memcpy(v, in, count * sizeof(float));
        in += count * sizeof(float);
      }
    });
  }
  /// True when the model has linear-attention layers (whose state a prefix hit must restore).
  [[nodiscard]] bool has_linear_state() const { return linear_floats() > 0; }

  /// Bytes held now: KV blocks (grown a block at a time) and linear state (fixed).
  [[nodiscard]] std::size_t bytes() const {
    std::size_t b = blocks_.size() * static_cast<std::size_t>(pool_->layout().block_bytes());
    for (auto const& l : linear_) b += (l.conv.size() + l.recurrent.size()) * sizeof(float);
    return b;
  }

 private:
  SequenceState(std::int64_t max_positions, std::shared_ptr<kv::KvBlockPool> pool, std::vector<LinearState> linear)
      : max_positions_(max_positions),
        pool_(std::move(pool)),
        blocks_(MemoryAllocator<std::int32_t>(pool_->memory().get())),
        linear_(std::move(linear)) {}

  [[nodiscard]] std::size_t linear_floats() const {
    std::size_t n = 0;
    for (auto const& l : linear_) n += l.conv.size() + l.recurrent.size();
    return n;
  }
  /// fn(data, count) over every linear layer's conv, then recurrent state (full-attention
  /// layers hold none).
  template <class Self, class Fn>
  static void for_each_linear(Self& self, Fn&& fn) {
    for (auto& l : self.linear_)
      if (!l.conv.empty()) {
        fn(l.conv.data(), l.conv.size());
        fn(l.recurrent.data(), l.recurrent.size());
      }
  }

  void release_blocks() {
    if (pool_) pool_->release(blocks_);
    blocks_.clear();
  }

  std::int64_t n_past_ = 0;
  std::int64_t max_positions_ = 0;
  std::shared_ptr<kv::KvBlockPool> pool_;
  MemoryVector<std::int32_t> blocks_;
  std::vector<LinearState> linear_;
};

}  // namespace qflash::model
