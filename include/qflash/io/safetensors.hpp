/// @file
/// One memory-mapped `.safetensors` file, validated completely when opened so that later code
/// can trust every record: the header length, the JSON header, every dtype, shape and data
/// range, and that no two tensors overlap. Tensor data is a span into the mapping (no copy).
/// Also the converting reads (`read_f32`) used for small tensors and for tests.
///
/// Format: 8-byte little-endian header length N, N bytes of JSON
/// `{"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
///   "__metadata__": {"key": "value"}}`, then the data buffer; offsets are relative to it.
/// Host only.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "qflash/core/dtype.hpp"
#include "qflash/core/error.hpp"
#include "qflash/core/mapped_file.hpp"
#include "qflash/core/tensor_view.hpp"
#include "qflash/io/json.hpp"
#include "qflash/numeric/bf16.hpp"
#include "qflash/numeric/fp16.hpp"

namespace qflash::io {

/// One tensor of a safetensors file. `data` points into the file's mapping and stays valid as
/// long as the owning SafetensorsFile (or Checkpoint) lives, moves included. `data` is aligned
/// only as the file's offsets make it (HF writers pad the header to 8 bytes; nothing more is
/// guaranteed), so read it with memcpy or through `read_f32`.
struct TensorRecord {
  std::string name;
  DType dtype = DType::kF32;        ///< F32, F16, BF16, I32, I64, U8, F8_E4M3, F8_E5M2
  Shape shape;                      ///< PyTorch order, e.g. [out, in]
  std::span<std::byte const> data;  ///< into the mapped file, no copy
  std::string const* file = nullptr;  ///< path of the shard that holds it

  [[nodiscard]] std::int64_t numel() const { return shape.numel(); }
  [[nodiscard]] std::size_t bytes() const { return data.size(); }
};

namespace detail {

/// The safetensors dtype names this loader understands, and their DType.
inline constexpr std::pair<std::string_view, DType> kSafetensorsDTypes[] = {
    {"F32", DType::kF32},          {"F16", DType::kF16},           {"BF16", DType::kBF16},
    {"F8_E4M3", DType::kFp8E4m3},  {"F8_E5M2", DType::kFp8E5m2},   {"I32", DType::kI32},
    {"I64", DType::kI64},          {"U8", DType::kU8},
};

inline std::optional<DType> parse_safetensors_dtype(std::string_view s) {
  for (auto const& [name, t] : kSafetensorsDTypes)
    if (name == s) return t;
  return std::nullopt;
}

inline std::string safetensors_dtype_list() {
  std::string out;
  for (auto const& [name, t] : kSafetensorsDTypes) {
    if (!out.empty()) out += ", ";
    out += name;
  }
  return out;
}

inline std::string_view safetensors_dtype_name(DType t) {
  for (auto const& [name, d] : kSafetensorsDTypes)
    if (d == t) return name;
  return "?";
}

inline std::string_view record_file(TensorRecord const& t) {
  return t.file ? std::string_view(*t.file) : std::string_view("<memory>");
}

}  // namespace detail

/// One mapped .safetensors file; move-only. The constructor validates everything and throws
/// Error naming the file (and the tensor or field) on the first problem.
class SafetensorsFile {
 public:
  /// The format's own limit on the JSON header (the reference implementation rejects larger).
  static constexpr std::uint64_t kMaxHeaderBytes = 100ull << 20;

  explicit SafetensorsFile(std::string path)
      : path_(std::make_unique<std::string const>(std::move(path))), file_(*path_) {
    parse();
  }

  SafetensorsFile(SafetensorsFile&&) noexcept = default;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept = default;
  SafetensorsFile(SafetensorsFile const&) = delete;
  SafetensorsFile& operator=(SafetensorsFile const&) = delete;

