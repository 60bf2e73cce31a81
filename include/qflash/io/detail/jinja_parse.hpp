/// @file
/// The lexer and parser of the Jinja2 subset in jinja.hpp, following jinja2 3.1's
/// lexer.py and parser.py rule by rule (whitespace control with trim_blocks and lstrip_blocks,
/// operator precedence, what a test's bare argument may be), so that a template parses here
/// exactly when it parses in Python, into the same tree. Errors name the template, line and
/// column. Part of jinja.hpp.
#pragma once

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/io/detail/jinja_value.hpp"

namespace qflash::io::jinja::detail {

// --- positions -------------------------------------------------------------------------------

/// Turns byte offsets into "name:line:col" (column in characters, both 1-based).
class SourceMap {
 public:
  SourceMap(std::string const& source, std::string name) : src_(&source), name_(std::move(name)) {
    line_starts_.push_back(0);
    for (std::size_t i = 0; i < source.size(); ++i)
      if (source[i] == '\n') line_starts_.push_back(static_cast<std::uint32_t>(i + 1));
  }

  [[nodiscard]] std::string const& name() const { return name_; }

  [[nodiscard]] std::string line_col(std::uint32_t pos) const {
    auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), pos);
    auto const line = static_cast<std::size_t>(it - line_starts_.begin());
    std::uint32_t const start = line_starts_[line - 1];
    std::int64_t const col = utf8_length(std::string_view(*src_).substr(start, pos - start)) + 1;
    return std::to_string(line) + ":" + std::to_string(col);
  }

  [[noreturn]] void fail(std::uint32_t pos, std::string const& message) const {
    QFLASH_FAIL(name_, ":", line_col(pos), ": ", message);
  }

 private:
  std::string const* src_;
  std::string name_;
  std::vector<std::uint32_t> line_starts_;
};

// --- lexer -----------------------------------------------------------------------------------

enum class Tok : std::uint8_t {
  kData, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat, kOp, kEof
};

struct Token {
  Tok type;
  std::uint32_t pos;
  std::string text;  // data, name, operator, or the decoded string literal
  std::int64_t i = 0;
  double f = 0;
};

/// Python's re `\s` at s[i]: the length of the whitespace character there, or 0.
inline std::size_t space_at(std::string_view s, std::size_t i) {
  if (i >= s.size()) return 0;
  std::size_t len = 1;
  return py_isspace(utf8_at(s, i, len)) ? len : 0;
}

inline std::string_view rstrip_space(std::string_view s) {
  while (!s.empty()) {
    std::size_t start = s.size() - 1;
    while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
    if (space_at(s, start) == 0) break;
    s = s.substr(0, start);
  }
  return s;
}

/// Splits a template into tokens as jinja2's Lexer.tokeniter does with trim_blocks and
/// lstrip_blocks: data, `{{ }}` and `{% %}` with the tokens inside; comments and raw blocks
/// resolved. `src` has its line breaks already normalized to "\n".
class Lexer {
 public:
  Lexer(std::string const& src, SourceMap const& map) : s_(src), map_(map) {}

  std::vector<Token> run() {
    std::size_t pos = 0;
    while (pos < s_.size()) {
      std::size_t const p = find_tag(pos);
      if (p == std::string_view::npos) {
        data(pos, s_.substr(pos));
        break;
      }
      char const kind = s_[p + 1];
      std::size_t q = p + 2;
      char const sign = q < s_.size() && (s_[q] == '-' || s_[q] == '+') ? s_[q] : 0;
      std::size_t const raw_end = kind == '%' ? match_raw_begin(p) : std::string_view::npos;
      data(pos, strip_before(s_.substr(pos, p - pos), sign, kind != '{'));
      if (sign != 0 && raw_end == std::string_view::npos) ++q;
      if (raw_end != std::string_view::npos) {
        line_starting_ = s_[raw_end - 1] == '\n';
        pos = raw_body(raw_end);
      } else if (kind == '#') {
        pos = comment(p, q);
      } else {
        pos = tag(p, q, kind == '%');
      }
    }
    out_.push_back(Token{Tok::kEof, static_cast<std::uint32_t>(s_.size()), {}});
    return std::move(out_);
  }

 private:
  std::size_t find_tag(std::size_t from) const {
    for (std::size_t i = s_.find('{', from); i != std::string_view::npos; i = s_.find('{', i + 1))
      if (i + 1 < s_.size() && (s_[i + 1] == '{' || s_[i + 1] == '%' || s_[i + 1] == '#')) return i;
    return std::string_view::npos;
  }

  std::size_t skip_space(std::size_t i) const {
    while (std::size_t n = space_at(s_, i)) i += n;
    return i;
  }

  bool starts(std::size_t i, std::string_view what) const {
    return s_.substr(std::min(i, s_.size())).starts_with(what);
  }

  /// End of `{%[-+]?\s*raw\s*(-%}\s*|%})` at `p`, or npos.
  std::size_t match_raw_begin(std::size_t p) const {
    std::size_t i = p + 2;
    if (i < s_.size() && (s_[i] == '-' || s_[i] == '+')) ++i;
    i = skip_space(i);
    if (!starts(i, "raw")) return std::string_view::npos;
    i = skip_space(i + 3);
    if (starts(i, "-%}")) return skip_space(i + 3);
    if (starts(i, "%}")) return i + 2;
    return std::string_view::npos;
  }

  /// jinja2's OptionalLStrip: the text before a tag loses its trailing whitespace for `-`, or
  /// (lstrip_blocks, not for `{{`) the indentation on the tag's own line unless `+`.
  std::string_view strip_before(std::string_view text, char sign, bool lstrip) const {
    if (sign == '-') return rstrip_space(text);
    if (sign == '+' || !lstrip) return text;
    std::size_t const nl = text.rfind('\n');
    std::size_t const l = nl == std::string_view::npos ? 0 : nl + 1;
    if ((l > 0 || line_starting_) && l < text.size()) {
      std::size_t i = l;
      while (i < text.size() && space_at(text, i)) i += space_at(text, i);
      if (i == text.size()) return text.substr(0, l);
    }
    return text;
  }

  void data(std::size_t pos, std::string_view text) {
    if (!text.empty())
      out_.push_back(Token{Tok::kData, static_cast<std::uint32_t>(pos), std::string(text)});
  }

  /// The end of a block tag at `i` (`+%}`, `-%}` and whitespace, or `%}` and one newline for
  /// trim_blocks), or npos.
  std::size_t block_end_at(std::size_t i) const {
    if (starts(i, "+%}")) return i + 3;
    if (starts(i, "-%}")) return skip_space(i + 3);
    if (starts(i, "%}")) return i + 2 + (starts(i + 2, "\n") ? 1 : 0);
    return std::string_view::npos;
  }

