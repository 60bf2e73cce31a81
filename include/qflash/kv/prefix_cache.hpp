/// @file
/// Level 2 of the KV hierarchy: a cross-request pool of full KV blocks, so that requests with a
/// common prefix (a system prompt, earlier turns) share its blocks instead of computing them
/// again. A block is keyed by a chained hash of every token up to its end, started from the
/// request's salt; an index entry also keeps the block's tokens and its parent entry, and a hit
/// is checked against both, so neither a hash collision nor another tenant's salt can ever match.
/// Blocks no sequence references stay cached until the pool needs them back; which goes first
/// is the eviction policy's choice. Hybrid models also keep snapshots of their Gated DeltaNet
/// states at some block boundaries (opaque bytes here), within their own byte budget, so a hit
/// can resume there.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/kv/block_pool.hpp"

namespace qflash::kv {

using BlockHash = std::uint64_t;

/// How the cache picks the unreferenced block to give back when the pool needs one.
enum class EvictionPolicy {
  kLru,         ///< least recently used first
  kLruWithAge,  ///< as kLru, but blocks cached within min_age are given back only when no older one is left
};

/// A state snapshot at a block boundary, as the model packs it.
struct StateSnapshot {
  std::vector<std::byte> bytes;
};

struct PrefixCacheStats {
  std::int64_t queries = 0;        ///< whole prompt blocks that could have been found
  std::int64_t hits = 0;           ///< ... that were
  std::int64_t evictions = 0;      ///< cached blocks given back to the pool
  std::int64_t snapshots = 0;      ///< snapshots kept now
  std::int64_t snapshot_bytes = 0; ///< their bytes
  std::int64_t snapshot_hits = 0;  ///< matches that resumed from a snapshot
};

class PrefixCache final : public BlockReuse {
 public:
  using Clock = std::function<std::chrono::steady_clock::time_point()>;
  struct Options {
    EvictionPolicy eviction = EvictionPolicy::kLru;
    std::chrono::duration<double> min_age{30.0};  ///< kLruWithAge only
    std::int64_t snapshot_bytes = 0;              ///< budget for state snapshots (0: none kept)
  };

  /// Caches blocks of `pool`, which must outlive the cache.
  PrefixCache(KvBlockPool& pool, Options opts, Clock clock = &std::chrono::steady_clock::now)
      : pool_(pool), opts_(opts), clock_(std::move(clock)) {
    pool_.set_reuse(this);
  }
  ~PrefixCache() override { pool_.set_reuse(nullptr); }
  PrefixCache(PrefixCache const&) = delete;
  PrefixCache& operator=(PrefixCache const&) = delete;

  /// The hash before a sequence's first block.
  static BlockHash root(std::string_view salt) {
    BlockHash h = 0x9e3779b97f4a7c15ull;
    for (unsigned char c : salt) h = mix(h ^ c);
    return mix(h ^ salt.size());
  }
  /// The hash of a block holding `tokens` after the block hashed `parent`.
  static BlockHash chain(BlockHash parent, std::span<std::int32_t const> tokens) {
    BlockHash h = mix(parent);
    for (std::int32_t t : tokens) h = mix(h ^ static_cast<std::uint32_t>(t));
    return h;
  }

  struct Match {
    std::vector<std::int32_t> blocks;  ///< the cached blocks of the first full blocks, in order; retained for the caller
    std::vector<BlockHash> hashes;     ///< their chain hashes
    std::vector<std::shared_ptr<StateSnapshot const>> snapshots;  ///< per block: the state after it, when kept
  };

  /// The cached blocks holding the first whole blocks of `tokens` (at most `max_blocks` of them),
  /// each retained once for the caller, who releases them through the pool.
  Match match(std::span<std::int32_t const> tokens, std::string_view salt, std::int64_t max_blocks) {
    Match m;
    int const bt = pool_.layout().block_tokens();
    std::int64_t const n = std::min<std::int64_t>(max_blocks, static_cast<std::int64_t>(tokens.size()) / bt);
    BlockHash h = root(salt);
    std::uint64_t parent = 0;  // serial of the previous entry (0: the root)
    auto const now = clock_();
    stats_.queries += std::max<std::int64_t>(0, n);
    for (std::int64_t i = 0; i < n; ++i) {
      auto const block_tokens = tokens.subspan(static_cast<std::size_t>(i * bt), static_cast<std::size_t>(bt));
      BlockHash const next = chain(h, block_tokens);
      auto it = index_.find(next);
      if (it == index_.end()) break;
      Entry& e = it->second;
      if (e.parent != parent || !std::equal(block_tokens.begin(), block_tokens.end(), e.tokens.begin()) ||
          (parent == 0 && e.salt != salt))
        break;
      ++stats_.hits;
      if (pool_.references(e.block) == 0) forget_unreferenced(e);
      pool_.retain(e.block);
      e.last_use = now;
      if (e.snapshot) touch_snapshot(e);
      m.blocks.push_back(e.block);
      m.hashes.push_back(next);
      m.snapshots.push_back(e.snapshot);
      h = next;
      parent = e.serial;
    }
    return m;
  }

  /// Registers `block` (referenced by the caller, its contents final) as holding `tokens` after
  /// the block hashed `parent` (root(salt) for a first block); returns the block's hash. When an
  /// equal block is cached already, that one stays and `block` remains private to the caller.
  BlockHash insert(BlockHash parent, std::span<std::int32_t const> tokens, std::string_view salt,
                   std::int32_t block) {
    BlockHash const h = chain(parent, tokens);
    std::uint64_t parent_serial = 0;
    if (parent != root(salt)) {
      auto p = index_.find(parent);
      if (p == index_.end()) return h;  // the parent was evicted meanwhile: this block cannot be matched
      parent_serial = p->second.serial;
    }
    auto [it, fresh] = index_.try_emplace(h);
    if (!fresh) return h;
    Entry& e = it->second;
    e.block = block;
    e.serial = ++serial_;
    e.parent = parent_serial;
    e.tokens.assign(tokens.begin(), tokens.end());
    if (parent_serial == 0) e.salt = salt;
    e.created = e.last_use = clock_();
    by_block_[block] = h;
    pool_.mark_reusable(block);
    return h;
  }

