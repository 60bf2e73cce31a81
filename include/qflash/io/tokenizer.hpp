/// @file
/// Hugging Face `tokenizer.json` byte-level BPE, as the Qwen2 / Qwen3 / Qwen3.5 models ship it,
/// so that serving needs no Python and gives the ids `tokenizers` gives.
///
/// The pipeline `encode` runs, in the order and with the semantics of `tokenizers`:
///  1. added tokens ("added_tokens", special or not) are cut out of the raw text, leftmost and
///     longest first, and never split (`single_word`, `lstrip`, `rstrip` honoured; those with
///     `normalized` are looked for after step 2 instead);
///  2. each remaining segment is normalized (none, or NFC through utf8proc);
///  3. pre-tokenized: the `Split` regexes (PCRE2, UTF + UCP), then `ByteLevel` (optional
///     prefix space, optional GPT-2 regex) which spells every byte as a printable code point;
///  4. each word is merged by BPE rank (lowest rank first, leftmost on ties), with a cache.
/// `decode` maps ids back to bytes (added tokens to their content) and repairs invalid UTF-8
/// as `tokenizers` does; `StreamDecoder` does the same incrementally, never emitting half a
/// character.
///
/// `Tokenizer::from_gguf` builds the same tokenizer from a llama.cpp GGUF file's
/// `tokenizer.ggml.*` metadata (see there for how the fields map and what is lost).
///
/// Needs PCRE2 (libpcre2-8) and utf8proc at link time, nlohmann-json at compile time.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/core/log.hpp"
#include "qflash/io/detail/bpe_tables.hpp"
#include "qflash/io/detail/byte_level.hpp"
#include "qflash/io/detail/regex.hpp"
#include "qflash/io/detail/unicode.hpp"
#include "qflash/io/detail/utf8.hpp"
#include "qflash/io/gguf.hpp"
#include "qflash/io/json.hpp"