  std::size_t raw_body(std::size_t from) {
    if (from >= s_.size()) return from;  // jinja2 stops quietly when nothing follows
    for (std::size_t j = s_.find("{%", from); j != std::string_view::npos; j = s_.find("{%", j + 1)) {
      std::size_t i = j + 2;
      char const sign = i < s_.size() && (s_[i] == '-' || s_[i] == '+') ? s_[i] : 0;
      if (sign) ++i;
      i = skip_space(i);
      if (!starts(i, "endraw")) continue;
      std::size_t const end = block_end_at(skip_space(i + 6));
      if (end == std::string_view::npos) continue;
      data(from, strip_before(s_.substr(from, j - from), sign, true));
      line_starting_ = s_[end - 1] == '\n';
      return end;
    }
    map_.fail(static_cast<std::uint32_t>(from), "missing end of raw directive ({% endraw %})");
  }

  std::size_t comment(std::size_t p, std::size_t from) {
    if (from >= s_.size()) return from;  // jinja2 stops quietly when nothing follows
    std::size_t const h = s_.find("#}", from);
    if (h == std::string_view::npos)
      map_.fail(static_cast<std::uint32_t>(p), "missing end of comment tag ('#}')");
    char const sign = h > from && (s_[h - 1] == '-' || s_[h - 1] == '+') ? s_[h - 1] : 0;
    std::size_t end = h + 2;
    if (sign == '-') end = skip_space(end);
    else if (sign == 0 && starts(end, "\n")) ++end;
    line_starting_ = s_[end - 1] == '\n';
    return end;
  }

  std::size_t tag(std::size_t p, std::size_t i, bool block) {
    auto const at = [](std::size_t x) { return static_cast<std::uint32_t>(x); };
    out_.push_back(Token{block ? Tok::kBlockBegin : Tok::kVarBegin, at(p), {}});
    std::vector<char> balance;
    for (;;) {
      if (i >= s_.size())
        map_.fail(at(p), std::string("unexpected end of template: '") + (block ? "{%" : "{{") +
                             "' is not closed");
      if (balance.empty()) {
        std::size_t end = std::string_view::npos;
        if (block) end = block_end_at(i);
        else if (starts(i, "-}}")) end = skip_space(i + 3);
        else if (starts(i, "}}")) end = i + 2;
        if (end != std::string_view::npos) {
          out_.push_back(Token{block ? Tok::kBlockEnd : Tok::kVarEnd, at(i), {}});
          line_starting_ = s_[end - 1] == '\n';
          return end;
        }
      }
      if (std::size_t const n = space_at(s_, i)) {
        i += n;
        continue;
      }
      i = token(i, balance);
    }
  }

  /// `(\d+_)*\d+` at i: its end, or i when there is no digit.
  std::size_t digits(std::size_t i) const {
    std::size_t j = i;
    while (j < s_.size() && std::isdigit(static_cast<unsigned char>(s_[j]))) ++j;
    if (j == i) return i;
    while (j + 1 < s_.size() && s_[j] == '_' && std::isdigit(static_cast<unsigned char>(s_[j + 1]))) {
      j += 2;
      while (j < s_.size() && std::isdigit(static_cast<unsigned char>(s_[j]))) ++j;
    }
    return j;
  }

  std::size_t exponent(std::size_t i) const {
    if (i >= s_.size() || (s_[i] != 'e' && s_[i] != 'E')) return i;
    std::size_t j = i + 1;
    if (j < s_.size() && (s_[j] == '+' || s_[j] == '-')) ++j;
    std::size_t const k = digits(j);
    return k == j ? i : k;
  }

  /// jinja2's float_re (not right after a '.'), then integer_re; the end, or `i` when neither.
  std::size_t number(std::size_t i, std::vector<Token>& out) {
    auto const at = static_cast<std::uint32_t>(i);
    std::size_t const int_end = digits(i);
    if (int_end > i && (i == 0 || s_[i - 1] != '.')) {
      std::size_t end = std::string_view::npos;
      std::size_t const frac = starts(int_end, ".") ? digits(int_end + 1) : int_end;
      bool const has_frac = frac > int_end + 1;
      if (has_frac && exponent(frac) > frac) end = exponent(frac);
      else if (exponent(int_end) > int_end) end = exponent(int_end);
      else if (has_frac) end = frac;
      if (end != std::string_view::npos) {
        std::string text;
        for (char c : s_.substr(i, end - i))
          if (c != '_') text += c;
        double v = 0;
        auto const r = std::from_chars(text.data(), text.data() + text.size(), v);
        if (r.ec == std::errc::result_out_of_range) {
          std::size_t const e = text.find_first_of("eE");
          bool const tiny = e != std::string::npos && text[e + 1] == '-';
          v = tiny ? 0.0 : std::numeric_limits<double>::infinity();
        }
        out.push_back(Token{Tok::kFloat, at, std::string(s_.substr(i, end - i)), 0, v});
        return end;
      }
    }
    // integer_re: 0b.., 0o.., 0x.., [1-9](_?\d)*, 0(_?0)*
    int base = 10;
    std::size_t j = i;
    auto const is_digit = [&](char c, int b) {
      if (b == 16) return std::isxdigit(static_cast<unsigned char>(c)) != 0;
      return c >= '0' && c < static_cast<char>('0' + b);
    };
    if (i + 1 < s_.size() && s_[i] == '0' && std::string_view("bBoOxX").find(s_[i + 1]) != std::string_view::npos) {
      char const p = static_cast<char>(std::tolower(static_cast<unsigned char>(s_[i + 1])));
      base = p == 'b' ? 2 : p == 'o' ? 8 : 16;
      j = i + 2;
      std::size_t k = j;
      while (k < s_.size()) {
        std::size_t const u = s_[k] == '_' ? 1 : 0;
        if (k + u < s_.size() && is_digit(s_[k + u], base)) k += u + 1;
        else break;
      }
      if (k == j) base = 10, j = i;  // "0b" alone: only the 0 is a number
      else j = k;
    }
    if (base == 10) {
      if (i >= s_.size() || !std::isdigit(static_cast<unsigned char>(s_[i]))) return i;
      char const first = s_[i];
      j = i + 1;
      while (j < s_.size()) {
        std::size_t const u = s_[j] == '_' ? 1 : 0;
        if (j + u < s_.size() && (first == '0' ? s_[j + u] == '0' : is_digit(s_[j + u], 10))) j += u + 1;
        else break;
      }
    }
    std::uint64_t v = 0;
    for (char c : s_.substr(i + (base == 10 ? 0 : 2), j - i - (base == 10 ? 0 : 2))) {
      if (c == '_') continue;
      int const d = std::isdigit(static_cast<unsigned char>(c)) ? c - '0' : std::tolower(c) - 'a' + 10;
      if (v > (static_cast<std::uint64_t>(INT64_MAX) - static_cast<std::uint64_t>(d)) / static_cast<std::uint64_t>(base))
        map_.fail(at, "integer literal does not fit in 64 bits");
      v = v * static_cast<std::uint64_t>(base) + static_cast<std::uint64_t>(d);
    }
    out.push_back(Token{Tok::kInt, at, std::string(s_.substr(i, j - i)), static_cast<std::int64_t>(v)});
    return j;
  }

