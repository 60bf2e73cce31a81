/// @file
/// The tree-walking renderer of jinja.hpp: scopes as jinja2 has them (a for loop's body and
/// a macro get their own, `if` does not), Python's operators, attribute and item lookup as
/// jinja2's sandbox does them, the filters, tests and globals chat templates use, and the
/// bounds of Limits. Part of jinja.hpp.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/io/detail/jinja_parse.hpp"
#include "qflash/io/detail/jinja_value.hpp"
#include "qflash/io/detail/utf8.hpp"

namespace qflash::io::jinja {

/// What `raise_exception(message)` in a template throws: the template refused its input.
/// `what()` adds the template's name and position; `template_message()` is the text alone,
/// fit to show to whoever sent the messages.
class RaisedError : public Error {
 public:
  RaisedError(std::string what, std::string template_message, char const* file, int line)
      : Error(std::move(what), file, line), template_message_(std::move(template_message)) {}
  [[nodiscard]] std::string const& template_message() const { return template_message_; }

 private:
  std::string template_message_;
};

namespace detail {

/// Variables of one scope; lookups continue in `parent`.
struct Scope {
  std::shared_ptr<Scope> parent;
  std::vector<std::pair<std::string, Value>> vars;

  [[nodiscard]] Value const* find(std::string_view name) const {
    for (Scope const* s = this; s; s = s->parent.get())
      for (auto const& [k, v] : s->vars)
        if (k == name) return &v;
    return nullptr;
  }
  void set(std::string const& name, Value v) {
    for (auto& [k, old] : vars)
      if (k == name) { old = std::move(v); return; }
    vars.emplace_back(name, std::move(v));
  }
};

}  // namespace detail

struct CallableData {
  enum class Kind : std::uint8_t { kMacro, kGlobal, kMethod };
  Kind kind;
  std::string name;
  Value self;                              // kMethod: the object the method is bound to
  detail::Stmt const* macro = nullptr;     // kMacro
  std::shared_ptr<detail::Scope> closure;  // kMacro: the scope it was defined in
};

struct LoopData {
  Value items;  // the list iterated, after the loop's filter
  std::size_t index0 = 0;
  std::optional<Value> changed_last;  // loop.changed()'s memory
};

namespace detail {

// --- Python's ordering ------------------------------------------------------------------------

[[noreturn]] inline void fail_undefined(Value const& v) { throw Failure{v.undefined_message()}; }

/// Python's ordering of two values for the comparison `op`: <0, 0, >0, or nullopt when they
/// are unordered (NaN); a TypeError where Python has one.
inline std::optional<int> py_order(Value const& a, Value const& b, char const* op) {
  if (a.is_undefined()) fail_undefined(a);
  if (b.is_undefined()) fail_undefined(b);
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) {
      double const x = a.as_float(), y = b.as_float();
      if (std::isnan(x) || std::isnan(y)) return std::nullopt;
      return x < y ? -1 : x > y ? 1 : 0;
    }
    return a.as_int() < b.as_int() ? -1 : a.as_int() > b.as_int() ? 1 : 0;
  }
  if (a.is_string() && b.is_string()) {
    int const c = a.str().compare(b.str());  // UTF-8 byte order is code point order
    return c < 0 ? -1 : c > 0 ? 1 : 0;
  }
  if (a.is_list() && b.is_list() && a.list().kind == b.list().kind &&
      (a.list().kind == SeqKind::kList || a.list().kind == SeqKind::kTuple)) {
    auto const& x = a.list().items;
    auto const& y = b.list().items;
    for (std::size_t i = 0; i < x.size() && i < y.size(); ++i)
      if (!py_eq(x[i], y[i])) return py_order(x[i], y[i], op);
    return x.size() < y.size() ? -1 : x.size() > y.size() ? 1 : 0;
  }
  throw Failure{std::string("'") + op + "' not supported between instances of '" + type_name(a) + "' and '" +
                type_name(b) + "'"};
}

// --- printing --------------------------------------------------------------------------------

/// Python's str() and repr() into a string of at most `limit` bytes (a Failure past it: a
/// list holding one big list many times prints far larger than it is).
class Printer {
 public:
  Printer(std::string& out, std::size_t limit) : out_(out), limit_(limit) {}

  /// str(): a string as it is, Undefined as nothing, anything else as repr().
  void str(Value const& v) {
    if (v.is_string()) out_ += v.str();
    else if (!v.is_undefined()) repr(v);
    room();
  }

  void repr(Value const& v) {
    // Lists and dicts nest at most kMaxValueDepth deep, but namespaces can chain without end.
    if (++depth_ > 2 * kMaxValueDepth) throw Failure{"a value nests too deeply to print"};
    switch (v.kind()) {
      case Value::Kind::kUndefined: out_ += "Undefined"; break;
      case Value::Kind::kNone: out_ += "None"; break;
      case Value::Kind::kBool: out_ += v.as_bool() ? "True" : "False"; break;
      case Value::Kind::kInt: out_ += std::to_string(v.as_int()); break;
      case Value::Kind::kFloat: append_float_repr(out_, v.as_float()); break;
      case Value::Kind::kString:
        if (v.markup()) out_ += "Markup(";
        append_str_repr(out_, v.str());
        if (v.markup()) out_ += ')';
        break;
      case Value::Kind::kList: {
        auto const& l = v.list();
        switch (l.kind) {
          case SeqKind::kList: items("[", l.items, "]"); break;
          case SeqKind::kTuple: items("(", l.items, l.items.size() == 1 ? ",)" : ")"); break;
          case SeqKind::kIterator: out_ += "<generator object>"; break;
          case SeqKind::kDictKeys:
          case SeqKind::kDictValues:
          case SeqKind::kDictItems: items(type_name(v) + "([", l.items, "])"); break;
        }
        break;
      }
      case Value::Kind::kDict: {
        out_ += '{';
        bool first = true;
        for (auto const& [k, x] : v.dict().items) {
          if (!first) out_ += ", ";
          first = false;
          repr(k);
          out_ += ": ";
          repr(x);
        }
        out_ += '}';
        break;
      }
      case Value::Kind::kNamespace: {
        out_ += "<Namespace ";
        if (std::find(active_.begin(), active_.end(), v.identity()) != active_.end()) {
          out_ += "{...}>";  // Python's dict repr of a dict that holds itself
          break;
        }
        active_.push_back(v.identity());
        out_ += '{';
        bool first = true;
        for (auto const& [k, x] : v.ns().attrs.items) {
          if (!first) out_ += ", ";
          first = false;
          repr(k);
          out_ += ": ";
          repr(x);
        }
        out_ += "}>";
        active_.pop_back();
        break;
      }
      case Value::Kind::kCallable: {
        auto const& c = v.callable();
        if (c.kind == CallableData::Kind::kMacro) out_ += "<Macro '" + c.name + "'>";
        else if (c.kind == CallableData::Kind::kGlobal) out_ += "<function " + c.name + ">";
        else out_ += "<built-in method " + c.name + " of " + type_name(c.self) + " object>";
        break;
      }
      case Value::Kind::kLoop: {
        auto const& l = v.loop();
        out_ += "<LoopContext " + std::to_string(l.index0 + 1) + "/" +
                std::to_string(l.items.list().items.size()) + ">";
        break;
      }
    }
    --depth_;
    room();
  }

 private:
  void room() const {
    if (out_.size() > limit_)
      throw Failure{"a string of more than " + std::to_string(limit_) + " bytes (see jinja::Limits)"};
  }

  void items(std::string const& open, std::vector<Value> const& items, char const* close) {
    out_ += open;
    for (std::size_t i = 0; i < items.size(); ++i) {
      if (i) out_ += ", ";
      repr(items[i]);
    }
    out_ += close;
  }

  std::string& out_;
  std::size_t limit_;
  std::vector<void const*> active_;  // the namespaces being printed
  int depth_ = 0;
};

inline std::string py_str(Value const& v, std::size_t limit) {
  if (v.is_string()) return v.str();
  std::string out;
  Printer(out, limit).str(v);
  return out;
}

/// repr() cut to a length fit for an error message.
inline std::string repr_excerpt(Value const& v) {
  constexpr std::size_t kLimit = 80;
  std::string out;
  try {
    Printer(out, kLimit).repr(v);
  } catch (Failure const&) {
    out.resize(kLimit);
    out += "...";
  }
  return out;
}

// --- JSON in and out -------------------------------------------------------------------------

/// A JSON value as a template value: objects become dicts in their key order.
inline Value from_json(nlohmann::ordered_json const& j, int depth = 0) {
  using J = nlohmann::ordered_json;
  if ((j.is_array() || j.is_object()) && depth >= kMaxValueDepth)
    throw Failure{"input nests deeper than " + std::to_string(kMaxValueDepth) + " levels"};
  switch (j.type()) {
    case J::value_t::null: return Value::none();
    case J::value_t::boolean: return Value::boolean(j.get<bool>());
    case J::value_t::number_integer: return Value::integer(j.get<std::int64_t>());
    case J::value_t::number_unsigned: {
      auto const u = j.get<std::uint64_t>();
      if (u > static_cast<std::uint64_t>(INT64_MAX))
        throw Failure{"integer " + std::to_string(u) + " does not fit in 64 bits"};
      return Value::integer(static_cast<std::int64_t>(u));
    }
    case J::value_t::number_float: return Value::number(j.get<double>());
    case J::value_t::string: {
      auto const& text = j.get_ref<std::string const&>();
      if (!::qflash::io::detail::is_valid_utf8(text)) throw Failure{"a string is not valid UTF-8"};
      return Value::string(text);
    }
    case J::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (auto const& e : j) items.push_back(from_json(e, depth + 1));
      return Value::list(std::move(items));
    }
    case J::value_t::object: {
      DictData d;
      for (auto it = j.begin(); it != j.end(); ++it) {
        if (!::qflash::io::detail::is_valid_utf8(it.key())) throw Failure{"a key is not valid UTF-8"};
        d.set(Value::string(it.key()), from_json(it.value(), depth + 1));
      }
      return Value::dict(std::move(d));
    }
    case J::value_t::binary:
    case J::value_t::discarded: break;
  }
  throw Failure{"binary JSON values cannot be passed to a template"};
}

/// How transformers' `tojson` (Python's json.dumps) writes.
struct JsonStyle {
  bool ensure_ascii = false;
  bool pretty = false;  // indent was given
  std::string indent;
  std::string item_sep = ", ";
  std::string key_sep = ": ";
  bool sort_keys = false;
};

inline void append_json_string(std::string& out, std::string_view s, bool ensure_ascii) {
  out += '"';
  for (std::size_t i = 0; i < s.size();) {
    std::size_t len = 1;
    char32_t const c = utf8_at(s, i, len);
    char buf[16];
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20 || (ensure_ascii && c >= 0x7F)) {
          if (c >= 0x10000) {
            char32_t const v = c - 0x10000;
            std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", static_cast<unsigned>(0xD800 + (v >> 10)),
                          static_cast<unsigned>(0xDC00 + (v & 0x3FF)));
          } else {
            std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
          }
          out += buf;
        } else {
          out.append(s.substr(i, len));
        }
    }
    i += len;
  }
  out += '"';
}

inline void append_json_float(std::string& out, double x) {
  if (std::isnan(x)) out += "NaN";
  else if (std::isinf(x)) out += x < 0 ? "-Infinity" : "Infinity";
  else append_float_repr(out, x);
}

/// json.dumps(v) with the style's options; a Failure past `limit` bytes.
inline void append_json(std::string& out, Value const& v, JsonStyle const& st, std::size_t limit, int level = 0) {
  if (out.size() > limit)
    throw Failure{"a string of more than " + std::to_string(limit) + " bytes (see jinja::Limits)"};
  auto const newline = [&](int lvl) {
    if (!st.pretty) return;
    out += '\n';
    for (int k = 0; k < lvl; ++k) out += st.indent;
  };
  switch (v.kind()) {
    case Value::Kind::kNone: out += "null"; return;
    case Value::Kind::kBool: out += v.as_bool() ? "true" : "false"; return;
    case Value::Kind::kInt: out += std::to_string(v.as_int()); return;
    case Value::Kind::kFloat: append_json_float(out, v.as_float()); return;
    case Value::Kind::kString: append_json_string(out, v.str(), st.ensure_ascii); return;
    case Value::Kind::kList: {
      auto const& l = v.list();
      if (l.kind != SeqKind::kList && l.kind != SeqKind::kTuple) break;
      if (l.items.empty()) { out += "[]"; return; }
      out += '[';
      for (std::size_t i = 0; i < l.items.size(); ++i) {
        if (i) out += st.item_sep;
        newline(level + 1);
        append_json(out, l.items[i], st, limit, level + 1);
      }
      newline(level);
      out += ']';
      return;
    }
    case Value::Kind::kDict: {
      auto const& d = v.dict();
      if (d.items.empty()) { out += "{}"; return; }
      std::vector<std::pair<Value, Value> const*> items;
      for (auto const& kv : d.items) items.push_back(&kv);
      if (st.sort_keys)
        std::stable_sort(items.begin(), items.end(),
                         [](auto const* x, auto const* y) {
                           auto const c = py_order(x->first, y->first, "<");
                           return c && *c < 0;
                         });
      out += '{';
      bool first = true;
      for (auto const* kv : items) {
        if (!first) out += st.item_sep;
        first = false;
        newline(level + 1);
        Value const& k = kv->first;
        if (k.is_string()) append_json_string(out, k.str(), st.ensure_ascii);
        else if (k.is_bool()) out += k.as_bool() ? "\"true\"" : "\"false\"";
        else if (k.is_none()) out += "\"null\"";
        else if (k.is_int()) out += "\"" + std::to_string(k.as_int()) + "\"";
        else if (k.is_float()) {
          out += '"';
          append_json_float(out, k.as_float());
          out += '"';
        } else {
          throw Failure{"keys must be str, int, float, bool or None, not " + type_name(k)};
        }
        out += st.key_sep;
        append_json(out, kv->second, st, limit, level + 1);
      }
      newline(level);
      out += '}';
      return;
    }
    default: break;
  }
  throw Failure{"Object of type " + type_name(v) + " is not JSON serializable"};
}

