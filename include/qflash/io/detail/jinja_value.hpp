/// @file
/// The values a chat template computes with, and how Python prints them. Templates are
/// written against Python: `{{ [1, 'a'] }}` must print `[1, 'a']`, `{{ 0.1 }}` `0.1`, a dict
/// `{'k': None}`, and `tojson` must write what `json.dumps` writes. Part of jinja.hpp.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

namespace qflash::io::jinja {

/// Bounds that keep a hostile template from exhausting the stack, memory or time. Python's
/// jinja2 has only its interpreter's recursion limit and the sandbox's range() bound.
struct Limits {
  int max_parse_depth = 100;            ///< nesting of expressions and blocks in the source
  int max_render_depth = 1000;          ///< nesting of evaluation: statements, expressions, calls
  int max_call_depth = 100;             ///< macro calls in progress at once
  std::size_t max_output = 16u << 20;   ///< bytes of output, and of any one string built
  std::uint64_t max_steps = 20'000'000; ///< work: one per node evaluated, loop iteration and
                                        ///< item a filter visits, one per 64 bytes built
  std::int64_t max_range = 100'000;     ///< items range() may make (the jinja2 sandbox's bound)
};

/// An error raised while evaluating; the renderer adds the template name and position.
struct Failure {
  std::string message;
};