  static int hex_value(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }

  /// Decodes a string literal's body as jinja2 does: Python's "unicode-escape" codec applied
  /// to the text with non-ASCII characters written as \x/\u/\U escapes first.
  std::string unescape(std::string_view body, std::uint32_t at) const {
    std::string out;
    for (std::size_t i = 0; i < body.size();) {
      if (body[i] != '\\') {
        std::size_t len = 1;
        utf8_at(body, i, len);
        out.append(body.substr(i, len));
        i += len;
        continue;
      }
      std::size_t len = 1;
      char32_t const d = utf8_at(body, i + 1, len);
      i += 1 + len;
      if (d >= 0x80) {  // "\é" became "\\xe9" before decoding: a backslash and "xe9"
        char buf[16];
        std::snprintf(buf, sizeof buf, d < 0x100 ? "\\x%02x" : d < 0x10000 ? "\\u%04x" : "\\U%08x",
                      static_cast<unsigned>(d));
        out += buf;
        continue;
      }
      switch (d) {
        case '\n': break;
        case '\\': out += '\\'; break;
        case '\'': out += '\''; break;
        case '"': out += '"'; break;
        case 'a': out += '\a'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'v': out += '\v'; break;
        case 'x':
        case 'u':
        case 'U': {
          std::size_t const n = d == 'x' ? 2 : d == 'u' ? 4 : 8;
          char32_t cp = 0;
          for (std::size_t k = 0; k < n; ++k) {
            int const h = i + k < body.size() ? hex_value(body[i + k]) : -1;
            if (h < 0)
              map_.fail(at, std::string("truncated \\") + static_cast<char>(d) +
                                std::string(n, 'X') + " escape in string literal");
            cp = cp * 16 + static_cast<char32_t>(h);
          }
          i += n;
          if (cp > 0x10FFFF) map_.fail(at, "illegal Unicode character in string literal");
          if (cp >= 0xD800 && cp <= 0xDFFF) map_.fail(at, "surrogate code point in string literal");
          utf8_append(out, cp);
          break;
        }
        case 'N': map_.fail(at, "\\N{...} escapes are not supported in string literals");
        default:
          if (d >= '0' && d <= '7') {
            char32_t cp = d - '0';
            for (int k = 0; k < 2 && i < body.size() && body[i] >= '0' && body[i] <= '7'; ++k, ++i)
              cp = cp * 8 + static_cast<char32_t>(body[i] - '0');
            utf8_append(out, cp);
          } else {
            out += '\\';
            out += static_cast<char>(d);
          }
      }
    }
    return out;
  }

  std::size_t token(std::size_t i, std::vector<char>& balance) {
    auto const at = static_cast<std::uint32_t>(i);
    char const c = s_[i];
    if (std::isdigit(static_cast<unsigned char>(c))) return number(i, out_);
    // Names: ASCII letters, digits and '_', and (as Python's identifiers allow) other
    // characters, taken here to be every non-ASCII one but whitespace.
    auto const name_char = [&](std::size_t k) -> std::size_t {
      auto const b = static_cast<unsigned char>(s_[k]);
      if (b < 0x80) return std::isalnum(b) || b == '_' ? 1 : 0;
      std::size_t len = 1;
      return py_isspace(utf8_at(s_, k, len)) ? 0 : len;
    };
    if (!std::isdigit(static_cast<unsigned char>(c)) && name_char(i)) {
      std::size_t j = i;
      while (j < s_.size() && name_char(j)) j += name_char(j);
      out_.push_back(Token{Tok::kName, at, std::string(s_.substr(i, j - i))});
      return j;
    }
    if (c == '\'' || c == '"') {
      std::size_t j = i + 1;
      while (j < s_.size() && s_[j] != c) j += s_[j] == '\\' ? 2 : 1;
      if (j >= s_.size()) map_.fail(at, "unterminated string literal");
      out_.push_back(Token{Tok::kString, at, unescape(s_.substr(i + 1, j - i - 1), at)});
      return j + 1;
    }
    static constexpr std::array<std::string_view, 6> kTwo = {"//", "**", "==", "!=", ">=", "<="};
    for (auto op : kTwo)
      if (starts(i, op)) {
        out_.push_back(Token{Tok::kOp, at, std::string(op)});
        return i + 2;
      }
    if (std::string_view("+-/*%~[](){}><=.:|,;").find(c) == std::string_view::npos) {
      std::size_t len = 1;
      utf8_at(s_, i, len);
      map_.fail(at, "unexpected character '" + std::string(s_.substr(i, len)) + "'");
    }
    if (c == '(' || c == '[' || c == '{') {
      balance.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
    } else if (c == ')' || c == ']' || c == '}') {
      if (balance.empty()) map_.fail(at, std::string("unexpected '") + c + "'");
      if (balance.back() != c)
        map_.fail(at, std::string("unexpected '") + c + "', expected '" + balance.back() + "'");
      balance.pop_back();
    }
    out_.push_back(Token{Tok::kOp, at, std::string(1, c)});
    return i + 1;
  }

  std::string_view s_;
  SourceMap const& map_;
  std::vector<Token> out_;
  bool line_starting_ = true;
};

// --- syntax tree -----------------------------------------------------------------------------

/// The filters this engine implements; jinja2's others are refused by name when parsed.
enum class Filter : std::uint8_t {
  kAbs, kAttr, kBatch, kCapitalize, kCenter, kCount, kDefault, kDictsort, kEscape, kFirst,
  kFloat, kIndent, kInt, kItems, kJoin, kLast, kLength, kList, kLower, kMap, kMax, kMin,
  kReject, kRejectattr, kReplace, kReverse, kRound, kSafe, kSelect, kSelectattr, kSort,
  kString, kSum, kTitle, kTojson, kTrim, kUnique, kUpper
};