// --- Python's operators ----------------------------------------------------------------------

/// markupsafe's escape().
inline std::string html_escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

[[noreturn]] inline void fail_overflow() {
  throw Failure{"integer overflow (Python would make a big integer; this engine has 64 bits)"};
}
inline std::int64_t add_int(std::int64_t a, std::int64_t b) {
  std::int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) fail_overflow();
  return r;
}
inline std::int64_t sub_int(std::int64_t a, std::int64_t b) {
  std::int64_t r = 0;
  if (__builtin_sub_overflow(a, b, &r)) fail_overflow();
  return r;
}
inline std::int64_t mul_int(std::int64_t a, std::int64_t b) {
  std::int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) fail_overflow();
  return r;
}
inline std::int64_t neg_int(std::int64_t a) { return sub_int(0, a); }

inline std::int64_t floor_div(std::int64_t a, std::int64_t b) {
  if (b == 0) throw Failure{"integer division or modulo by zero"};
  if (a == INT64_MIN && b == -1) fail_overflow();
  std::int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

inline std::int64_t floor_mod(std::int64_t a, std::int64_t b) {
  if (b == 0) throw Failure{"integer modulo by zero"};
  if (b == -1) return 0;
  std::int64_t r = a % b;
  if (r != 0 && ((r < 0) != (b < 0))) r += b;
  return r;
}

/// CPython's float floor division and modulo (_float_div_mod).
inline std::pair<double, double> float_div_mod(double vx, double wx) {
  double mod = std::fmod(vx, wx);
  double div = (vx - mod) / wx;
  if (mod != 0.0) {
    if ((wx < 0) != (mod < 0)) {
      mod += wx;
      div -= 1.0;
    }
  } else {
    mod = std::copysign(0.0, wx);
  }
  double floordiv;
  if (div != 0.0) {
    floordiv = std::floor(div);
    if (div - floordiv > 0.5) floordiv += 1.0;
  } else {
    floordiv = std::copysign(0.0, vx / wx);
  }
  return {floordiv, mod};
}

inline char const* op_symbol(Op op) {
  switch (op) {
    case Op::kAdd: return "+";
    case Op::kSub: return "-";
    case Op::kMul: return "*";
    case Op::kDiv: return "/";
    case Op::kFloorDiv: return "//";
    case Op::kMod: return "%";
    case Op::kPow: return "** or pow()";
    default: return "?";
  }
}

// --- strings as Python's str ----------------------------------------------------------------

/// A str seen as code points: byte offsets of each, for indexing and slicing.
class CodePoints {
 public:
  explicit CodePoints(std::string_view s) : s_(s), ascii_(is_ascii(s)) {
    if (!ascii_) at_ = utf8_offsets(s);
  }
  [[nodiscard]] std::int64_t size() const {
    return ascii_ ? static_cast<std::int64_t>(s_.size()) : static_cast<std::int64_t>(at_.size()) - 1;
  }
  [[nodiscard]] std::size_t offset(std::int64_t i) const {
    return ascii_ ? static_cast<std::size_t>(i) : at_[static_cast<std::size_t>(i)];
  }
  [[nodiscard]] std::string_view at(std::int64_t i) const {
    return s_.substr(offset(i), offset(i + 1) - offset(i));
  }
  [[nodiscard]] std::string_view range(std::int64_t a, std::int64_t b) const {
    return s_.substr(offset(a), offset(b) - offset(a));
  }
  /// Code point index of byte offset `byte` (at a character boundary).
  [[nodiscard]] std::int64_t index_of(std::size_t byte) const {
    if (ascii_) return static_cast<std::int64_t>(byte);
    return std::lower_bound(at_.begin(), at_.end(), byte) - at_.begin();
  }

 private:
  std::string_view s_;
  bool ascii_;
  std::vector<std::size_t> at_;
};

inline char ascii_upper(char c) { return c >= 'a' && c <= 'z' ? static_cast<char>(c - 32) : c; }
inline char ascii_lower(char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c; }
inline bool ascii_alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

/// Case mapping of ASCII letters; other characters are kept (Python maps all of Unicode).
inline std::string to_upper(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = ascii_upper(c);
  return out;
}
inline std::string to_lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = ascii_lower(c);
  return out;
}
inline std::string capitalize(std::string_view s) {
  std::string out = to_lower(s);
  if (!out.empty()) out[0] = ascii_upper(out[0]);
  return out;
}
/// str.title(): a letter after a non-letter is upper case, any other letter lower case.
inline std::string str_title(std::string_view s) {
  std::string out(s);
  bool prev_cased = false;
  for (char& c : out) {
    bool const alpha = ascii_alpha(c);
    c = alpha ? (prev_cased ? ascii_lower(c) : ascii_upper(c)) : c;
    prev_cased = alpha || static_cast<unsigned char>(c) >= 0x80;
  }
  return out;
}

/// Python's str.strip family: `chars` null strips whitespace.
inline std::string_view py_strip(std::string_view s, Value const* chars, bool left, bool right) {
  auto const strips = [&](char32_t c) {
    if (!chars || chars->is_none()) return py_isspace(c);
    std::string_view const set = chars->str();
    for (std::size_t i = 0; i < set.size();) {
      std::size_t len = 1;
      if (utf8_at(set, i, len) == c) return true;
      i += len;
    }
    return false;
  };
  if (left) {
    while (!s.empty()) {
      std::size_t len = 1;
      if (!strips(utf8_at(s, 0, len))) break;
      s.remove_prefix(len);
    }
  }
  if (right) {
    while (!s.empty()) {
      std::size_t start = s.size() - 1;
      while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
      std::size_t len = 1;
      if (!strips(utf8_at(s, start, len))) break;
      s = s.substr(0, start);
    }
  }
  return s;
}

/// Python's str.replace(old, new, count).
inline std::string py_replace(std::string_view s, std::string_view old, std::string_view with,
                              std::int64_t count) {
  std::string out;
  if (old.empty()) {  // inserts `with` before every character and at the end
    CodePoints cp(s);
    std::int64_t done = 0;
    for (std::int64_t i = 0; i <= cp.size(); ++i) {
      if (count < 0 || done < count) {
        out += with;
        ++done;
      }
      if (i < cp.size()) out += cp.at(i);
    }
    return out;
  }
  std::size_t pos = 0;
  std::int64_t done = 0;
  while (count < 0 || done < count) {
    std::size_t const hit = s.find(old, pos);
    if (hit == std::string_view::npos) break;
    out.append(s.substr(pos, hit - pos));
    out += with;
    pos = hit + old.size();
    ++done;
  }
  out.append(s.substr(pos));
  return out;
}

/// Python's str.splitlines().
inline std::vector<std::string_view> splitlines(std::string_view s, bool keepends) {
  std::vector<std::string_view> lines;
  std::size_t start = 0;
  for (std::size_t i = 0; i < s.size();) {
    std::size_t len = 1;
    char32_t const c = utf8_at(s, i, len);
    bool const brk = c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || (c >= 0x1C && c <= 0x1E) ||
                     c == 0x85 || c == 0x2028 || c == 0x2029;
    if (!brk) {
      i += len;
      continue;
    }
    std::size_t end = i + len;
    if (c == '\r' && end < s.size() && s[end] == '\n') ++end;
    lines.push_back(s.substr(start, (keepends ? end : i) - start));
    start = i = end;
  }
  if (start < s.size()) lines.push_back(s.substr(start));
  return lines;
}

// --- arguments -------------------------------------------------------------------------------

struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
};

/// Binds Args to the parameters of a Python function, with Python's rules and errors.
class Bound {
 public:
  Bound(Args const& a, std::initializer_list<std::string_view> names, std::string_view what,
        std::size_t required = 0)
      : names_(names), given_(names.size(), nullptr) {
    if (a.pos.size() > names_.size())
      throw Failure{std::string(what) + " takes at most " + std::to_string(names_.size()) +
                    " argument(s) (" + std::to_string(a.pos.size()) + " given)"};
    for (std::size_t i = 0; i < a.pos.size(); ++i) given_[i] = &a.pos[i];
    for (auto const& [k, v] : a.kw) {
      auto it = std::find(names_.begin(), names_.end(), k);
      if (it == names_.end())
        throw Failure{std::string(what) + " got an unexpected keyword argument '" + k + "'"};
      auto const i = static_cast<std::size_t>(it - names_.begin());
      if (given_[i]) throw Failure{std::string(what) + " got multiple values for argument '" + k + "'"};
      given_[i] = &v;
    }
    for (std::size_t i = 0; i < required; ++i)
      if (!given_[i])
        throw Failure{std::string(what) + " missing required argument '" + std::string(names_[i]) + "'"};
  }

  [[nodiscard]] Value const* operator[](std::size_t i) const { return given_[i]; }
  [[nodiscard]] Value get(std::size_t i, Value fallback) const { return given_[i] ? *given_[i] : fallback; }

 private:
  std::vector<std::string_view> names_;
  std::vector<Value const*> given_;
};

inline std::int64_t want_int(Value const& v, std::string_view what) {
  if (!v.is_integral())
    throw Failure{std::string(what) + ": '" + type_name(v) + "' object cannot be interpreted as an integer"};
  return v.as_int();
}

inline std::string const& want_str(Value const& v, std::string_view what) {
  if (!v.is_string()) throw Failure{std::string(what) + " must be str, not " + type_name(v)};
  return v.str();
}

/// Python's slice.indices(): the items a slice selects from a sequence of `n` items.
struct SliceRange {
  std::int64_t start = 0, step = 1, count = 0;
};

inline SliceRange slice_range(std::int64_t n, Value const& start, Value const& stop, Value const& step_v) {
  auto const index = [](Value const& v) -> std::optional<std::int64_t> {
    if (v.is_none()) return std::nullopt;
    if (!v.is_integral())
      throw Failure{"slice indices must be integers or None or have an __index__ method"};
    return v.as_int();
  };
  std::int64_t const step = index(step_v).value_or(1);
  if (step == 0) throw Failure{"slice step cannot be zero"};
  auto const clamp = [&](std::optional<std::int64_t> v, std::int64_t fallback) {
    if (!v) return fallback;
    std::int64_t x = *v;
    if (x < 0) x = std::max<std::int64_t>(x + n, step < 0 ? -1 : 0);
    else x = std::min<std::int64_t>(x, step < 0 ? n - 1 : n);
    return x;
  };
  std::int64_t const a = clamp(index(start), step < 0 ? n - 1 : 0);
  std::int64_t const b = clamp(index(stop), step < 0 ? -1 : n);
  std::int64_t count = 0;
  if (step > 0 && b > a) count = (b - a + step - 1) / step;
  if (step < 0 && a > b) count = (a - b + (-step) - 1) / (-step);
  return SliceRange{a, step, count};
}

/// raise_exception() unwinding to the expression that called it.
struct Raised {
  std::string message;
};

// --- the renderer ----------------------------------------------------------------------------

inline constexpr std::string_view kStrMethods[] = {
    "capitalize", "casefold", "center", "count", "encode", "endswith", "expandtabs", "find",
    "format", "format_map", "index", "isalnum", "isalpha", "isascii", "isdecimal", "isdigit",
    "isidentifier", "islower", "isnumeric", "isprintable", "isspace", "istitle", "isupper",
    "join", "ljust", "lower", "lstrip", "maketrans", "partition", "removeprefix",
    "removesuffix", "replace", "rfind", "rindex", "rjust", "rpartition", "rsplit", "rstrip",
    "split", "splitlines", "startswith", "strip", "swapcase", "title", "translate", "upper",
    "zfill"};
// What the sandbox allows of dict and list; the rest would change the object.
inline constexpr std::string_view kDictMethods[] = {"copy", "fromkeys", "get", "items", "keys", "values"};
inline constexpr std::string_view kDictMutators[] = {"clear", "pop", "popitem", "setdefault", "update"};
inline constexpr std::string_view kListMethods[] = {"copy", "count", "index"};
inline constexpr std::string_view kListMutators[] = {"append", "clear", "extend", "insert", "pop",
                                                     "remove", "reverse", "sort"};
inline constexpr std::string_view kGlobals[] = {"range", "dict", "namespace", "raise_exception",
                                                "strftime_now", "cycler", "joiner", "lipsum"};

template <std::size_t N>
bool one_of(std::string_view const (&names)[N], std::string_view name) {
  return std::find(std::begin(names), std::end(names), name) != std::end(names);
}

/// One render of a template: walks the tree with its own scopes, output and counters.
class Renderer {
 public:
  Renderer(SourceMap const& map, Limits const& limits, DictData const& context)
      : map_(map), lim_(limits), context_(context) {}

  /// Macros' scopes and namespaces can reference themselves; emptying them frees the cycles.
  ~Renderer() {
    for (auto& sc : captured_) sc->vars.clear();
    for (auto& ns : namespaces_) ns->attrs = DictData{};
  }
  Renderer(Renderer const&) = delete;
  Renderer& operator=(Renderer const&) = delete;

  std::string run(Body const& body) {
    std::string out;
    out_ = &out;
    exec(body, std::make_shared<Scope>());
    return out;
  }

 private:
  enum class Flow : std::uint8_t { kNormal, kBreak, kContinue };

  /// Counts nesting of evaluation, so that the stack stays bounded.
  class Depth {
   public:
    Depth(Renderer& r, std::uint32_t pos) : r_(r) {
      if (++r_.depth_ > r_.lim_.max_render_depth)
        r_.map_.fail(pos, "template nests deeper than " + std::to_string(r_.lim_.max_render_depth) +
                              " levels while rendering (see jinja::Limits)");
    }
    ~Depth() { --r_.depth_; }
    Depth(Depth const&) = delete;
    Depth& operator=(Depth const&) = delete;

   private:
    Renderer& r_;
  };

  void step(std::uint64_t n = 1) {
    steps_ += n;
    if (steps_ > lim_.max_steps)
      throw Failure{"template exceeded " + std::to_string(lim_.max_steps) +
                    " evaluation steps (see jinja::Limits)"};
  }

  void emit(std::string_view s) {
    live_bytes_ += s.size();
    if (live_bytes_ > lim_.max_output)
      throw Failure{"output exceeds " + std::to_string(lim_.max_output) + " bytes (see jinja::Limits)"};
    step(s.size() / 64);
    out_->append(s);
  }

