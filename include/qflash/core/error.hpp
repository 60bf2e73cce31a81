/// @file
/// Host-layer errors: `qflash::Error` carries where it was raised; `QFLASH_CHECK` throws it.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "qflash/core/status.hpp"

namespace qflash {

class Error : public std::runtime_error {
 public:
  Error(std::string message, char const* file, int line)
      : std::runtime_error(std::move(message)), file_(file), line_(line) {}

  [[nodiscard]] char const* file() const noexcept { return file_; }
  [[nodiscard]] int line() const noexcept { return line_; }

 private:
  char const* file_;
  int line_;
};

/// `text` safe to print on a terminal: control characters (C0, DEL, and C1 such as the
/// single-byte CSI) become `\n`, `\t`, `\xNN` or `\u00NN`, and bytes that are not UTF-8
/// become `\xNN`, so that a string read from a file cannot inject terminal escapes.
inline std::string printable(std::string_view text) {
  static constexpr char kHex[] = "0123456789abcdef";
  auto hex = [](std::string& out, char const* prefix, unsigned v) {
    out += prefix;
    out += kHex[(v >> 4) & 15];
    out += kHex[v & 15];
  };
  std::string out;
  out.reserve(text.size());
  auto const* s = reinterpret_cast<unsigned char const*>(text.data());
  std::size_t const n = text.size();
  for (std::size_t i = 0; i < n;) {
    unsigned const c = s[i];
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
      ++i;
      continue;
    }
    if (c < 0x80) {  // C0 or DEL
      if (c == '\n') out += "\\n";
      else if (c == '\t') out += "\\t";
      else if (c == '\r') out += "\\r";
      else hex(out, "\\x", c);
      ++i;
      continue;
    }
    // A well-formed UTF-8 sequence (no overlongs, surrogates or values above U+10FFFF).
    std::size_t len = c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
    bool ok = len > 0 && i + len <= n;
    for (std::size_t k = 1; ok && k < len; ++k) ok = (s[i + k] & 0xc0) == 0x80;
    if (ok && len == 3) ok = !(c == 0xe0 && s[i + 1] < 0xa0) && !(c == 0xed && s[i + 1] >= 0xa0);
    if (ok && len == 4) ok = !(c == 0xf0 && s[i + 1] < 0x90) && !(c == 0xf4 && s[i + 1] >= 0x90);
    if (!ok) {
      hex(out, "\\x", c);
      ++i;
    } else if (c == 0xc2 && s[i + 1] < 0xa0) {  // U+0080..U+009F: C1 controls
      hex(out, "\\u00", s[i + 1]);
      i += 2;
    } else {
      out.append(text.data() + i, len);
      i += len;
    }
  }
  return out;
}

namespace detail {
template <class Part>
void append_printable(std::ostringstream& os, Part const& part) {
  if constexpr (std::is_convertible_v<Part const&, std::string_view>)
    os << printable(std::string_view(part));
  else if constexpr (std::is_same_v<Part, char>)
    os << printable(std::string_view(&part, 1));
  else
    os << part;
}

/// The message of an Error or a log line: the parts streamed in order, every string part
/// passed through printable() (file names, keys and values read from files reach here).
template <class... Parts>
std::string concat(Parts const&... parts) {
  std::ostringstream os;
  (append_printable(os, parts), ...);
  return os.str();
}
}  // namespace detail

}  // namespace qflash

/// Throws qflash::Error with the concatenated message parts when `cond` is false.
#define QFLASH_CHECK(cond, ...)                                                        \
  do {                                                                                 \
    if (!(cond)) [[unlikely]]                                                          \
      throw ::qflash::Error(::qflash::detail::concat(__VA_ARGS__), __FILE__, __LINE__); \
  } while (0)

/// Throws qflash::Error unconditionally.
#define QFLASH_FAIL(...) \
  throw ::qflash::Error(::qflash::detail::concat(__VA_ARGS__), __FILE__, __LINE__)

/// Turns a kernel-layer Status into an Error naming the operation.
#define QFLASH_CHECK_STATUS(expr, what)                                                   \
  do {                                                                                    \
    ::qflash::Status qflash_status_ = (expr);                                             \
    QFLASH_CHECK(qflash_status_ == ::qflash::Status::kSuccess, what, ": ",                \
                 ::qflash::to_string(qflash_status_));                                    \
  } while (0)