namespace qflash::io {

/// One entry of tokenizer.json's "added_tokens".
struct AddedToken {
  std::string content;
  std::int32_t id = -1;
  bool special = false;      ///< skipped by `decode(.., skip_special)`, literal text to
                             ///< `encode(.., allow_special=false)`
  bool single_word = false;  ///< matched only where it does not touch a word character
  bool lstrip = false;       ///< takes the whitespace on its left with it
  bool rstrip = false;       ///< takes the whitespace on its right with it
  bool normalized = false;   ///< looked for in the normalized text instead of the raw text
};

namespace detail {

enum class SplitBehavior : std::uint8_t {
  kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous
};

/// A `Split` pre-tokenizer: where `regex` matches (or does not, with `invert`) delimits pieces.
struct SplitStep {
  Regex regex;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
};

/// A piece of the text being split: [begin, end) and whether the pattern matched it.
struct Span {
  std::size_t begin, end;
  bool match;
};

/// One symbol of a word being merged; symbols form a doubly linked list over a vector.
struct Symbol {
  std::int32_t id;
  std::int32_t prev, next;  // -1 at the ends
  bool alive;
};

/// A candidate merge of symbol `pos` with its right neighbour.
struct MergeCandidate {
  std::int32_t rank, pos, new_id;
};
/// Heap order: lowest rank on top, then the leftmost position.
struct MergeAfter {
  bool operator()(MergeCandidate const& a, MergeCandidate const& b) const {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  }
};

/// Buffers reused across the words of one `encode` call.
struct EncodeScratch {
  MatchData match_data;
  std::vector<std::vector<Span>> spans;  // one per Split step
  std::string normalized, prefixed, byte_level;
  std::vector<Symbol> symbols;
  std::vector<MergeCandidate> heap;
  std::vector<std::int32_t> word_ids;
};

inline constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

/// The `Split` regexes of the Qwen tokenizer.json files, by llama.cpp pre-tokenizer name
/// (`tokenizer.ggml.pre`). llama.cpp's own copies (src/llama-vocab.cpp) spell `(?i:'s|...)`
/// as `'[sS]|...`, which can differ on non-ASCII case folds; these are the originals.
struct GgufPreTokenizer {
  std::string_view name;
  std::string_view pattern;
};
inline constexpr GgufPreTokenizer kGgufPreTokenizers[] = {
    // Qwen2 / Qwen2.5 / Qwen3 (transformers models/qwen2/tokenization_qwen2.py)
    {"qwen2",
     R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"},
    // Qwen3.5 / Qwen3.6 (transformers models/qwen3_5/tokenization_qwen3_5.py): letters with
    // their combining marks
    {"qwen35",
     R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"},
};

/// llama.cpp token types (gguf-py constants.py TokenType).
enum class GgufTokenType : std::int32_t {
  kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6
};

/// Start of the character that ends at `end` (end > 0) in valid UTF-8.
[[nodiscard]] inline std::size_t utf8_prev(std::string_view s, std::size_t end) {
  std::size_t i = end - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  return i;
}

}  // namespace detail

/// A loaded tokenizer. Immutable after loading except for its internal word cache, so one
/// instance may encode and decode from many threads at once. Move-only.
class Tokenizer {
 public:
  /// Loads a `tokenizer.json`; throws Error naming the file and the field when it is
  /// malformed or uses a component this implementation does not support.
  static Tokenizer from_file(std::string const& path) {
    return from_json(read_json_file(path), path);
  }

  /// As `from_file`, from parsed JSON; `source` names it in error messages.
  static Tokenizer from_json(Json const& root, std::string const& source) {
    Tokenizer t;
    t.load(root, source);
    return t;
  }

  /// The tokenizer a Qwen GGUF file carries, equal to the tokenizer.json llama.cpp's
  /// converter made it from (same ids, tokens and decoding). The metadata maps as:
  ///  - `tokenizer.ggml.model` must be "gpt2" (byte-level BPE);
  ///  - `tokenizer.ggml.pre` picks the Split regex (kGgufPreTokenizers: "qwen2", "qwen35");
  ///    the normalizer is NFC and ByteLevel adds no prefix space, as in Qwen's tokenizer.json;
  ///  - `tokenizer.ggml.tokens[id]` with `tokenizer.ggml.token_type[id]` (all NORMAL when
  ///    absent): NORMAL / UNKNOWN -> the BPE vocabulary; CONTROL -> a special added token;
  ///    USER_DEFINED -> a non-special added token; UNUSED (the converter's "[PAD<id>]" fill up
  ///    to the model's vocab_size) -> no token, like the holes of tokenizer.json;
  ///  - `tokenizer.ggml.merges`: "a b" strings, in rank order.
  /// What GGUF does not keep: added tokens are taken as `normalized: false` and without
  /// lstrip/rstrip/single_word (true of every Qwen added token), and the converter marks
  /// non-special added tokens that look like "<|...|>" CONTROL, so those become special here.
  /// Throws Error naming the file and the key on anything else.
  static Tokenizer from_gguf(GgufFile const& file) {
    Tokenizer t;
    t.load_gguf(file);
    return t;
  }

  /// Token ids of `text` (UTF-8; throws Error on invalid UTF-8). With `allow_special` false,
  /// special added tokens in `text` are not recognised and are encoded as the plain text they
  /// spell (non-special added tokens still are), like `tokenizers`' `encode_special_tokens`.
  /// No BOS/EOS is added (Qwen's post-processor adds none).
  [[nodiscard]] std::vector<std::int32_t> encode(std::string_view text,
                                                 bool allow_special = true) const {
    std::size_t const bad = detail::utf8_find_invalid(text);
    QFLASH_CHECK(bad == std::string_view::npos, "Tokenizer::encode: text is not valid UTF-8 (byte ",
                 bad, " of ", text.size(), ")");
    std::vector<std::int32_t> ids;
    ids.reserve(text.size() / 3 + 4);
    detail::EncodeScratch sc;
    sc.spans.resize(splits_.size());
    split_added(raw_added_, text, allow_special, [&](std::string_view seg, std::int32_t added) {
      if (added >= 0) {
        ids.push_back(added);
        return;
      }
      std::string_view norm = seg;
      if (nfc_ && !detail::nfc_trivially_stable(seg)) {
        sc.normalized.clear();
        detail::append_nfc(sc.normalized, seg);
        norm = sc.normalized;
      }
      split_added(normalized_added_, norm, allow_special,
                  [&](std::string_view piece, std::int32_t added2) {
                    if (added2 >= 0)
                      ids.push_back(added2);
                    else
                      pre_tokenize(piece, 0, sc, ids);
                  });
    });
    return ids;
  }

  /// The text of `ids`: each id's bytes concatenated, invalid UTF-8 replaced by U+FFFD (one
  /// per maximal invalid subpart, as `tokenizers` does). Ids of no token decode to nothing;
  /// with `skip_special`, special added tokens are dropped.
  [[nodiscard]] std::string decode(std::span<std::int32_t const> ids,
                                   bool skip_special = false) const {
    std::string raw;
    for (std::int32_t id : ids) raw.append(piece(id, skip_special));
    if (detail::is_valid_utf8(raw)) return raw;
    std::string out;
    detail::append_utf8_lossy(out, raw, /*final=*/true);
    return out;
  }

  /// The id of a token spelled as in tokenizer.json ("Ġthe", "<|im_end|>"); added tokens first.
  [[nodiscard]] std::optional<std::int32_t> token_id(std::string_view token) const {
    if (auto it = added_ids_.find(token); it != added_ids_.end()) return it->second;
    if (auto it = vocab_.find(token); it != vocab_.end()) return it->second;
    return std::nullopt;
  }

  /// The tokenizer.json spelling of `id` ("Ġthe"); empty when no token has this id.
  [[nodiscard]] std::string_view token(std::int32_t id) const {
    return has(id) ? std::string_view(tokens_[static_cast<std::size_t>(id)]) : std::string_view{};
  }

  /// The bytes `id` decodes to (" the"); may be part of a UTF-8 character. Empty when unknown.
  [[nodiscard]] std::string_view token_bytes(std::int32_t id) const {
    return has(id) ? std::string_view(bytes_[static_cast<std::size_t>(id)]) : std::string_view{};
  }

  /// One past the highest id of the vocabulary and the added tokens. Ids below it with no
  /// token (holes) decode to nothing. Model embedding tables are often padded past it.
  [[nodiscard]] std::int32_t vocab_size() const { return static_cast<std::int32_t>(flags_.size()); }

  /// True when a token has this id (not a hole, not past the vocabulary).
  [[nodiscard]] bool has(std::int32_t id) const {
    return id >= 0 && id < vocab_size() && (flags_[static_cast<std::size_t>(id)] & kPresent);
  }
  [[nodiscard]] bool is_special(std::int32_t id) const { return has(id) && (flag(id) & kSpecial); }
  [[nodiscard]] bool is_added(std::int32_t id) const { return has(id) && (flag(id) & kAdded); }
  [[nodiscard]] std::span<AddedToken const> added_tokens() const { return added_; }
  /// The file (or name) the tokenizer was loaded from.
  [[nodiscard]] std::string const& source() const { return source_; }

  /// Bytes `id` contributes to decoded text: empty for unknown ids and, with `skip_special`,
  /// for special tokens.
  [[nodiscard]] std::string_view piece(std::int32_t id, bool skip_special) const {
    if (!has(id) || (skip_special && (flag(id) & kSpecial))) return {};
    return bytes_[static_cast<std::size_t>(id)];
  }

 private:
  static constexpr std::uint8_t kPresent = 1, kAdded = 2, kSpecial = 4;
  /// Ids index dense tables; 2^24 is 60x Qwen3.5's 248k and bounds what a bad file allocates.
  static constexpr std::int64_t kMaxId = std::int64_t{1} << 24;
  static constexpr std::int64_t kIdSlack = 1024;

  Tokenizer() : cache_(std::make_unique<detail::WordCache>()) {}

  [[nodiscard]] std::uint8_t flag(std::int32_t id) const {
    return flags_[static_cast<std::size_t>(id)];
  }

  // --- encode ------------------------------------------------------------------------------

  /// Calls `emit(segment, -1)` for text and `emit(segment, id)` for each added token found by
  /// `trie` in `text`, in order, skipping empty text segments (tokenizers' `find_matches`).
  template <class Emit>
  void split_added(detail::TokenTrie const& trie, std::string_view text, bool allow_special,
                   Emit&& emit) const {
    if (text.empty()) return;
    if (trie.empty()) {
      emit(text, -1);
      return;
    }
    std::size_t done = 0, from = 0;
    while (from < text.size()) {
      auto const m = trie.find(text, from);
      if (m.value < 0) break;
      from = m.end;
      AddedToken const& tok = added_[static_cast<std::size_t>(m.value)];
      if (tok.special && !allow_special) continue;
      std::size_t b = m.begin, e = m.end;
      if (tok.single_word && !is_single_word(text, b, e)) continue;
      if (tok.lstrip) {
        while (b > done) {
          std::size_t const p = detail::utf8_prev(text, b);
          std::size_t len = 1;
          if (!detail::is_white_space(detail::utf8_decode(text, p, len))) break;
          b = p;
        }
      }
      if (tok.rstrip) {
        while (e < text.size()) {
          std::size_t len = 1;
          if (!detail::is_white_space(detail::utf8_decode(text, e, len))) break;
          e += len;
        }
        from = e;
      }
      if (done < b) emit(text.substr(done, b - done), -1);
      emit(text.substr(b, e - b), tok.id);
      done = e;
    }
    if (done < text.size()) emit(text.substr(done), -1);
  }

  [[nodiscard]] static bool is_single_word(std::string_view text, std::size_t b, std::size_t e) {
    std::size_t len = 1;
    if (b > 0 && detail::is_word_char(detail::utf8_decode(text, detail::utf8_prev(text, b), len)))
      return false;
    if (e < text.size() && detail::is_word_char(detail::utf8_decode(text, e, len))) return false;
    return true;
  }

  /// Runs Split step `depth` (then the later ones, then ByteLevel and BPE) on `s`.
  void pre_tokenize(std::string_view s, std::size_t depth, detail::EncodeScratch& sc,
                    std::vector<std::int32_t>& ids) const {
    if (depth == splits_.size()) {
      byte_level(s, sc, ids);
      return;
    }
    detail::SplitStep const& step = splits_[depth];
    std::vector<detail::Span>& spans = sc.spans[depth];
    spans.clear();
    std::size_t prev = 0;
    step.regex.for_each_match(s, sc.match_data, [&](std::size_t b, std::size_t e) {
      if (prev < b) spans.push_back({prev, b, false});
      spans.push_back({b, e, true});
      prev = e;
    });
    if (prev < s.size()) spans.push_back({prev, s.size(), false});
    if (step.invert)
      for (auto& sp : spans) sp.match = !sp.match;
    apply_behavior(step.behavior, spans);
    for (auto const& sp : spans)
      if (sp.end > sp.begin) pre_tokenize(s.substr(sp.begin, sp.end - sp.begin), depth + 1, sc, ids);
  }

  /// Rewrites `spans` into the pieces to keep (tokenizers' NormalizedString::split).
  static void apply_behavior(detail::SplitBehavior behavior, std::vector<detail::Span>& spans) {
    using B = detail::SplitBehavior;
    std::size_t n = 0;  // spans[0, n) is the output so far
    bool previous_match = false;
    switch (behavior) {
      case B::kIsolated:
        return;
      case B::kRemoved:
        for (auto const& sp : spans)
          if (!sp.match) spans[n++] = sp;
        break;
      case B::kContiguous:
        for (auto const& sp : spans) {
          if (sp.match == previous_match && n > 0)
            spans[n - 1].end = sp.end;
          else
            spans[n++] = sp;
          previous_match = sp.match;
        }
        break;
      case B::kMergedWithPrevious:
        for (auto const& sp : spans) {
          if (sp.match && !previous_match && n > 0)
            spans[n - 1].end = sp.end;
          else
            spans[n++] = sp;
          previous_match = sp.match;
        }
        break;
      case B::kMergedWithNext: {
        std::reverse(spans.begin(), spans.end());
        for (auto const& sp : spans) {
          if (sp.match && !previous_match && n > 0)
            spans[n - 1].begin = sp.begin;
          else
            spans[n++] = sp;
          previous_match = sp.match;
        }
        spans.resize(n);
        std::reverse(spans.begin(), spans.end());
        return;
      }
    }
    spans.resize(n);
  }

  /// The ByteLevel pre-tokenizer on one piece, then BPE on each word.
  void byte_level(std::string_view s, detail::EncodeScratch& sc,
                  std::vector<std::int32_t>& ids) const {
    if (prefix_space_ && s.front() != ' ') {
      sc.prefixed.assign(1, ' ');
      sc.prefixed.append(s);
      s = sc.prefixed;
    }
    if (!gpt2_regex_) {
      bpe(s, sc, ids);
      return;
    }
    std::size_t prev = 0;
    gpt2_regex_.for_each_match(s, sc.match_data, [&](std::size_t b, std::size_t e) {
      if (prev < b) bpe(s.substr(prev, b - prev), sc, ids);
      bpe(s.substr(b, e - b), sc, ids);
      prev = e;
    });
    if (prev < s.size()) bpe(s.substr(prev), sc, ids);
  }

  /// BPE on one word given as raw bytes (each byte is one initial symbol).
  void bpe(std::string_view word, detail::EncodeScratch& sc, std::vector<std::int32_t>& ids) const {
    if (ignore_merges_) {
      sc.byte_level.clear();
      detail::append_byte_level(sc.byte_level, word);
      if (auto it = vocab_.find(std::string_view(sc.byte_level)); it != vocab_.end()) {
        ids.push_back(it->second);
        return;
      }
    }
    if (word.size() == 1) {
      std::int32_t const id = byte_ids_[static_cast<unsigned char>(word[0])];
      if (id >= 0)
        ids.push_back(id);
      else if (unk_id_ >= 0)
        ids.push_back(unk_id_);
      return;
    }
    if (cache_->lookup(word, ids)) return;
    merge_word(word, sc);
    ids.insert(ids.end(), sc.word_ids.begin(), sc.word_ids.end());
    cache_->insert(word, sc.word_ids);
  }

  /// tokenizers' `BPE::merge_word` + `Word::merge_all`; result in `sc.word_ids`.
  void merge_word(std::string_view word, detail::EncodeScratch& sc) const {
    auto& sym = sc.symbols;
    sym.clear();
    auto add = [&](std::int32_t id) {
      auto const i = static_cast<std::int32_t>(sym.size());
      if (i > 0) sym.back().next = i;
      sym.push_back({id, i - 1, -1, true});
    };
    // Bytes missing from the vocabulary become unk (fused when `fuse_unk`) or vanish.
    bool pending_unk = false;
    for (char c : word) {
      std::int32_t const id = byte_ids_[static_cast<unsigned char>(c)];
      if (id >= 0) {
        if (pending_unk) {
          add(unk_id_);
          pending_unk = false;
        }
        add(id);
      } else if (unk_id_ >= 0) {
        if (pending_unk && !fuse_unk_) add(unk_id_);
        pending_unk = true;
      }
    }
    if (pending_unk) add(unk_id_);

    auto& heap = sc.heap;
    heap.clear();
    for (std::size_t i = 0; i + 1 < sym.size(); ++i) {
      if (auto const* r = merges_.find(sym[i].id, sym[i + 1].id))
        heap.push_back({r->rank, static_cast<std::int32_t>(i), r->new_id});
    }
    std::make_heap(heap.begin(), heap.end(), detail::MergeAfter{});
    auto push = [&](detail::MergeCandidate c) {
      heap.push_back(c);
      std::push_heap(heap.begin(), heap.end(), detail::MergeAfter{});
    };
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), detail::MergeAfter{});
      detail::MergeCandidate const top = heap.back();
      heap.pop_back();
      detail::Symbol& left = sym[static_cast<std::size_t>(top.pos)];
      if (!left.alive || left.next < 0) continue;
      detail::Symbol& right = sym[static_cast<std::size_t>(left.next)];
      // Stale when either side changed since the candidate was queued.
      auto const* rule = merges_.find(left.id, right.id);
      if (rule == nullptr || rule->new_id != top.new_id) continue;
      left.id = top.new_id;
      right.alive = false;
      left.next = right.next;
      if (left.next >= 0) sym[static_cast<std::size_t>(left.next)].prev = top.pos;
      if (left.prev >= 0) {
        auto const& p = sym[static_cast<std::size_t>(left.prev)];
        if (auto const* r = merges_.find(p.id, left.id)) push({r->rank, left.prev, r->new_id});
      }
      if (left.next >= 0) {
        auto const& nx = sym[static_cast<std::size_t>(left.next)];
        if (auto const* r = merges_.find(left.id, nx.id)) push({r->rank, top.pos, r->new_id});
      }
    }
    sc.word_ids.clear();
    for (std::int32_t i = sym.empty() ? -1 : 0; i >= 0; i = sym[static_cast<std::size_t>(i)].next)
      sc.word_ids.push_back(sym[static_cast<std::size_t>(i)].id);
  }

