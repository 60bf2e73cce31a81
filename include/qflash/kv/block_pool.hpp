/// @file
/// The paged KV store of full-attention layers: fixed-size blocks of `block_tokens`
/// positions, every layer's K and V of a block at the same block id (one block table per
/// sequence serves all layers), laid out per head in its own format (kv/map.hpp). The pool
/// is sized in blocks, from a byte budget or a context: its arenas are allocated at once
/// (kUpFront) or as blocks are first used (kOnDemand, for a private single-sequence pool).
/// Running out is an Error that leaves every block as it was. The arenas come from a Memory
/// (core/memory.hpp): the host's, or a CUDA device's for a model on it.
///
/// Blocks are reference-counted, so sequences can share the blocks of a common prefix: a
/// BlockReuse (the prefix cache) may mark blocks as reusable, keep them after their last
/// reference is gone, and hand them back when the pool runs short of free blocks.
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
#include "qflash/kv/map.hpp"
#include "qflash/kv/view.hpp"
#include "qflash/model/config.hpp"

namespace qflash::kv {

/// Positions per block.
inline constexpr int kBlockTokens = 16;

/// Where each layer's heads sit inside a block (KvView's static part).
class KvLayout {
 public:
  /// Layers' heads as `map` has them: every layer with heads holds n_head_kv of d_head.
  KvLayout(KvMap map, int n_head_kv, int d_head, int block_tokens = kBlockTokens)
      : map_(std::move(map)), block_tokens_(block_tokens), d_head_(d_head), n_head_kv_(n_head_kv) {
    QFLASH_CHECK(block_tokens > 0 && n_head_kv > 0 && d_head > 0, "KV layout: block_tokens ", block_tokens,
                 ", n_head_kv ", n_head_kv, " and d_head ", d_head, " must be positive");
    layers_.resize(map_.n_layer());
    for (std::size_t l = 0; l < map_.n_layer(); ++l) {
      std::vector<KvFormats> const& f = map_.layer(l);
      QFLASH_CHECK(f.empty() || f.size() == static_cast<std::size_t>(n_head_kv), "KV map: layer ", l, " has ",
                   f.size(), " heads, expected ", n_head_kv);
      Layer& out = layers_[l];
      for (KvFormats const& h : f) {
        KvHeadLayout hl;
        hl.k_format = h.k;
        hl.v_format = h.v;
        hl.k_bytes = static_cast<std::int32_t>(kv_head_bytes(h.k, d_head_));
        hl.v_bytes = static_cast<std::int32_t>(kv_head_bytes(h.v, d_head_));
        hl.k_offset = out.block_bytes;
        out.block_bytes += std::int64_t{block_tokens} * hl.k_bytes;
        hl.v_offset = out.block_bytes;
        out.block_bytes += std::int64_t{block_tokens} * hl.v_bytes;
        out.heads.push_back(hl);
      }
    }
  }

  /// A model's layout: heads in its full-attention layers only.
  KvLayout(model::ModelConfig const& cfg, KvMap map, int block_tokens = kBlockTokens)
      : KvLayout(checked(cfg, std::move(map)), cfg.n_head_kv, cfg.d_head, block_tokens) {}

  [[nodiscard]] KvMap const& map() const { return map_; }
  [[nodiscard]] int block_tokens() const { return block_tokens_; }
  [[nodiscard]] int d_head() const { return d_head_; }
  [[nodiscard]] int n_head_kv() const { return n_head_kv_; }
  [[nodiscard]] std::size_t n_layer() const { return layers_.size(); }
  [[nodiscard]] bool holds_kv(std::size_t layer) const { return !layers_[layer].heads.empty(); }
  [[nodiscard]] std::span<KvHeadLayout const> heads(std::size_t layer) const { return layers_[layer].heads; }
  /// One block of one layer.
  [[nodiscard]] std::int64_t layer_block_bytes(std::size_t layer) const { return layers_[layer].block_bytes; }
  /// One block of every layer.
  [[nodiscard]] std::int64_t block_bytes() const {
    std::int64_t b = 0;
    for (Layer const& l : layers_) b += l.block_bytes;
    return b;
  }

