/// @file
/// A small RAII wrapper over PCRE2 (8-bit, UTF + UCP, JIT when available) for the
/// pre-tokenizer's split patterns. Hugging Face `tokenizers` runs these patterns on Oniguruma;
/// PCRE2 accepts the same syntax for every pattern the Qwen/GPT-2/Llama-3 families ship
/// (`\p{L}`, `\p{N}`, `\p{M}`, `(?i:...)`, `\s+(?!\S)`) and gives the same leftmost,
/// non-overlapping matches.
#pragma once

#ifndef PCRE2_CODE_UNIT_WIDTH
#define PCRE2_CODE_UNIT_WIDTH 8
#endif
#include <pcre2.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "qflash/core/error.hpp"
#include "qflash/io/detail/utf8.hpp"

namespace qflash::io::detail {

// The `_8` names are declared whatever width the includer chose for the generic ones.
struct Pcre2CodeDeleter {
  void operator()(pcre2_code_8* p) const noexcept { pcre2_code_free_8(p); }
};
struct Pcre2MatchDataDeleter {
  void operator()(pcre2_match_data_8* p) const noexcept { pcre2_match_data_free_8(p); }
};

[[nodiscard]] inline std::string pcre2_error_text(int code) {
  PCRE2_UCHAR8 buf[256];
  int n = pcre2_get_error_message_8(code, buf, sizeof buf);
  if (n < 0) return "PCRE2 error " + std::to_string(code);
  return std::string(reinterpret_cast<char const*>(buf), static_cast<std::size_t>(n));
}

/// Per-call scratch for matching: one ovector pair is enough, the splitters only need the
/// whole match. Not shareable between threads; cheap to make once per `encode`.
class MatchData {
 public:
  MatchData() : md_(pcre2_match_data_create_8(1, nullptr)) {
    QFLASH_CHECK(md_ != nullptr, "tokenizer: out of memory allocating PCRE2 match data");
  }
  [[nodiscard]] pcre2_match_data_8* get() const { return md_.get(); }

 private:
  std::unique_ptr<pcre2_match_data_8, Pcre2MatchDataDeleter> md_;
};

/// Rewrites the escapes whose meaning differs between Oniguruma (what `tokenizers` runs) and
/// PCRE2 with UCP into explicit sets with Oniguruma's meaning:
///  - `\s` / `\S`: Oniguruma's is Unicode White_Space; PCRE2 10.42 also counts U+180E
///    MONGOLIAN VOWEL SEPARATOR (and its set may change with the library version);
///  - `\w` / `\W`: Oniguruma's is Letter | Mark | Number | Connector_Punctuation; PCRE2's lacks
///    marks and connectors other than '_';
///  - `\h` / `\H`: a hex digit in Oniguruma, horizontal space in PCRE2.
/// Inside a character class the positive escapes expand to their members; a negated escape
/// inside a class (`[\S...]`) has no such expansion and is left to PCRE2.
[[nodiscard]] inline std::string oniguruma_escapes_to_pcre2(std::string_view p) {
  static constexpr std::string_view kSpace =
      R"(\t\n\x0B\f\r\x20\x85\xA0\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";
  static constexpr std::string_view kWord = R"(\p{L}\p{M}\p{N}\p{Pc})";
  static constexpr std::string_view kHex = "0-9A-Fa-f";
  std::string out;
  out.reserve(p.size() + 64);
  bool in_class = false;
  for (std::size_t i = 0; i < p.size(); ++i) {
    char const c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      char const d = p[i + 1];
      if (d == 'Q') {  // \Q...\E is literal text
        std::size_t const e = p.find("\\E", i + 2);
        std::size_t const stop = e == std::string_view::npos ? p.size() : e + 2;
        out.append(p.substr(i, stop - i));
        i = stop - 1;
        continue;
      }
      std::string_view set;
      if (d == 's' || d == 'S') set = kSpace;
      if (d == 'w' || d == 'W') set = kWord;
      if (d == 'h' || d == 'H') set = kHex;
      bool const negated = d == 'S' || d == 'W' || d == 'H';
      if (!set.empty() && !(in_class && negated)) {
        if (in_class) {
          out.append(set);
        } else {
          out.append(negated ? "[^" : "[");
          out.append(set);
          out.push_back(']');
        }
      } else {
        out.push_back(c);
        out.push_back(d);
      }
      ++i;
      continue;
    }
    out.push_back(c);
    if (!in_class && c == '[') {
      in_class = true;
      // A ']' first in the class (after an optional '^') is a literal.
      if (i + 1 < p.size() && p[i + 1] == '^') out.push_back(p[++i]);
      if (i + 1 < p.size() && p[i + 1] == ']') out.push_back(p[++i]);
    } else if (in_class && c == '[' && i + 1 < p.size() && p[i + 1] == ':') {
      std::size_t const e = p.find(":]", i + 2);  // POSIX class such as [:alpha:]
      if (e != std::string_view::npos) {
        out.append(p.substr(i + 1, e + 2 - (i + 1)));
        i = e + 1;
      }
    } else if (in_class && c == ']') {
      in_class = false;
    }
  }
  return out;
}