  // --- load --------------------------------------------------------------------------------

  void load(Json const& root_json, std::string const& file) {
    source_ = file;
    JsonFields root(root_json, file);
    load_model(root.object("model"));
    load_added_tokens(root);
    load_normalizer(root);
    load_pre_tokenizer(root);
    check_post_processor(root);
    check_decoder(root);
    for (char const* key : {"truncation", "padding"}) {
      if (root.has(key))
        QFLASH_LOG_WARN(file, ": '", key, "' is set; qflash's tokenizer ignores it");
    }
    build_id_tables(file);
  }

  void load_gguf(GgufFile const& f) {
    std::string const& file = f.path();
    source_ = file;
    std::string_view const model = f.get_string("tokenizer.ggml.model");
    QFLASH_CHECK(model == "gpt2", file, ": metadata 'tokenizer.ggml.model' is \"", model,
                 "\"; only \"gpt2\" (byte-level BPE) is supported");
    std::string_view const pre = f.get_string("tokenizer.ggml.pre");
    detail::GgufPreTokenizer const* pt = nullptr;
    std::string known;
    for (auto const& c : detail::kGgufPreTokenizers) {
      if (c.name == pre) pt = &c;
      known += (known.empty() ? "" : ", ") + std::string(c.name);
    }
    QFLASH_CHECK(pt != nullptr, file, ": metadata 'tokenizer.ggml.pre' is \"", pre,
                 "\", a pre-tokenizer qflash does not implement (supported: ", known, ")");

    auto const tokens = f.get_string_array("tokenizer.ggml.tokens");
    QFLASH_CHECK(!tokens.empty() && static_cast<std::int64_t>(tokens.size()) <= kMaxId, file,
                 ": metadata 'tokenizer.ggml.tokens' holds ", tokens.size(),
                 " tokens (expected 1 to 2^24)");
    std::vector<std::int64_t> types(tokens.size(),
                                    static_cast<std::int64_t>(detail::GgufTokenType::kNormal));
    if (f.has("tokenizer.ggml.token_type")) {
      types = f.get_int_array("tokenizer.ggml.token_type");
      QFLASH_CHECK(types.size() == tokens.size(), file, ": metadata 'tokenizer.ggml.token_type' "
                   "has ", types.size(), " entries for ", tokens.size(), " tokens");
    }

    using T = detail::GgufTokenType;
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      auto const id = static_cast<std::int32_t>(i);
      std::string_view const tok = tokens[i];
      switch (static_cast<T>(types[i])) {
        case T::kNormal:
        case T::kUnknown:
          if (auto const [it, fresh] = vocab_.try_emplace(std::string(tok), id); !fresh)
            QFLASH_FAIL(file, ": metadata 'tokenizer.ggml.tokens': tokens ", it->second, " and ",
                        id, " are both \"", tok, "\"");
          break;
        case T::kControl:
        case T::kUserDefined: {
          QFLASH_CHECK(!tok.empty(), file, ": metadata 'tokenizer.ggml.tokens' element ", i,
                       ": an added token (type ", types[i], ") must not be empty");
          AddedToken a;
          a.content = std::string(tok);
          a.id = id;
          a.special = static_cast<T>(types[i]) == T::kControl;
          added_ids_[a.content] = a.id;
          added_.push_back(std::move(a));
          break;
        }
        case T::kUnused:
          break;
        default:
          QFLASH_FAIL(file, ": metadata 'tokenizer.ggml.token_type' element ", i, ": type ",
                      types[i], " is not one byte-level BPE uses (1 normal, 2 unknown, "
                      "3 control, 4 user-defined, 5 unused)");
      }
    }
    QFLASH_CHECK(!vocab_.empty(), file, ": metadata 'tokenizer.ggml.tokens' has no NORMAL token");