 private:
  static KvMap checked(model::ModelConfig const& cfg, KvMap map) {
    QFLASH_CHECK(map.n_layer() == cfg.layer_types.size(), "KV map: ", map.n_layer(), " layers, the model has ",
                 cfg.layer_types.size());
    for (std::size_t l = 0; l < map.n_layer(); ++l) {
      bool const full = cfg.layer_types[l] == model::LayerKind::kFullAttention;
      QFLASH_CHECK(map.layer(l).size() == (full ? static_cast<std::size_t>(cfg.n_head_kv) : 0u), "KV map: layer ", l,
                   " has ", map.layer(l).size(), " heads, expected ", full ? cfg.n_head_kv : 0,
                   full ? " (the model's KV heads)" : " (a linear-attention layer holds no KV)");
    }
    return map;
  }

  struct Layer {
    std::vector<KvHeadLayout> heads;
    std::int64_t block_bytes = 0;
  };
  KvMap map_;
  int block_tokens_;
  int d_head_;
  int n_head_kv_;
  std::vector<Layer> layers_;
};

/// Keeps blocks whose contents may be read again after their last reference goes (the
/// prefix cache, kv/prefix_cache.hpp), until the pool needs them.
class BlockReuse {
 public:
  virtual ~BlockReuse() = default;
  /// A block marked reusable lost its last reference; it is kept until reclaim() gives it up.
  virtual void unreferenced(std::int32_t block) = 0;
  /// Unreferenced blocks kept now.
  [[nodiscard]] virtual std::int64_t reclaimable() const = 0;
  /// Forgets one unreferenced block (by its policy) and returns it for reuse; only called when
  /// reclaimable() > 0.
  virtual std::int32_t reclaim() = 0;
};

class KvBlockPool {
 public:
  enum class Allocation { kUpFront, kOnDemand };
  static constexpr std::int64_t kMaxBlocks = INT32_MAX;  ///< block ids are int32

  /// A pool of `capacity` blocks whose arenas come from `memory`.
  KvBlockPool(KvLayout layout, std::int64_t capacity, Allocation a = Allocation::kUpFront,
              std::shared_ptr<Memory> memory = host_memory())
      : layout_(std::move(layout)), capacity_(capacity), memory_(std::move(memory)) {
    QFLASH_CHECK(capacity >= 0 && capacity <= kMaxBlocks, "KV pool: ", capacity, " blocks is not a valid size");
    QFLASH_CHECK(memory_, "KV pool: no memory to allocate from");
    for (std::size_t l = 0; l < layout_.n_layer(); ++l) arenas_.emplace_back(memory_.get());
    if (a == Allocation::kUpFront) grow(capacity, /*commit=*/true);
  }

  /// The most blocks of `layout` that fit in `bytes`.
  static std::int64_t blocks_in(KvLayout const& layout, std::int64_t bytes) {
    std::int64_t const per = layout.block_bytes();
    return per == 0 ? 0 : std::max<std::int64_t>(0, bytes / per);
  }
  /// Blocks that hold `positions` positions.
  [[nodiscard]] std::int64_t blocks_for(std::int64_t positions) const {
    return (positions + layout_.block_tokens() - 1) / layout_.block_tokens();
  }

  [[nodiscard]] KvLayout const& layout() const { return layout_; }
  /// What the arenas (and the block tables and states of sequences in this pool) live in.
  [[nodiscard]] std::shared_ptr<Memory> const& memory() const { return memory_; }
  [[nodiscard]] std::int64_t capacity() const { return capacity_; }
  /// Blocks some sequence references.
  [[nodiscard]] std::int64_t used_blocks() const { return referenced_; }
  /// Blocks allocate() can hand out: free ones and those a BlockReuse keeps unreferenced.
  [[nodiscard]] std::int64_t free_blocks() const { return capacity_ - referenced_; }
  /// Sequences referencing `block`.
  [[nodiscard]] int references(std::int32_t block) const { return refs_[static_cast<std::size_t>(block)]; }
  /// Bytes the arenas hold now (allocated; kOnDemand's untouched room is not resident).
  [[nodiscard]] std::int64_t reserved_bytes() const { return allocated_ * layout_.block_bytes(); }