struct NamedFilter {
  std::string_view name;
  Filter id;
};
inline constexpr NamedFilter kFilters[] = {
    {"abs", Filter::kAbs},         {"attr", Filter::kAttr},
    {"batch", Filter::kBatch},     {"capitalize", Filter::kCapitalize},
    {"center", Filter::kCenter},   {"count", Filter::kCount},
    {"d", Filter::kDefault},       {"default", Filter::kDefault},
    {"dictsort", Filter::kDictsort}, {"e", Filter::kEscape},
    {"escape", Filter::kEscape},   {"first", Filter::kFirst},
    {"float", Filter::kFloat},     {"indent", Filter::kIndent},
    {"int", Filter::kInt},         {"items", Filter::kItems},
    {"join", Filter::kJoin},       {"last", Filter::kLast},
    {"length", Filter::kLength},   {"list", Filter::kList},
    {"lower", Filter::kLower},     {"map", Filter::kMap},
    {"max", Filter::kMax},         {"min", Filter::kMin},
    {"reject", Filter::kReject},   {"rejectattr", Filter::kRejectattr},
    {"replace", Filter::kReplace}, {"reverse", Filter::kReverse},
    {"round", Filter::kRound},     {"safe", Filter::kSafe},
    {"select", Filter::kSelect},   {"selectattr", Filter::kSelectattr},
    {"sort", Filter::kSort},       {"string", Filter::kString},
    {"sum", Filter::kSum},         {"title", Filter::kTitle},
    {"tojson", Filter::kTojson},   {"trim", Filter::kTrim},
    {"unique", Filter::kUnique},   {"upper", Filter::kUpper}};

/// jinja2 3.1's built-in filters that this engine does not implement.
inline constexpr std::string_view kUnsupportedFilters[] = {
    "filesizeformat", "forceescape", "format", "groupby", "pprint", "random", "slice",
    "striptags", "truncate", "urlencode", "urlize", "wordcount", "wordwrap", "xmlattr"};

enum class Test : std::uint8_t {
  kBoolean, kCallable, kDefined, kDivisibleby, kEq, kEscaped, kEven, kFalse, kFilter, kFloat,
  kGe, kGt, kIn, kInteger, kIterable, kLe, kLower, kLt, kMapping, kNe, kNone, kNumber, kOdd,
  kSameas, kSequence, kString, kTest, kTrue, kUndefined, kUpper
};

struct NamedTest {
  std::string_view name;
  Test id;
};
/// jinja2 3.1's TESTS, aliases included.
inline constexpr NamedTest kTests[] = {
    {"boolean", Test::kBoolean},   {"callable", Test::kCallable}, {"defined", Test::kDefined},
    {"divisibleby", Test::kDivisibleby}, {"eq", Test::kEq},       {"equalto", Test::kEq},
    {"==", Test::kEq},             {"escaped", Test::kEscaped},   {"even", Test::kEven},
    {"false", Test::kFalse},       {"filter", Test::kFilter},     {"float", Test::kFloat},
    {"ge", Test::kGe},             {">=", Test::kGe},             {"gt", Test::kGt},
    {"greaterthan", Test::kGt},    {">", Test::kGt},              {"in", Test::kIn},
    {"integer", Test::kInteger},   {"iterable", Test::kIterable}, {"le", Test::kLe},
    {"<=", Test::kLe},             {"lower", Test::kLower},       {"lt", Test::kLt},
    {"lessthan", Test::kLt},       {"<", Test::kLt},              {"mapping", Test::kMapping},
    {"ne", Test::kNe},             {"!=", Test::kNe},             {"none", Test::kNone},
    {"number", Test::kNumber},     {"odd", Test::kOdd},           {"sameas", Test::kSameas},
    {"sequence", Test::kSequence}, {"string", Test::kString},     {"test", Test::kTest},
    {"true", Test::kTrue},         {"undefined", Test::kUndefined}, {"upper", Test::kUpper}};

inline Filter const* find_filter(std::string_view name) {
  for (auto const& f : kFilters)
    if (f.name == name) return &f.id;
  return nullptr;
}
inline Test const* find_test(std::string_view name) {
  for (auto const& t : kTests)
    if (t.name == name) return &t.id;
  return nullptr;
}

enum class Op : std::uint8_t {
  kAdd, kSub, kMul, kDiv, kFloorDiv, kMod, kPow, kEq, kNe, kLt, kLe, kGt, kGe, kIn, kNotIn
};

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Keyword {
  std::string name;
  ExprPtr value;
};

struct Expr {
  enum class Kind : std::uint8_t {
    kConst, kName, kAttr, kItem, kSlice, kList, kTuple, kDict, kNot, kNeg, kPos, kBinary,
    kConcat, kCompare, kAnd, kOr, kCond, kFilter, kTest, kCall, kBlockValue
  };
  Kind kind;
  std::uint32_t pos = 0;
  Value value;       // kConst
  std::string name;  // kName, kAttr's attribute, kFilter's or kTest's name
  Op op{};           // kBinary
  int fn = 0;        // kFilter: Filter, kTest: Test
  // kAttr {object}; kItem {object, key}; kSlice {start, stop, step} (each may be null);
  // kList/kTuple items; kDict {key, value, key, value, ...}; kNot/kNeg/kPos {operand};
  // kBinary/kAnd/kOr {left, right}; kConcat operands; kCompare {first, operand...};
  // kCond {then, condition, else (may be null)}; kFilter/kTest {input, positional...};
  // kCall {callee, positional...}. kBlockValue is the body of a filter block or set block.
  std::vector<ExprPtr> args;
  std::vector<Op> ops;            // kCompare: one per operand
  std::vector<Keyword> kwargs;    // kFilter, kTest, kCall
  ExprPtr star_args, star_kwargs; // kFilter, kTest, kCall: `*list`, `**dict`
};

/// What `set`, `for` and `with` assign to.
struct Target {
  enum class Kind : std::uint8_t { kName, kTuple, kNsAttr };
  Kind kind = Kind::kName;
  std::uint32_t pos = 0;
  std::string name;  // kName; kNsAttr: the namespace's name
  std::string attr;  // kNsAttr
  std::vector<Target> items;
};

struct Stmt;
using Body = std::vector<std::unique_ptr<Stmt>>;

struct Stmt {
  enum class Kind : std::uint8_t {
    kData, kOutput, kIf, kFor, kSet, kSetBlock, kMacro, kBreak, kContinue, kFilterBlock, kWith,
    kScope
  };
  Kind kind;
  std::uint32_t pos = 0;
  std::string text;  // kData: the text; kMacro: the macro's name
  // kOutput: what to print, one after the other; kIf: one condition per branch; kFor: {iterable, filter or null};
  // kSet: {value}; kSetBlock, kFilterBlock: {filter chain on a kBlockValue, or null};
  // kWith: the values; kMacro: one default per parameter, null where none.
  std::vector<ExprPtr> exprs;
  // kIf: one body per condition, then the else body; kFor: {body, else}; the rest: {body}.
  std::vector<Body> bodies;
  Target target;                    // kFor, kSet, kSetBlock
  std::vector<Target> targets;      // kWith
  std::vector<std::string> params;  // kMacro
  bool catch_varargs = false;       // kMacro: the body reads `varargs`
  bool catch_kwargs = false;        // kMacro: the body reads `kwargs`
};