    auto const merges = f.get_string_array("tokenizer.ggml.merges");
    merges_.reserve(merges.size());
    std::string merged;
    for (std::size_t i = 0; i < merges.size(); ++i) {
      std::string_view const m = merges[i];
      auto fail = [&](std::string_view what) {
        QFLASH_FAIL(file, ": metadata 'tokenizer.ggml.merges' element ", i, " \"", m, "\": ",
                    what);
      };
      auto const sp = m.find(' ');
      if (sp == std::string_view::npos || m.find(' ', sp + 1) != std::string_view::npos)
        fail("must be \"a b\" (two tokens, one space)");
      std::string_view const a = m.substr(0, sp), b = m.substr(sp + 1);
      auto const ia = vocab_.find(a), ib = vocab_.find(b);
      if (ia == vocab_.end() || ib == vocab_.end())
        fail("merges what is not a token of the vocabulary");
      merged.assign(a);
      merged.append(b);
      auto const im = vocab_.find(std::string_view(merged));
      if (im == vocab_.end()) fail("merges into what is not a token of the vocabulary");
      merges_.insert_or_assign(ia->second, ib->second,
                               {static_cast<std::int32_t>(i), im->second});
    }

    nfc_ = true;
    detail::SplitStep step;
    step.regex = detail::Regex(pt->pattern, false, "pre-tokenizer '" + std::string(pt->name) + "'");
    splits_.push_back(std::move(step));
    prefix_space_ = false;
    for (std::size_t i = 0; i < added_.size(); ++i)
      raw_added_.insert(added_[i].content, static_cast<std::int32_t>(i));
    build_id_tables(file);
  }

  [[noreturn]] static void fail_at(std::string const& file, std::string const& field,
                                   std::string_view what) {
    QFLASH_FAIL(file, ": field '", field, "' ", what);
  }

  void load_model(JsonFields const& model) {
    std::string const& file = model.file();
    if (model.has("type")) {
      std::string const type = model.string("type");
      if (type != "BPE")
        model.fail("type", "\"BPE\" (unknown or unsupported model type; only byte-level BPE is)");
    }
    Json const* vocab = model.find("vocab");
    if (vocab == nullptr || !vocab->is_object())
      model.fail("vocab", "a JSON object mapping token -> id");
    vocab_.reserve(vocab->size());
    for (auto it = vocab->begin(); it != vocab->end(); ++it) {
      auto const& v = it.value();
      bool const ok = (v.is_number_unsigned() && v.get<std::uint64_t>() < kMaxId) ||
                      (v.is_number_integer() && v.get<std::int64_t>() >= 0 &&
                       v.get<std::int64_t>() < kMaxId);
      if (!ok)
        fail_at(file, model.field("vocab") + "[" + json_excerpt(it.key()) + "]",
                "must be a token id in [0, 2^24), got " + json_excerpt(v));
      vocab_.try_emplace(it.key(), static_cast<std::int32_t>(v.get<std::int64_t>()));
    }
    QFLASH_CHECK(!vocab_.empty(), file, ": field '", model.field("vocab"), "' is empty");

    Json const* merges = model.find("merges");
    if (merges == nullptr || !merges->is_array())
      model.fail("merges", "a list of merges (\"a b\" strings or [\"a\", \"b\"] pairs)");
    merges_.reserve(merges->size());
    std::int32_t rank = 0;
    std::string merged;
    for (std::size_t i = 0; i < merges->size(); ++i) {
      auto const& m = (*merges)[i];
      std::string const where = model.field("merges") + "[" + std::to_string(i) + "]";
      std::string_view a, b;
      if (m.is_string()) {
        auto const& s = m.get_ref<std::string const&>();
        if (s.starts_with("#version")) continue;  // legacy merges.txt header
        auto const sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          fail_at(file, where, "must be \"a b\" (two tokens, one space), got " + json_excerpt(m));
        a = std::string_view(s).substr(0, sp);
        b = std::string_view(s).substr(sp + 1);
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        a = m[0].get_ref<std::string const&>();
        b = m[1].get_ref<std::string const&>();
      } else {
        fail_at(file, where, "must be \"a b\" or [\"a\", \"b\"], got " + json_excerpt(m));
      }
      auto const ia = vocab_.find(a), ib = vocab_.find(b);
      if (ia == vocab_.end() || ib == vocab_.end())
        fail_at(file, where,
                "merges a token missing from model.vocab: " +
                    json_excerpt(std::string(ia == vocab_.end() ? a : b)));
      merged.assign(a);
      merged.append(b);
      auto const im = vocab_.find(std::string_view(merged));
      if (im == vocab_.end())
        fail_at(file, where, "merges into " + json_excerpt(merged) + ", which is not in model.vocab");
      merges_.insert_or_assign(ia->second, ib->second, {rank++, im->second});
    }

    if (Json const* d = model.find("dropout");
        d != nullptr && !(d->is_number() && d->get<double>() == 0.0))
      model.fail("dropout", "null (BPE dropout is not supported)");
    for (char const* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      if (model.has(key) && !model.string(key).empty())
        model.fail(key, "null or \"\" (not used by byte-level BPE; not supported)");
    }
    if (model.boolean("byte_fallback", false))
      model.fail("byte_fallback", "false (byte fallback is not supported with byte-level BPE)");
    fuse_unk_ = model.boolean("fuse_unk", false);
    ignore_merges_ = model.boolean("ignore_merges", false);
    if (model.has("unk_token")) {
      std::string const unk = model.string("unk_token");
      auto it = vocab_.find(std::string_view(unk));
      if (it == vocab_.end())
        model.fail("unk_token", "null or a token of model.vocab");
      unk_id_ = it->second;
    }
  }

  void load_added_tokens(JsonFields const& root) {
    Json const* list = root.find("added_tokens");
    if (list == nullptr) return;
    if (!list->is_array()) root.fail("added_tokens", "a list of objects");
    for (std::size_t i = 0; i < list->size(); ++i) {
      std::string const where = "added_tokens[" + std::to_string(i) + "]";
      auto const& e = (*list)[i];
      if (!e.is_object()) fail_at(root.file(), where, "must be an object, got " + json_excerpt(e));
      JsonFields f(e, root.file(), where + ".");
      AddedToken t;
      t.id = static_cast<std::int32_t>(f.integer("id", 0, kMaxId - 1, "a token id in [0, 2^24)"));
      t.content = f.string("content");
      if (t.content.empty()) f.fail("content", "a non-empty string");
      t.special = f.boolean("special", false);
      t.single_word = f.boolean("single_word", false);
      t.lstrip = f.boolean("lstrip", false);
      t.rstrip = f.boolean("rstrip", false);
      t.normalized = f.boolean("normalized", !t.special);
      added_ids_[t.content] = t.id;
      added_.push_back(std::move(t));
    }
  }

  void load_normalizer(JsonFields const& root) {
    if (Json const* n = root.find("normalizer")) parse_normalizer(*n, root.file(), "normalizer");
    // Added tokens with `normalized` are searched for in the normalized text, so in NFC form.
    for (std::size_t i = 0; i < added_.size(); ++i) {
      auto const& t = added_[i];
      auto const v = static_cast<std::int32_t>(i);
      if (!t.normalized)
        raw_added_.insert(t.content, v);
      else
        normalized_added_.insert(nfc_ ? detail::nfc(t.content) : t.content, v);
    }
  }

  void parse_normalizer(Json const& n, std::string const& file, std::string const& where) {
    if (n.is_null()) return;
    if (!n.is_object()) fail_at(file, where, "must be null or an object, got " + json_excerpt(n));
    JsonFields f(n, file, where + ".");
    std::string const type = f.string("type");
    if (type == "NFC") {
      nfc_ = true;
    } else if (type == "Sequence") {
      Json const* list = f.find("normalizers");
      if (list == nullptr || !list->is_array()) f.fail("normalizers", "a list of normalizers");
      for (std::size_t i = 0; i < list->size(); ++i)
        parse_normalizer((*list)[i], file, f.field("normalizers") + "[" + std::to_string(i) + "]");
    } else {
      f.fail("type", "\"NFC\" or a \"Sequence\" of them (unsupported normalizer type)");
    }
  }

  void load_pre_tokenizer(JsonFields const& root) {
    Json const* p = root.find("pre_tokenizer");
    if (p == nullptr) root.fail("pre_tokenizer", "an object ending in ByteLevel (byte-level BPE)");
    bool byte_level_seen = false;
    parse_pre_tokenizer(*p, root.file(), "pre_tokenizer", byte_level_seen);
    if (!byte_level_seen)
      fail_at(root.file(), "pre_tokenizer",
              "must end with a ByteLevel pre-tokenizer (only byte-level BPE is supported)");
  }

  void parse_pre_tokenizer(Json const& p, std::string const& file, std::string const& where,
                           bool& byte_level_seen) {
    if (!p.is_object()) fail_at(file, where, "must be an object, got " + json_excerpt(p));
    JsonFields f(p, file, where + ".");
    std::string const type = f.string("type");
    if (byte_level_seen)
      fail_at(file, where, "follows ByteLevel; ByteLevel must be the last pre-tokenizer");
    if (type == "Sequence") {
      Json const* list = f.find("pretokenizers");
      if (list == nullptr || !list->is_array()) f.fail("pretokenizers", "a list of pre-tokenizers");
      for (std::size_t i = 0; i < list->size(); ++i)
        parse_pre_tokenizer((*list)[i], file,
                            f.field("pretokenizers") + "[" + std::to_string(i) + "]",
                            byte_level_seen);
    } else if (type == "Split") {
      JsonFields pattern = f.object("pattern");
      detail::SplitStep step;
      if (pattern.has("Regex")) {
        step.regex = detail::Regex(pattern.string("Regex"), false,
                                   file + ": field '" + pattern.field("Regex") + "'");
      } else if (pattern.has("String")) {
        step.regex = detail::Regex(pattern.string("String"), true,
                                   file + ": field '" + pattern.field("String") + "'");
      } else {
        f.fail("pattern", "{\"Regex\": ...} or {\"String\": ...}");
      }
      std::string const behavior = f.string("behavior");
      using B = detail::SplitBehavior;
      if (behavior == "Isolated") step.behavior = B::kIsolated;
      else if (behavior == "Removed") step.behavior = B::kRemoved;
      else if (behavior == "MergedWithPrevious") step.behavior = B::kMergedWithPrevious;
      else if (behavior == "MergedWithNext") step.behavior = B::kMergedWithNext;
      else if (behavior == "Contiguous") step.behavior = B::kContiguous;
      else
        f.fail("behavior",
               "one of Isolated, Removed, MergedWithPrevious, MergedWithNext, Contiguous");
      step.invert = f.boolean("invert", false);
      splits_.push_back(std::move(step));
    } else if (type == "ByteLevel") {
      byte_level_seen = true;
      prefix_space_ = f.boolean("add_prefix_space", true);
      if (f.boolean("use_regex", true))
        gpt2_regex_ = detail::Regex(detail::kGpt2Pattern, false, "GPT-2 pre-tokenizer regex");
    } else {
      f.fail("type", "\"Split\", \"ByteLevel\" or a \"Sequence\" of them (unsupported pre_tokenizer type)");
    }
  }

  /// Only post-processors that add no tokens: `encode` never adds BOS/EOS.
  static void check_post_processor(JsonFields const& root) {
    check_byte_level_only(root, "post_processor", "processors", true);
  }
  static void check_decoder(JsonFields const& root) {
    check_byte_level_only(root, "decoder", "decoders", false);
  }
  static void check_byte_level_only(JsonFields const& root, char const* key, char const* list_key,
                                    bool null_ok) {
    Json const* d = root.find(key);
    std::string const expected =
        std::string(null_ok ? "null, " : "") + "ByteLevel or a Sequence of ByteLevel (unsupported " +
        key + " type)";
    if (d == nullptr) {
      if (null_ok) return;
      root.fail(key, expected);
    }
    auto check = [&](Json const& v, std::string const& where, auto& self) -> void {
      if (!v.is_object()) fail_at(root.file(), where, "must be " + expected + ", got " + json_excerpt(v));
      JsonFields f(v, root.file(), where + ".");
      std::string const type = f.string("type");
      if (type == "ByteLevel") return;
      if (type != "Sequence") f.fail("type", expected);
      Json const* list = f.find(list_key);
      if (list == nullptr || !list->is_array()) f.fail(list_key, "a list");
      for (std::size_t i = 0; i < list->size(); ++i)
        self((*list)[i], f.field(list_key) + "[" + std::to_string(i) + "]", self);
    };
    check(*d, key, check);
  }

  void build_id_tables(std::string const& file) {
    std::int32_t max_id = -1;
    for (auto const& [tok, id] : vocab_) max_id = std::max(max_id, id);
    for (auto const& t : added_) max_id = std::max(max_id, t.id);
    // Ids index dense tables: a few ids far past the tokens (holes) are normal, a lone huge id
    // would make a small file allocate a gigabyte.
    std::int64_t const n_tokens = static_cast<std::int64_t>(vocab_.size() + added_.size());
    QFLASH_CHECK(max_id < 2 * n_tokens + kIdSlack, file, ": token id ", max_id, " is far beyond the ", n_tokens,
                 " tokens defined (ids must stay below 2 x tokens + ", kIdSlack, ")");
    auto const n = static_cast<std::size_t>(max_id) + 1;
    tokens_.assign(n, {});
    bytes_.assign(n, {});
    flags_.assign(n, 0);
    std::string buf;
    for (auto const& [tok, id] : vocab_) {
      auto const i = static_cast<std::size_t>(id);
      if (flags_[i] & kPresent)
        fail_at(file, "model.vocab",
                "gives id " + std::to_string(id) + " to both " + json_excerpt(tokens_[i]) +
                    " and " + json_excerpt(tok));
      tokens_[i] = tok;
      // As tokenizers' ByteLevel decoder: a token with a character outside the byte alphabet
      // decodes to its own UTF-8.
      bytes_[i] = detail::byte_level_to_bytes(tok, buf) ? buf : tok;
      flags_[i] = kPresent;
    }
    for (auto const& t : added_) {
      auto const i = static_cast<std::size_t>(t.id);
      tokens_[i] = t.content;
      bytes_[i] = t.content;
      flags_[i] = kPresent | kAdded | (t.special ? kSpecial : 0);
    }
    for (int b = 0; b < 256; ++b) {
      buf.clear();
      detail::append_utf8(buf, detail::kByteLevel.byte_to_cp[static_cast<std::size_t>(b)]);
      auto it = vocab_.find(std::string_view(buf));
      byte_ids_[static_cast<std::size_t>(b)] = it == vocab_.end() ? -1 : it->second;
    }
  }

  std::string source_;
  // model
  detail::StringMap<std::int32_t> vocab_;  // model.vocab
  detail::MergeTable merges_;
  std::array<std::int32_t, 256> byte_ids_{};  // id of each byte's one-character token, or -1
  std::int32_t unk_id_ = -1;
  bool fuse_unk_ = false;
  bool ignore_merges_ = false;
  // added tokens
  std::vector<AddedToken> added_;
  detail::StringMap<std::int32_t> added_ids_;
  detail::TokenTrie raw_added_, normalized_added_;  // values index added_
  // normalizer and pre-tokenizer
  bool nfc_ = false;
  std::vector<detail::SplitStep> splits_;
  bool prefix_space_ = false;
  detail::Regex gpt2_regex_;  // set when ByteLevel has use_regex
  // by id
  std::vector<std::string> tokens_, bytes_;
  std::vector<std::uint8_t> flags_;
  std::unique_ptr<detail::WordCache> cache_;
};