  /// Appends `n` blocks to `table` (a vector of int32 block ids), each with one reference, or
  /// throws (naming what was asked and what is free) with `table` and the pool unchanged. Free
  /// blocks go first, then blocks a BlockReuse gives up.
  template <class Table>
  void allocate(std::int64_t n, Table& table) {
    if (n <= 0) return;
    QFLASH_CHECK(n <= free_blocks(), "KV cache full: ", n, " more blocks of ", layout_.block_tokens(),
                 " tokens needed, ", free_blocks(), " of ", capacity_, " free (", layout_.block_bytes(),
                 " bytes each); give the KV cache more memory or use shorter or fewer sequences");
    std::int64_t const unused = static_cast<std::int64_t>(free_.size()) + (capacity_ - next_);
    for (std::int64_t i = unused; i < n; ++i) free_.push_back(reuse_->reclaim());
    std::int64_t const fresh = std::max<std::int64_t>(0, n - static_cast<std::int64_t>(free_.size()));
    if (next_ + fresh > allocated_) grow(std::min(capacity_, std::max(next_ + fresh, 2 * allocated_)));
    table.reserve(table.size() + static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) {
      std::int32_t b;
      if (!free_.empty()) {
        b = free_.back();
        free_.pop_back();
      } else {
        b = static_cast<std::int32_t>(next_++);
        refs_.push_back(0);
        reusable_.push_back(false);
      }
      refs_[static_cast<std::size_t>(b)] = 1;
      reusable_[static_cast<std::size_t>(b)] = false;
      table.push_back(b);
    }
    referenced_ += n;
  }

  /// One more reference to a block that is referenced now, or that `reuse` keeps (it must
  /// stop keeping it for reclaim()).
  void retain(std::int32_t b) {
    check_block(b);
    QFLASH_CHECK(refs_[static_cast<std::size_t>(b)] > 0 || reusable_[static_cast<std::size_t>(b)],
                 "KV pool: block ", b, " is free; only referenced or reusable blocks can be retained");
    if (refs_[static_cast<std::size_t>(b)]++ == 0) ++referenced_;
  }

  /// Drops one reference to each block; a block left without one is free again, or kept by
  /// the BlockReuse when marked reusable.
  void release(std::span<std::int32_t const> blocks) {
    for (std::int32_t b : blocks) {
      check_block(b);
      int& r = refs_[static_cast<std::size_t>(b)];
      QFLASH_CHECK(r > 0, "KV pool: block ", b, " released more often than referenced");
      if (--r > 0) continue;
      --referenced_;
      if (reusable_[static_cast<std::size_t>(b)])
        reuse_->unreferenced(b);
      else
        free_.push_back(b);
    }
  }

  /// Lets `reuse` keep blocks marked reusable after their last reference (one per pool).
  void set_reuse(BlockReuse* reuse) { reuse_ = reuse; }
  /// Marks a referenced block as one the BlockReuse keeps once unreferenced (its contents are
  /// final: a full block of a cached prefix).
  void mark_reusable(std::int32_t b) {
    check_block(b);
    QFLASH_CHECK(reuse_, "KV pool: no BlockReuse to keep reusable blocks");
    reusable_[static_cast<std::size_t>(b)] = true;
  }
  [[nodiscard]] bool reusable(std::int32_t b) const { return reusable_[static_cast<std::size_t>(b)]; }