  void check_size(std::size_t bytes) const {
    if (bytes > lim_.max_output)
      throw Failure{"a string of " + std::to_string(bytes) + " bytes exceeds " + std::to_string(lim_.max_output) +
                    " bytes (see jinja::Limits)"};
  }

  /// Python's str(v), within the size limit.
  std::string str_of(Value const& v) const { return py_str(v, lim_.max_output); }

  /// A str of `v`, keeping Markup (jinja2's soft_str).
  Value soft_str(Value const& v) const { return v.is_string() ? v : Value::string(str_of(v)); }

  Value make_str(std::string s, bool markup = false) {
    check_size(s.size());
    step(s.size() / 64);
    return Value::string(std::move(s), markup);
  }

  std::shared_ptr<Scope> child(std::shared_ptr<Scope> const& parent) {
    auto sc = std::make_shared<Scope>();
    sc->parent = parent;
    return sc;
  }

  /// Runs `body` into `buf` instead of the output.
  Flow capture(Body const& body, std::shared_ptr<Scope> const& sc, std::string& buf) {
    std::string* const saved = out_;
    out_ = &buf;
    Flow const f = exec(body, sc);
    out_ = saved;
    live_bytes_ -= buf.size();
    return f;
  }

  // --- statements ---

  Flow exec(Body const& body, std::shared_ptr<Scope> const& sc) {
    for (auto const& s : body)
      if (Flow const f = exec(*s, sc); f != Flow::kNormal) return f;
    return Flow::kNormal;
  }

  Flow exec(Stmt const& s, std::shared_ptr<Scope> const& sc) {
    Depth depth(*this, s.pos);
    try {
      step();
      return exec_inner(s, sc);
    } catch (Failure const& f) {
      map_.fail(s.pos, f.message);
    }
  }

  Flow exec_inner(Stmt const& s, std::shared_ptr<Scope> const& sc) {
    switch (s.kind) {
      case Stmt::Kind::kData: emit(s.text); return Flow::kNormal;
      case Stmt::Kind::kOutput:
        for (auto const& e : s.exprs) {
          Value const v = eval(*e, *sc);
          emit(v.is_string() ? v.str() : str_of(v));
        }
        return Flow::kNormal;
      case Stmt::Kind::kIf:
        for (std::size_t i = 0; i < s.exprs.size(); ++i)
          if (truthy(eval(*s.exprs[i], *sc))) return exec(s.bodies[i], sc);
        if (s.bodies.size() > s.exprs.size()) return exec(s.bodies.back(), sc);
        return Flow::kNormal;
      case Stmt::Kind::kFor: return exec_for(s, sc);
      case Stmt::Kind::kSet: assign(s.target, eval(*s.exprs[0], *sc), *sc); return Flow::kNormal;
      case Stmt::Kind::kSetBlock:
      case Stmt::Kind::kFilterBlock: {
        auto inner = child(sc);
        std::string buf;
        if (Flow const f = capture(s.bodies[0], inner, buf); f != Flow::kNormal) return f;
        Value v = make_str(std::move(buf));
        if (s.exprs[0]) {
          block_values_.push_back(std::move(v));
          v = eval(*s.exprs[0], *inner);
          block_values_.pop_back();
        }
        if (s.kind == Stmt::Kind::kSetBlock) {
          assign(s.target, v, *sc);
        } else {
          emit(str_of(v));
        }
        return Flow::kNormal;
      }
      case Stmt::Kind::kMacro: {
        auto c = std::make_shared<CallableData>();
        c->kind = CallableData::Kind::kMacro;
        c->name = s.text;
        c->macro = &s;
        c->closure = sc;
        captured_.push_back(sc);
        sc->set(s.text, Value::from(std::shared_ptr<CallableData const>(std::move(c))));
        return Flow::kNormal;
      }
      case Stmt::Kind::kBreak: return Flow::kBreak;
      case Stmt::Kind::kContinue: return Flow::kContinue;
      case Stmt::Kind::kWith: {
        std::vector<Value> values;
        for (auto const& e : s.exprs) values.push_back(eval(*e, *sc));
        auto inner = child(sc);
        for (std::size_t i = 0; i < values.size(); ++i) assign(s.targets[i], values[i], *inner);
        return exec(s.bodies[0], inner);
      }
      case Stmt::Kind::kScope: return exec(s.bodies[0], child(sc));
    }
    return Flow::kNormal;
  }

  Flow exec_for(Stmt const& s, std::shared_ptr<Scope> const& sc) {
    Value items = iterable(eval(*s.exprs[0], *sc));
    if (s.exprs[1]) {  // `for x in xs if cond`: filtered before the loop counts
      std::vector<Value> kept;
      for (auto const& item : items.list().items) {
        step();
        auto test_scope = child(sc);
        assign(s.target, item, *test_scope);
        if (truthy(eval(*s.exprs[1], *test_scope))) kept.push_back(item);
      }
      items = Value::list(std::move(kept));
    }
    auto loop = std::make_shared<LoopData>();
    loop->items = items;
    Value const loop_value = Value::from(loop);
    auto const& list = items.list().items;
    for (std::size_t i = 0; i < list.size(); ++i) {
      step();
      loop->index0 = i;
      auto body_scope = child(sc);
      assign(s.target, list[i], *body_scope);
      body_scope->set("loop", loop_value);
      if (exec(s.bodies[0], body_scope) == Flow::kBreak) break;
    }
    if (list.empty() && !s.bodies[1].empty()) return exec(s.bodies[1], child(sc));
    return Flow::kNormal;
  }

  void assign(Target const& t, Value const& v, Scope& sc) {
    switch (t.kind) {
      case Target::Kind::kName: sc.set(t.name, v); return;
      case Target::Kind::kTuple: {
        Value const seq = iterable(v);
        auto const& items = seq.list().items;
        std::size_t const want = t.items.size();
        if (items.size() < want)
          throw Failure{"not enough values to unpack (expected " + std::to_string(want) + ", got " +
                        std::to_string(items.size()) + ")"};
        if (items.size() > want)
          throw Failure{"too many values to unpack (expected " + std::to_string(want) + ")"};
        for (std::size_t i = 0; i < want; ++i) assign(t.items[i], items[i], sc);
        return;
      }
      case Target::Kind::kNsAttr: {
        Value const ns = lookup(t.name, sc);
        if (ns.kind() != Value::Kind::kNamespace)
          throw Failure{"cannot assign attribute on non-namespace object"};
        check_namespace_name(t.attr);
        ns.ns().set(t.attr, v);
        return;
      }
    }
  }

  static void check_namespace_name(std::string_view name) {
    if (name.starts_with("_"))
      throw Failure{"Chat templates cannot store underscore-prefixed attributes on a namespace, but got '" +
                    std::string(name) + "'. Please rename the attribute."};
  }

  // --- names and lookups ---

  Value lookup(std::string const& name, Scope const& sc) const {
    if (Value const* v = sc.find(name)) return *v;
    if (Value const* v = context_.find(name)) return *v;
    if (one_of(kGlobals, name)) {
      auto c = std::make_shared<CallableData>();
      c->kind = CallableData::Kind::kGlobal;
      c->name = name;
      return Value::from(std::shared_ptr<CallableData const>(std::move(c)));
    }
    return Value::undefined("'" + name + "' is undefined");
  }

  static std::string owner(Value const& obj) {
    if (obj.is_none()) return "None";
    return type_name(obj) + " object";
  }
  static Value no_attribute(Value const& obj, std::string_view name) {
    return Value::undefined("'" + owner(obj) + "' has no attribute '" + std::string(name) + "'");
  }
  static Value unsafe(Value const& obj, std::string_view name) {
    return Value::undefined("access to attribute '" + std::string(name) + "' of '" + type_name(obj) +
                            "' object is unsafe.");
  }
  static Value method(Value const& self, std::string_view name) {
    auto c = std::make_shared<CallableData>();
    c->kind = CallableData::Kind::kMethod;
    c->name = name;
    c->self = self;
    return Value::from(std::shared_ptr<CallableData const>(std::move(c)));
  }

  /// Python's getattr() as the sandbox allows it; nullopt when there is no such attribute.
  std::optional<Value> attribute(Value const& obj, std::string_view name) const {
    switch (obj.kind()) {
      case Value::Kind::kString:
        if (one_of(kStrMethods, name)) return method(obj, name);
        break;
      case Value::Kind::kDict:
        if (one_of(kDictMethods, name)) return method(obj, name);
        if (one_of(kDictMutators, name)) return unsafe(obj, name);
        break;
      case Value::Kind::kList: {
        SeqKind const k = obj.list().kind;
        if (k == SeqKind::kList && one_of(kListMethods, name)) return method(obj, name);
        if (k == SeqKind::kList && one_of(kListMutators, name)) return unsafe(obj, name);
        if (k == SeqKind::kTuple && (name == "count" || name == "index")) return method(obj, name);
        break;
      }
      case Value::Kind::kNamespace:
        if (Value const* v = obj.ns().find(name)) return *v;
        break;
      case Value::Kind::kLoop: return loop_attribute(obj, name);
      default: break;
    }
    return std::nullopt;
  }

  std::optional<Value> loop_attribute(Value const& obj, std::string_view name) const {
    LoopData const& l = obj.loop();
    auto const& items = l.items.list().items;
    auto const n = static_cast<std::int64_t>(items.size());
    auto const i = static_cast<std::int64_t>(l.index0);
    if (name == "index") return Value::integer(i + 1);
    if (name == "index0") return Value::integer(i);
    if (name == "revindex") return Value::integer(n - i);
    if (name == "revindex0") return Value::integer(n - i - 1);
    if (name == "first") return Value::boolean(i == 0);
    if (name == "last") return Value::boolean(i == n - 1);
    if (name == "length") return Value::integer(n);
    if (name == "depth") return Value::integer(1);
    if (name == "depth0") return Value::integer(0);
    if (name == "previtem")
      return i > 0 ? items[static_cast<std::size_t>(i - 1)] : Value::undefined("there is no previous item");
    if (name == "nextitem")
      return i + 1 < n ? items[static_cast<std::size_t>(i + 1)] : Value::undefined("there is no next item");
    if (name == "cycle" || name == "changed") return method(obj, name);
    return std::nullopt;
  }

  /// `obj.name`: jinja2's Environment.getattr (the attribute, else the item).
  Value get_attr(Value const& obj, std::string const& name) const {
    if (obj.is_undefined()) fail_undefined(obj);
    if (auto a = attribute(obj, name)) return *a;
    if (obj.is_dict())
      if (Value const* v = obj.dict().find(name)) return *v;
    return no_attribute(obj, name);
  }

  /// `obj[key]`: jinja2's Environment.getitem (the item, else the attribute for a str key).
  Value get_item(Value const& obj, Value const& key) const {
    if (obj.is_undefined()) fail_undefined(obj);
    if (obj.is_dict() && hashable(key)) {
      if (Value const* v = obj.dict().find(key)) return *v;
    } else if (key.is_integral() && (obj.is_string() || (obj.is_list() && (obj.list().kind == SeqKind::kList ||
                                                                          obj.list().kind == SeqKind::kTuple)))) {
      std::int64_t i = key.as_int();
      if (obj.is_string()) {
        CodePoints cp(obj.str());
        if (i < 0) i += cp.size();
        if (i >= 0 && i < cp.size()) return Value::string(std::string(cp.at(i)), obj.markup());
      } else {
        auto const& items = obj.list().items;
        if (i < 0) i += static_cast<std::int64_t>(items.size());
        if (i >= 0 && i < static_cast<std::int64_t>(items.size())) return items[static_cast<std::size_t>(i)];
      }
    }
    if (key.is_string()) {
      if (auto a = attribute(obj, key.str())) return *a;
      return no_attribute(obj, key.str());
    }
    return Value::undefined(owner(obj) + " has no element " + repr_excerpt(key));
  }

  Value slice(Value const& obj, Value const& start, Value const& stop, Value const& step_v) {
    if (obj.is_undefined()) fail_undefined(obj);
    if (obj.is_string()) {
      CodePoints cp(obj.str());
      SliceRange const r = slice_range(cp.size(), start, stop, step_v);
      step(static_cast<std::uint64_t>(r.count) / 64);
      if (r.step == 1) return Value::string(std::string(cp.range(r.start, r.start + r.count)), obj.markup());
      std::string out;
      for (std::int64_t k = 0; k < r.count; ++k) out += cp.at(r.start + k * r.step);
      return Value::string(std::move(out), obj.markup());
    }
    if (obj.is_list() && (obj.list().kind == SeqKind::kList || obj.list().kind == SeqKind::kTuple)) {
      auto const& items = obj.list().items;
      SliceRange const r = slice_range(static_cast<std::int64_t>(items.size()), start, stop, step_v);
      step(static_cast<std::uint64_t>(r.count));
      std::vector<Value> out;
      out.reserve(static_cast<std::size_t>(r.count));
      for (std::int64_t k = 0; k < r.count; ++k) out.push_back(items[static_cast<std::size_t>(r.start + k * r.step)]);
      return Value::list(std::move(out), obj.list().kind);
    }
    return Value::undefined(owner(obj) + " has no element slice(" + repr_excerpt(start) + ", " +
                            repr_excerpt(stop) + ", " + repr_excerpt(step_v) + ")");
  }

  /// What `for` and the filters iterate: a list value (a dict gives its keys, a str its
  /// characters, Undefined nothing).
  Value iterable(Value const& v) {
    switch (v.kind()) {
      case Value::Kind::kUndefined: return Value::list({});
      case Value::Kind::kList:
        if (v.list().failure) throw Failure{*v.list().failure};
        return v;
      case Value::Kind::kDict: {
        std::vector<Value> keys;
        for (auto const& kv : v.dict().items) keys.push_back(kv.first);
        step(keys.size());
        return Value::list(std::move(keys));
      }
      case Value::Kind::kString: {
        CodePoints cp(v.str());
        std::vector<Value> chars;
        // iterating a Markup gives plain characters (str.__iter__), indexing it Markup ones
        for (std::int64_t i = 0; i < cp.size(); ++i) chars.push_back(Value::string(std::string(cp.at(i))));
        step(chars.size());
        return Value::list(std::move(chars));
      }
      default: throw Failure{"'" + type_name(v) + "' object is not iterable"};
    }
  }