/// The special token ids and flags a GGUF file's tokenizer metadata names
/// (`tokenizer.ggml.bos_token_id`, ...); absent keys stay empty.
struct GgufSpecialTokens {
  std::optional<std::int32_t> bos, eos, eot, eom, unk, sep, pad, mask;
  std::optional<bool> add_bos, add_eos;
};

/// Reads GgufSpecialTokens; throws Error naming the key when one is not an integer id in
/// [0, 2^31) or a flag is not a bool.
inline GgufSpecialTokens gguf_special_tokens(GgufFile const& f) {
  auto id = [&](char const* key) -> std::optional<std::int32_t> {
    auto v = f.find_int(key);
    if (!v) return std::nullopt;
    QFLASH_CHECK(*v >= 0 && *v <= std::numeric_limits<std::int32_t>::max(), f.path(),
                 ": metadata '", key, "' = ", *v, " is not a token id");
    return static_cast<std::int32_t>(*v);
  };
  GgufSpecialTokens s;
  s.bos = id("tokenizer.ggml.bos_token_id");
  s.eos = id("tokenizer.ggml.eos_token_id");
  s.eot = id("tokenizer.ggml.eot_token_id");
  s.eom = id("tokenizer.ggml.eom_token_id");
  s.unk = id("tokenizer.ggml.unknown_token_id");
  s.sep = id("tokenizer.ggml.seperator_token_id");  // sic: gguf-py's spelling
  s.pad = id("tokenizer.ggml.padding_token_id");
  s.mask = id("tokenizer.ggml.mask_token_id");
  s.add_bos = f.find<bool>("tokenizer.ggml.add_bos_token");
  s.add_eos = f.find<bool>("tokenizer.ggml.add_eos_token");
  return s;
}

