/// @file
/// GPT-2's `bytes_to_unicode` table: byte-level BPE vocabularies spell every byte as a
/// printable code point (space is "Ġ" U+0120, newline "Ċ" U+010A), so that tokens are strings.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "qflash/io/detail/utf8.hpp"

namespace qflash::io::detail {

struct ByteLevelTable {
  static constexpr char32_t kMaxCodePoint = 256 + 68;  // 68 bytes are remapped past 0xFF
  std::array<char32_t, 256> byte_to_cp{};
  std::array<std::int16_t, kMaxCodePoint> cp_to_byte{};  // -1: not a byte-level code point
};

/// Printable Latin-1 bytes ('!'..'~', U+00A1..U+00AC, U+00AE..U+00FF) stand for themselves;
/// the others take U+0100, U+0101, ... in byte order.
[[nodiscard]] constexpr ByteLevelTable make_byte_level_table() {
  ByteLevelTable t;
  for (auto& b : t.cp_to_byte) b = -1;
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    bool const printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    char32_t const cp = printable ? static_cast<char32_t>(b) : next++;
    t.byte_to_cp[b] = cp;
    t.cp_to_byte[cp] = static_cast<std::int16_t>(b);
  }
  return t;
}

inline constexpr ByteLevelTable kByteLevel = make_byte_level_table();
static_assert(kByteLevel.byte_to_cp[' '] == 0x120 && kByteLevel.byte_to_cp['\n'] == 0x10A);

/// Appends the byte-level spelling of raw `bytes` ("a b" -> "aĠb").
inline void append_byte_level(std::string& out, std::string_view bytes) {
  for (char c : bytes) append_utf8(out, kByteLevel.byte_to_cp[static_cast<unsigned char>(c)]);
}

/// The bytes a byte-level token spells, or false when some character of `token` is not a
/// byte-level code point (added tokens like "<|im_end|>" are ASCII and map to themselves).
[[nodiscard]] inline bool byte_level_to_bytes(std::string_view token, std::string& out) {
  out.clear();
  if (!is_valid_utf8(token)) return false;
  for (std::size_t i = 0; i < token.size();) {
    std::size_t len = 1;
    char32_t const cp = utf8_decode(token, i, len);
    if (cp >= ByteLevelTable::kMaxCodePoint || kByteLevel.cp_to_byte[cp] < 0) return false;
    out.push_back(static_cast<char>(kByteLevel.cp_to_byte[cp]));
    i += len;
  }
  return true;
}

}  // namespace qflash::io::detail
