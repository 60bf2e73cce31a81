/// @file
/// Reading JSON files (HF config.json, generation_config.json, model.safetensors.index.json)
/// with errors that name the file, the field and what was expected, e.g.
/// `/m/config.json: field 'text_config.hidden_size' must be a positive integer, got "abc"`.
/// Host only; uses nlohmann-json.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "qflash/core/error.hpp"
#include "qflash/core/mapped_file.hpp"

namespace qflash::io {

using Json = nlohmann::json;

namespace detail {
/// Writes `v` to `out` until it holds `limit` characters. Containers are walked one element
/// at a time and every level writes at least one character, so the recursion is at most
/// `limit` deep however deeply the value nests.
inline void write_excerpt(Json const& v, std::string& out, std::size_t limit) {
  if (out.size() >= limit) return;
  if (v.is_object() || v.is_array()) {
    out += v.is_object() ? '{' : '[';
    bool first = true;
    for (auto it = v.begin(); it != v.end() && out.size() < limit; ++it, first = false) {
      if (!first) out += ',';
      if (v.is_object()) out += Json(it.key()).dump(-1, ' ', false, Json::error_handler_t::replace) + ':';
      write_excerpt(*it, out, limit);
    }
    out += v.is_object() ? '}' : ']';
    return;
  }
  out += v.dump(-1, ' ', false, Json::error_handler_t::replace);
}
}  // namespace detail

/// A short printable form of a JSON value for error messages (at most 80 characters).
inline std::string json_excerpt(Json const& v) {
  constexpr std::size_t kLimit = 80;
  std::string s;
  detail::write_excerpt(v, s, kLimit);
  if (s.size() > kLimit) s = s.substr(0, kLimit - 3) + "...";
  return s;
}

/// Parses `text`, the contents of `file`; throws Error naming the file and where parsing failed.
inline Json parse_json(std::string_view text, std::string const& file) {
  try {
    return Json::parse(text.begin(), text.end());
  } catch (Json::exception const& e) {
    QFLASH_FAIL(file, ": invalid JSON: ", e.what());
  }
}

/// Reads and parses a JSON file; throws Error naming the file when it cannot be read or parsed.
inline Json read_json_file(std::string const& path) {
  MappedFile f(path);
  auto b = f.bytes();
  return parse_json(std::string_view(reinterpret_cast<char const*>(b.data()), b.size()), path);
}

/// A JSON object plus where it came from, with typed field access. Every accessor throws Error
/// naming the file and the dotted field path (`prefix` + key) and saying what was expected.
/// Accessors with a fallback use it only when the key is absent, and record the key in
/// `defaulted()` so the caller can report which reference defaults were applied. A null is
/// absent only where transformers reads None as "not set" (booleans, lists, token ids); a
/// null integer, number or string is an error, as it would be there.
class JsonFields {
 public:
  /// `prefix` is the dotted path of `object` inside the file ("" for the top level,
  /// "text_config." for a nested one); `object` must outlive this.
  JsonFields(Json const& object, std::string file, std::string prefix = {})
      : j_(&object), file_(std::move(file)), prefix_(std::move(prefix)) {
    QFLASH_CHECK(j_->is_object(), file_, ": ",
                 prefix_.empty() ? std::string("the top level")
                                 : "field '" + prefix_.substr(0, prefix_.size() - 1) + "'",
                 " must be a JSON object, got ", json_excerpt(*j_));
  }

  [[nodiscard]] Json const& json() const { return *j_; }
  [[nodiscard]] std::string const& file() const { return file_; }
  [[nodiscard]] std::string field(std::string_view key) const {
    return prefix_ + std::string(key);
  }
  /// Keys whose fallback was used, in the order they were read.
  [[nodiscard]] std::vector<std::string> const& defaulted() const { return defaulted_; }

  /// The value at `key`, or nullptr when it is absent or null.
  [[nodiscard]] Json const* find(std::string_view key) const {
    auto it = j_->find(key);
    if (it == j_->end() || it->is_null()) return nullptr;
    return &*it;
  }
  [[nodiscard]] bool has(std::string_view key) const { return find(key) != nullptr; }
  /// True when the key is present, even as null.
  [[nodiscard]] bool contains(std::string_view key) const { return j_->contains(key); }

  [[noreturn]] void fail(std::string_view key, std::string_view expected) const {
    auto it = j_->find(key);
    if (it == j_->end()) QFLASH_FAIL(file_, ": missing field '", field(key), "' (", expected, ")");
    QFLASH_FAIL(file_, ": field '", field(key), "' must be ", expected, ", got ", json_excerpt(*it));
  }