/// Incremental decoding for streamed generation: feed ids one at a time, get back only whole
/// UTF-8 characters (a byte-level token can end inside one). The concatenation of every
/// `push` and the final `flush` equals `Tokenizer::decode` of all the ids.
class StreamDecoder {
 public:
  /// `tokenizer` must outlive this decoder.
  explicit StreamDecoder(Tokenizer const& tokenizer, bool skip_special = false)
      : tok_(&tokenizer), skip_special_(skip_special) {}

  /// The text that `id` completes; empty while a character is still cut.
  [[nodiscard]] std::string push(std::int32_t id) {
    std::string out;
    std::string_view const bytes = tok_->piece(id, skip_special_);
    if (pending_.empty()) {
      std::size_t const used = detail::append_utf8_lossy(out, bytes, /*final=*/false);
      pending_.assign(bytes.substr(used));
    } else {
      pending_.append(bytes);
      std::size_t const used = detail::append_utf8_lossy(out, pending_, /*final=*/false);
      pending_.erase(0, used);
    }
    return out;
  }

  /// What is left at the end of the stream: a cut character becomes U+FFFD.
  [[nodiscard]] std::string flush() {
    std::string out;
    detail::append_utf8_lossy(out, pending_, /*final=*/true);
    pending_.clear();
    return out;
  }

  /// Bytes held back waiting for the rest of a character (at most 3).
  [[nodiscard]] std::size_t pending_bytes() const { return pending_.size(); }

 private:
  Tokenizer const* tok_;
  bool skip_special_;
  std::string pending_;
};

}  // namespace qflash::io