  /// Python's len().
  static std::int64_t py_len(Value const& v) {
    switch (v.kind()) {
      case Value::Kind::kUndefined: return 0;
      case Value::Kind::kString: return utf8_length(v.str());
      case Value::Kind::kDict: return static_cast<std::int64_t>(v.dict().items.size());
      case Value::Kind::kList:
        if (v.list().kind != SeqKind::kIterator) return static_cast<std::int64_t>(v.list().items.size());
        break;
      case Value::Kind::kLoop: return static_cast<std::int64_t>(v.loop().items.list().items.size());
      default: break;
    }
    throw Failure{"object of type '" + type_name(v) + "' has no len()"};
  }

  /// Python's `in`.
  bool contains(Value const& container, Value const& x) {
    switch (container.kind()) {
      case Value::Kind::kUndefined: return false;
      case Value::Kind::kString:
        if (!x.is_string())
          throw Failure{"'in <string>' requires string as left operand, not " + type_name(x)};
        return container.str().find(x.str()) != std::string::npos;
      case Value::Kind::kDict:
        if (!hashable(x)) throw Failure{"unhashable type: '" + type_name(x) + "'"};
        step(container.dict().items.size());
        return container.dict().find(x) != nullptr;
      case Value::Kind::kList:
        step(container.list().items.size());
        for (auto const& item : container.list().items)
          if (py_eq(item, x)) return true;
        if (container.list().failure) throw Failure{*container.list().failure};
        return false;
      default: throw Failure{"argument of type '" + type_name(container) + "' is not iterable"};
    }
  }

  // --- expressions ---

  Value eval(Expr const& e, Scope const& sc) {
    Depth depth(*this, e.pos);
    try {
      step();
      return eval_inner(e, sc);
    } catch (Failure const& f) {
      map_.fail(e.pos, f.message);
    } catch (Raised const& r) {
      throw RaisedError(::qflash::detail::concat(map_.name(), ":", map_.line_col(e.pos), ": ", r.message),
                        r.message, __FILE__, __LINE__);
    }
  }

  Value eval_inner(Expr const& e, Scope const& sc) {
    switch (e.kind) {
      case Expr::Kind::kConst: return e.value;
      case Expr::Kind::kName: return lookup(e.name, sc);
      case Expr::Kind::kAttr: return get_attr(eval(*e.args[0], sc), e.name);
      case Expr::Kind::kItem: {
        Value const obj = eval(*e.args[0], sc);
        Expr const& key = *e.args[1];
        if (key.kind != Expr::Kind::kSlice) return get_item(obj, eval(key, sc));
        auto const part = [&](ExprPtr const& p) { return p ? eval(*p, sc) : Value::none(); };
        Value const a = part(key.args[0]);
        Value const b = part(key.args[1]);
        return slice(obj, a, b, part(key.args[2]));
      }
      case Expr::Kind::kSlice: throw Failure{"a slice is only allowed as a subscript"};
      case Expr::Kind::kList:
      case Expr::Kind::kTuple: {
        std::vector<Value> items;
        items.reserve(e.args.size());
        for (auto const& a : e.args) items.push_back(eval(*a, sc));
        return Value::list(std::move(items), e.kind == Expr::Kind::kList ? SeqKind::kList : SeqKind::kTuple);
      }
      case Expr::Kind::kDict: {
        DictData d;
        for (std::size_t i = 0; i < e.args.size(); i += 2) {
          Value k = eval(*e.args[i], sc);
          if (!hashable(k)) throw Failure{"unhashable type: '" + type_name(k) + "'"};
          d.set(std::move(k), eval(*e.args[i + 1], sc));
        }
        return Value::dict(std::move(d));
      }
      case Expr::Kind::kNot: return Value::boolean(!truthy(eval(*e.args[0], sc)));
      case Expr::Kind::kNeg:
      case Expr::Kind::kPos: {
        Value const v = eval(*e.args[0], sc);
        if (v.is_undefined()) fail_undefined(v);
        bool const neg = e.kind == Expr::Kind::kNeg;
        if (v.is_float()) return Value::number(neg ? -v.as_float() : v.as_float());
        if (v.is_integral()) return Value::integer(neg ? neg_int(v.as_int()) : v.as_int());
        throw Failure{std::string("bad operand type for unary ") + (neg ? "-" : "+") + ": '" + type_name(v) + "'"};
      }
      case Expr::Kind::kBinary: {
        Value const l = eval(*e.args[0], sc);
        return binary(e.op, l, eval(*e.args[1], sc));
      }
      case Expr::Kind::kConcat: {
        std::string out;
        Printer print(out, lim_.max_output);
        for (auto const& a : e.args) print.str(eval(*a, sc));
        return make_str(std::move(out));
      }
      case Expr::Kind::kCompare: {
        Value left = eval(*e.args[0], sc);
        for (std::size_t i = 0; i < e.ops.size(); ++i) {
          Value right = eval(*e.args[i + 1], sc);
          if (!compare(e.ops[i], left, right)) return Value::boolean(false);
          left = std::move(right);
        }
        return Value::boolean(true);
      }
      case Expr::Kind::kAnd: {
        Value l = eval(*e.args[0], sc);
        return truthy(l) ? eval(*e.args[1], sc) : l;
      }
      case Expr::Kind::kOr: {
        Value l = eval(*e.args[0], sc);
        return truthy(l) ? l : eval(*e.args[1], sc);
      }
      case Expr::Kind::kCond:
        if (truthy(eval(*e.args[1], sc))) return eval(*e.args[0], sc);
        if (e.args[2]) return eval(*e.args[2], sc);
        return Value::undefined("the inline if-expression at " + map_.line_col(e.pos) +
                                " evaluated to false and no else section was defined.");
      case Expr::Kind::kFilter: {
        Value const input = eval(*e.args[0], sc);
        Args const a = eval_args(e, sc);
        return filter(static_cast<Filter>(e.fn), e.name, input, a);
      }
      case Expr::Kind::kTest: {
        Value const input = eval(*e.args[0], sc);
        Args const a = eval_args(e, sc);
        return Value::boolean(test(static_cast<Test>(e.fn), input, a));
      }
      case Expr::Kind::kCall: {
        Value const callee = eval(*e.args[0], sc);
        Args a = eval_args(e, sc);
        return call(callee, a);
      }
      case Expr::Kind::kBlockValue: return block_values_.back();
    }
    return Value();
  }

  /// The arguments of a call, filter or test: args[1...], keywords, `*list` and `**dict`.
  Args eval_args(Expr const& e, Scope const& sc) {
    Args a;
    for (std::size_t i = 1; i < e.args.size(); ++i) a.pos.push_back(eval(*e.args[i], sc));
    for (auto const& k : e.kwargs) a.kw.emplace_back(k.name, eval(*k.value, sc));
    if (e.star_args) {
      Value const extra = iterable(eval(*e.star_args, sc));
      for (auto const& v : extra.list().items) a.pos.push_back(v);
    }
    if (e.star_kwargs) {
      Value const extra = eval(*e.star_kwargs, sc);
      if (!extra.is_dict()) throw Failure{"argument after ** must be a mapping, not " + type_name(extra)};
      for (auto const& [k, v] : extra.dict().items) {
        if (!k.is_string()) throw Failure{"keywords must be strings"};
        a.kw.emplace_back(k.str(), v);
      }
    }
    return a;
  }

  bool compare(Op op, Value const& a, Value const& b) {
    switch (op) {
      case Op::kEq: return py_eq(a, b);
      case Op::kNe: return !py_eq(a, b);
      case Op::kIn: return contains(b, a);
      case Op::kNotIn: return !contains(b, a);
      case Op::kLt: { auto c = py_order(a, b, "<"); return c && *c < 0; }
      case Op::kLe: { auto c = py_order(a, b, "<="); return c && *c <= 0; }
      case Op::kGt: { auto c = py_order(a, b, ">"); return c && *c > 0; }
      case Op::kGe: { auto c = py_order(a, b, ">="); return c && *c >= 0; }
      default: return false;
    }
  }

  [[noreturn]] static void unsupported(Op op, Value const& a, Value const& b) {
    throw Failure{std::string("unsupported operand type(s) for ") + op_symbol(op) + ": '" + type_name(a) +
                  "' and '" + type_name(b) + "'"};
  }

  Value repeat(Value const& seq, std::int64_t n) {
    n = std::max<std::int64_t>(n, 0);
    if (seq.is_string()) {
      std::size_t const size = seq.str().size();
      if (size > 0 && static_cast<std::uint64_t>(n) > lim_.max_output / size)
        throw Failure{"a string of more than " + std::to_string(lim_.max_output) + " bytes (see jinja::Limits)"};
      std::string out;
      out.reserve(size * static_cast<std::size_t>(n));
      for (std::int64_t i = 0; i < n; ++i) out += seq.str();
      return make_str(std::move(out), seq.markup());
    }
    auto const& items = seq.list().items;
    step(items.size() * static_cast<std::uint64_t>(std::min<std::int64_t>(n, INT32_MAX)));
    std::vector<Value> out;
    for (std::int64_t i = 0; i < n; ++i) out.insert(out.end(), items.begin(), items.end());
    return Value::list(std::move(out), seq.list().kind);
  }

  /// Python's binary arithmetic, with markupsafe's Markup escaping what `+` joins to it.
  Value binary(Op op, Value const& a, Value const& b) {
    if (a.is_undefined()) fail_undefined(a);
    if (b.is_undefined()) fail_undefined(b);
    bool const nums = a.is_number() && b.is_number();
    bool const floats = nums && (a.is_float() || b.is_float());
    switch (op) {
      case Op::kAdd:
        if (floats) return Value::number(a.as_float() + b.as_float());
        if (nums) return Value::integer(add_int(a.as_int(), b.as_int()));
        if (a.is_string() && b.is_string()) {
          bool const markup = a.markup() || b.markup();
          auto const part = [&](Value const& v) { return markup && !v.markup() ? html_escape(v.str()) : v.str(); };
          return make_str(part(a) + part(b), markup);
        }
        if (a.is_string()) throw Failure{"can only concatenate str (not \"" + type_name(b) + "\") to str"};
        if (a.is_list() && b.is_list() && (a.list().kind == SeqKind::kList || a.list().kind == SeqKind::kTuple)) {
          if (a.list().kind != b.list().kind)
            throw Failure{"can only concatenate " + type_name(a) + " (not \"" + type_name(b) + "\") to " + type_name(a)};
          std::vector<Value> items = a.list().items;
          items.insert(items.end(), b.list().items.begin(), b.list().items.end());
          step(items.size());
          return Value::list(std::move(items), a.list().kind);
        }
        unsupported(op, a, b);
      case Op::kSub:
        if (floats) return Value::number(a.as_float() - b.as_float());
        if (nums) return Value::integer(sub_int(a.as_int(), b.as_int()));
        unsupported(op, a, b);
      case Op::kMul: {
        if (floats) return Value::number(a.as_float() * b.as_float());
        if (nums) return Value::integer(mul_int(a.as_int(), b.as_int()));
        auto const is_seq = [](Value const& v) {
          return v.is_string() || (v.is_list() && (v.list().kind == SeqKind::kList || v.list().kind == SeqKind::kTuple));
        };
        if (is_seq(a) && b.is_integral()) return repeat(a, b.as_int());
        if (a.is_integral() && is_seq(b)) return repeat(b, a.as_int());
        if (is_seq(a) || is_seq(b))
          throw Failure{"can't multiply sequence by non-int of type '" + type_name(is_seq(a) ? b : a) + "'"};
        unsupported(op, a, b);
      }
      case Op::kDiv:
        if (!nums) unsupported(op, a, b);
        if (b.as_float() == 0.0) throw Failure{floats ? "float division by zero" : "division by zero"};
        return Value::number(a.as_float() / b.as_float());
      case Op::kFloorDiv:
      case Op::kMod:
        if (floats) {
          if (b.as_float() == 0.0) throw Failure{op == Op::kMod ? "float modulo" : "float floor division by zero"};
          auto const [q, m] = float_div_mod(a.as_float(), b.as_float());
          return Value::number(op == Op::kMod ? m : q);
        }
        if (nums) return Value::integer(op == Op::kMod ? floor_mod(a.as_int(), b.as_int()) : floor_div(a.as_int(), b.as_int()));
        if (op == Op::kMod && a.is_string()) return percent_format(a, b);
        unsupported(op, a, b);
      case Op::kPow: {
        if (!nums) unsupported(op, a, b);
        if (!floats && b.as_int() >= 0) {
          std::int64_t base = a.as_int(), result = 1;
          for (std::int64_t e = b.as_int(); e > 0; e >>= 1) {
            if (e & 1) result = mul_int(result, base);
            if (e > 1) base = mul_int(base, base);
          }
          return Value::integer(result);
        }
        double const x = a.as_float(), y = b.as_float();
        if (x == 0.0 && y < 0) throw Failure{"0.0 cannot be raised to a negative power"};
        if (x < 0 && y != std::floor(y)) throw Failure{"a negative number to a fractional power is complex"};
        return Value::number(std::pow(x, y));
      }
      default: return Value();
    }
  }