  /// Keeps `snapshot` as the state after the block hashed `hash` (if it is still cached and has
  /// none), giving up the least recently used snapshots beyond the byte budget.
  void attach_snapshot(BlockHash hash, std::shared_ptr<StateSnapshot const> snapshot) {
    auto it = index_.find(hash);
    if (it == index_.end() || it->second.snapshot || !snapshot) return;
    std::int64_t const bytes = static_cast<std::int64_t>(snapshot->bytes.size());
    if (bytes > opts_.snapshot_bytes) return;
    while (stats_.snapshot_bytes + bytes > opts_.snapshot_bytes) drop_snapshot(snapshot_lru_.begin()->second);
    Entry& e = it->second;
    e.snapshot = std::move(snapshot);
    e.snapshot_use = clock_();
    snapshot_lru_.emplace(e.snapshot_use, hash);
    stats_.snapshot_bytes += bytes;
    ++stats_.snapshots;
  }
  /// True when the block hashed `hash` is cached with a snapshot.
  [[nodiscard]] bool has_snapshot(BlockHash hash) const {
    auto it = index_.find(hash);
    return it != index_.end() && it->second.snapshot;
  }

  void note_snapshot_hit() { ++stats_.snapshot_hits; }
  [[nodiscard]] PrefixCacheStats const& stats() const { return stats_; }
  /// Blocks in the index (referenced or not).
  [[nodiscard]] std::int64_t cached_blocks() const { return static_cast<std::int64_t>(index_.size()); }

  // ---- BlockReuse ----

  void unreferenced(std::int32_t block) override {
    Entry& e = index_.at(by_block_.at(block));
    (age_of(e) ? old_ : young_).emplace(e.last_use, block);
    if (!age_of(e)) by_creation_.emplace(e.created, block);
  }
  [[nodiscard]] std::int64_t reclaimable() const override {
    return static_cast<std::int64_t>(old_.size() + young_.size());
  }
  std::int32_t reclaim() override {
    promote_aged();
    auto& from = old_.empty() ? young_ : old_;
    QFLASH_CHECK(!from.empty(), "prefix cache: no unreferenced block to give back");
    std::int32_t const block = from.begin()->second;
    BlockHash const h = by_block_.at(block);
    Entry& e = index_.at(h);
    forget_unreferenced(e);
    if (e.snapshot) drop_snapshot(h);
    by_block_.erase(block);
    index_.erase(h);
    ++stats_.evictions;
    return block;
  }

 private:
  struct Entry {
    std::int32_t block = -1;
    std::uint64_t serial = 0;  ///< unique per insert
    std::uint64_t parent = 0;  ///< the parent entry's serial; 0 for a first block
    std::vector<std::int32_t> tokens;
    std::string salt;  ///< first blocks only
    std::chrono::steady_clock::time_point created, last_use, snapshot_use;
    std::shared_ptr<StateSnapshot const> snapshot;
  };
  using Ordered = std::set<std::pair<std::chrono::steady_clock::time_point, std::int32_t>>;

  static BlockHash mix(BlockHash x) {  // splitmix64's finaliser
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  }

  /// True when an entry counts as old: every entry under kLru, those past min_age under kLruWithAge.
  [[nodiscard]] bool age_of(Entry const& e) const {
    return opts_.eviction == EvictionPolicy::kLru || clock_() - e.created >= opts_.min_age;
  }
  /// Moves unreferenced entries that have aged past min_age from young_ to old_.
  void promote_aged() {
    while (!by_creation_.empty()) {
      auto const [created, block] = *by_creation_.begin();
      Entry const& e = index_.at(by_block_.at(block));
      if (!age_of(e)) break;
      by_creation_.erase(by_creation_.begin());
      young_.erase({e.last_use, block});
      old_.emplace(e.last_use, block);
    }
  }
  /// Takes an unreferenced entry out of the eviction order (it is referenced again or evicted).
  void forget_unreferenced(Entry const& e) {
    old_.erase({e.last_use, e.block});
    young_.erase({e.last_use, e.block});
    by_creation_.erase({e.created, e.block});
  }
  void touch_snapshot(Entry& e) {
    BlockHash const h = by_block_.at(e.block);
    snapshot_lru_.erase({e.snapshot_use, h});
    e.snapshot_use = clock_();
    snapshot_lru_.emplace(e.snapshot_use, h);
  }
  void drop_snapshot(BlockHash h) {
    Entry& e = index_.at(h);
    snapshot_lru_.erase({e.snapshot_use, h});
    stats_.snapshot_bytes -= static_cast<std::int64_t>(e.snapshot->bytes.size());
    --stats_.snapshots;
    e.snapshot.reset();
  }

  KvBlockPool& pool_;
  Options opts_;
  Clock clock_;
  std::unordered_map<BlockHash, Entry> index_;
  std::unordered_map<std::int32_t, BlockHash> by_block_;
  Ordered old_, young_;  ///< unreferenced entries by last use; young_: cached within min_age
  Ordered by_creation_;  ///< young_'s entries by creation
  std::set<std::pair<std::chrono::steady_clock::time_point, BlockHash>> snapshot_lru_;
  std::uint64_t serial_ = 0;
  PrefixCacheStats stats_;
};

}  // namespace qflash::kv
