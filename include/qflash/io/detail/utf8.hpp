/// @file
/// UTF-8 validation and lossy repair for the tokenizer. Byte-level BPE tokens are byte strings,
/// so decoding one token at a time can end inside a character; these helpers tell a complete
/// character from a cut one and replace invalid bytes the way Rust's `String::from_utf8_lossy`
/// does (one U+FFFD per maximal invalid subpart), so that `Tokenizer::decode` and
/// `StreamDecoder` agree with Hugging Face `tokenizers` byte for byte.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace qflash::io::detail {

enum class Utf8Kind : std::uint8_t {
  kValid,       ///< a whole, well-formed character
  kInvalid,     ///< a maximal subpart that can never start a character: replace it
  kIncomplete,  ///< the input ends inside a character that may still be completed
};

struct Utf8Step {
  Utf8Kind kind;
  std::size_t len;  ///< bytes of the character, or of the invalid / incomplete subpart (>= 1)
};

/// Classifies the bytes at `s[i]` (i < s.size()) per the Unicode "maximal subpart" practice:
/// overlong forms, surrogates and code points above U+10FFFF are invalid.
[[nodiscard]] constexpr Utf8Step utf8_step(std::string_view s, std::size_t i) {
  auto const b0 = static_cast<std::uint8_t>(s[i]);
  if (b0 < 0x80) return {Utf8Kind::kValid, 1};
  std::size_t need = 0;
  std::uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 2;
  } else if (b0 == 0xE0) {
    need = 3, lo = 0xA0;
  } else if ((b0 >= 0xE1 && b0 <= 0xEC) || b0 == 0xEE || b0 == 0xEF) {
    need = 3;
  } else if (b0 == 0xED) {
    need = 3, hi = 0x9F;  // no surrogates
  } else if (b0 == 0xF0) {
    need = 4, lo = 0x90;
  } else if (b0 >= 0xF1 && b0 <= 0xF3) {
    need = 4;
  } else if (b0 == 0xF4) {
    need = 4, hi = 0x8F;  // <= U+10FFFF
  } else {
    return {Utf8Kind::kInvalid, 1};  // continuation byte, C0/C1, F5..FF
  }
  for (std::size_t k = 1; k < need; ++k) {
    if (i + k >= s.size()) return {Utf8Kind::kIncomplete, k};
    auto const b = static_cast<std::uint8_t>(s[i + k]);
    if (b < lo || b > hi) return {Utf8Kind::kInvalid, k};
    lo = 0x80, hi = 0xBF;
  }
  return {Utf8Kind::kValid, need};
}

/// Offset of the first byte that is not part of a well-formed character, or npos.
[[nodiscard]] inline std::size_t utf8_find_invalid(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    if (static_cast<std::uint8_t>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    auto const st = utf8_step(s, i);
    if (st.kind != Utf8Kind::kValid) return i;
    i += st.len;
  }
  return std::string_view::npos;
}

[[nodiscard]] inline bool is_valid_utf8(std::string_view s) {
  return utf8_find_invalid(s) == std::string_view::npos;
}

inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

/// Appends the longest prefix of `bytes` that can be decided now: whole characters as they are,
/// each invalid subpart as U+FFFD. Stops before a character cut by the end of `bytes` unless
/// `final` is set, in which case that tail becomes one U+FFFD too. Returns the bytes consumed.
inline std::size_t append_utf8_lossy(std::string& out, std::string_view bytes, bool final) {
  std::size_t i = 0, run = 0;  // [run, i) is valid and not yet copied
  while (i < bytes.size()) {
    if (static_cast<std::uint8_t>(bytes[i]) < 0x80) {
      ++i;
      continue;
    }
    auto const st = utf8_step(bytes, i);
    if (st.kind == Utf8Kind::kValid) {
      i += st.len;
      continue;
    }
    out.append(bytes.substr(run, i - run));
    if (st.kind == Utf8Kind::kIncomplete && !final) return i;
    out.append(kReplacementChar);
    i += st.len;
    run = i;
  }
  out.append(bytes.substr(run, i - run));
  return i;
}

/// Decodes the well-formed character at `s[i]` (callers validated `s`); sets `len`.
[[nodiscard]] inline char32_t utf8_decode(std::string_view s, std::size_t i, std::size_t& len) {
  auto const b0 = static_cast<std::uint8_t>(s[i]);
  auto cont = [&](std::size_t k) { return static_cast<char32_t>(s[i + k]) & 0x3F; };
  if (b0 < 0x80) return len = 1, b0;
  if (b0 < 0xE0) return len = 2, ((b0 & 0x1Fu) << 6) | cont(1);
  if (b0 < 0xF0) return len = 3, ((b0 & 0x0Fu) << 12) | (cont(1) << 6) | cont(2);
  return len = 4, ((b0 & 0x07u) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3);
}

inline void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace qflash::io::detail