  /// Python's printf-style `str % args`: flags, width and precision, and the conversions
  /// s r d i u f F e E g G x X o c %, positional or by `%(name)` from a dict.
  Value percent_format(Value const& format, Value const& args) {
    std::string const& f = format.str();
    bool const tuple = args.is_list() && args.list().kind == SeqKind::kTuple;
    bool const mapping = !tuple && (args.is_dict() || args.is_list());  // Python: no "not all converted"
    std::vector<Value> const single{args};
    std::vector<Value> const& vals = tuple ? args.list().items : single;
    std::size_t next = 0;
    std::string out;
    auto const number = [&](std::size_t& i) {
      std::int64_t n = 0;
      if (i < f.size() && f[i] == '*') {
        ++i;
        if (next >= vals.size()) throw Failure{"not enough arguments for format string"};
        return want_int(vals[next++], "* wants int");
      }
      while (i < f.size() && std::isdigit(static_cast<unsigned char>(f[i])) && n < 100000) n = n * 10 + (f[i++] - '0');
      return n;
    };
    for (std::size_t i = 0; i < f.size(); ++i) {
      if (f[i] != '%') {
        out += f[i];
        continue;
      }
      ++i;
      Value const* arg = nullptr;
      if (i < f.size() && f[i] == '(') {
        std::size_t const close = f.find(')', i);
        if (close == std::string::npos) throw Failure{"incomplete format key"};
        if (!args.is_dict()) throw Failure{"format requires a mapping"};
        arg = args.dict().find(std::string_view(f).substr(i + 1, close - i - 1));
        if (!arg) throw Failure{"'" + f.substr(i + 1, close - i - 1) + "'"};
        i = close + 1;
      }
      std::string flags;
      while (i < f.size() && std::string_view("-+ #0").find(f[i]) != std::string_view::npos) flags += f[i++];
      std::int64_t width = number(i);
      if (width < 0) {
        flags += '-';
        width = -width;
      }
      std::int64_t precision = -1;
      if (i < f.size() && f[i] == '.') {
        ++i;
        precision = number(i);
      }
      while (i < f.size() && (f[i] == 'h' || f[i] == 'l' || f[i] == 'L')) ++i;
      if (i >= f.size()) throw Failure{"incomplete format"};
      char const conv = f[i];
      if (conv == '%') {
        out += '%';
        continue;
      }
      if (!arg) {
        if (next >= vals.size()) throw Failure{"not enough arguments for format string"};
        arg = &vals[next++];
      }
      check_size(static_cast<std::size_t>(std::max<std::int64_t>(width, 0)) + out.size());
      std::string text;
      bool const left = flags.find('-') != std::string::npos;
      if (conv == 's' || conv == 'r' || conv == 'c') {
        if (conv == 'c') {
          if (arg->is_string() && utf8_length(arg->str()) == 1) text = arg->str();
          else if (arg->is_integral() && arg->as_int() >= 0 && arg->as_int() <= 0x10FFFF) utf8_append(text, static_cast<char32_t>(arg->as_int()));
          else throw Failure{"%c requires an int or a unicode character, not " + type_name(*arg)};
        } else if (conv == 's') {
          text = str_of(*arg);
        } else {
          Printer(text, lim_.max_output).repr(*arg);
        }
        if (format.markup() && !arg->markup()) text = html_escape(text);
        CodePoints const cp(text);
        if (precision >= 0 && precision < cp.size()) text = std::string(cp.range(0, precision));
        auto const pad = std::max<std::int64_t>(0, width - utf8_length(text));
        text = left ? text + std::string(static_cast<std::size_t>(pad), ' ')
                    : std::string(static_cast<std::size_t>(pad), ' ') + text;
      } else if (std::string_view("diufFeEgGxXo").find(conv) != std::string_view::npos) {
        bool const integral = std::string_view("diuxXo").find(conv) != std::string_view::npos;
        if (!arg->is_number())
          throw Failure{std::string("%") + conv + " format: " +
                        (integral && conv != 'd' && conv != 'i' && conv != 'u' ? "an integer" : "a real number") +
                        " is required, not " + type_name(*arg)};
        if ((conv == 'x' || conv == 'X' || conv == 'o') && arg->is_float())
          throw Failure{std::string("%") + conv + " format: an integer is required, not float"};
        std::string spec = "%" + flags;
        if (width > 0) spec += std::to_string(std::min<std::int64_t>(width, 100000));
        if (precision >= 0) spec += "." + std::to_string(std::min<std::int64_t>(precision, 1000));
        char buf[512];
        std::vector<char> big;
        auto const print = [&](auto value, char const* length) {
          std::string const c = spec + length + (conv == 'u' || conv == 'i' ? std::string("d") : std::string(1, conv));
          int const n = std::snprintf(buf, sizeof buf, c.c_str(), value);
          if (n >= static_cast<int>(sizeof buf)) {
            big.resize(static_cast<std::size_t>(n) + 1);
            std::snprintf(big.data(), big.size(), c.c_str(), value);
            return std::string(big.data(), static_cast<std::size_t>(n));
          }
          return std::string(buf, static_cast<std::size_t>(std::max(n, 0)));
        };
        if (integral) {
          double const x = arg->as_float();
          if (arg->is_float() && !(x > -9.2e18 && x < 9.2e18)) fail_overflow();
          std::int64_t const v = arg->is_float() ? static_cast<std::int64_t>(x) : arg->as_int();
          if ((conv == 'x' || conv == 'X' || conv == 'o') && v < 0) {  // Python: a sign, not two's complement
            spec = "%";
            text = "-" + print(0ULL - static_cast<unsigned long long>(v), "ll");
            auto const pad = std::max<std::int64_t>(0, width - static_cast<std::int64_t>(text.size()));
            text = left ? text + std::string(static_cast<std::size_t>(pad), ' ')
                        : std::string(static_cast<std::size_t>(pad), ' ') + text;
          } else if (conv == 'o' && flags.find('#') != std::string::npos) {  // Python writes 0o17
            spec = "%";
            text = "0o" + print(static_cast<unsigned long long>(v), "ll");
            auto const pad = std::max<std::int64_t>(0, width - static_cast<std::int64_t>(text.size()));
            text = left ? text + std::string(static_cast<std::size_t>(pad), ' ')
                        : std::string(static_cast<std::size_t>(pad), ' ') + text;
          } else if (conv == 'x' || conv == 'X' || conv == 'o') {
            text = print(static_cast<unsigned long long>(v), "ll");
          } else {
            text = print(static_cast<long long>(v), "ll");
          }
        } else {
          text = print(arg->as_float(), "");
        }
      } else {
        char hex[8];
        std::snprintf(hex, sizeof hex, "%x", static_cast<unsigned>(static_cast<unsigned char>(conv)));
        throw Failure{std::string("unsupported format character '") + conv + "' (0x" + hex + ") at index " +
                      std::to_string(i)};
      }
      out += text;
      check_size(out.size());
    }
    if (!mapping && next < vals.size()) throw Failure{"not all arguments converted during string formatting"};
    return make_str(std::move(out), format.markup());
  }

  // --- calls ---

  Value call(Value const& f, Args& a) {
    if (f.is_undefined()) fail_undefined(f);
    if (f.kind() == Value::Kind::kLoop) throw Failure{"recursive loops (loop(...)) are not supported"};
    if (f.kind() != Value::Kind::kCallable) throw Failure{"'" + type_name(f) + "' object is not callable"};
    auto const& c = f.callable();
    switch (c.kind) {
      case CallableData::Kind::kMacro: return call_macro(c, a);
      case CallableData::Kind::kGlobal: return call_global(c.name, a);
      case CallableData::Kind::kMethod: return call_method(c.self, c.name, a);
    }
    return Value();
  }

  /// jinja2's Macro.__call__: positional, then keyword arguments, then defaults evaluated in
  /// the macro's scope; `varargs` and `kwargs` only for a macro that reads them.
  Value call_macro(CallableData const& c, Args& a) {
    Stmt const& m = *c.macro;
    if (calls_ >= lim_.max_call_depth)
      throw Failure{"macro calls nest deeper than " + std::to_string(lim_.max_call_depth) + " (see jinja::Limits)"};
    auto sc = child(c.closure);
    std::size_t const n = m.params.size();
    for (std::size_t i = 0; i < n && i < a.pos.size(); ++i) sc->set(m.params[i], a.pos[i]);
    for (std::size_t i = a.pos.size(); i < n; ++i) {
      auto it = std::find_if(a.kw.begin(), a.kw.end(), [&](auto const& kv) { return kv.first == m.params[i]; });
      if (it != a.kw.end()) {
        sc->set(m.params[i], std::move(it->second));
        a.kw.erase(it);
      } else if (m.exprs[i]) {
        sc->set(m.params[i], eval(*m.exprs[i], *sc));
      } else {
        sc->set(m.params[i], Value::undefined("parameter '" + m.params[i] + "' was not provided"));
      }
    }
    if (m.catch_kwargs) {
      DictData d;
      for (auto& [k, v] : a.kw) d.set(Value::string(k), std::move(v));
      sc->set("kwargs", Value::dict(std::move(d)));
    } else if (!a.kw.empty()) {
      throw Failure{"macro '" + m.text + "' takes no keyword argument '" + a.kw.front().first + "'"};
    }
    if (m.catch_varargs) {
      std::vector<Value> rest;
      for (std::size_t i = n; i < a.pos.size(); ++i) rest.push_back(a.pos[i]);
      sc->set("varargs", Value::list(std::move(rest), SeqKind::kTuple));
    } else if (a.pos.size() > n) {
      throw Failure{"macro '" + m.text + "' takes not more than " + std::to_string(n) + " argument(s)"};
    }
    ++calls_;
    std::string buf;
    capture(m.bodies[0], sc, buf);
    --calls_;
    return make_str(std::move(buf));
  }

  Value call_global(std::string const& name, Args const& a) {
    if (name == "range") {
      if (!a.kw.empty()) throw Failure{"range() takes no keyword arguments"};
      if (a.pos.empty() || a.pos.size() > 3)
        throw Failure{"range expected 1 to 3 arguments, got " + std::to_string(a.pos.size())};
      std::int64_t start = 0, stop = 0, stride = 1;
      if (a.pos.size() == 1) {
        stop = want_int(a.pos[0], "range()");
      } else {
        start = want_int(a.pos[0], "range()");
        stop = want_int(a.pos[1], "range()");
        if (a.pos.size() == 3) stride = want_int(a.pos[2], "range()");
      }
      if (stride == 0) throw Failure{"range() arg 3 must not be zero"};
      long double const span = stride > 0 ? static_cast<long double>(stop) - start : static_cast<long double>(start) - stop;
      long double const count = span <= 0 ? 0 : std::ceil(span / std::abs(static_cast<long double>(stride)));
      if (count > static_cast<long double>(lim_.max_range))
        throw Failure{"Range too big. The sandbox blocks ranges larger than MAX_RANGE (" +
                      std::to_string(lim_.max_range) + ")."};
      std::vector<Value> items;
      for (std::int64_t k = 0; k < static_cast<std::int64_t>(count); ++k) items.push_back(Value::integer(start + k * stride));
      step(items.size());
      return Value::list(std::move(items));
    }
    if (name == "dict" || name == "namespace") {
      DictData d;
      if (a.pos.size() > 1) throw Failure{name + "() expected at most 1 argument, got " + std::to_string(a.pos.size())};
      if (!a.pos.empty()) d = dict_from(a.pos[0], name);
      for (auto const& [k, v] : a.kw) d.set(Value::string(k), v);
      if (name == "dict") return Value::dict(std::move(d));
      auto ns = std::make_shared<NamespaceData>();
      for (auto& [k, v] : d.items) {
        if (!k.is_string()) throw Failure{"namespace() attribute names must be strings"};
        check_namespace_name(k.str());
        ns->set(k.str(), std::move(v));
      }
      namespaces_.push_back(ns);
      return Value::from(std::move(ns));
    }
    if (name == "raise_exception") {
      Bound const b(a, {"message"}, "raise_exception()", 1);
      throw Raised{str_of(*b[0])};
    }
    if (name == "strftime_now") {
      Bound const b(a, {"format"}, "strftime_now()", 1);
      return make_str(strftime_now(want_str(*b[0], "strftime_now() format")));
    }
    throw Failure{name + "() is not supported"};
  }

  DictData dict_from(Value const& v, std::string const& what) {
    if (v.is_dict()) return v.dict();
    if (v.is_undefined()) fail_undefined(v);  // dict() asks it for keys()
    DictData d;
    Value const seq = iterable(v);
    for (auto const& item : seq.list().items) {
      Value const pair = iterable(item);
      if (pair.list().items.size() != 2)
        throw Failure{what + "() update sequence element has length " +
                      std::to_string(pair.list().items.size()) + "; 2 is required"};
      Value const& key = pair.list().items[0];
      if (!hashable(key)) throw Failure{"unhashable type: '" + type_name(key) + "'"};
      step(key.is_string() ? 1 : d.items.size());  // keys other than str are looked for one by one
      d.set(key, pair.list().items[1]);
    }
    return d;
  }

  /// datetime.now().strftime(format): C's strftime, plus Python's %f (microseconds).
  static std::string strftime_now(std::string const& format) {
    auto const now = std::chrono::system_clock::now();
    std::time_t const t = std::chrono::system_clock::to_time_t(now);
    auto const micros = std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count() % 1000000;
    std::tm tm{};
    localtime_r(&t, &tm);
    std::string fmt;
    for (std::size_t i = 0; i < format.size(); ++i) {
      if (format[i] == '%' && i + 1 < format.size()) {
        if (format[i + 1] == 'f') {
          char buf[8];
          std::snprintf(buf, sizeof buf, "%06lld", static_cast<long long>(micros));
          fmt += buf;
        } else {
          fmt += format.substr(i, 2);
        }
        ++i;
      } else {
        fmt += format[i];
      }
    }
    if (fmt.empty()) return {};
    std::string out(64 + fmt.size() * 8, '\0');
    std::size_t const n = std::strftime(out.data(), out.size(), fmt.c_str(), &tm);
    out.resize(n);
    return out;
  }

  // --- methods ---

