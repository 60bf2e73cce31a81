/// @file
/// Unicode helpers for the tokenizer: NFC through utf8proc (the normalizer Qwen's
/// `tokenizer.json` names), and the `\s` / `\w` character tests Hugging Face `tokenizers` uses
/// for the `lstrip`, `rstrip` and `single_word` options of added tokens.
#pragma once

#include <utf8proc.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include "qflash/core/error.hpp"

namespace qflash::io::detail {

/// True when `s` is already in NFC for certain. Every code point below U+0300 is NFC-stable
/// (the first NFC_Quick_Check=No/Maybe code point is U+0300), and a UTF-8 string holds one at
/// or above U+0300 exactly when some byte is >= 0xCC, so ASCII and Latin text skips utf8proc.
[[nodiscard]] inline bool nfc_trivially_stable(std::string_view s) {
  for (char c : s)
    if (static_cast<unsigned char>(c) >= 0xCC) return false;
  return true;
}

/// Appends NFC of the valid UTF-8 `s` (no NUL-termination needed) to `out`.
inline void append_nfc_utf8proc(std::string& out, std::string_view s) {
  utf8proc_uint8_t* dst = nullptr;
  utf8proc_ssize_t const n =
      utf8proc_map(reinterpret_cast<utf8proc_uint8_t const*>(s.data()),
                   static_cast<utf8proc_ssize_t>(s.size()), &dst,
                   static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> hold(dst, &std::free);
  QFLASH_CHECK(n >= 0, "tokenizer: NFC normalization failed: ", utf8proc_errmsg(n));
  out.append(reinterpret_cast<char const*>(dst), static_cast<std::size_t>(n));
}

/// Appends NFC(`s`) to `out`; `s` must be valid UTF-8. Only the runs of non-ASCII text around
/// code points >= U+0300 go through utf8proc: an ASCII character is a boundary NFC never
/// crosses (combining class 0, never the second half of a composition, no decomposition), so
/// normalizing the pieces between such boundaries separately gives NFC of the whole. The ASCII
/// character before a run is part of it, as it may be the base a combining mark composes with.
inline void append_nfc(std::string& out, std::string_view s) {
  auto const byte = [&](std::size_t i) { return static_cast<unsigned char>(s[i]); };
  std::size_t done = 0;  // s[0, done) is appended
  for (std::size_t i = 0; i < s.size();) {
    if (byte(i) < 0xCC) {
      ++i;
      continue;
    }
    std::size_t b = i, e = i;
    while (b > done && byte(b - 1) >= 0x80) --b;
    if (b > done) --b;  // the ASCII base
    while (e < s.size() && byte(e) >= 0x80) ++e;
    out.append(s.substr(done, b - done));
    append_nfc_utf8proc(out, s.substr(b, e - b));
    done = i = e;
  }
  out.append(s.substr(done));
}

[[nodiscard]] inline std::string nfc(std::string_view s) {
  std::string out;
  append_nfc(out, s);
  return out;
}

/// Unicode White_Space, what `\s` means in Rust's regex crate.
[[nodiscard]] constexpr bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

/// Rust regex's `\w`: Alphabetic, marks, decimal digits, connector punctuation, joiners.
/// Alphabetic is approximated by the letter and letter-number categories.
[[nodiscard]] inline bool is_word_char(char32_t c) {
  if (c < 0x80)
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
  if (c == 0x200C || c == 0x200D) return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME: case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

}  // namespace qflash::io::detail