  /// Every tensor, in the order of its data in the file.
  [[nodiscard]] std::vector<TensorRecord> const& tensors() const { return tensors_; }
  /// The tensor called `name`, or nullptr.
  [[nodiscard]] TensorRecord const* find(std::string_view name) const {
    auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : &tensors_[it->second];
  }
  /// Tensors validated like the others but not representable as a Shape (rank above
  /// kMaxRank, e.g. the vision tower's Conv3d patch embedding [out, in, t, h, w]): they are
  /// not in tensors() and find() does not return them. Name -> rank.
  [[nodiscard]] std::map<std::string, int, std::less<>> const& skipped() const {
    return skipped_;
  }
  /// The header's `__metadata__` (string to string), empty when absent.
  [[nodiscard]] std::map<std::string, std::string> const& metadata() const { return metadata_; }
  [[nodiscard]] std::string const& path() const { return *path_; }
  /// Bytes of tensor data (the sum over tensors, not the file size).
  [[nodiscard]] std::size_t weight_bytes() const {
    std::size_t n = 0;
    for (auto const& t : tensors_) n += t.data.size();
    return n;
  }

 private:
  void parse() {
    std::string const& p = *path_;
    auto bytes = file_.bytes();
    QFLASH_CHECK(bytes.size() >= 8, p, ": not a safetensors file: ", bytes.size(),
                 " bytes is shorter than the 8-byte header length");
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i)
      n = (n << 8) | static_cast<std::uint64_t>(bytes[static_cast<std::size_t>(i)]);
    QFLASH_CHECK(n > 0, p, ": header length is 0");
    QFLASH_CHECK(n <= bytes.size() - 8, p, ": header length ", n, " exceeds the ",
                 bytes.size() - 8, " bytes after the length field (truncated file, or not a "
                 "safetensors file)");
    QFLASH_CHECK(n <= kMaxHeaderBytes, p, ": header length ", n, " exceeds the format's limit of ",
                 kMaxHeaderBytes, " bytes");
    std::string_view text(reinterpret_cast<char const*>(bytes.data() + 8), n);
    std::span<std::byte const> buffer = bytes.subspan(8 + n);

    Json header;
    try {
      // Duplicate keys are legal JSON, but a file with two tensors of one name is corrupt.
      std::set<std::string> seen;
      std::string dup;
      header = Json::parse(text.begin(), text.end(),
                           [&](int depth, Json::parse_event_t ev, Json& parsed) {
                             if (depth == 1 && ev == Json::parse_event_t::key &&
                                 !seen.insert(parsed.get<std::string>()).second && dup.empty())
                               dup = parsed.get<std::string>();
                             return true;
                           });
      QFLASH_CHECK(dup.empty(), p, ": header lists tensor '", dup, "' twice");
    } catch (Json::exception const& e) {
      QFLASH_FAIL(p, ": header is not valid JSON: ", e.what());
    }
    QFLASH_CHECK(header.is_object(), p, ": header must be a JSON object, got ",
                 json_excerpt(header));

    std::vector<Range> ranges;
    for (auto const& [name, entry] : header.items()) {
      if (name == "__metadata__") {
        parse_metadata(entry);
        continue;
      }
      auto r = parse_entry(name, entry, buffer, ranges);
      if (r) tensors_.push_back(std::move(*r));
    }

    // No two non-empty data ranges may overlap (skipped tensors included).
    std::sort(ranges.begin(), ranges.end(), [](Range const& a, Range const& b) {
      return a.begin < b.begin || (a.begin == b.begin && a.name < b.name);
    });
    Range const* prev = nullptr;  // the non-empty range that ends last so far
    for (auto const& r : ranges) {
      if (r.begin == r.end) continue;
      if (prev && r.begin < prev->end)
        QFLASH_FAIL(p, ": tensors '", prev->name, "' (data_offsets [", prev->begin, ", ",
                    prev->end, "]) and '", r.name, "' (data_offsets [", r.begin, ", ", r.end,
                    "]) overlap");
      if (!prev || r.end > prev->end) prev = &r;
    }

    // tensors() in data order.
    std::sort(tensors_.begin(), tensors_.end(), [&](TensorRecord const& a, TensorRecord const& b) {
      return offset_of(a) < offset_of(b) || (offset_of(a) == offset_of(b) && a.name < b.name);
    });
    for (std::size_t i = 0; i < tensors_.size(); ++i) by_name_.emplace(tensors_[i].name, i);
  }