  // --- integers ---------------------------------------------------------------------------
  [[nodiscard]] std::int64_t integer(std::string_view key, std::int64_t lo, std::int64_t hi,
                                     std::string_view expected) const {
    Json const* v = find(key);
    if (!v) fail(key, expected);
    auto r = as_integer(*v, lo, hi);
    if (!r) fail(key, expected);
    return *r;
  }
  [[nodiscard]] std::int64_t integer(std::string_view key, std::int64_t fallback,
                                     std::int64_t lo, std::int64_t hi,
                                     std::string_view expected) const {
    if (!contains(key)) return note_default(key, fallback);
    return integer(key, lo, hi, expected);
  }
  [[nodiscard]] int positive_int(std::string_view key) const {
    return static_cast<int>(integer(key, 1, kIntMax, "a positive integer"));
  }
  [[nodiscard]] int positive_int(std::string_view key, int fallback) const {
    return static_cast<int>(integer(key, fallback, 1, kIntMax, "a positive integer"));
  }
  [[nodiscard]] int nonneg_int(std::string_view key, int fallback) const {
    return static_cast<int>(integer(key, fallback, 0, kIntMax, "a non-negative integer"));
  }
  /// An optional token id style field: absent or null gives nullopt.
  [[nodiscard]] std::optional<int> optional_nonneg_int(std::string_view key) const {
    if (!has(key)) return std::nullopt;
    return static_cast<int>(integer(key, 0, kIntMax, "a non-negative integer or null"));
  }
  /// A list of non-negative integers; absent gives `fallback`.
  [[nodiscard]] std::vector<int> int_list(std::string_view key, std::vector<int> fallback) const {
    Json const* v = find(key);
    if (!v) return note_default(key, std::move(fallback));
    if (!v->is_array()) fail(key, "a list of non-negative integers");
    std::vector<int> out;
    for (auto const& e : *v) {
      auto r = as_integer(e, 0, kIntMax);
      if (!r) fail(key, "a list of non-negative integers");
      out.push_back(static_cast<int>(*r));
    }
    return out;
  }
  /// A non-negative integer or a list of them (HF `eos_token_id`); absent or null gives {}.
  [[nodiscard]] std::vector<int> int_or_int_list(std::string_view key) const {
    Json const* v = find(key);
    if (!v) return {};
    if (v->is_array()) return int_list(key, {});
    auto r = as_integer(*v, 0, kIntMax);
    if (!r) fail(key, "a non-negative integer or a list of them");
    return {static_cast<int>(*r)};
  }

  // --- other scalars ----------------------------------------------------------------------
  [[nodiscard]] double number(std::string_view key) const {
    Json const* v = find(key);
    if (!v || !v->is_number()) fail(key, "a number");
    return v->get<double>();
  }
  [[nodiscard]] double number(std::string_view key, double fallback) const {
    if (!contains(key)) return note_default(key, fallback);
    return number(key);
  }
  [[nodiscard]] double positive_number(std::string_view key, double fallback) const {
    double x = number(key, fallback);
    if (!(x > 0)) fail(key, "a positive number");
    return x;
  }
  [[nodiscard]] bool boolean(std::string_view key, bool fallback) const {
    Json const* v = find(key);
    if (!v) return note_default(key, fallback);
    if (!v->is_boolean()) fail(key, "true or false");
    return v->get<bool>();
  }
  [[nodiscard]] std::string string(std::string_view key) const {
    Json const* v = find(key);
    if (!v || !v->is_string()) fail(key, "a string");
    return v->get<std::string>();
  }
  [[nodiscard]] std::string string(std::string_view key, std::string fallback) const {
    if (!contains(key)) return note_default(key, std::move(fallback));
    return string(key);
  }
  [[nodiscard]] std::vector<std::string> string_list(std::string_view key) const {
    Json const* v = find(key);
    if (!v || !v->is_array()) fail(key, "a list of strings");
    std::vector<std::string> out;
    for (auto const& e : *v) {
      if (!e.is_string()) fail(key, "a list of strings");
      out.push_back(e.get<std::string>());
    }
    return out;
  }

  /// The nested object at `key` (required).
  [[nodiscard]] JsonFields object(std::string_view key) const {
    Json const* v = find(key);
    if (!v || !v->is_object()) fail(key, "a JSON object");
    return JsonFields(*v, file_, field(key) + ".");
  }

 private:
  static constexpr std::int64_t kIntMax = std::numeric_limits<int>::max();

  static std::optional<std::int64_t> as_integer(Json const& v, std::int64_t lo, std::int64_t hi) {
    std::int64_t x = 0;
    if (v.is_number_unsigned()) {
      auto u = v.get<std::uint64_t>();
      if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        return std::nullopt;
      x = static_cast<std::int64_t>(u);
    } else if (v.is_number_integer()) {
      x = v.get<std::int64_t>();
    } else {
      return std::nullopt;  // floats, strings, bools: Python writes integers without a dot
    }
    if (x < lo || x > hi) return std::nullopt;
    return x;
  }

  template <class T>
  T note_default(std::string_view key, T value) const {
    defaulted_.push_back(field(key));
    return value;
  }

  Json const* j_;
  std::string file_;
  std::string prefix_;
  mutable std::vector<std::string> defaulted_;
};

}  // namespace qflash::io