namespace detail {

// --- UTF-8 and Python's character classes ----------------------------------------------------

/// The code point at `s[i]` (valid UTF-8) and its length in bytes.
inline char32_t utf8_at(std::string_view s, std::size_t i, std::size_t& len) {
  auto const b = [&](std::size_t k) { return static_cast<unsigned char>(s[i + k]); };
  unsigned const c = b(0);
  if (c < 0x80) { len = 1; return c; }
  if (c < 0xE0) { len = 2; return ((c & 0x1F) << 6) | (b(1) & 0x3F); }
  if (c < 0xF0) { len = 3; return ((c & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F); }
  len = 4;
  return ((c & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
}

inline void utf8_append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

/// Byte offset where each code point of `s` starts, plus s.size() at the end.
inline std::vector<std::size_t> utf8_offsets(std::string_view s) {
  std::vector<std::size_t> at;
  at.reserve(s.size() + 1);
  for (std::size_t i = 0; i < s.size(); ++i)
    if ((static_cast<unsigned char>(s[i]) & 0xC0) != 0x80) at.push_back(i);
  at.push_back(s.size());
  return at;
}

/// Python's len() of a str: its code points.
inline std::int64_t utf8_length(std::string_view s) {
  std::int64_t n = 0;
  for (char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

/// Python's str.isspace() for one code point (also what `\s` matches in Python's re).
inline bool py_isspace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
         c == 0x202F || c == 0x205F || c == 0x3000;
}

/// Python's str.isprintable() for one code point, from the Unicode categories it excludes
/// (Cc, Cf, Co, Zl, Zp, Zs but the space); unassigned code points (Cn) count as printable
/// here, which only changes how repr() shows them.
inline bool py_isprintable(char32_t c) {
  if (c < 0x20 || (c >= 0x7F && c <= 0xA0) || c == 0xAD) return false;
  if (c < 0x600) return true;
  static constexpr char32_t kRanges[][2] = {
      {0x600, 0x605},     {0x61C, 0x61C},     {0x6DD, 0x6DD},     {0x70F, 0x70F},
      {0x890, 0x891},     {0x8E2, 0x8E2},     {0x1680, 0x1680},   {0x180E, 0x180E},
      {0x2000, 0x200F},   {0x2028, 0x202F},   {0x205F, 0x2064},   {0x2066, 0x206F},
      {0x3000, 0x3000},   {0xE000, 0xF8FF},   {0xFEFF, 0xFEFF},   {0xFFF9, 0xFFFB},
      {0x110BD, 0x110BD}, {0x110CD, 0x110CD}, {0x13430, 0x1343F}, {0x1BCA0, 0x1BCA3},
      {0x1D173, 0x1D17A}, {0xE0001, 0xE0001}, {0xE0020, 0xE007F}, {0xF0000, 0x10FFFF}};
  for (auto const& r : kRanges)
    if (c >= r[0] && c <= r[1]) return false;
  return true;
}

inline bool is_ascii(std::string_view s) {
  for (char c : s)
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  return true;
}

}  // namespace detail

// --- values ----------------------------------------------------------------------------------

class Value;

/// How a sequence came to be: Python prints and measures these differently (a generator has
/// no len() and is always true; `d.items()` prints as `dict_items([...])`).
enum class SeqKind : std::uint8_t { kList, kTuple, kIterator, kDictKeys, kDictValues, kDictItems };

struct ListData;
struct DictData;
/// A `namespace()` object: the one mutable value (`{% set ns.x = ... %}`).
struct NamespaceData;
/// A macro, a global function, or a method bound to its object.
struct CallableData;
/// The `loop` variable of a for loop.
struct LoopData;

/// A string; `markup` marks markupsafe's Markup (from `|safe`, `|escape`), which escapes
/// what `+` joins to it.
struct StringRef {
  std::shared_ptr<std::string const> text;
  bool markup = false;
};

/// The undefined value; `message` says why when an operation on it fails.
struct UndefinedRef {
  std::shared_ptr<std::string const> message;
};

/// A template value: Python's None, bool, int (64-bit here), float, str, list/tuple, dict
/// (insertion-ordered), plus jinja2's Undefined, namespaces, callables and loop objects.
/// Lists, dicts and strings are immutable and shared (the sandbox forbids changing them), so
/// copying a Value is cheap.
class Value {
 public:
  enum class Kind : std::uint8_t {
    kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kNamespace, kCallable, kLoop
  };

  Value() = default;  // undefined, with the generic message
  static Value undefined(std::string message) {
    Value v;
    v.v_ = UndefinedRef{std::make_shared<std::string const>(std::move(message))};
    return v;
  }
  static Value none() { return from_alt(std::monostate{}); }
  static Value boolean(bool b) { return from_alt(b); }
  static Value integer(std::int64_t i) { return from_alt(i); }
  static Value number(double d) { return from_alt(d); }
  static Value string(std::string s, bool markup = false) {
    return from_alt(StringRef{std::make_shared<std::string const>(std::move(s)), markup});
  }
  static Value list(std::vector<Value> items, SeqKind kind = SeqKind::kList);
  /// A generator that yielded `items`, then raised `failure` (Python's filters are lazy: the
  /// error surfaces only if the template reads past those items).
  static Value failed_iterator(std::vector<Value> items, std::string failure);
  static Value dict(DictData d);
  static Value from(std::shared_ptr<NamespaceData> ns) { return from_alt(std::move(ns)); }
  static Value from(std::shared_ptr<CallableData const> c) { return from_alt(std::move(c)); }
  static Value from(std::shared_ptr<LoopData> l) { return from_alt(std::move(l)); }

  [[nodiscard]] Kind kind() const { return static_cast<Kind>(v_.index()); }
  [[nodiscard]] bool is_undefined() const { return kind() == Kind::kUndefined; }
  [[nodiscard]] bool is_none() const { return kind() == Kind::kNone; }
  [[nodiscard]] bool is_bool() const { return kind() == Kind::kBool; }
  [[nodiscard]] bool is_int() const { return kind() == Kind::kInt; }
  [[nodiscard]] bool is_float() const { return kind() == Kind::kFloat; }
  /// int, float or bool: what Python's arithmetic takes (bool is an int there).
  [[nodiscard]] bool is_number() const { return is_int() || is_float() || is_bool(); }
  /// int or bool: what Python accepts as an index.
  [[nodiscard]] bool is_integral() const { return is_int() || is_bool(); }
  [[nodiscard]] bool is_string() const { return kind() == Kind::kString; }
  [[nodiscard]] bool is_list() const { return kind() == Kind::kList; }
  [[nodiscard]] bool is_dict() const { return kind() == Kind::kDict; }

  [[nodiscard]] bool as_bool() const { return std::get<bool>(v_); }
  [[nodiscard]] std::int64_t as_int() const {
    return is_bool() ? std::int64_t{as_bool()} : std::get<std::int64_t>(v_);
  }
  [[nodiscard]] double as_float() const {
    return is_float() ? std::get<double>(v_) : static_cast<double>(as_int());
  }
  [[nodiscard]] std::string const& str() const { return *std::get<StringRef>(v_).text; }
  [[nodiscard]] bool markup() const { return is_string() && std::get<StringRef>(v_).markup; }
  [[nodiscard]] std::string const& undefined_message() const;
  [[nodiscard]] ListData const& list() const { return *std::get<std::shared_ptr<ListData const>>(v_); }
  [[nodiscard]] DictData const& dict() const { return *std::get<std::shared_ptr<DictData const>>(v_); }
  [[nodiscard]] NamespaceData& ns() const { return *std::get<std::shared_ptr<NamespaceData>>(v_); }
  [[nodiscard]] CallableData const& callable() const {
    return *std::get<std::shared_ptr<CallableData const>>(v_);
  }
  [[nodiscard]] LoopData& loop() const { return *std::get<std::shared_ptr<LoopData>>(v_); }
  /// The shared object behind a container value (Python's `is` for those).
  [[nodiscard]] void const* identity() const;

 private:
  template <class T>
  static Value from_alt(T x) {
    Value v;
    v.v_ = std::move(x);
    return v;
  }

  std::variant<UndefinedRef, std::monostate, bool, std::int64_t, double, StringRef,
               std::shared_ptr<ListData const>, std::shared_ptr<DictData const>,
               std::shared_ptr<NamespaceData>, std::shared_ptr<CallableData const>,
               std::shared_ptr<LoopData>>
      v_;
};

/// Deepest nesting of lists and dicts a value may have, so that printing, comparing and
/// freeing values never recurse without bound.
inline constexpr int kMaxValueDepth = 256;

struct ListData {
  std::vector<Value> items;
  SeqKind kind = SeqKind::kList;
  int depth = 1;                                // 1 + the deepest element
  std::shared_ptr<std::string const> failure;   // kIterator: raised after `items`
};

/// Hashes std::string and std::string_view alike, for lookups without a copy.
struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

/// A dict: items in insertion order, keys unique by Python's equality. Add items with set()
/// only: str keys are also indexed by hash, so that lookups cost the same in a dict of any
/// size (other keys, which only template literals make, are looked for one by one).
struct DictData {
  std::vector<std::pair<Value, Value>> items;
  int depth = 1;
  std::unordered_map<std::string, std::size_t, StringHash, std::equal_to<>> index;  // str key -> item

  [[nodiscard]] Value const* find(Value const& key) const;
  [[nodiscard]] Value const* find(std::string_view key) const {
    auto const it = index.find(key);
    return it == index.end() ? nullptr : &items[it->second].second;
  }
  /// Sets `key`, keeping its position when present (as Python's dict does).
  void set(Value key, Value value);
};

struct NamespaceData {
  DictData attrs;  // str keys only

  [[nodiscard]] Value const* find(std::string_view name) const { return attrs.find(name); }
  void set(std::string const& name, Value v);
};

namespace detail {
inline int depth_of(Value const& v) {
  if (v.is_list()) return v.list().depth;
  if (v.is_dict()) return v.dict().depth;
  return 0;
}
inline void check_depth(int depth) {
  if (depth > kMaxValueDepth)
    throw Failure{"value nests deeper than " + std::to_string(kMaxValueDepth) + " lists or dicts"};
}
}  // namespace detail

inline Value Value::list(std::vector<Value> items, SeqKind kind) {
  int depth = 1;
  for (auto const& v : items) depth = std::max(depth, 1 + detail::depth_of(v));
  detail::check_depth(depth);
  return from_alt(std::shared_ptr<ListData const>(
      std::make_shared<ListData>(ListData{std::move(items), kind, depth, nullptr})));
}

inline Value Value::failed_iterator(std::vector<Value> items, std::string failure) {
  Value v = list(std::move(items), SeqKind::kIterator);
  auto data = std::make_shared<ListData>(v.list());
  data->failure = std::make_shared<std::string const>(std::move(failure));
  return from_alt(std::shared_ptr<ListData const>(std::move(data)));
}

inline Value Value::dict(DictData d) {
  d.depth = 1;
  for (auto const& [k, v] : d.items) d.depth = std::max(d.depth, 1 + detail::depth_of(v));
  detail::check_depth(d.depth);
  return from_alt(std::shared_ptr<DictData const>(std::make_shared<DictData>(std::move(d))));
}

inline std::string const& Value::undefined_message() const {
  static std::string const kGeneric = "value is undefined";
  auto const& m = std::get<UndefinedRef>(v_).message;
  return m ? *m : kGeneric;
}

inline void const* Value::identity() const {
  switch (kind()) {
    case Kind::kString: return std::get<StringRef>(v_).text.get();
    case Kind::kList: return std::get<std::shared_ptr<ListData const>>(v_).get();
    case Kind::kDict: return std::get<std::shared_ptr<DictData const>>(v_).get();
    case Kind::kNamespace: return std::get<std::shared_ptr<NamespaceData>>(v_).get();
    case Kind::kCallable: return std::get<std::shared_ptr<CallableData const>>(v_).get();
    case Kind::kLoop: return std::get<std::shared_ptr<LoopData>>(v_).get();
    default: return nullptr;
  }
}

// --- Python semantics shared by the renderer -------------------------------------------------

namespace detail {

/// Python's type name, for error messages.
inline std::string type_name(Value const& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined: return "Undefined";
    case Value::Kind::kNone: return "NoneType";
    case Value::Kind::kBool: return "bool";
    case Value::Kind::kInt: return "int";
    case Value::Kind::kFloat: return "float";
    case Value::Kind::kString: return v.markup() ? "Markup" : "str";
    case Value::Kind::kList:
      switch (v.list().kind) {
        case SeqKind::kList: return "list";
        case SeqKind::kTuple: return "tuple";
        case SeqKind::kIterator: return "generator";
        case SeqKind::kDictKeys: return "dict_keys";
        case SeqKind::kDictValues: return "dict_values";
        case SeqKind::kDictItems: return "dict_items";
      }
      return "list";
    case Value::Kind::kDict: return "dict";
    case Value::Kind::kNamespace: return "Namespace";
    case Value::Kind::kCallable: return "function";
    case Value::Kind::kLoop: return "LoopContext";
  }
  return "object";
}

/// Python's truth value.
inline bool truthy(Value const& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone: return false;
    case Value::Kind::kBool: return v.as_bool();
    case Value::Kind::kInt: return v.as_int() != 0;
    case Value::Kind::kFloat: return v.as_float() != 0.0;
    case Value::Kind::kString: return !v.str().empty();
    case Value::Kind::kList: return v.list().kind == SeqKind::kIterator || !v.list().items.empty();
    case Value::Kind::kDict: return !v.dict().items.empty();
    case Value::Kind::kNamespace:
    case Value::Kind::kCallable:
    case Value::Kind::kLoop: return true;
  }
  return false;
}

/// Python's `==`: numbers by value across int/float/bool, lists and tuples elementwise (a list
/// never equals a tuple), dicts regardless of order, Undefined equal to Undefined.
inline bool py_eq(Value const& a, Value const& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_float() == b.as_float();
    return a.as_int() == b.as_int();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone: return true;
    case Value::Kind::kString: return a.str() == b.str();
    case Value::Kind::kList: {
      auto const& x = a.list();
      auto const& y = b.list();
      if (&x == &y) return true;
      bool const plain = x.kind == SeqKind::kList || x.kind == SeqKind::kTuple ||
                         x.kind == SeqKind::kDictItems || x.kind == SeqKind::kDictKeys;
      if (x.kind != y.kind || !plain || x.items.size() != y.items.size()) return false;
      for (std::size_t i = 0; i < x.items.size(); ++i)
        if (!py_eq(x.items[i], y.items[i])) return false;
      return true;
    }
    case Value::Kind::kDict: {
      auto const& x = a.dict();
      auto const& y = b.dict();
      if (x.items.size() != y.items.size()) return false;
      for (auto const& [k, v] : x.items) {
        Value const* w = y.find(k);
        if (!w || !py_eq(v, *w)) return false;
      }
      return true;
    }
    default: return a.identity() == b.identity();
  }
}

/// Python's hashability: what may be a dict key or looked up in one.
inline bool hashable(Value const& v) {
  if (v.is_list()) {
    if (v.list().kind != SeqKind::kTuple) return false;
    for (auto const& e : v.list().items)
      if (!hashable(e)) return false;
    return true;
  }
  return !v.is_dict();  // jinja2's Undefined hashes too
}

}  // namespace detail

inline Value const* DictData::find(Value const& key) const {
  if (key.is_string()) return find(std::string_view(key.str()));
  for (auto const& [k, v] : items)
    if (!k.is_string() && detail::py_eq(k, key)) return &v;
  return nullptr;
}

inline void DictData::set(Value key, Value value) {
  if (key.is_string()) {
    auto const it = index.find(std::string_view(key.str()));
    if (it != index.end()) {
      items[it->second].second = std::move(value);
      return;
    }
    index.emplace(key.str(), items.size());
  } else {
    for (auto& [k, v] : items)
      if (!k.is_string() && detail::py_eq(k, key)) {
        v = std::move(value);
        return;
      }
  }
  items.emplace_back(std::move(key), std::move(value));
}

inline void NamespaceData::set(std::string const& name, Value v) { attrs.set(Value::string(name), std::move(v)); }

// --- printing as Python does -----------------------------------------------------------------

namespace detail {

/// Python's repr() of a float: the shortest digits that round-trip, in fixed notation for
/// decimal exponents -4..15 ("0.0001", "1e-05", "1e+16") and always with a dot or exponent.
inline void append_float_repr(std::string& out, double x) {
  if (std::isnan(x)) { out += "nan"; return; }
  if (std::isinf(x)) { out += x < 0 ? "-inf" : "inf"; return; }
  char buf[64];
  auto const r = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
  std::string_view const s(buf, static_cast<std::size_t>(r.ptr - buf));
  std::size_t const e = s.find('e');
  std::string digits;
  bool const negative = s[0] == '-';
  for (char c : s.substr(negative ? 1 : 0, e - (negative ? 1 : 0)))
    if (c != '.') digits += c;
  int exp10 = 0;
  std::from_chars(s.data() + e + (s[e + 1] == '+' ? 2 : 1), s.data() + s.size(), exp10);
  int const decpt = exp10 + 1;  // digits d1 d2 ... mean 0.d1d2... x 10^decpt
  auto const n = static_cast<int>(digits.size());
  if (negative) out += '-';
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out += "0.";
      out.append(static_cast<std::size_t>(-decpt), '0');
      out += digits;
    } else if (decpt >= n) {
      out += digits;
      out.append(static_cast<std::size_t>(decpt - n), '0');
      out += ".0";
    } else {
      out.append(digits, 0, static_cast<std::size_t>(decpt));
      out += '.';
      out.append(digits, static_cast<std::size_t>(decpt));
    }
    return;
  }
  out += digits[0];
  if (n > 1) {
    out += '.';
    out.append(digits, 1);
  }
  char ebuf[16];
  std::snprintf(ebuf, sizeof ebuf, "e%c%02d", exp10 < 0 ? '-' : '+', std::abs(exp10));
  out += ebuf;
}

/// Python's repr() of a str: single quotes unless it holds ' and no ", backslash escapes for
/// the quote, backslash and non-printable characters.
inline void append_str_repr(std::string& out, std::string_view s) {
  bool const has_single = s.find('\'') != std::string_view::npos;
  char const quote = has_single && s.find('"') == std::string_view::npos ? '"' : '\'';
  out += quote;
  for (std::size_t i = 0; i < s.size();) {
    std::size_t len = 1;
    char32_t const c = utf8_at(s, i, len);
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (!py_isprintable(c)) {
      char buf[16];
      if (c < 0x100) std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned>(c));
      else if (c < 0x10000) std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
      else std::snprintf(buf, sizeof buf, "\\U%08x", static_cast<unsigned>(c));
      out += buf;
    } else {
      out.append(s.substr(i, len));
    }
    i += len;
  }
  out += quote;
}

}  // namespace detail
}  // namespace qflash::io::jinja