  struct Range {
    std::uint64_t begin, end;
    std::string_view name;
  };

  void parse_metadata(Json const& entry) {
    std::string const& p = *path_;
    QFLASH_CHECK(entry.is_object(), p, ": '__metadata__' must be an object of strings, got ",
                 json_excerpt(entry));
    for (auto const& [k, v] : entry.items()) {
      QFLASH_CHECK(v.is_string(), p, ": '__metadata__' field '", k, "' must be a string, got ",
                   json_excerpt(v));
      metadata_.emplace(k, v.get<std::string>());
    }
  }

  /// Validates one header entry and appends its data range; returns its record, or nullopt
  /// when it is valid but of a rank a Shape cannot hold (then it is listed in skipped_).
  std::optional<TensorRecord> parse_entry(std::string const& name, Json const& e,
                                          std::span<std::byte const> buffer,
                                          std::vector<Range>& ranges) {
    std::string const& p = *path_;
    auto bad = [&](std::string_view field, std::string_view expected) {
      auto it = e.find(field);
      if (it == e.end())
        QFLASH_FAIL(p, ": tensor '", name, "': missing field '", field, "' (", expected, ")");
      QFLASH_FAIL(p, ": tensor '", name, "': field '", field, "' must be ", expected, ", got ",
                  json_excerpt(*it));
    };
    QFLASH_CHECK(e.is_object(), p, ": tensor '", name, "': entry must be an object, got ",
                 json_excerpt(e));

    TensorRecord r;
    r.name = name;
    r.file = path_.get();

    auto dt = e.find("dtype");
    if (dt == e.end() || !dt->is_string()) bad("dtype", "a string");
    auto parsed = detail::parse_safetensors_dtype(dt->get<std::string>());
    QFLASH_CHECK(parsed.has_value(), p, ": tensor '", name, "': unknown or unsupported dtype '",
                 dt->get<std::string>(), "' (supported: ", detail::safetensors_dtype_list(), ")");
    r.dtype = *parsed;

    auto sh = e.find("shape");
    if (sh == e.end() || !sh->is_array()) bad("shape", "a list of non-negative integers");
    int const rank = static_cast<int>(sh->size());
    std::uint64_t numel = 1;
    bool overflow = false;
    for (auto const& d : *sh) {
      if (!d.is_number_unsigned() &&
          !(d.is_number_integer() && d.get<std::int64_t>() >= 0))
        bad("shape", "a list of non-negative integers");
      auto v = d.get<std::uint64_t>();
      if (v > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) overflow = true;
      else if (v != 0 && numel > std::numeric_limits<std::uint64_t>::max() / v) overflow = true;
      else numel *= v;
      if (r.shape.rank < kMaxRank)
        r.shape.dims[static_cast<std::size_t>(r.shape.rank++)] = static_cast<std::int64_t>(v);
    }
    std::uint64_t const elem = size_of(r.dtype);
    overflow = overflow || numel > std::numeric_limits<std::uint64_t>::max() / elem ||
               numel > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
    QFLASH_CHECK(!overflow, p, ": tensor '", name, "': shape ", json_excerpt(*sh),
                 " has too many elements");
    std::uint64_t const need = numel * elem;

    auto off = e.find("data_offsets");
    if (off == e.end() || !off->is_array() || off->size() != 2 ||
        !(*off)[0].is_number_unsigned() || !(*off)[1].is_number_unsigned())
      bad("data_offsets", "a pair [begin, end] of non-negative integers");
    auto begin = (*off)[0].get<std::uint64_t>();
    auto end = (*off)[1].get<std::uint64_t>();
    QFLASH_CHECK(begin <= end, p, ": tensor '", name, "': data_offsets [", begin, ", ", end,
                 "] end before they begin");
    QFLASH_CHECK(end <= buffer.size(), p, ": tensor '", name, "': data_offsets [", begin, ", ",
                 end, "] run past the end of the data buffer (", buffer.size(),
                 " bytes): the file is truncated or the header is wrong");
    QFLASH_CHECK(end - begin == need, p, ": tensor '", name, "': data_offsets [", begin, ", ",
                 end, "] hold ", end - begin, " bytes, but shape ", json_excerpt(*sh), " of ",
                 detail::safetensors_dtype_name(r.dtype), " needs ", need);
    ranges.push_back({begin, end, name});
    if (rank > kMaxRank) {
      skipped_.emplace(name, rank);
      return std::nullopt;
    }
    r.data = buffer.subspan(begin, end - begin);
    return r;
  }