  /// Copies block `from`'s contents in every layer to block `to`.
  void copy_block(std::int32_t from, std::int32_t to) {
    check_block(from);
    check_block(to);
    for (std::size_t l = 0; l < arenas_.size(); ++l) {
      if (!layout_.holds_kv(l)) continue;
      std::int64_t const bytes = layout_.layer_block_bytes(l);
      memory_->copy(arenas_[l].get() + to * bytes, arenas_[l].get() + from * bytes, static_cast<std::size_t>(bytes),
                    nullptr);
    }
    memory_->synchronize(nullptr);
  }

  /// Layer `layer`'s view of the sequence whose blocks are `table`.
  [[nodiscard]] KvView view(std::size_t layer, std::span<std::int32_t const> table) {
    KvView v;
    v.base = arenas_[layer].get();
    v.block_bytes = layout_.layer_block_bytes(layer);
    v.block_table = table.data();
    v.n_blocks = static_cast<std::int64_t>(table.size());
    v.block_tokens = layout_.block_tokens();
    v.n_head_kv = layout_.n_head_kv();
    v.d_head = layout_.d_head();
    v.heads = layout_.heads(layer).data();
    return v;
  }

 private:
  /// Arenas for `blocks` blocks, keeping the blocks handed out so far; 8 bytes of tail room
  /// let SIMD readers load a whole word at a vector's last bytes. The new memory is left
  /// untouched (so unused room costs no resident memory) except by kUpFront, which commits it.
  void grow(std::int64_t blocks, bool commit = false) {
    std::vector<Arena> old;  // freed once the copies out of them are done
    for (std::size_t l = 0; l < arenas_.size(); ++l) {
      if (!layout_.holds_kv(l)) continue;
      std::size_t const bytes = static_cast<std::size_t>(blocks * layout_.layer_block_bytes(l) + 8);
      Arena arena(memory_.get(), bytes);  // not initialized
      if (arenas_[l].get())
        memory_->copy(arena.get(), arenas_[l].get(), static_cast<std::size_t>(next_ * layout_.layer_block_bytes(l)),
                      nullptr);
      if (commit) memory_->zero(arena.get(), bytes, nullptr);
      old.push_back(std::exchange(arenas_[l], std::move(arena)));
    }
    memory_->synchronize(nullptr);
    allocated_ = blocks;
  }

  /// One layer's arena: bytes of the pool's memory, given back when it goes.
  class Arena {
   public:
    explicit Arena(Memory* m, std::size_t bytes = 0)
        : m_(m), bytes_(bytes), p_(bytes ? static_cast<std::uint8_t*>(m->allocate(bytes, Memory::kCacheLine)) : nullptr) {}
    Arena(Arena&& o) noexcept : m_(o.m_), bytes_(std::exchange(o.bytes_, 0)), p_(std::exchange(o.p_, nullptr)) {}
    Arena& operator=(Arena&& o) noexcept {
      std::swap(m_, o.m_);
      std::swap(bytes_, o.bytes_);
      std::swap(p_, o.p_);
      return *this;
    }
    ~Arena() {
      if (p_) m_->deallocate(p_, bytes_, Memory::kCacheLine);
    }
    [[nodiscard]] std::uint8_t* get() const { return p_; }

   private:
    Memory* m_;
    std::size_t bytes_;
    std::uint8_t* p_;
  };

  void check_block(std::int32_t b) const {
    QFLASH_CHECK(b >= 0 && b < next_, "KV pool: block ", b, " was never allocated");
  }

  KvLayout layout_;
  std::int64_t capacity_ = 0;
  std::int64_t allocated_ = 0;        ///< blocks the arenas hold
  std::int64_t next_ = 0;             ///< blocks handed out at least once
  std::int64_t referenced_ = 0;       ///< blocks with references
  std::vector<std::int32_t> free_;    ///< returned blocks, reused first
  std::vector<int> refs_;             ///< [next_] references per block
  std::vector<bool> reusable_;        ///< [next_] kept by reuse_ when unreferenced
  BlockReuse* reuse_ = nullptr;
  std::shared_ptr<Memory> memory_;
  std::vector<Arena> arenas_;  ///< per layer; empty for layers without KV
};

}  // namespace qflash::kv