  Value call_method(Value const& self, std::string const& name, Args const& a) {
    std::string const what = type_name(self) + "." + name + "()";
    switch (self.kind()) {
      case Value::Kind::kString: return str_method(self, name, a, what);
      case Value::Kind::kDict: {
        auto const& d = self.dict();
        if (!a.kw.empty()) throw Failure{what + " takes no keyword arguments"};
        if (name == "get") {
          if (a.pos.empty() || a.pos.size() > 2) throw Failure{what + " takes 1 or 2 arguments"};
          Value const* v = hashable(a.pos[0]) ? d.find(a.pos[0]) : nullptr;
          return v ? *v : a.pos.size() == 2 ? a.pos[1] : Value::none();
        }
        if (!a.pos.empty()) throw Failure{what + " takes no arguments"};
        if (name == "copy") return self;
        std::vector<Value> out;
        for (auto const& [k, v] : d.items) {
          if (name == "keys") out.push_back(k);
          else if (name == "values") out.push_back(v);
          else out.push_back(Value::list({k, v}, SeqKind::kTuple));
        }
        step(out.size());
        if (name == "keys") return Value::list(std::move(out), SeqKind::kDictKeys);
        if (name == "values") return Value::list(std::move(out), SeqKind::kDictValues);
        if (name == "items") return Value::list(std::move(out), SeqKind::kDictItems);
        break;
      }
      case Value::Kind::kList: {
        auto const& items = self.list().items;
        if (name == "copy") return Value::list(items, self.list().kind);
        Bound const b(a, {"value", "start", "stop"}, what, 1);
        step(items.size());
        if (name == "count") {
          std::int64_t n = 0;
          for (auto const& v : items) n += py_eq(v, *b[0]);
          return Value::integer(n);
        }
        SliceRange const r = slice_range(static_cast<std::int64_t>(items.size()), b.get(1, Value::none()),
                                         b.get(2, Value::none()), Value::none());
        for (std::int64_t k = 0; k < r.count; ++k)
          if (py_eq(items[static_cast<std::size_t>(r.start + k)], *b[0])) return Value::integer(r.start + k);
        throw Failure{repr_excerpt(*b[0]) + " is not in " + type_name(self)};
      }
      case Value::Kind::kLoop: {
        LoopData& l = self.loop();
        if (name == "cycle") {
          if (a.pos.empty()) throw Failure{"no items for cycling given"};
          return a.pos[l.index0 % a.pos.size()];
        }
        Value const key = Value::list(a.pos, SeqKind::kList);
        if (l.changed_last && py_eq(*l.changed_last, key)) return Value::boolean(false);
        l.changed_last = key;
        return Value::boolean(true);
      }
      default: break;
    }
    throw Failure{what + " is not supported"};
  }

  /// The bounds [start, end) of str methods' optional start/end arguments, in code points.
  static std::pair<std::int64_t, std::int64_t> str_bounds(CodePoints const& cp, Value const* start, Value const* end) {
    SliceRange const r = slice_range(cp.size(), start ? *start : Value::none(), end ? *end : Value::none(), Value::none());
    return {r.start, r.start + r.count};
  }

  Value str_method(Value const& self, std::string const& name, Args const& a, std::string const& what) {
    std::string const& s = self.str();
    bool const markup = self.markup();
    auto const text = [&](std::string v, bool keep) { return make_str(std::move(v), keep && markup); };
    auto const escaped = [&](Value const& v) {  // Markup's methods escape their string arguments
      std::string const& t = want_str(v, what);
      return markup && !v.markup() ? html_escape(t) : t;
    };
    if (name == "upper" || name == "lower" || name == "title" || name == "capitalize" || name == "swapcase") {
      Bound const b(a, {}, what);
      if (name == "upper") return text(to_upper(s), true);
      if (name == "lower") return text(to_lower(s), true);
      if (name == "title") return text(str_title(s), true);
      if (name == "capitalize") return text(capitalize(s), true);
      std::string out(s);
      for (char& c : out) c = c >= 'a' && c <= 'z' ? ascii_upper(c) : ascii_lower(c);
      return text(std::move(out), true);
    }
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      Bound const b(a, {"chars"}, what);
      if (b[0] && !b[0]->is_none()) want_str(*b[0], what);
      return text(std::string(py_strip(s, b[0], name != "rstrip", name != "lstrip")), true);
    }
    if (name == "startswith" || name == "endswith") {
      Bound const b(a, {"prefix", "start", "end"}, what, 1);
      CodePoints cp(s);
      auto const [lo, hi] = str_bounds(cp, b[1], b[2]);
      std::string_view const part = cp.range(lo, std::max(lo, hi));
      std::vector<Value> options;
      if (b[0]->is_string()) options.push_back(*b[0]);
      else if (b[0]->is_list() && b[0]->list().kind == SeqKind::kTuple) options = b[0]->list().items;
      else throw Failure{name + " first arg must be str or a tuple of str, not " + type_name(*b[0])};
      for (auto const& o : options) {
        std::string const& p = want_str(o, what);
        if (name == "startswith" ? part.starts_with(p) : part.ends_with(p)) return Value::boolean(true);
      }
      return Value::boolean(false);
    }
    if (name == "split" || name == "rsplit") {
      Bound const b(a, {"sep", "maxsplit"}, what);
      std::int64_t const maxsplit = b[1] ? want_int(*b[1], what) : -1;
      std::vector<Value> parts;
      if (!b[0] || b[0]->is_none()) {
        for (auto const& p : split_whitespace(s, maxsplit, name == "rsplit")) parts.push_back(text(std::string(p), true));
      } else {
        std::string const& sep = want_str(*b[0], what);
        if (sep.empty()) throw Failure{"empty separator"};
        std::vector<std::string_view> pieces;
        std::string_view rest(s);
        if (name == "split") {
          for (std::int64_t k = 0; maxsplit < 0 || k < maxsplit; ++k) {
            std::size_t const hit = rest.find(sep);
            if (hit == std::string_view::npos) break;
            pieces.push_back(rest.substr(0, hit));
            rest.remove_prefix(hit + sep.size());
          }
          pieces.push_back(rest);
        } else {
          for (std::int64_t k = 0; maxsplit < 0 || k < maxsplit; ++k) {
            std::size_t const hit = rest.rfind(sep);
            if (hit == std::string_view::npos) break;
            pieces.push_back(rest.substr(hit + sep.size()));
            rest = rest.substr(0, hit);
          }
          pieces.push_back(rest);
          std::reverse(pieces.begin(), pieces.end());
        }
        for (auto p : pieces) parts.push_back(text(std::string(p), true));
      }
      step(parts.size());
      return Value::list(std::move(parts));
    }
    if (name == "replace") {
      Bound const b(a, {"old", "new", "count"}, what, 2);
      std::int64_t const count = b[2] ? want_int(*b[2], what) : -1;
      return text(py_replace(s, escaped(*b[0]), escaped(*b[1]), count), true);
    }
    if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count") {
      Bound const b(a, {"sub", "start", "end"}, what, 1);
      std::string const& sub = want_str(*b[0], what);
      CodePoints cp(s);
      auto const [lo, hi] = str_bounds(cp, b[1], b[2]);
      if (hi < lo) return Value::integer(name == "count" ? 0 : -1);
      std::string_view const part = cp.range(lo, hi);
      if (name == "count") {
        if (sub.empty()) return Value::integer(hi - lo + 1);
        std::int64_t n = 0;
        for (std::size_t p = part.find(sub); p != std::string_view::npos; p = part.find(sub, p + sub.size())) ++n;
        return Value::integer(n);
      }
      bool const right = name[0] == 'r';
      std::size_t const hit = right ? part.rfind(sub) : part.find(sub);
      if (hit == std::string_view::npos) {
        if (name.ends_with("index")) throw Failure{"substring not found"};
        return Value::integer(-1);
      }
      return Value::integer(cp.index_of(cp.offset(lo) + hit));
    }
    if (name == "join") {
      Bound const b(a, {"iterable"}, what, 1);
      Value const seq = iterable(*b[0]);
      std::string out;
      std::size_t k = 0;
      for (auto const& item : seq.list().items) {
        if (!item.is_string())
          throw Failure{"sequence item " + std::to_string(k) + ": expected str instance, " + type_name(item) + " found"};
        if (k++) out += s;
        out += item.str();
        check_size(out.size());
      }
      return make_str(std::move(out));
    }
    if (name == "splitlines") {
      Bound const b(a, {"keepends"}, what);
      std::vector<Value> lines;
      for (auto l : splitlines(s, b[0] && truthy(*b[0]))) lines.push_back(text(std::string(l), true));
      step(lines.size());
      return Value::list(std::move(lines));
    }
    if (name == "removeprefix" || name == "removesuffix") {
      Bound const b(a, {"affix"}, what, 1);
      std::string const& x = want_str(*b[0], what);
      if (name == "removeprefix" && std::string_view(s).starts_with(x)) return text(s.substr(x.size()), true);
      if (name == "removesuffix" && !x.empty() && std::string_view(s).ends_with(x))
        return text(s.substr(0, s.size() - x.size()), true);
      return self;
    }
    if (name == "partition" || name == "rpartition") {
      Bound const b(a, {"sep"}, what, 1);
      std::string const& sep = want_str(*b[0], what);
      if (sep.empty()) throw Failure{"empty separator"};
      std::size_t const hit = name == "partition" ? s.find(sep) : s.rfind(sep);
      std::vector<Value> parts;
      if (hit == std::string::npos) {
        parts = name == "partition" ? std::vector<Value>{self, text({}, true), text({}, true)}
                                    : std::vector<Value>{text({}, true), text({}, true), self};
      } else {
        parts = {text(s.substr(0, hit), true), text(sep, true), text(s.substr(hit + sep.size()), true)};
      }
      return Value::list(std::move(parts), SeqKind::kTuple);
    }
    if (name == "center" || name == "ljust" || name == "rjust" || name == "zfill") {
      Bound const b(a, {"width", "fillchar"}, what, 1);
      std::int64_t const width = want_int(*b[0], what);
      std::string fill = " ";
      if (b[1]) {
        fill = want_str(*b[1], what);
        if (utf8_length(fill) != 1) throw Failure{"The fill character must be exactly one character long"};
      }
      std::int64_t const len = utf8_length(s);
      if (width <= len) return self;
      check_size(static_cast<std::size_t>(std::min<std::int64_t>(width - len, INT32_MAX)) * fill.size() + s.size());
      std::int64_t const pad = width - len;
      std::int64_t left = 0;
      if (name == "center") left = pad / 2 + (pad & width & 1);
      else if (name == "rjust") left = pad;
      else if (name == "zfill") {
        std::size_t const sign = !s.empty() && (s[0] == '+' || s[0] == '-') ? 1 : 0;
        return text(s.substr(0, sign) + std::string(static_cast<std::size_t>(pad), '0') + s.substr(sign), false);
      }
      std::string out;
      for (std::int64_t k = 0; k < left; ++k) out += fill;
      out += s;
      for (std::int64_t k = left; k < pad; ++k) out += fill;
      return text(std::move(out), false);
    }
    if (name.starts_with("is") && name != "isascii" && name != "isidentifier" && name != "isprintable" &&
        name != "istitle") {
      Bound const b(a, {}, what);
      return Value::boolean(str_is(name, s));
    }
    throw Failure{"str." + name + "() is not supported"};
  }

  /// str.isalpha() and friends; letters beyond ASCII count as alphabetic and cased as
  /// neither upper nor lower.
  static bool str_is(std::string const& name, std::string const& s) {
    if (name == "islower" || name == "isupper") {
      bool cased = false;
      for (char c : s) {
        if (!ascii_alpha(c)) continue;
        if ((name == "islower") != (c >= 'a' && c <= 'z')) return false;
        cased = true;
      }
      return cased;
    }
    if (s.empty()) return false;
    for (std::size_t i = 0; i < s.size();) {
      std::size_t len = 1;
      char32_t const c = utf8_at(s, i, len);
      i += len;
      bool const digit = c >= '0' && c <= '9';
      bool const alpha = (c < 0x80 && ascii_alpha(static_cast<char>(c))) || (c >= 0x80 && !py_isspace(c));
      bool ok = false;
      if (name == "isspace") ok = py_isspace(c);
      else if (name == "isalpha") ok = alpha;
      else if (name == "isalnum") ok = alpha || digit;
      else ok = digit;  // isdigit, isdecimal, isnumeric
      if (!ok) return false;
    }
    return true;
  }

  /// str.split() / str.rsplit() without a separator: runs of whitespace, none at the ends.
  static std::vector<std::string_view> split_whitespace(std::string_view s, std::int64_t maxsplit, bool from_right) {
    std::vector<std::string_view> parts;
    if (!from_right) {
      std::string_view rest = py_strip(s, nullptr, true, false);
      while (!rest.empty()) {
        if (maxsplit >= 0 && static_cast<std::int64_t>(parts.size()) == maxsplit) {
          parts.push_back(rest);
          break;
        }
        std::size_t i = 0;
        while (i < rest.size() && !space_at(rest, i)) {
          std::size_t len = 1;
          utf8_at(rest, i, len);
          i += len;
        }
        parts.push_back(rest.substr(0, i));
        rest = py_strip(rest.substr(i), nullptr, true, false);
      }
      return parts;
    }
    std::string_view rest = py_strip(s, nullptr, false, true);
    while (!rest.empty()) {
      if (maxsplit >= 0 && static_cast<std::int64_t>(parts.size()) == maxsplit) {
        parts.push_back(rest);
        break;
      }
      std::size_t j = rest.size();
      while (j > 0) {
        std::size_t start = j - 1;
        while (start > 0 && (static_cast<unsigned char>(rest[start]) & 0xC0) == 0x80) --start;
        if (space_at(rest, start)) break;
        j = start;
      }
      parts.push_back(rest.substr(j));
      rest = py_strip(rest.substr(0, j), nullptr, false, true);
    }
    std::reverse(parts.begin(), parts.end());
    return parts;
  }

  // --- filters and tests: declared here, defined below ---

  Value filter(Filter f, std::string_view name, Value const& v, Args const& a);
  bool test(Test t, Value const& v, Args const& a);
  static Value round_common(Value const& v, std::int64_t precision);

  /// The items `v` iterates; `keep` holds them alive.
  std::vector<Value> const& items_of(Value const& v, Value& keep) {
    keep = iterable(v);
    return keep.list().items;
  }

  /// Python's sorted(items, key=key, reverse=reverse): keys computed once, stable.
  template <class Key>
  void sort_values(std::vector<Value>& items, bool reverse, Key key) {
    std::vector<std::pair<Value, std::size_t>> keyed;
    keyed.reserve(items.size());
    for (std::size_t i = 0; i < items.size(); ++i) keyed.emplace_back(key(items[i]), i);
    step(items.size() * 8);
    std::stable_sort(keyed.begin(), keyed.end(), [&](auto const& x, auto const& y) {
      auto const c = py_order(x.first, y.first, "<");
      return c && (reverse ? *c > 0 : *c < 0);
    });
    std::vector<Value> sorted;
    sorted.reserve(items.size());
    for (auto const& k : keyed) sorted.push_back(items[k.second]);
    items = std::move(sorted);
  }

  Value filter_by_name(Value const& name, Value const& v, Args const& a) {
    Filter const* f = name.is_string() ? find_filter(name.str()) : nullptr;
    if (!f) throw Failure{"No filter named " + repr_excerpt(name) + "."};
    return filter(*f, name.str(), v, a);
  }
  bool test_by_name(Value const& name, Value const& v, Args const& a) {
    Test const* t = name.is_string() ? find_test(name.str()) : nullptr;
    if (!t) throw Failure{"No test named " + repr_excerpt(name) + "."};
    return test(*t, v, a);
  }

  /// The filters jinja2 writes as generators: their body runs only when read, so an error in
  /// it is raised by whatever reads past the items made before it, not by the filter.
  Value generator(Filter f, std::string const& what, Value const& v, Args const& a);

  /// jinja2's make_attrgetter: `attribute` is a dotted path ("a.b", "0.c") looked up with
  /// getitem; `fallback` replaces an undefined result.
  Value attr_path(Value item, Value const& attribute, Value const* fallback) const {
    std::vector<Value> parts;
    if (attribute.is_string()) {
      std::string_view rest(attribute.str());
      for (;;) {
        std::size_t const dot = rest.find('.');
        std::string_view const part = rest.substr(0, dot);
        bool const digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
        if (digits) {
          std::int64_t k = 0;
          std::from_chars(part.data(), part.data() + part.size(), k);
          parts.push_back(Value::integer(k));
        } else {
          parts.push_back(Value::string(std::string(part)));
        }
        if (dot == std::string_view::npos) break;
        rest.remove_prefix(dot + 1);
      }
    } else if (!attribute.is_none()) {
      parts.push_back(attribute);
    }
    for (auto const& p : parts) {
      item = get_item(item, p);
      if (fallback && item.is_undefined()) item = *fallback;
    }
    return item;
  }

  static Value ignore_case(Value const& v) { return v.is_string() ? Value::string(to_lower(v.str())) : v; }

  SourceMap const& map_;
  Limits const& lim_;
  DictData const& context_;
  std::string* out_ = nullptr;
  std::size_t live_bytes_ = 0;  // bytes in the output and in every capture under way
  std::uint64_t steps_ = 0;
  int depth_ = 0;
  int calls_ = 0;
  std::vector<Value> block_values_;  // the bodies of the filter blocks being filtered
  std::vector<std::shared_ptr<Scope>> captured_;
  std::vector<std::shared_ptr<NamespaceData>> namespaces_;
};