  /// Position of a record's data in the file (records keep no offsets of their own).
  std::size_t offset_of(TensorRecord const& t) const {
    return static_cast<std::size_t>(t.data.data() - file_.data());
  }

  std::unique_ptr<std::string const> path_;  // heap, so TensorRecord::file survives moves
  MappedFile file_;
  std::vector<TensorRecord> tensors_;
  std::map<std::string, std::size_t, std::less<>> by_name_;
  std::map<std::string, std::string> metadata_;
  std::map<std::string, int, std::less<>> skipped_;
};

// --- Converting reads -------------------------------------------------------------------------

namespace detail {

inline void check_float_source(TensorRecord const& t, char const* what) {
  QFLASH_CHECK(t.dtype == DType::kF32 || t.dtype == DType::kF16 || t.dtype == DType::kBF16,
               record_file(t), ": tensor '", t.name, "': ", what, " cannot convert ",
               safetensors_dtype_name(t.dtype), " (supported sources: F32, F16, BF16)");
  QFLASH_CHECK(t.data.size() == static_cast<std::size_t>(t.numel()) * size_of(t.dtype),
               record_file(t), ": tensor '", t.name, "': ", t.data.size(),
               " bytes of data do not match shape ", to_string(t.shape), " of ",
               safetensors_dtype_name(t.dtype));
}

inline float load_as_f32(std::byte const* p, DType t) {
  if (t == DType::kF32) {
    float x;
    std::memcpy(&x, p, 4);
    return x;
  }
  std::uint16_t h;
  std::memcpy(&h, p, 2);
  return t == DType::kBF16 ? to_float(Bf16{h}) : to_float(Fp16{h});
}

}  // namespace detail

/// Converts a whole F32/F16/BF16 tensor to f32. `out.size()` must equal the element count.
/// Throws Error naming the file and tensor on another dtype or a size mismatch.
inline void read_f32(TensorRecord const& t, std::span<float> out) {
  detail::check_float_source(t, "read_f32");
  QFLASH_CHECK(out.size() == static_cast<std::size_t>(t.numel()), detail::record_file(t),
               ": tensor '", t.name, "': read_f32 into ", out.size(), " floats, but shape ",
               to_string(t.shape), " holds ", t.numel());
  std::size_t const n = out.size();
  std::byte const* src = t.data.data();
  switch (t.dtype) {
    case DType::kF32:
      if (n) std::memcpy(out.data(), src, n * 4);
      break;
    case DType::kBF16:
      for (std::size_t i = 0; i < n; ++i) out[i] = detail::load_as_f32(src + 2 * i, DType::kBF16);
      break;
    default:
      for (std::size_t i = 0; i < n; ++i) out[i] = detail::load_as_f32(src + 2 * i, DType::kF16);
      break;
  }
}

/// The whole tensor as a new f32 vector (see the span overload).
inline std::vector<float> read_f32(TensorRecord const& t) {
  detail::check_float_source(t, "read_f32");
  std::vector<float> out(static_cast<std::size_t>(t.numel()));
  read_f32(t, out);
  return out;
}

/// Element `index` (flat, row-major) of an F32/F16/BF16 tensor, as f32.
inline float read_scalar_f32(TensorRecord const& t, std::int64_t index) {
  detail::check_float_source(t, "read_scalar_f32");
  QFLASH_CHECK(index >= 0 && index < t.numel(), detail::record_file(t), ": tensor '", t.name,
               "': element ", index, " is out of range for shape ", to_string(t.shape));
  return detail::load_as_f32(
      t.data.data() + static_cast<std::size_t>(index) * size_of(t.dtype), t.dtype);
}

}  // namespace qflash::io
