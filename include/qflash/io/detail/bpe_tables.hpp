/// @file
/// The lookup tables behind byte-level BPE: merge rules by token-id pair (an open-addressing
/// table: the merge loop does one lookup per candidate pair, the hot path of `encode`), the
/// leftmost-longest matcher for added tokens, and the bounded per-word result cache.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace qflash::io::detail {

struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const noexcept {
    return std::hash<std::string_view>{}(s);
  }
};
/// std::unordered_map keyed by std::string that can be searched with a std::string_view.
template <class V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

struct MergeRule {
  std::int32_t rank;    ///< position in model.merges: lower merges first
  std::int32_t new_id;  ///< id of the concatenated token
};

/// (left id, right id) -> MergeRule, linear probing at load factor <= 1/2.
class MergeTable {
 public:
  void reserve(std::size_t n) {
    std::size_t cap = std::bit_ceil(std::max<std::size_t>(16, 2 * n));
    shift_ = 64 - std::countr_zero(cap);
    keys_.assign(cap, kEmpty);
    rules_.assign(cap, MergeRule{-1, -1});
    size_ = 0;
  }

  /// A repeated pair keeps the later rule, as `tokenizers` does when it builds its map.
  void insert_or_assign(std::int32_t a, std::int32_t b, MergeRule rule) {
    if (2 * (size_ + 1) > keys_.size()) grow();
    std::uint64_t const k = key(a, b);
    std::size_t i = slot(k);
    while (keys_[i] != kEmpty && keys_[i] != k) i = (i + 1) & (keys_.size() - 1);
    if (keys_[i] == kEmpty) ++size_;
    keys_[i] = k;
    rules_[i] = rule;
  }

  [[nodiscard]] MergeRule const* find(std::int32_t a, std::int32_t b) const {
    if (size_ == 0) return nullptr;
    std::uint64_t const k = key(a, b);
    for (std::size_t i = slot(k);; i = (i + 1) & (keys_.size() - 1)) {
      if (keys_[i] == k) return &rules_[i];
      if (keys_[i] == kEmpty) return nullptr;
    }
  }

  [[nodiscard]] std::size_t size() const { return size_; }

 private:
  // Ids are non-negative int32, so no pair packs to all ones.
  static constexpr std::uint64_t kEmpty = ~std::uint64_t{0};

  static std::uint64_t key(std::int32_t a, std::int32_t b) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) |
           static_cast<std::uint32_t>(b);
  }
  [[nodiscard]] std::size_t slot(std::uint64_t k) const {
    return static_cast<std::size_t>((k * 0x9E3779B97F4A7C15ull) >> shift_);
  }
  void grow() {
    auto keys = std::move(keys_);
    auto rules = std::move(rules_);
    reserve(std::max<std::size_t>(16, keys.size()));
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (keys[i] != kEmpty)
        insert_or_assign(static_cast<std::int32_t>(keys[i] >> 32),
                         static_cast<std::int32_t>(keys[i] & 0xFFFFFFFFu), rules[i]);
    }
  }

  std::vector<std::uint64_t> keys_;
  std::vector<MergeRule> rules_;
  std::size_t size_ = 0;
  int shift_ = 60;
};

/// Byte trie over added-token contents giving the leftmost-longest match, the semantics of the
/// Aho-Corasick automaton (MatchKind::LeftmostLongest) `tokenizers` splits added tokens with.
/// Added tokens are few and short, so a walk from each candidate first byte is cheap.
class TokenTrie {
 public:
  struct Match {
    std::size_t begin = 0, end = 0;
    std::int32_t value = -1;  ///< what `insert` was given, or -1 for no match
  };

  TokenTrie() { root_.fill(-1); }

  void insert(std::string_view s, std::int32_t value) {
    if (s.empty()) return;
    std::int32_t node = child_or_add(-1, static_cast<unsigned char>(s[0]));
    for (std::size_t i = 1; i < s.size(); ++i)
      node = child_or_add(node, static_cast<unsigned char>(s[i]));
    value_[static_cast<std::size_t>(node)] = value;
  }

  [[nodiscard]] bool empty() const { return value_.empty(); }

  /// The leftmost-longest match starting at or after `from`.
  [[nodiscard]] Match find(std::string_view text, std::size_t from) const {
    for (std::size_t i = from; i < text.size(); ++i) {
      std::int32_t node = root_[static_cast<unsigned char>(text[i])];
      if (node < 0) continue;
      Match best;
      for (std::size_t j = i + 1;; ++j) {
        if (value_[static_cast<std::size_t>(node)] >= 0)
          best = {i, j, value_[static_cast<std::size_t>(node)]};
        if (j == text.size()) break;
        auto it = edges_.find(edge(node, static_cast<unsigned char>(text[j])));
        if (it == edges_.end()) break;
        node = it->second;
      }
      if (best.value >= 0) return best;
    }
    return {text.size(), text.size(), -1};
  }

 private:
  static std::uint64_t edge(std::int32_t node, unsigned char c) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(node)) << 8) | c;
  }
  std::int32_t child_or_add(std::int32_t node, unsigned char c) {
    auto const fresh = static_cast<std::int32_t>(value_.size());
    if (node < 0) {
      if (root_[c] < 0) {
        root_[c] = fresh;
        value_.push_back(-1);
      }
      return root_[c];
    }
    auto [it, added] = edges_.try_emplace(edge(node, c), fresh);
    if (added) value_.push_back(-1);
    return it->second;
  }

  std::array<std::int32_t, 256> root_;
  std::vector<std::int32_t> value_;  // per node: value of the token ending there, or -1
  std::unordered_map<std::uint64_t, std::int32_t> edges_;
};

/// Word (raw bytes) -> ids, shared by every thread that encodes with one Tokenizer. Like
/// `tokenizers`' BPE cache it stops inserting when full rather than evicting.
class WordCache {
 public:
  // tokenizers keeps 10000 words; source code has more distinct identifiers than that. CPU,
  // 3.5 MB of Python + prose, 51k-token Qwen3.5-style vocab: 13 MB/s at 10000, 19 MB/s at
  // 100000 (tools: a local encode loop). ~100 bytes per entry, so this is a few MB at most.
  static constexpr std::size_t kCapacity = 65536;
  static constexpr std::size_t kMaxWordBytes = 256;  // longer words are rare and not cached

  /// Appends the cached ids of `word` to `out`; false on a miss.
  bool lookup(std::string_view word, std::vector<std::int32_t>& out) const {
    std::shared_lock lock(mutex_);
    auto it = map_.find(word);
    if (it == map_.end()) return false;
    out.insert(out.end(), it->second.begin(), it->second.end());
    return true;
  }

  void insert(std::string_view word, std::vector<std::int32_t> const& ids) {
    if (word.size() >= kMaxWordBytes) return;
    std::unique_lock lock(mutex_);
    if (map_.size() >= kCapacity) return;
    map_.try_emplace(std::string(word), ids);
  }

  [[nodiscard]] std::size_t size() const {
    std::shared_lock lock(mutex_);
    return map_.size();
  }

 private:
  mutable std::shared_mutex mutex_;
  StringMap<std::vector<std::int32_t>> map_;
};

}  // namespace qflash::io::detail