/// Python's float(str): surrounding whitespace, underscores between digits, inf and nan.
inline std::optional<double> parse_float(std::string_view s) {
  s = py_strip(s, nullptr, true, true);
  std::string t;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '_') {
      bool const ok = i > 0 && i + 1 < s.size() && std::isdigit(static_cast<unsigned char>(s[i - 1])) &&
                      std::isdigit(static_cast<unsigned char>(s[i + 1]));
      if (!ok) return std::nullopt;
      continue;
    }
    t += s[i];
  }
  std::string_view body(t);
  bool const negative = !body.empty() && body[0] == '-';
  if (!body.empty() && (body[0] == '-' || body[0] == '+')) body.remove_prefix(1);
  std::string const lower = to_lower(body);
  if (lower == "inf" || lower == "infinity") return negative ? -HUGE_VAL : HUGE_VAL;
  if (lower == "nan") return std::nan("");
  if (body.empty() || !(std::isdigit(static_cast<unsigned char>(body[0])) || body[0] == '.')) return std::nullopt;
  double v = 0;
  auto const r = std::from_chars(body.data(), body.data() + body.size(), v);
  if (r.ptr != body.data() + body.size()) return std::nullopt;
  if (r.ec == std::errc::result_out_of_range) {
    std::size_t const e = lower.find('e');
    v = e != std::string::npos && lower[e + 1] == '-' ? 0.0 : HUGE_VAL;
  }
  return negative ? -v : v;
}

/// Python's int(str, base) for base 0 (the literal's own prefix) and 2 to 36: whitespace, a
/// sign, a 0x/0o/0b prefix matching the base, underscores between digits.
inline std::optional<std::int64_t> parse_int(std::string_view s, std::int64_t base) {
  s = py_strip(s, nullptr, true, true);
  bool negative = false;
  if (!s.empty() && (s[0] == '-' || s[0] == '+')) {
    negative = s[0] == '-';
    s.remove_prefix(1);
  }
  if (s.size() > 2 && s[0] == '0') {
    char const p = ascii_lower(s[1]);
    std::int64_t const prefixed = p == 'x' ? 16 : p == 'o' ? 8 : p == 'b' ? 2 : 0;
    if (prefixed != 0 && (base == 0 || base == prefixed)) {
      base = prefixed;
      s.remove_prefix(s[2] == '_' ? 3 : 2);
    }
  }
  if (base == 0) {  // decimal, where a leading 0 allows only zeros
    base = 10;
    if (s.size() > 1 && s[0] == '0' && s.find_first_not_of("0_") != std::string_view::npos) return std::nullopt;
  }
  if (s.empty() || s.front() == '_' || s.back() == '_') return std::nullopt;
  std::int64_t v = 0;
  char prev = 0;
  for (char c : s) {
    if (c == '_') {
      if (prev == '_') return std::nullopt;
      prev = c;
      continue;
    }
    prev = c;
    int const d = std::isdigit(static_cast<unsigned char>(c)) ? c - '0'
                  : std::isalpha(static_cast<unsigned char>(c)) ? ascii_lower(c) - 'a' + 10 : 99;
    if (d >= base) return std::nullopt;
    v = add_int(mul_int(v, base), d);
  }
  return negative ? -v : v;
}