class Regex {
 public:
  Regex() = default;

  /// Compiles `pattern` (matched as plain text when `literal`). On failure throws Error
  /// "<where>: regex failed to compile at offset N: <PCRE2 message>".
  Regex(std::string_view pattern, bool literal, std::string_view where) {
    // PCRE2_LITERAL refuses PCRE2_UCP, which only changes what classes mean anyway.
    std::uint32_t const options = literal ? PCRE2_UTF | PCRE2_LITERAL : PCRE2_UTF | PCRE2_UCP;
    int err = 0;
    PCRE2_SIZE err_offset = 0;
    // Compile the pattern as written first so that errors give offsets into it.
    pcre2_code_8* code =
        pcre2_compile_8(reinterpret_cast<PCRE2_SPTR8>(pattern.data()), pattern.size(), options,
                        &err, &err_offset, nullptr);
    if (code == nullptr) {
      QFLASH_FAIL(where, ": regex failed to compile at offset ", err_offset, ": ",
                  pcre2_error_text(err), " (pattern ", pattern, ")");
    }
    if (!literal) {
      std::string const rewritten = oniguruma_escapes_to_pcre2(pattern);
      if (rewritten != pattern) {
        pcre2_code_free_8(code);
        code = pcre2_compile_8(reinterpret_cast<PCRE2_SPTR8>(rewritten.data()), rewritten.size(),
                               options, &err, &err_offset, nullptr);
        QFLASH_CHECK(code != nullptr, where, ": regex failed to compile after rewriting \\s, \\w, ",
                     "\\h for Oniguruma compatibility, at offset ", err_offset, ": ",
                     pcre2_error_text(err), " (rewritten pattern ", rewritten, ")");
      }
    }
    code_.reset(code);
    // Without JIT (not built in, or no executable memory) the interpreter gives the same matches.
    jit_ = pcre2_jit_compile_8(code, PCRE2_JIT_COMPLETE) == 0;
  }

  [[nodiscard]] bool jit() const { return jit_; }
  [[nodiscard]] explicit operator bool() const { return code_ != nullptr; }

  /// Calls `on_match(begin, end)` for each non-empty match in `subject`, leftmost first and
  /// non-overlapping, like Oniguruma's `find_iter`. `subject` must be valid UTF-8.
  template <class OnMatch>
  void for_each_match(std::string_view subject, MatchData& md, OnMatch&& on_match) const {
    auto const* s = reinterpret_cast<PCRE2_SPTR8>(subject.data());
    std::size_t const n = subject.size();
    std::size_t offset = 0;
    while (offset <= n) {
      int rc = pcre2_match_8(code_.get(), s, n, offset, PCRE2_NO_UTF_CHECK, md.get(), nullptr);
      if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
        // A very long run for the 32 KiB default JIT stack: the interpreter keeps its
        // backtracking state on the heap.
        rc = pcre2_match_8(code_.get(), s, n, offset, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md.get(),
                           nullptr);
      }
      if (rc == PCRE2_ERROR_NOMATCH) return;
      QFLASH_CHECK(rc >= 0, "tokenizer: pre-tokenizer regex failed on a ", n,
                   "-byte piece: ", pcre2_error_text(rc));
      PCRE2_SIZE const* ov = pcre2_get_ovector_pointer_8(md.get());
      std::size_t const b = ov[0], e = ov[1];
      if (e > b) {
        on_match(b, e);
        offset = e;
      } else {
        // Empty match: contributes nothing; step one character, as find_iter does.
        if (e >= n) return;
        std::size_t len = 1;
        (void)utf8_decode(subject, e, len);
        offset = e + len;
      }
    }
  }

 private:
  std::unique_ptr<pcre2_code_8, Pcre2CodeDeleter> code_;
  bool jit_ = false;
};

}  // namespace qflash::io::detail