// --- parser ----------------------------------------------------------------------------------

/// jinja2's Parser over the tokens of Lexer.
class Parser {
 public:
  Parser(std::vector<Token> tokens, SourceMap const& map, int max_depth)
      : t_(std::move(tokens)), map_(map), max_depth_(max_depth) {}

  Body parse() {
    return subparse({});  // returns only at the end: no end tag closes the top level
  }

 private:
  struct Open {
    std::string tag;
    std::uint32_t pos;
    std::vector<std::string_view> ends;
  };

  /// Counts nesting so that hostile input cannot exhaust the stack.
  class Nest {
   public:
    Nest(Parser& p, std::uint32_t pos) : p_(p) {
      if (++p_.depth_ > p_.max_depth_)
        p_.map_.fail(pos, "template nests deeper than " + std::to_string(p_.max_depth_) + " levels");
    }
    ~Nest() { --p_.depth_; }
    Nest(Nest const&) = delete;
    Nest& operator=(Nest const&) = delete;

   private:
    Parser& p_;
  };

  Token const& cur() const { return t_[i_]; }
  Token const& look() const { return t_[std::min(i_ + 1, t_.size() - 1)]; }
  Token const& next() { return t_[i_ < t_.size() - 1 ? i_++ : i_]; }
  bool is(Tok type, std::string_view text = {}) const {
    return cur().type == type && (text.empty() || cur().text == text);
  }
  bool is_op(std::string_view op) const { return is(Tok::kOp, op); }
  bool is_name(std::string_view name) const { return is(Tok::kName, name); }
  bool skip_op(std::string_view op) {
    if (!is_op(op)) return false;
    next();
    return true;
  }
  bool skip_name(std::string_view name) {
    if (!is_name(name)) return false;
    next();
    return true;
  }

  static std::string describe(Token const& t) {
    switch (t.type) {
      case Tok::kData: return "template text";
      case Tok::kVarBegin: return "'{{'";
      case Tok::kVarEnd: return "end of print statement '}}'";
      case Tok::kBlockBegin: return "'{%'";
      case Tok::kBlockEnd: return "end of statement block '%}'";
      case Tok::kName:
      case Tok::kOp: return "'" + t.text + "'";
      case Tok::kString: return "string";
      case Tok::kInt:
      case Tok::kFloat: return "number " + t.text;
      case Tok::kEof: return "end of template";
    }
    return "token";
  }

  [[noreturn]] void fail(std::uint32_t pos, std::string const& message) const { map_.fail(pos, message); }

  void expect(Tok type, std::string_view text, std::string_view what) {
    if (!is(type, text)) fail(cur().pos, "expected " + std::string(what) + ", got " + describe(cur()));
    next();
  }
  void expect_op(std::string_view op) { expect(Tok::kOp, op, "'" + std::string(op) + "'"); }
  std::string expect_name() {
    if (!is(Tok::kName)) fail(cur().pos, "expected a name, got " + describe(cur()));
    return next().text;
  }

  /// " (expected 'endfor' or 'else' to close 'for' opened at 2:1)" for the innermost block.
  std::string closing_hint() const {
    if (open_.empty()) return {};
    Open const& o = open_.back();
    std::string s = " (expected ";
    for (std::size_t k = 0; k < o.ends.size(); ++k)
      s += (k ? " or '" : "'") + std::string(o.ends[k]) + "'";
    return s + " to close '" + o.tag + "' opened at " + map_.line_col(o.pos) + ")";
  }

  [[noreturn]] void fail_unexpected_tag() const {
    std::string const name = cur().text;
    bool const closer = name.starts_with("end") || name == "else" || name == "elif";
    fail(cur().pos, (closer ? "unexpected '" : "unknown tag '") + name + "'" + closing_hint());
  }