inline Value Renderer::filter(Filter f, std::string_view name, Value const& v, Args const& a) {
  std::string const what = "filter '" + std::string(name) + "'";
  Value keep;  // what seq() returned last stays alive in it
  auto const seq = [&](Value const& x) -> std::vector<Value> const& { return items_of(x, keep); };
  switch (f) {
    case Filter::kAbs: {
      Bound const b(a, {}, what);
      if (v.is_float()) return Value::number(std::fabs(v.as_float()));
      if (v.is_integral()) return Value::integer(v.as_int() < 0 ? neg_int(v.as_int()) : v.as_int());
      throw Failure{"bad operand type for abs(): '" + type_name(v) + "'"};
    }
    case Filter::kAttr: {
      Bound const b(a, {"name"}, what, 1);
      if (v.is_undefined()) fail_undefined(v);
      std::string const attr = str_of(*b[0]);
      if (auto x = attribute(v, attr)) return *x;
      return no_attribute(v, attr);
    }
    case Filter::kBatch:
    case Filter::kItems:
    case Filter::kMap:
    case Filter::kReject:
    case Filter::kRejectattr:
    case Filter::kSelect:
    case Filter::kSelectattr:
    case Filter::kUnique: return generator(f, what, v, a);
    case Filter::kCapitalize: {
      Bound const b(a, {}, what);
      Value const s = soft_str(v);
      return make_str(capitalize(s.str()), s.markup());
    }
    case Filter::kCenter: {
      Bound const b(a, {"width"}, what);
      Args const width{{b.get(0, Value::integer(80))}, {}};
      return str_method(soft_str(v), "center", width, what);
    }
    case Filter::kCount:
    case Filter::kLength: {
      Bound const b(a, {}, what);
      return Value::integer(py_len(v));
    }
    case Filter::kDefault: {
      Bound const b(a, {"default_value", "boolean"}, what);
      bool const boolean = b[1] && truthy(*b[1]);
      if (v.is_undefined() || (boolean && !truthy(v))) return b.get(0, Value::string({}));
      return v;
    }
    case Filter::kDictsort: {
      Bound const b(a, {"case_sensitive", "by", "reverse"}, what);
      if (v.is_undefined()) fail_undefined(v);
      if (!v.is_dict()) throw Failure{"'" + type_name(v) + "' object has no attribute 'items'"};
      bool const case_sensitive = b[0] && truthy(*b[0]);
      std::size_t pos = 0;
      if (b[1]) {
        if (b[1]->is_string() && b[1]->str() == "value") pos = 1;
        else if (!b[1]->is_string() || b[1]->str() != "key")
          throw Failure{"You can only sort by either \"key\" or \"value\""};
      }
      std::vector<Value> items;
      for (auto const& [k, x] : v.dict().items) items.push_back(Value::list({k, x}, SeqKind::kTuple));
      sort_values(items, b[2] && want_int(*b[2], what) != 0, [&](Value const& item) {
        Value const& key = item.list().items[pos];
        return case_sensitive ? key : ignore_case(key);
      });
      return Value::list(std::move(items));
    }
    case Filter::kEscape: {
      Bound const b(a, {}, what);
      return v.markup() ? v : make_str(html_escape(str_of(v)), true);
    }
    case Filter::kFirst: {
      Bound const b(a, {}, what);
      if (v.is_list() && v.list().failure && !v.list().items.empty()) return v.list().items.front();
      auto const& items = seq(v);
      return items.empty() ? Value::undefined("No first item, sequence was empty.") : items.front();
    }
    case Filter::kFloat: {
      Bound const b(a, {"default"}, what);
      if (v.is_undefined()) fail_undefined(v);
      if (v.is_number()) return Value::number(v.as_float());
      if (v.is_string())
        if (auto x = parse_float(v.str())) return Value::number(*x);
      return b.get(0, Value::number(0.0));
    }
    case Filter::kIndent: {
      Bound const b(a, {"width", "first", "blank"}, what);
      std::string indention = "    ";
      if (b[0]) indention = b[0]->is_string() ? b[0]->str() : std::string(static_cast<std::size_t>(std::max<std::int64_t>(0, want_int(*b[0], what))), ' ');
      check_size(indention.size());
      Value const s = soft_str(v);
      std::string const text = s.str() + "\n";
      auto const lines = splitlines(text, false);
      std::string out;
      if (b[2] && truthy(*b[2])) {
        for (std::size_t i = 0; i < lines.size(); ++i) {
          if (i) out += "\n" + indention;
          out += lines[i];
          check_size(out.size());
        }
      } else {
        out = std::string(lines.empty() ? std::string_view() : lines[0]);
        for (std::size_t i = 1; i < lines.size(); ++i) {
          out += "\n";
          if (!lines[i].empty()) out += indention;
          out += lines[i];
          check_size(out.size());
        }
      }
      if (b[1] && truthy(*b[1])) out = indention + out;
      return make_str(std::move(out), s.markup());
    }
    case Filter::kInt: {
      Bound const b(a, {"default", "base"}, what);
      Value const fallback = b.get(0, Value::integer(0));
      std::int64_t const base = b[1] ? want_int(*b[1], what) : 10;
      if (v.is_undefined()) fail_undefined(v);
      if (v.is_integral()) return Value::integer(v.as_int());
      auto const from_float = [&](double x) {
        if (std::isinf(x)) throw Failure{"cannot convert float infinity to integer"};
        if (std::isnan(x)) return fallback;
        if (!(x > -9.3e18 && x < 9.3e18)) throw Failure{"integer overflow (Python would make a big integer; this engine has 64 bits)"};
        return Value::integer(static_cast<std::int64_t>(x));
      };
      if (v.is_float()) return from_float(v.as_float());
      if (v.is_string()) {
        if (base == 0 || (base >= 2 && base <= 36))  // another base is a ValueError there, and caught
          if (auto x = parse_int(v.str(), base)) return Value::integer(*x);
        if (auto x = parse_float(v.str())) return from_float(*x);
      }
      return fallback;
    }
    case Filter::kJoin: {
      Bound const b(a, {"d", "attribute"}, what);
      std::string const sep = b[0] ? str_of(*b[0]) : std::string();
      std::string out;
      Printer print(out, lim_.max_output);
      bool first = true;
      for (auto const& item : seq(v)) {
        step();
        if (!first) out += sep;
        first = false;
        print.str(b[1] ? attr_path(item, *b[1], nullptr) : item);
      }
      return make_str(std::move(out));
    }
    case Filter::kLast: {
      Bound const b(a, {}, what);
      if (v.is_list() && v.list().kind == SeqKind::kIterator) throw Failure{"'generator' object is not reversible"};
      auto const& items = seq(v);
      return items.empty() ? Value::undefined("No last item, sequence was empty.") : items.back();
    }
    case Filter::kList: {
      Bound const b(a, {}, what);
      return Value::list(seq(v));
    }
    case Filter::kLower:
    case Filter::kUpper: {
      Bound const b(a, {}, what);
      Value const s = soft_str(v);
      return make_str(f == Filter::kLower ? to_lower(s.str()) : to_upper(s.str()), s.markup());
    }
    case Filter::kMax:
    case Filter::kMin: {
      Bound const b(a, {"case_sensitive", "attribute"}, what);
      auto const& items = seq(v);
      if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
      bool const case_sensitive = b[0] && truthy(*b[0]);
      Value const attribute = b.get(1, Value::none());
      auto const key = [&](Value const& item) {
        Value k = attr_path(item, attribute, nullptr);
        return case_sensitive ? k : ignore_case(k);
      };
      std::size_t best = 0;
      Value best_key = key(items[0]);
      for (std::size_t i = 1; i < items.size(); ++i) {
        step();
        Value k = key(items[i]);
        auto const c = py_order(k, best_key, f == Filter::kMin ? "<" : ">");
        if (c && (f == Filter::kMin ? *c < 0 : *c > 0)) {
          best = i;
          best_key = std::move(k);
        }
      }
      return items[best];
    }
    case Filter::kReplace: {
      Bound const b(a, {"old", "new", "count"}, what, 2);
      std::int64_t const count = b[2] && !b[2]->is_none() ? want_int(*b[2], what) : -1;
      std::string const s = str_of(v);
      std::string const with = str_of(*b[1]);
      std::string const old = str_of(*b[0]);
      if (!old.empty() && !with.empty() && with.size() > old.size())
        check_size(s.size() + (with.size() - old.size()) * (s.size() / old.size()));
      if (old.empty()) check_size(s.size() + with.size() * (static_cast<std::size_t>(utf8_length(s)) + 1));
      return make_str(py_replace(s, old, with, count));
    }
    case Filter::kReverse: {
      Bound const b(a, {}, what);
      if (v.is_string()) {
        CodePoints cp(v.str());
        std::string out;
        for (std::int64_t i = cp.size() - 1; i >= 0; --i) out += cp.at(i);
        return make_str(std::move(out), v.markup());
      }
      auto const& items = seq(v);
      if (v.is_list() && v.list().kind == SeqKind::kIterator)  // not reversible: made a list
        return Value::list(std::vector<Value>(items.rbegin(), items.rend()));
      step(items.size());
      return Value::list(std::vector<Value>(items.rbegin(), items.rend()), SeqKind::kIterator);
    }
    case Filter::kRound: {
      Bound const b(a, {"precision", "method"}, what);
      std::int64_t const precision = b[0] ? want_int(*b[0], what) : 0;
      std::string const method = b[1] ? want_str(*b[1], what) : "common";
      if (method != "common" && method != "ceil" && method != "floor")
        throw Failure{"method must be common, ceil or floor"};
      if (v.is_undefined()) throw Failure{"type Undefined doesn't define __round__ method"};
      if (!v.is_number()) throw Failure{"type " + type_name(v) + " doesn't define __round__ method"};
      if (method == "common") return round_common(v, precision);
      double const scale = std::pow(10.0, static_cast<double>(precision));
      double const x = v.as_float() * scale;
      return Value::number((method == "ceil" ? std::ceil(x) : std::floor(x)) / scale);
    }
    case Filter::kSafe: {
      Bound const b(a, {}, what);
      return v.markup() ? v : make_str(str_of(v), true);
    }
    case Filter::kSort: {
      Bound const b(a, {"reverse", "case_sensitive", "attribute"}, what);
      bool const case_sensitive = b[1] && truthy(*b[1]);
      std::vector<Value> attrs;  // "a,b" sorts by a, then b
      if (b[2] && b[2]->is_string()) {
        std::string_view rest(b[2]->str());
        for (std::size_t comma; (comma = rest.find(',')) != std::string_view::npos; rest.remove_prefix(comma + 1))
          attrs.push_back(Value::string(std::string(rest.substr(0, comma))));
        attrs.push_back(Value::string(std::string(rest)));
      } else if (b[2] && !b[2]->is_none()) {
        attrs.push_back(*b[2]);
      }
      bool const reverse = b[0] && want_int(*b[0], what) != 0;  // sorted() wants an int
      std::vector<Value> items = seq(v);
      sort_values(items, reverse, [&](Value const& item) {
        if (attrs.empty()) return case_sensitive ? item : ignore_case(item);
        std::vector<Value> keys;
        for (auto const& attr : attrs) {
          Value k = attr_path(item, attr, nullptr);
          keys.push_back(case_sensitive ? k : ignore_case(k));
        }
        return attrs.size() == 1 ? keys[0] : Value::list(std::move(keys));
      });
      return Value::list(std::move(items));
    }
    case Filter::kString: {
      Bound const b(a, {}, what);
      return v.is_string() ? v : make_str(str_of(v));
    }
    case Filter::kSum: {
      Bound const b(a, {"attribute", "start"}, what);
      Value total = b.get(1, Value::integer(0));
      for (auto const& item : seq(v)) {
        step();
        total = binary(Op::kAdd, total, b[0] ? attr_path(item, *b[0], nullptr) : item);
      }
      return total;
    }
    case Filter::kTitle: {
      Bound const b(a, {}, what);
      Value const s = soft_str(v);
      std::string out(s.str());
      bool boundary = true;  // jinja2 splits words at runs of [-\s({[<]
      for (std::size_t i = 0; i < out.size();) {
        std::size_t len = 1;
        char32_t const c = utf8_at(out, i, len);
        bool const sep = py_isspace(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
        if (len == 1 && !sep) out[i] = boundary ? ascii_upper(out[i]) : ascii_lower(out[i]);
        boundary = sep;
        i += len;
      }
      return make_str(std::move(out), s.markup());
    }
    case Filter::kTojson: {
      Bound const b(a, {"ensure_ascii", "indent", "separators", "sort_keys"}, what);
      JsonStyle st;
      st.ensure_ascii = b[0] && truthy(*b[0]);
      if (b[1] && !b[1]->is_none()) {
        st.pretty = true;
        st.item_sep = ",";
        if (b[1]->is_string()) st.indent = b[1]->str();
        else st.indent = std::string(static_cast<std::size_t>(std::clamp<std::int64_t>(want_int(*b[1], what), 0, 256)), ' ');
      }
      if (b[2] && !b[2]->is_none()) {
        Value const& sep = *b[2];
        if (!sep.is_list() || sep.list().items.size() != 2 || !sep.list().items[0].is_string() ||
            !sep.list().items[1].is_string())
          throw Failure{"separators must be a pair of strings"};
        st.item_sep = sep.list().items[0].str();
        st.key_sep = sep.list().items[1].str();
      }
      st.sort_keys = b[3] && truthy(*b[3]);
      std::string out;
      append_json(out, v, st, lim_.max_output);
      return make_str(std::move(out));
    }
    case Filter::kTrim: {
      Bound const b(a, {"chars"}, what);
      Value const s = soft_str(v);
      if (b[0] && !b[0]->is_none()) want_str(*b[0], what);
      return make_str(std::string(py_strip(s.str(), b[0], true, true)), s.markup());
    }
  }
  return Value();
}

inline Value Renderer::generator(Filter f, std::string const& what, Value const& v, Args const& a) {
  // Arguments are bound when the filter is called; the body runs as the generator is read.
  std::optional<Bound> b;
  if (f == Filter::kBatch) b.emplace(a, std::initializer_list<std::string_view>{"linecount", "fill_with"}, what, 1);
  if (f == Filter::kItems) b.emplace(a, std::initializer_list<std::string_view>{}, what);
  if (f == Filter::kUnique) b.emplace(a, std::initializer_list<std::string_view>{"case_sensitive", "attribute"}, what);
  std::vector<Value> out;
  Value keep;
  try {
    switch (f) {
      case Filter::kBatch: {
        std::int64_t const n = want_int(*(*b)[0], what);
        std::vector<Value> row;
        for (auto const& item : items_of(v, keep)) {
          step();
          if (static_cast<std::int64_t>(row.size()) == n) {
            out.push_back(Value::list(std::move(row)));
            row.clear();
          }
          row.push_back(item);
        }
        if (!row.empty()) {
          if ((*b)[1] && !(*b)[1]->is_none())
            while (static_cast<std::int64_t>(row.size()) < n) row.push_back(*(*b)[1]);
          out.push_back(Value::list(std::move(row)));
        }
        break;
      }
      case Filter::kItems:
        if (v.is_undefined()) break;
        if (!v.is_dict()) throw Failure{"Can only get item pairs from a mapping."};
        for (auto const& [k, x] : v.dict().items) out.push_back(Value::list({k, x}, SeqKind::kTuple));
        step(out.size());
        break;
      case Filter::kMap: {
        if (!truthy(v)) break;
        if (a.pos.empty()) {
          Value const* attribute = nullptr;
          Value const* fallback = nullptr;
          for (auto const& [k, x] : a.kw) {
            if (k == "attribute") attribute = &x;
            else if (k == "default") fallback = &x;
            else throw Failure{"Unexpected keyword argument '" + k + "'"};
          }
          if (!attribute) throw Failure{"map requires a filter argument"};
          for (auto const& item : items_of(v, keep)) {
            step();
            out.push_back(attr_path(item, *attribute, fallback && !fallback->is_none() ? fallback : nullptr));
          }
        } else {
          Args const rest{std::vector<Value>(a.pos.begin() + 1, a.pos.end()), a.kw};
          for (auto const& item : items_of(v, keep)) {
            step();
            out.push_back(filter_by_name(a.pos[0], item, rest));
          }
        }
        break;
      }
      case Filter::kReject:
      case Filter::kSelect:
      case Filter::kRejectattr:
      case Filter::kSelectattr: {
        if (!truthy(v)) break;
        bool const by_attr = f == Filter::kRejectattr || f == Filter::kSelectattr;
        bool const keep_if = f == Filter::kSelect || f == Filter::kSelectattr;
        if (by_attr && a.pos.empty()) throw Failure{"Missing parameter for attribute name"};
        std::size_t const off = by_attr ? 1 : 0;
        Value const* test_name = a.pos.size() > off ? &a.pos[off] : nullptr;
        Args const rest{std::vector<Value>(a.pos.begin() + static_cast<std::ptrdiff_t>(std::min(a.pos.size(), off + 1)),
                                           a.pos.end()),
                        a.kw};
        for (auto const& item : items_of(v, keep)) {
          step();
          Value const x = by_attr ? attr_path(item, a.pos[0], nullptr) : item;
          bool const pass = test_name ? test_by_name(*test_name, x, rest) : truthy(x);
          if (pass == keep_if) out.push_back(item);
        }
        break;
      }
      case Filter::kUnique: {
        bool const case_sensitive = (*b)[0] && truthy(*(*b)[0]);
        Value const attribute = b->get(1, Value::none());
        std::vector<Value> seen;
        for (auto const& item : items_of(v, keep)) {
          Value key = attr_path(item, attribute, nullptr);
          if (!case_sensitive) key = ignore_case(key);
          if (!hashable(key)) throw Failure{"unhashable type: '" + type_name(key) + "'"};
          step(seen.size() + 1);
          if (std::none_of(seen.begin(), seen.end(), [&](Value const& x) { return py_eq(x, key); })) {
            seen.push_back(std::move(key));
            out.push_back(item);
          }
        }
        break;
      }
      default: break;
    }
  } catch (Failure const& e) {
    return Value::failed_iterator(std::move(out), e.message);
  }
  return Value::list(std::move(out), SeqKind::kIterator);
}

/// Python's round(x, n): correctly rounded, ties to even; an int stays an int.
inline Value Renderer::round_common(Value const& v, std::int64_t precision) {
  if (v.is_integral()) {
    if (precision >= 0) return Value::integer(v.as_int());
    if (precision < -18) return Value::integer(0);
    std::int64_t p = 1;
    for (std::int64_t k = 0; k < -precision; ++k) p *= 10;
    std::int64_t const x = v.as_int();
    std::int64_t q = floor_div(x, p);
    std::int64_t const r = x - q * p;
    if (2 * r > p || (2 * r == p && (q & 1))) ++q;
    return Value::integer(mul_int(q, p));
  }
  double const x = v.as_float();
  if (!std::isfinite(x) || precision > 330) return Value::number(x);
  if (precision < 0) {
    double const p = std::pow(10.0, static_cast<double>(-precision));
    return Value::number(std::nearbyint(x / p) * p);
  }
  char buf[512];
  std::snprintf(buf, sizeof buf, "%.*f", static_cast<int>(precision), x);
  double r = 0;
  std::from_chars(buf, buf + std::strlen(buf), r);
  return Value::number(r);
}

inline bool Renderer::test(Test t, Value const& v, Args const& a) {
  std::string const what = "test";
  auto const arg = [&](std::string_view name) -> Value const& { return *Bound(a, {name}, what, 1)[0]; };
  auto const none = [&] { Bound const b(a, {}, what); };
  auto const mod = [&](Value const& n) { return binary(Op::kMod, v, n); };
  switch (t) {
    case Test::kBoolean: none(); return v.is_bool();
    case Test::kCallable: none(); return v.kind() == Value::Kind::kCallable || v.kind() == Value::Kind::kLoop || v.is_undefined();
    case Test::kDefined: none(); return !v.is_undefined();
    case Test::kUndefined: none(); return v.is_undefined();
    case Test::kDivisibleby: return py_eq(mod(arg("num")), Value::integer(0));
    case Test::kEven: none(); return py_eq(mod(Value::integer(2)), Value::integer(0));
    case Test::kOdd: none(); return py_eq(mod(Value::integer(2)), Value::integer(1));
    case Test::kEq: return compare(Op::kEq, v, arg("other"));
    case Test::kNe: return compare(Op::kNe, v, arg("other"));
    case Test::kLt: return compare(Op::kLt, v, arg("other"));
    case Test::kLe: return compare(Op::kLe, v, arg("other"));
    case Test::kGt: return compare(Op::kGt, v, arg("other"));
    case Test::kGe: return compare(Op::kGe, v, arg("other"));
    case Test::kIn: return contains(arg("seq"), v);
    case Test::kEscaped: none(); return v.markup();
    case Test::kFalse: none(); return v.is_bool() && !v.as_bool();
    case Test::kTrue: none(); return v.is_bool() && v.as_bool();
    case Test::kFilter:
      none();
      return v.is_string() && (find_filter(v.str()) != nullptr || one_of(kUnsupportedFilters, v.str()));
    case Test::kTest: none(); return v.is_string() && find_test(v.str()) != nullptr;
    case Test::kFloat: none(); return v.is_float();
    case Test::kInteger: none(); return v.is_int();
    case Test::kNumber: none(); return v.is_number();
    case Test::kNone: none(); return v.is_none();
    case Test::kString: none(); return v.is_string();
    case Test::kMapping: none(); return v.is_dict();
    case Test::kIterable:
      none();
      return v.is_undefined() || v.is_string() || v.is_list() || v.is_dict() || v.kind() == Value::Kind::kLoop;
    case Test::kSequence:
      none();
      return v.is_undefined() || v.is_string() || v.is_dict() ||
             (v.is_list() && (v.list().kind == SeqKind::kList || v.list().kind == SeqKind::kTuple));
    case Test::kLower:
    case Test::kUpper: {
      none();
      return str_is(t == Test::kLower ? "islower" : "isupper", str_of(v));
    }
    case Test::kSameas: {
      Value const& other = arg("other");
      if (v.kind() != other.kind()) return false;
      if (v.is_none() || v.is_undefined()) return v.is_none();
      if (v.is_bool()) return v.as_bool() == other.as_bool();
      if (v.is_int()) return v.as_int() == other.as_int() && v.as_int() >= -5 && v.as_int() <= 256;
      return v.identity() != nullptr && v.identity() == other.identity();
    }
  }
  return false;
}

}  // namespace detail
}  // namespace qflash::io::jinja