  static ExprPtr node(Expr::Kind kind, std::uint32_t pos) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->pos = pos;
    return e;
  }
  static std::unique_ptr<Stmt> stmt(Stmt::Kind kind, std::uint32_t pos) {
    auto s = std::make_unique<Stmt>();
    s->kind = kind;
    s->pos = pos;
    return s;
  }

  // --- statements ---

  Body subparse(std::vector<std::string_view> const& ends) {
    Body body;
    for (;;) {
      Token const& t = cur();
      if (t.type == Tok::kData) {
        auto s = stmt(Stmt::Kind::kData, t.pos);
        s->text = t.text;
        body.push_back(std::move(s));
        next();
      } else if (t.type == Tok::kVarBegin) {
        auto s = stmt(Stmt::Kind::kOutput, t.pos);
        next();
        s->exprs.push_back(parse_tuple(false, true, {}, false));
        expect(Tok::kVarEnd, {}, "'}}'");
        body.push_back(std::move(s));
      } else if (t.type == Tok::kBlockBegin) {
        next();
        for (auto e : ends)
          if (is_name(e)) return body;
        body.push_back(parse_statement());
        expect(Tok::kBlockEnd, {}, "end of statement block '%}'");
      } else {
        return body;  // end of template; the caller checks it is allowed
      }
    }
  }

  /// The body of a block tag up to one of `ends`; with `drop`, the end tag's name is consumed.
  Body statements(std::string tag, std::uint32_t pos, std::vector<std::string_view> ends, bool drop) {
    Nest nest(*this, pos);
    skip_op(":");
    expect(Tok::kBlockEnd, {}, "end of statement block '%}'");
    open_.push_back(Open{std::move(tag), pos, ends});  // open_ may grow: subparse gets `ends`
    Body body = subparse(ends);
    if (cur().type == Tok::kEof)
      fail(cur().pos, "unexpected end of template" + closing_hint());
    open_.pop_back();
    if (drop) next();
    return body;
  }

  std::unique_ptr<Stmt> parse_statement() {
    Token const& t = cur();
    if (t.type != Tok::kName) fail(t.pos, "expected a tag name, got " + describe(t));
    std::string const tag = t.text;
    std::uint32_t const pos = t_[i_ - 1].pos;  // the '{%'
    if (tag == "if") return parse_if(pos);
    if (tag == "for") return parse_for(pos);
    if (tag == "set") return parse_set(pos);
    if (tag == "macro") return parse_macro(pos);
    if (tag == "filter") return parse_filter_block(pos);
    if (tag == "with") return parse_with(pos);
    if (tag == "print") {
      next();
      auto s = stmt(Stmt::Kind::kOutput, pos);
      while (!is(Tok::kBlockEnd)) {
        if (!s->exprs.empty()) expect_op(",");
        s->exprs.push_back(parse_expression(true));
      }
      return s;
    }
    if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) fail(t.pos, "'" + tag + "' outside of a for loop");
      next();
      return stmt(tag == "break" ? Stmt::Kind::kBreak : Stmt::Kind::kContinue, pos);
    }
    if (tag == "generation") {  // transformers' AssistantTracker: renders its body
      next();
      auto s = stmt(Stmt::Kind::kScope, pos);
      int const outer_loops = loop_depth_;  // the body is a function in jinja2: no break
      loop_depth_ = 0;
      s->bodies.push_back(statements(tag, pos, {"endgeneration"}, true));
      loop_depth_ = outer_loops;
      return s;
    }
    if (tag == "extends" || tag == "include" || tag == "import" || tag == "from")
      fail(t.pos, "'" + tag + "' is not supported: chat templates are rendered without a loader");
    if (tag == "block" || tag == "call" || tag == "autoescape")
      fail(t.pos, "the '" + tag + "' tag is not supported");
    fail_unexpected_tag();
  }

  std::unique_ptr<Stmt> parse_if(std::uint32_t pos) {
    next();
    auto s = stmt(Stmt::Kind::kIf, pos);
    std::uint32_t branch_pos = pos;
    std::string tag = "if";
    for (;;) {
      s->exprs.push_back(parse_tuple(false, false, {}, false));
      s->bodies.push_back(statements(tag, branch_pos, {"elif", "else", "endif"}, false));
      std::uint32_t const end_pos = t_[i_ - 1].pos;
      Token const& end = next();
      if (end.text == "elif") {
        tag = "elif";
        branch_pos = end_pos;
        continue;
      }
      if (end.text == "else") s->bodies.push_back(statements("else", end_pos, {"endif"}, true));
      return s;
    }
  }

  std::unique_ptr<Stmt> parse_for(std::uint32_t pos) {
    next();
    auto s = stmt(Stmt::Kind::kFor, pos);
    s->target = parse_assign_target(false, {"in"});
    expect(Tok::kName, "in", "'in'");
    s->exprs.push_back(parse_tuple(false, false, {"recursive"}, false));
    s->exprs.push_back(skip_name("if") ? parse_expression(true) : nullptr);
    if (is_name("recursive")) fail(cur().pos, "recursive for loops are not supported");
    ++loop_depth_;
    s->bodies.push_back(statements("for", s->pos, {"endfor", "else"}, false));
    --loop_depth_;
    std::uint32_t const end_pos = t_[i_ - 1].pos;
    Token const& end = next();
    s->bodies.push_back(end.text == "else" ? statements("else", end_pos, {"endfor"}, true) : Body{});
    return s;
  }

  std::unique_ptr<Stmt> parse_set(std::uint32_t pos) {
    next();
    Target target = parse_assign_target(true, {});
    if (skip_op("=")) {
      auto s = stmt(Stmt::Kind::kSet, pos);
      s->target = std::move(target);
      s->exprs.push_back(parse_tuple(false, true, {}, false));
      return s;
    }
    auto s = stmt(Stmt::Kind::kSetBlock, pos);
    s->target = std::move(target);
    s->exprs.push_back(is_op("|") ? parse_filter(node(Expr::Kind::kBlockValue, pos), false) : nullptr);
    s->bodies.push_back(statements("set", pos, {"endset"}, true));
    return s;
  }

  std::unique_ptr<Stmt> parse_macro(std::uint32_t pos) {
    next();
    auto s = stmt(Stmt::Kind::kMacro, pos);
    s->text = expect_name();
    expect_op("(");
    while (!is_op(")")) {
      if (!s->params.empty()) expect_op(",");
      std::uint32_t const at = cur().pos;
      std::string param = expect_name();
      if (param == "true" || param == "false" || param == "none" || param == "True" ||
          param == "False" || param == "None")
        fail(at, "cannot assign to '" + param + "'");
      s->params.push_back(std::move(param));
      if (skip_op("=")) s->exprs.push_back(parse_expression(true));
      else if (!s->exprs.empty() && s->exprs.back()) fail(at, "non-default argument follows default argument");
      else s->exprs.push_back(nullptr);
    }
    next();
    int const outer_loops = loop_depth_;
    loop_depth_ = 0;
    macros_.push_back(s.get());
    s->bodies.push_back(statements("macro", s->pos, {"endmacro"}, true));
    macros_.pop_back();
    loop_depth_ = outer_loops;
    return s;
  }

  std::unique_ptr<Stmt> parse_filter_block(std::uint32_t pos) {
    next();
    auto s = stmt(Stmt::Kind::kFilterBlock, pos);
    s->exprs.push_back(parse_filter(node(Expr::Kind::kBlockValue, s->pos), true));
    s->bodies.push_back(statements("filter", s->pos, {"endfilter"}, true));
    return s;
  }

  std::unique_ptr<Stmt> parse_with(std::uint32_t pos) {
    next();
    auto s = stmt(Stmt::Kind::kWith, pos);
    while (!is(Tok::kBlockEnd)) {
      if (!s->targets.empty()) expect_op(",");
      s->targets.push_back(parse_assign_target(false, {}));
      expect_op("=");
      s->exprs.push_back(parse_expression(true));
    }
    s->bodies.push_back(statements("with", s->pos, {"endwith"}, true));
    return s;
  }

  /// A name, `ns.attr` (with `with_namespace`), or a tuple of names: jinja2's
  /// parse_assign_target.
  Target parse_assign_target(bool with_namespace, std::vector<std::string_view> const& extra_end) {
    if (with_namespace && is(Tok::kName) && look().type == Tok::kOp && look().text == ".") {
      Target t;
      t.kind = Target::Kind::kNsAttr;
      t.pos = cur().pos;
      t.name = next().text;
      next();
      t.attr = expect_name();
      return t;
    }
    ExprPtr const e = parse_tuple(true, true, extra_end, false);
    return to_target(*e);
  }

  Target to_target(Expr const& e) const {
    Target t;
    t.pos = e.pos;
    if (e.kind == Expr::Kind::kName) {
      t.name = e.name;
      return t;
    }
    if (e.kind == Expr::Kind::kTuple) {
      t.kind = Target::Kind::kTuple;
      for (auto const& item : e.args) t.items.push_back(to_target(*item));
      return t;
    }
    fail(e.pos, e.kind == Expr::Kind::kConst ? "cannot assign to a constant" : "cannot assign to this expression");
  }

  // --- expressions ---

  bool is_tuple_end(std::vector<std::string_view> const& extra_end) const {
    if (is(Tok::kVarEnd) || is(Tok::kBlockEnd) || is_op(")")) return true;
    for (auto e : extra_end)
      if (is_name(e)) return true;
    return false;
  }

  /// jinja2's parse_tuple: one expression, or a tuple when commas separate several.
  ExprPtr parse_tuple(bool simplified, bool with_condexpr,
                      std::vector<std::string_view> const& extra_end, bool explicit_parens) {
    std::uint32_t const pos = cur().pos;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    for (;;) {
      if (!items.empty()) expect_op(",");
      if (is_tuple_end(extra_end)) break;
      items.push_back(simplified ? parse_primary() : parse_expression(with_condexpr));
      if (is_op(",")) is_tuple = true;
      else break;
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parens) fail(cur().pos, "expected an expression, got " + describe(cur()));
    }
    auto t = node(Expr::Kind::kTuple, pos);
    t->args = std::move(items);
    return t;
  }

  ExprPtr parse_expression(bool with_condexpr) {
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  ExprPtr parse_condexpr() {
    std::uint32_t const pos = cur().pos;
    ExprPtr e = parse_or();
    while (skip_name("if")) {
      auto c = node(Expr::Kind::kCond, pos);
      ExprPtr test = parse_or();
      ExprPtr otherwise = skip_name("else") ? parse_condexpr() : nullptr;
      c->args.push_back(std::move(e));
      c->args.push_back(std::move(test));
      c->args.push_back(std::move(otherwise));
      e = std::move(c);
    }
    return e;
  }

  ExprPtr binary(Expr::Kind kind, std::uint32_t pos, ExprPtr l, ExprPtr r, Op op = {}) {
    auto e = node(kind, pos);
    e->op = op;
    e->args.push_back(std::move(l));
    e->args.push_back(std::move(r));
    return e;
  }

  ExprPtr parse_or() {
    ExprPtr e = parse_and();
    while (is_name("or")) {
      std::uint32_t const pos = next().pos;
      e = binary(Expr::Kind::kOr, pos, std::move(e), parse_and());
    }
    return e;
  }

  ExprPtr parse_and() {
    ExprPtr e = parse_not();
    while (is_name("and")) {
      std::uint32_t const pos = next().pos;
      e = binary(Expr::Kind::kAnd, pos, std::move(e), parse_not());
    }
    return e;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      auto e = node(Expr::Kind::kNot, next().pos);
      Nest nest(*this, e->pos);
      e->args.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    std::uint32_t const pos = cur().pos;
    ExprPtr first = parse_math1();
    std::vector<ExprPtr> operands;
    std::vector<Op> ops;
    static constexpr std::pair<std::string_view, Op> kCompare[] = {
        {"==", Op::kEq}, {"!=", Op::kNe}, {"<", Op::kLt}, {"<=", Op::kLe}, {">", Op::kGt}, {">=", Op::kGe}};
    for (;;) {
      bool found = false;
      for (auto const& [text, op] : kCompare)
        if (is_op(text)) {
          next();
          ops.push_back(op);
          found = true;
          break;
        }
      if (!found) {
        if (skip_name("in")) {
          ops.push_back(Op::kIn);
        } else if (is_name("not") && look().type == Tok::kName && look().text == "in") {
          next();
          next();
          ops.push_back(Op::kNotIn);
        } else {
          break;
        }
      }
      operands.push_back(parse_math1());
    }
    if (ops.empty()) return first;
    auto e = node(Expr::Kind::kCompare, pos);
    e->args.push_back(std::move(first));
    for (auto& o : operands) e->args.push_back(std::move(o));
    e->ops = std::move(ops);
    return e;
  }

  ExprPtr parse_math1() {
    ExprPtr e = parse_concat();
    while (is_op("+") || is_op("-")) {
      Token const& t = next();
      e = binary(Expr::Kind::kBinary, t.pos, std::move(e), parse_concat(), t.text == "+" ? Op::kAdd : Op::kSub);
    }
    return e;
  }

  ExprPtr parse_concat() {
    std::uint32_t const pos = cur().pos;
    ExprPtr e = parse_math2();
    if (!is_op("~")) return e;
    auto c = node(Expr::Kind::kConcat, pos);
    c->args.push_back(std::move(e));
    while (skip_op("~")) c->args.push_back(parse_math2());
    return c;
  }

  ExprPtr parse_math2() {
    ExprPtr e = parse_pow();
    for (;;) {
      Op op;
      if (is_op("*")) op = Op::kMul;
      else if (is_op("/")) op = Op::kDiv;
      else if (is_op("//")) op = Op::kFloorDiv;
      else if (is_op("%")) op = Op::kMod;
      else return e;
      std::uint32_t const pos = next().pos;
      e = binary(Expr::Kind::kBinary, pos, std::move(e), parse_pow(), op);
    }
  }

  ExprPtr parse_pow() {
    ExprPtr e = parse_unary(true);
    while (is_op("**")) {
      std::uint32_t const pos = next().pos;
      e = binary(Expr::Kind::kBinary, pos, std::move(e), parse_unary(true), Op::kPow);
    }
    return e;
  }

  ExprPtr parse_unary(bool with_filter) {
    Nest nest(*this, cur().pos);
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      Token const& t = next();
      e = node(t.text == "-" ? Expr::Kind::kNeg : Expr::Kind::kPos, t.pos);
      e->args.push_back(parse_unary(false));
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }

  ExprPtr parse_primary() {
    Token const& t = cur();
    if (t.type == Tok::kName) {
      next();
      auto e = node(Expr::Kind::kConst, t.pos);
      if (t.text == "true" || t.text == "True" || t.text == "false" || t.text == "False") {
        e->value = Value::boolean(t.text[0] == 't' || t.text[0] == 'T');
      } else if (t.text == "none" || t.text == "None") {
        e->value = Value::none();
      } else {
        e->kind = Expr::Kind::kName;
        e->name = t.text;
        if (!macros_.empty() && t.text == "varargs") macros_.back()->catch_varargs = true;
        if (!macros_.empty() && t.text == "kwargs") macros_.back()->catch_kwargs = true;
      }
      return e;
    }
    if (t.type == Tok::kString) {
      auto e = node(Expr::Kind::kConst, t.pos);
      std::string s;
      while (is(Tok::kString)) s += next().text;  // adjacent literals join, as in Python
      e->value = Value::string(std::move(s));
      return e;
    }
    if (t.type == Tok::kInt || t.type == Tok::kFloat) {
      auto e = node(Expr::Kind::kConst, t.pos);
      e->value = t.type == Tok::kInt ? Value::integer(t.i) : Value::number(t.f);
      next();
      return e;
    }
    if (is_op("(")) {
      next();
      ExprPtr e = parse_tuple(false, true, {}, true);
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      auto e = node(Expr::Kind::kList, next().pos);
      while (!is_op("]")) {
        if (!e->args.empty()) expect_op(",");
        if (is_op("]")) break;
        e->args.push_back(parse_expression(true));
      }
      expect_op("]");
      return e;
    }
    if (is_op("{")) {
      auto e = node(Expr::Kind::kDict, next().pos);
      while (!is_op("}")) {
        if (!e->args.empty()) expect_op(",");
        if (is_op("}")) break;
        e->args.push_back(parse_expression(true));
        expect_op(":");
        e->args.push_back(parse_expression(true));
      }
      expect_op("}");
      return e;
    }
    fail(t.pos, "unexpected " + describe(t));
  }

  ExprPtr parse_postfix(ExprPtr e) {
    for (;;) {
      if (is_op(".") || is_op("[")) e = parse_subscript(std::move(e));
      else if (is_op("(")) e = parse_call(std::move(e));
      else return e;
    }
  }

  ExprPtr parse_filter_expr(ExprPtr e) {
    for (;;) {
      if (is_op("|")) e = parse_filter(std::move(e), false);
      else if (is_name("is")) e = parse_test(std::move(e));
      else if (is_op("(")) e = parse_call(std::move(e));
      else return e;
    }
  }

  ExprPtr parse_subscript(ExprPtr object) {
    Token const& t = next();
    if (t.text == ".") {
      Token const& attr = next();
      if (attr.type == Tok::kName) {
        auto e = node(Expr::Kind::kAttr, t.pos);
        e->name = attr.text;
        e->args.push_back(std::move(object));
        return e;
      }
      if (attr.type != Tok::kInt) fail(attr.pos, "expected a name or number after '.'");
      auto key = node(Expr::Kind::kConst, attr.pos);
      key->value = Value::integer(attr.i);
      auto e = node(Expr::Kind::kItem, t.pos);
      e->args.push_back(std::move(object));
      e->args.push_back(std::move(key));
      return e;
    }
    std::vector<ExprPtr> keys;
    while (!is_op("]")) {
      if (!keys.empty()) expect_op(",");
      keys.push_back(parse_subscribed());
    }
    expect_op("]");
    auto e = node(Expr::Kind::kItem, t.pos);
    e->args.push_back(std::move(object));
    if (keys.size() == 1) {
      e->args.push_back(std::move(keys[0]));
    } else {
      auto tuple = node(Expr::Kind::kTuple, t.pos);
      tuple->args = std::move(keys);
      e->args.push_back(std::move(tuple));
    }
    return e;
  }

  ExprPtr parse_subscribed() {
    std::uint32_t const pos = cur().pos;
    ExprPtr start;
    if (!skip_op(":")) {
      start = parse_expression(true);
      if (!skip_op(":")) return start;
    }
    auto s = node(Expr::Kind::kSlice, pos);
    s->args.push_back(std::move(start));
    s->args.push_back(is_op(":") || is_op("]") || is_op(",") ? nullptr : parse_expression(true));
    ExprPtr step;
    if (skip_op(":") && !is_op("]") && !is_op(",")) step = parse_expression(true);
    s->args.push_back(std::move(step));
    return s;
  }

  /// `(args, name=value, *list, **dict)` into `e`'s args (after those it has) and kwargs.
  void parse_call_args(Expr& e) {
    std::uint32_t const pos = cur().pos;
    expect_op("(");
    bool require_comma = false;
    auto const ensure = [&](bool ok) {
      if (!ok) fail(pos, "invalid syntax for function call expression");
    };
    while (!is_op(")")) {
      if (require_comma) {
        expect_op(",");
        if (is_op(")")) break;
      }
      if (skip_op("*")) {
        ensure(!e.star_args && !e.star_kwargs);
        e.star_args = parse_expression(true);
      } else if (skip_op("**")) {
        ensure(!e.star_kwargs);
        e.star_kwargs = parse_expression(true);
      } else if (is(Tok::kName) && look().type == Tok::kOp && look().text == "=") {
        ensure(!e.star_kwargs);
        std::string key = next().text;
        next();
        e.kwargs.push_back(Keyword{std::move(key), parse_expression(true)});
      } else {
        ensure(!e.star_args && !e.star_kwargs && e.kwargs.empty());
        e.args.push_back(parse_expression(true));
      }
      require_comma = true;
    }
    expect_op(")");
  }

  ExprPtr parse_call(ExprPtr callee) {
    auto e = node(Expr::Kind::kCall, callee->pos);  // errors point at what is called
    e->args.push_back(std::move(callee));
    parse_call_args(*e);
    return e;
  }

  std::string dotted_name() {
    std::string name = expect_name();
    while (skip_op(".")) {  // appended in two steps: `"." + s` trips GCC 12's -Wrestrict (PR105329)
      name += '.';
      name += expect_name();
    }
    return name;
  }

  ExprPtr parse_filter(ExprPtr input, bool start_inline) {
    while (is_op("|") || start_inline) {
      if (!start_inline) next();
      start_inline = false;
      std::uint32_t const pos = cur().pos;
      auto e = node(Expr::Kind::kFilter, pos);
      e->name = dotted_name();
      Filter const* id = find_filter(e->name);
      if (!id) {
        for (auto u : kUnsupportedFilters)
          if (u == e->name) fail(pos, "filter '" + e->name + "' is not supported");
        fail(pos, "unknown filter '" + e->name + "'");
      }
      e->fn = static_cast<int>(*id);
      e->args.push_back(std::move(input));
      if (is_op("(")) parse_call_args(*e);
      input = std::move(e);
    }
    return input;
  }

  ExprPtr parse_test(ExprPtr input) {
    std::uint32_t const pos = next().pos;
    bool const negated = skip_name("not");
    std::uint32_t const name_pos = cur().pos;
    auto e = node(Expr::Kind::kTest, pos);
    e->name = dotted_name();
    Test const* id = find_test(e->name);
    if (!id) fail(name_pos, "unknown test '" + e->name + "'");
    e->fn = static_cast<int>(*id);
    e->args.push_back(std::move(input));
    if (is_op("(")) {
      parse_call_args(*e);
    } else if ((is(Tok::kName) || is(Tok::kString) || is(Tok::kInt) || is(Tok::kFloat) ||
                is_op("[") || is_op("{")) &&
               !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) fail(cur().pos, "cannot chain tests with 'is'");
      e->args.push_back(parse_postfix(parse_primary()));  // `x is divisibleby 3`
    }
    if (!negated) return e;
    auto n = node(Expr::Kind::kNot, pos);
    n->args.push_back(std::move(e));
    return n;
  }

  std::vector<Token> t_;
  std::size_t i_ = 0;
  SourceMap const& map_;
  int max_depth_;
  int depth_ = 0;
  int loop_depth_ = 0;
  std::vector<Open> open_;
  std::vector<Stmt*> macros_;
};

}  // namespace qflash::io::jinja::detail
