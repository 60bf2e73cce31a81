/// @file
/// One memory-mapped llama.cpp `.gguf` file, validated completely when opened so that later
/// code can trust every record: the header, every metadata entry (all GGUF value types,
/// arrays of them, arrays of strings), every tensor info (name, shape, ggml type, offset) and
/// that every tensor's data lies in the file, aligned, without overlapping another. Tensor
/// data is a span into the mapping (no copy), aligned to `general.alignment`, so quantized
/// blocks can be used in place (numeric/gguf_blocks.hpp has the block layouts).
///
/// Format (GGUF v2 and v3 have the same layout; v3 only allows big-endian files, which are
/// rejected here; v1 had 32-bit counts and is rejected as llama.cpp does). All little-endian:
///   "GGUF", u32 version, u64 n_tensors, u64 n_kv,
///   n_kv x { string key, u32 value_type, value },  value = scalar | string |
///            { u32 element_type, u64 count, count x element }  (value_type 9 = array),
///   n_tensors x { string name, u32 n_dims, n_dims x i64 ne, u32 ggml_type, u64 offset },
///   zero padding to `general.alignment` (a u32 power of two; default 32), the data section.
/// A string is a u64 byte length and that many UTF-8 bytes, no terminator; a bool one byte.
/// `offset` is relative to the data section and a multiple of the alignment.
/// Facts checked against llama.cpp 3f545becc: ggml/include/gguf.h (layout, gguf_type ids,
/// GGUF_DEFAULT_ALIGNMENT), ggml/include/ggml.h (ggml_type ids), gguf-py/gguf/constants.py
/// (GGML_QUANT_SIZES: block sizes and bytes) and ggml/src/gguf.cpp (what the reader rejects).
/// Host only.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/core/mapped_file.hpp"
#include "qflash/core/tensor_view.hpp"

namespace qflash::io {

// --- ggml tensor types ----------------------------------------------------------------------

/// ggml's tensor types with ggml's ids (ggml.h `enum ggml_type`). Ids 4, 5 (Q4_2, Q4_3),
/// 31-33 and 36-38 (repacked layouts) were removed from the format and are rejected.
enum class GgmlType : std::uint32_t {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ8_1 = 9,
  kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kQ8_K = 15,
  kIQ2_XXS = 16, kIQ2_XS = 17, kIQ3_XXS = 18, kIQ1_S = 19, kIQ4_NL = 20, kIQ3_S = 21,
  kIQ2_S = 22, kIQ4_XS = 23, kI8 = 24, kI16 = 25, kI32 = 26, kI64 = 27, kF64 = 28,
  kIQ1_M = 29, kBF16 = 30, kTQ1_0 = 34, kTQ2_0 = 35, kMXFP4 = 39, kNVFP4 = 40,
  kQ1_0 = 41, kQ2_0 = 42,
};

/// How a ggml type stores values: `block_size` values in `block_bytes` bytes.
struct GgmlTypeInfo {
  GgmlType type;
  std::string_view name;     ///< as gguf-py and llama-quantize spell it ("Q4_K")
  std::int64_t block_size;   ///< values per block
  std::int64_t block_bytes;  ///< bytes per block
};

/// Every ggml type a GGUF file may hold (gguf-py GGML_QUANT_SIZES; QK_K = 256).
inline constexpr GgmlTypeInfo kGgmlTypes[] = {
    {GgmlType::kF32, "F32", 1, 4},
    {GgmlType::kF16, "F16", 1, 2},
    {GgmlType::kQ4_0, "Q4_0", 32, 2 + 16},
    {GgmlType::kQ4_1, "Q4_1", 32, 2 + 2 + 16},
    {GgmlType::kQ5_0, "Q5_0", 32, 2 + 4 + 16},
    {GgmlType::kQ5_1, "Q5_1", 32, 2 + 2 + 4 + 16},
    {GgmlType::kQ8_0, "Q8_0", 32, 2 + 32},
    {GgmlType::kQ8_1, "Q8_1", 32, 4 + 4 + 32},
    {GgmlType::kQ2_K, "Q2_K", 256, 2 + 2 + 256 / 16 + 256 / 4},
    {GgmlType::kQ3_K, "Q3_K", 256, 2 + 256 / 4 + 256 / 8 + 12},
    {GgmlType::kQ4_K, "Q4_K", 256, 2 + 2 + 256 / 2 + 12},
    {GgmlType::kQ5_K, "Q5_K", 256, 2 + 2 + 256 / 2 + 256 / 8 + 12},
    {GgmlType::kQ6_K, "Q6_K", 256, 2 + 256 / 2 + 256 / 4 + 256 / 16},
    {GgmlType::kQ8_K, "Q8_K", 256, 4 + 256 + 256 / 8},
    {GgmlType::kIQ2_XXS, "IQ2_XXS", 256, 2 + 256 / 4},
    {GgmlType::kIQ2_XS, "IQ2_XS", 256, 2 + 256 / 4 + 256 / 32},
    {GgmlType::kIQ3_XXS, "IQ3_XXS", 256, 2 + 256 / 4 + 256 / 8},
    {GgmlType::kIQ1_S, "IQ1_S", 256, 2 + 256 / 8 + 256 / 16},
    {GgmlType::kIQ4_NL, "IQ4_NL", 32, 2 + 16},
    {GgmlType::kIQ3_S, "IQ3_S", 256, 2 + 256 / 4 + 256 / 8 + 256 / 32 + 4},
    {GgmlType::kIQ2_S, "IQ2_S", 256, 2 + 256 / 4 + 256 / 16},
    {GgmlType::kIQ4_XS, "IQ4_XS", 256, 2 + 2 + 256 / 2 + 256 / 64},
    {GgmlType::kI8, "I8", 1, 1},
    {GgmlType::kI16, "I16", 1, 2},
    {GgmlType::kI32, "I32", 1, 4},
    {GgmlType::kI64, "I64", 1, 8},
    {GgmlType::kF64, "F64", 1, 8},
    {GgmlType::kIQ1_M, "IQ1_M", 256, 256 / 8 + 256 / 16 + 256 / 32},
    {GgmlType::kBF16, "BF16", 1, 2},
    {GgmlType::kTQ1_0, "TQ1_0", 256, 2 + 4 * 13},
    {GgmlType::kTQ2_0, "TQ2_0", 256, 2 + 64},
    {GgmlType::kMXFP4, "MXFP4", 32, 1 + 16},
    {GgmlType::kNVFP4, "NVFP4", 64, 4 + 32},
    {GgmlType::kQ1_0, "Q1_0", 128, 2 + 16},
    {GgmlType::kQ2_0, "Q2_0", 64, 2 + 16},
};

/// The type with ggml id `id`, or nullptr for an id no GGUF file may use.
constexpr GgmlTypeInfo const* ggml_type_info(std::uint32_t id) {
  for (auto const& t : kGgmlTypes)
    if (static_cast<std::uint32_t>(t.type) == id) return &t;
  return nullptr;
}
constexpr GgmlTypeInfo const& ggml_type_info(GgmlType t) {
  for (auto const& i : kGgmlTypes)
    if (i.type == t) return i;
  return kGgmlTypes[0];  // unreachable for enumerators
}

/// "Q4_K", "BF16", ...; "unknown" for a value that is not an enumerator.
constexpr std::string_view to_string(GgmlType t) {
  auto const* i = ggml_type_info(static_cast<std::uint32_t>(t));
  return i ? i->name : std::string_view("unknown");
}

/// The type spelled `name` ("Q8_0"; case-sensitive, as to_string writes it).
constexpr std::optional<GgmlType> parse_ggml_type(std::string_view name) {
  for (auto const& t : kGgmlTypes)
    if (t.name == name) return t.type;
  return std::nullopt;
}

/// Bytes of one row of `n` values (`n` a multiple of the block size).
constexpr std::int64_t ggml_row_bytes(GgmlType t, std::int64_t n) {
  auto const& i = ggml_type_info(t);
  return n / i.block_size * i.block_bytes;
}

// --- metadata values ------------------------------------------------------------------------

/// GGUF metadata value types with their ids (gguf.h `enum gguf_type`).
enum class GgufValueType : std::uint32_t {
  kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7,
  kString = 8, kArray = 9, kU64 = 10, kI64 = 11, kF64 = 12,
};

/// The spec's names: "uint32", "float32", "string", "array", ...
constexpr std::string_view to_string(GgufValueType t) {
  constexpr std::string_view kNames[] = {"uint8",   "int8",  "uint16", "int16", "uint32",
                                         "int32",   "float32", "bool", "string", "array",
                                         "uint64",  "int64", "float64"};
  auto const i = static_cast<std::uint32_t>(t);
  return i < std::size(kNames) ? kNames[i] : std::string_view("unknown");
}

/// Bytes of one value of a fixed-size type; 0 for string and array.
constexpr std::size_t gguf_value_size(GgufValueType t) {
  switch (t) {
    case GgufValueType::kU8: case GgufValueType::kI8: case GgufValueType::kBool: return 1;
    case GgufValueType::kU16: case GgufValueType::kI16: return 2;
    case GgufValueType::kU32: case GgufValueType::kI32: case GgufValueType::kF32: return 4;
    case GgufValueType::kU64: case GgufValueType::kI64: case GgufValueType::kF64: return 8;
    default: return 0;
  }
}

constexpr bool is_integer(GgufValueType t) {
  return t == GgufValueType::kU8 || t == GgufValueType::kI8 || t == GgufValueType::kU16 ||
         t == GgufValueType::kI16 || t == GgufValueType::kU32 || t == GgufValueType::kI32 ||
         t == GgufValueType::kU64 || t == GgufValueType::kI64;
}

/// The GGUF value type that holds the C++ type T (the types `GgufFile::get<T>` accepts).
template <class T>
constexpr GgufValueType gguf_type_of() {
  if constexpr (std::is_same_v<T, std::uint8_t>) return GgufValueType::kU8;
  else if constexpr (std::is_same_v<T, std::int8_t>) return GgufValueType::kI8;
  else if constexpr (std::is_same_v<T, std::uint16_t>) return GgufValueType::kU16;
  else if constexpr (std::is_same_v<T, std::int16_t>) return GgufValueType::kI16;
  else if constexpr (std::is_same_v<T, std::uint32_t>) return GgufValueType::kU32;
  else if constexpr (std::is_same_v<T, std::int32_t>) return GgufValueType::kI32;
  else if constexpr (std::is_same_v<T, std::uint64_t>) return GgufValueType::kU64;
  else if constexpr (std::is_same_v<T, std::int64_t>) return GgufValueType::kI64;
  else if constexpr (std::is_same_v<T, float>) return GgufValueType::kF32;
  else if constexpr (std::is_same_v<T, double>) return GgufValueType::kF64;
  else if constexpr (std::is_same_v<T, bool>) return GgufValueType::kBool;
  else if constexpr (std::is_same_v<T, std::string_view>) return GgufValueType::kString;
  else static_assert(sizeof(T) == 0, "no GGUF value type holds this C++ type");
}

/// One metadata entry. Views point into the file's mapping and live as long as the GgufFile.
struct GgufKv {
  std::string key;
  GgufValueType type = GgufValueType::kU8;          ///< kArray for an array
  GgufValueType element_type = GgufValueType::kU8;  ///< an array's element type; else == type
  std::uint64_t count = 1;                          ///< an array's length; 1 for a scalar
  std::span<std::byte const> data;         ///< the value's (elements') bytes; empty for strings
  std::vector<std::string_view> strings;   ///< a string's or string array's elements

  [[nodiscard]] bool is_array() const { return type == GgufValueType::kArray; }
  /// "uint32", "array of string", ...
  [[nodiscard]] std::string type_name() const {
    return is_array() ? "array of " + std::string(to_string(element_type))
                      : std::string(to_string(type));
  }
  /// Element `i` of a fixed-size value (i = 0 for a scalar) as T, which must be its C++ type.
  template <class T>
  [[nodiscard]] T element(std::size_t i) const {
    if constexpr (std::is_same_v<T, std::string_view>) {
      return strings[i];
    } else if constexpr (std::is_same_v<T, bool>) {
      return data[i] != std::byte{0};  // as ggml: any non-zero byte is true
    } else {
      T v;
      std::memcpy(&v, data.data() + i * sizeof(T), sizeof(T));
      return v;
    }
  }
  /// Element `i` of an integer value as int64; nullopt when a uint64 does not fit.
  [[nodiscard]] std::optional<std::int64_t> integer(std::size_t i) const {
    switch (element_type) {
      case GgufValueType::kU8: return element<std::uint8_t>(i);
      case GgufValueType::kI8: return element<std::int8_t>(i);
      case GgufValueType::kU16: return element<std::uint16_t>(i);
      case GgufValueType::kI16: return element<std::int16_t>(i);
      case GgufValueType::kU32: return element<std::uint32_t>(i);
      case GgufValueType::kI32: return element<std::int32_t>(i);
      case GgufValueType::kI64: return element<std::int64_t>(i);
      case GgufValueType::kU64: {
        auto const v = element<std::uint64_t>(i);
        if (v > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
          return std::nullopt;
        return static_cast<std::int64_t>(v);
      }
      default: return std::nullopt;
    }
  }
};

/// The value for logs and dumps: `42`, `"qwen35moe"`, `[11, 11, 10, 0]`; arrays longer than
/// `max_elements` are cut with "... (N total)".
inline std::string format_value(GgufKv const& kv, std::size_t max_elements = 8) {
  std::ostringstream os;
  auto one = [&](std::size_t i) {
    switch (kv.element_type) {
      case GgufValueType::kString: os << '"' << kv.strings[i] << '"'; break;
      case GgufValueType::kBool: os << (kv.element<bool>(i) ? "true" : "false"); break;
      case GgufValueType::kF32: os << kv.element<float>(i); break;
      case GgufValueType::kF64: os << kv.element<double>(i); break;
      case GgufValueType::kU64: os << kv.element<std::uint64_t>(i); break;
      default: os << *kv.integer(i); break;
    }
  };
  if (!kv.is_array()) {
    one(0);
    return os.str();
  }
  os << '[';
  std::size_t const n = static_cast<std::size_t>(std::min<std::uint64_t>(kv.count, max_elements));
  for (std::size_t i = 0; i < n; ++i) {
    if (i) os << ", ";
    one(i);
  }
  if (kv.count > n) os << (n ? ", " : "") << "... (" << kv.count << " total)";
  os << ']';
  return os.str();
}

// --- tensors --------------------------------------------------------------------------------

/// One tensor of a GGUF file. `data` points into the file's mapping, starts at a multiple of
/// the file's alignment from the (page-aligned) mapping, and stays valid as long as the
/// owning GgufFile lives, moves included.
struct GgufTensor {
  std::string name;
  GgmlType type = GgmlType::kF32;
  int n_dims = 0;                           ///< 0..4
  std::array<std::int64_t, 4> ne{1, 1, 1, 1};  ///< ggml order: ne[0] contiguous; 1 past n_dims
  std::uint64_t offset = 0;                 ///< from the start of the data section
  std::span<std::byte const> data;          ///< [bytes()], into the mapping, no copy
  std::string const* file = nullptr;        ///< path of the file that holds it

  [[nodiscard]] std::int64_t numel() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
  /// Rows of ne[0] values (the product of ne[1..3]).
  [[nodiscard]] std::int64_t rows() const { return ne[1] * ne[2] * ne[3]; }
  [[nodiscard]] std::int64_t row_bytes() const { return ggml_row_bytes(type, ne[0]); }
  [[nodiscard]] std::size_t bytes() const { return data.size(); }
  /// The shape in PyTorch order (ne reversed, rank n_dims): ne {2048, 8192} -> [8192, 2048].
  [[nodiscard]] Shape shape() const {
    Shape s;
    s.rank = n_dims;
    for (int i = 0; i < n_dims; ++i)
      s.dims[static_cast<std::size_t>(i)] = ne[static_cast<std::size_t>(n_dims - 1 - i)];
    return s;
  }
};

/// "{2048, 8192}": ggml order, as llama.cpp prints shapes.
inline std::string format_ne(GgufTensor const& t) {
  std::string out = "{";
  for (int i = 0; i < t.n_dims; ++i) {
    if (i) out += ", ";
    out += std::to_string(t.ne[static_cast<std::size_t>(i)]);
  }
  return out + "}";
}

namespace detail {

inline constexpr std::uint64_t kNoIndex = std::numeric_limits<std::uint64_t>::max();

/// Where a read is, for error messages: "header", "metadata 'key'", "tensor info 3", ...
struct GgufWhere {
  std::string_view kind;
  std::string_view name;  // key or tensor name; empty when not read yet
  std::uint64_t index;    // entry or element, or kNoIndex

  GgufWhere(std::string_view kind_, std::string_view name_ = {}, std::uint64_t index_ = kNoIndex)
      : kind(kind_), name(name_), index(index_) {}

  friend std::ostream& operator<<(std::ostream& os, GgufWhere const& w) {
    os << w.kind;
    if (!w.name.empty()) os << " '" << w.name << "'";
    if (w.index != kNoIndex)
      os << (w.name.empty() ? " " : " element ") << w.index;
    return os;
  }
};

/// Lower-case hex of `bytes`, in file order.
inline std::string hex(std::span<std::byte const> bytes) {
  constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (auto b : bytes) {
    auto const v = static_cast<unsigned>(b);
    out += kDigits[v >> 4];
    out += kDigits[v & 15];
  }
  return out;
}

/// Bounds-checked little-endian reads over the file's bytes.
class GgufReader {
 public:
  GgufReader(std::span<std::byte const> bytes, std::string const& file)
      : bytes_(bytes), file_(file) {}

  [[nodiscard]] std::size_t pos() const { return pos_; }
  [[nodiscard]] std::size_t remaining() const { return bytes_.size() - pos_; }

  void need(std::uint64_t n, GgufWhere const& w) const {
    QFLASH_CHECK(n <= remaining(), file_, ": ", w, ": needs ", n, " bytes at offset ", pos_,
                 ", but the file has only ", remaining(), " left (truncated file?)");
  }
  template <class T>
  T read(GgufWhere const& w) {
    need(sizeof(T), w);
    T v;
    std::memcpy(&v, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::span<std::byte const> take(std::uint64_t n, GgufWhere const& w) {
    need(n, w);
    auto s = bytes_.subspan(pos_, static_cast<std::size_t>(n));
    pos_ += static_cast<std::size_t>(n);
    return s;
  }
  std::string_view read_string(GgufWhere const& w) {
    auto const n = read<std::uint64_t>(w);
    QFLASH_CHECK(n <= remaining(), file_, ": ", w, ": string length ", n, " at offset ",
                 pos_ - 8, " exceeds the ", remaining(), " bytes left in the file");
    auto s = take(n, w);
    return {reinterpret_cast<char const*>(s.data()), s.size()};
  }

 private:
  std::span<std::byte const> bytes_;
  std::string const& file_;
  std::size_t pos_ = 0;
};

}  // namespace detail

/// One GGUF file (mapped, or bytes the caller owns); move-only. The constructor validates
/// everything and throws Error naming the file and the field on the first problem.
class GgufFile {
 public:
  static constexpr std::uint32_t kDefaultAlignment = 32;  ///< GGUF_DEFAULT_ALIGNMENT
  /// Smallest encodings, which bound how many entries a file of a given size can hold:
  /// key (8-byte length + 1 byte) + type + a uint8; name + n_dims + type + offset.
  static constexpr std::uint64_t kMinKvBytes = 8 + 1 + 4 + 1;
  static constexpr std::uint64_t kMinTensorInfoBytes = 8 + 1 + 4 + 4 + 8;

  /// Maps and validates `path`.
  explicit GgufFile(std::string path)
      : path_(std::make_unique<std::string const>(std::move(path))), file_(*path_),
        bytes_(file_.bytes()) {
    parse();
  }

  /// Validates `bytes` as a GGUF file without copying them: they must outlive the result.
  /// `name` stands for the file in error messages and GgufTensor::file. For tests and fuzzing.
  static GgufFile from_bytes(std::span<std::byte const> bytes, std::string name) {
    return GgufFile(bytes, std::move(name));
  }

  GgufFile(GgufFile&&) noexcept = default;
  GgufFile& operator=(GgufFile&&) noexcept = default;
  GgufFile(GgufFile const&) = delete;
  GgufFile& operator=(GgufFile const&) = delete;

  [[nodiscard]] std::string const& path() const { return *path_; }
  [[nodiscard]] std::uint32_t version() const { return version_; }
  /// `general.alignment`, or 32 when absent.
  [[nodiscard]] std::uint64_t alignment() const { return alignment_; }
  /// Where the data section starts in the file.
  [[nodiscard]] std::uint64_t data_offset() const { return data_offset_; }
  /// The whole file.
  [[nodiscard]] std::span<std::byte const> bytes() const { return bytes_; }

  // --- metadata ---------------------------------------------------------------------------

  /// Every metadata entry, in file order.
  [[nodiscard]] std::vector<GgufKv> const& metadata() const { return kv_; }
  /// The entry `key`, or nullptr.
  [[nodiscard]] GgufKv const* find_kv(std::string_view key) const {
    auto it = kv_index_.find(key);
    return it == kv_index_.end() ? nullptr : &kv_[it->second];
  }
  [[nodiscard]] bool has(std::string_view key) const { return find_kv(key) != nullptr; }

  /// The scalar `key` of exactly the GGUF type holding T (uint32_t -> uint32, float ->
  /// float32, std::string_view -> string, ...). Throws Error naming the key and the expected
  /// and actual types when it is missing or of another type.
  template <class T>
  [[nodiscard]] T get(std::string_view key) const {
    return checked_scalar<T>(required(key, to_string(gguf_type_of<T>())));
  }
  /// As get, but nullopt when `key` is absent (still throws when it has another type).
  template <class T>
  [[nodiscard]] std::optional<T> find(std::string_view key) const {
    GgufKv const* kv = find_kv(key);
    if (kv == nullptr) return std::nullopt;
    return checked_scalar<T>(*kv);
  }
  [[nodiscard]] std::uint32_t get_u32(std::string_view key) const { return get<std::uint32_t>(key); }
  [[nodiscard]] std::int32_t get_i32(std::string_view key) const { return get<std::int32_t>(key); }
  [[nodiscard]] std::uint64_t get_u64(std::string_view key) const { return get<std::uint64_t>(key); }
  [[nodiscard]] float get_f32(std::string_view key) const { return get<float>(key); }
  [[nodiscard]] bool get_bool(std::string_view key) const { return get<bool>(key); }
  [[nodiscard]] std::string_view get_string(std::string_view key) const {
    return get<std::string_view>(key);
  }
  [[nodiscard]] std::optional<std::uint32_t> find_u32(std::string_view key) const {
    return find<std::uint32_t>(key);
  }
  [[nodiscard]] std::optional<float> find_f32(std::string_view key) const { return find<float>(key); }
  [[nodiscard]] std::optional<std::string_view> find_string(std::string_view key) const {
    return find<std::string_view>(key);
  }

  /// A scalar of any integer type (writers differ: llama.cpp writes token ids as uint32,
  /// other tools as int32), as int64. Throws when missing, not an integer, or a uint64 above
  /// INT64_MAX.
  [[nodiscard]] std::int64_t get_int(std::string_view key) const {
    return checked_int(required(key, "an integer"));
  }
  [[nodiscard]] std::optional<std::int64_t> find_int(std::string_view key) const {
    GgufKv const* kv = find_kv(key);
    if (kv == nullptr) return std::nullopt;
    return checked_int(*kv);
  }
  /// A float32 or float64 scalar as double.
  [[nodiscard]] double get_float(std::string_view key) const {
    return checked_float(required(key, "float32 or float64"));
  }
  [[nodiscard]] std::optional<double> find_float(std::string_view key) const {
    GgufKv const* kv = find_kv(key);
    if (kv == nullptr) return std::nullopt;
    return checked_float(*kv);
  }

  /// The array `key`, whose elements must be exactly of the GGUF type holding T; strings as
  /// views into the mapping. Throws naming the key and types when missing or of another type.
  template <class T>
  [[nodiscard]] std::vector<T> get_array(std::string_view key) const {
    return checked_array<T>(required(key, "array of " + std::string(to_string(gguf_type_of<T>()))));
  }
  template <class T>
  [[nodiscard]] std::optional<std::vector<T>> find_array(std::string_view key) const {
    GgufKv const* kv = find_kv(key);
    if (kv == nullptr) return std::nullopt;
    return checked_array<T>(*kv);
  }
  /// An array of strings, without copying.
  [[nodiscard]] std::span<std::string_view const> get_string_array(std::string_view key) const {
    GgufKv const& kv = required(key, "array of string");
    check_array_of(kv, GgufValueType::kString);
    return kv.strings;
  }
  /// An array of any integer element type, as int64.
  [[nodiscard]] std::vector<std::int64_t> get_int_array(std::string_view key) const {
    GgufKv const& kv = required(key, "array of integers");
    QFLASH_CHECK(kv.is_array() && is_integer(kv.element_type), *path_, ": metadata '", kv.key,
                 "': expected an array of integers, got ", kv.type_name());
    std::vector<std::int64_t> out(static_cast<std::size_t>(kv.count));
    for (std::size_t i = 0; i < out.size(); ++i) {
      auto v = kv.integer(i);
      QFLASH_CHECK(v.has_value(), *path_, ": metadata '", kv.key, "' element ", i,
                   ": uint64 value ", kv.element<std::uint64_t>(i), " exceeds INT64_MAX");
      out[i] = *v;
    }
    return out;
  }
  /// Length of the array `key` (throws when missing or not an array).
  [[nodiscard]] std::uint64_t array_size(std::string_view key) const {
    GgufKv const& kv = required(key, "an array");
    QFLASH_CHECK(kv.is_array(), *path_, ": metadata '", kv.key, "': expected an array, got ",
                 kv.type_name());
    return kv.count;
  }

  /// `general.architecture` ("qwen35moe", "qwen3moe"); throws when missing.
  [[nodiscard]] std::string_view architecture() const {
    return get_string("general.architecture");
  }
  /// "<architecture>.<suffix>", the key of a per-architecture hyperparameter:
  /// `arch_key("block_count")` -> "qwen35moe.block_count".
  [[nodiscard]] std::string arch_key(std::string_view suffix) const {
    return std::string(architecture()) + "." + std::string(suffix);
  }

  // --- tensors ----------------------------------------------------------------------------

  /// Every tensor, in the order of the file's tensor infos.
  [[nodiscard]] std::vector<GgufTensor> const& tensors() const { return tensors_; }
  /// The tensor called `name`, or nullptr.
  [[nodiscard]] GgufTensor const* find_tensor(std::string_view name) const {
    auto it = tensor_index_.find(name);
    return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
  }
  /// The tensor called `name`; throws Error naming the file and tensor when absent.
  [[nodiscard]] GgufTensor const& tensor(std::string_view name) const {
    GgufTensor const* t = find_tensor(name);
    QFLASH_CHECK(t != nullptr, *path_, ": no tensor '", name, "'");
    return *t;
  }
  /// Bytes of tensor data (the sum over tensors, not the file size).
  [[nodiscard]] std::size_t weight_bytes() const {
    std::size_t n = 0;
    for (auto const& t : tensors_) n += t.data.size();
    return n;
  }

 private:
  GgufFile(std::span<std::byte const> bytes, std::string name)
      : path_(std::make_unique<std::string const>(std::move(name))), bytes_(bytes) {
    parse();
  }

  using Where = detail::GgufWhere;

  void parse() {
    std::string const& p = *path_;
    detail::GgufReader r(bytes_, p);

    // Header.
    QFLASH_CHECK(bytes_.size() >= 4, p, ": not a GGUF file: ", bytes_.size(),
                 " bytes is shorter than the 4-byte magic");
    auto const magic = r.take(4, {"header"});
    QFLASH_CHECK(std::memcmp(magic.data(), "GGUF", 4) == 0, p,
                 ": not a GGUF file: bad magic 0x", detail::hex(magic), ", expected \"GGUF\"");
    version_ = r.read<std::uint32_t>({"header field 'version'"});
    QFLASH_CHECK(version_ != 1, p, ": GGUF version 1 is not supported (its 32-bit counts were "
                 "replaced in v2; supported: 2, 3)");
    QFLASH_CHECK((version_ & 0xFFFFu) != 0, p, ": GGUF version field ", version_, " (0x",
                 detail::hex(bytes_.subspan(4, 4)), ") looks byte-swapped: big-endian GGUF files are "
                 "not supported");
    QFLASH_CHECK(version_ == 2 || version_ == 3, p, ": unsupported GGUF version ", version_,
                 " (supported: 2, 3)");
    auto const n_tensors = r.read<std::uint64_t>({"header field 'n_tensors'"});
    auto const n_kv = r.read<std::uint64_t>({"header field 'n_kv'"});
    // The counts are untrusted: bound them by what the rest of the file could hold before
    // anything is sized from them.
    QFLASH_CHECK(n_kv <= r.remaining() / kMinKvBytes, p, ": header field 'n_kv' = ", n_kv,
                 " cannot fit in the ", r.remaining(), " bytes after the header (each entry "
                 "takes at least ", kMinKvBytes, ")");
    QFLASH_CHECK(n_tensors <= (r.remaining() - n_kv * kMinKvBytes) / kMinTensorInfoBytes, p,
                 ": header field 'n_tensors' = ", n_tensors, " cannot fit in the ",
                 r.remaining(), " bytes after the header with ", n_kv,
                 " metadata entries (each tensor info takes at least ", kMinTensorInfoBytes, ")");

    kv_.reserve(static_cast<std::size_t>(n_kv));
    for (std::uint64_t i = 0; i < n_kv; ++i) parse_kv(r, i);

    alignment_ = kDefaultAlignment;
    if (GgufKv const* a = find_kv("general.alignment")) {
      QFLASH_CHECK(a->type == GgufValueType::kU32, p,
                   ": metadata 'general.alignment': expected uint32, got ", a->type_name());
      alignment_ = a->element<std::uint32_t>(0);
      QFLASH_CHECK(alignment_ != 0 && (alignment_ & (alignment_ - 1)) == 0, p,
                   ": metadata 'general.alignment' = ", alignment_, " is not a power of 2");
    }

    tensors_.reserve(static_cast<std::size_t>(n_tensors));
    for (std::uint64_t i = 0; i < n_tensors; ++i) parse_tensor_info(r, i);

    // The data section starts at the next multiple of the alignment (from the file start).
    std::uint64_t const end_of_infos = r.pos();
    data_offset_ = n_tensors == 0 ? end_of_infos
                                  : (end_of_infos + alignment_ - 1) / alignment_ * alignment_;
    QFLASH_CHECK(data_offset_ <= bytes_.size(), p, ": the data section would start at offset ",
                 data_offset_, " (tensor infos end at ", end_of_infos, ", padded to alignment ",
                 alignment_, "), past the end of the ", bytes_.size(), "-byte file (truncated?)");
    std::uint64_t const data_size = bytes_.size() - data_offset_;
    for (auto& t : tensors_) {
      QFLASH_CHECK(t.offset % alignment_ == 0, p, ": tensor '", t.name, "': offset ", t.offset,
                   " is not a multiple of the alignment ", alignment_);
      std::uint64_t const n = static_cast<std::uint64_t>(
          t.numel() / ggml_type_info(t.type).block_size * ggml_type_info(t.type).block_bytes);
      QFLASH_CHECK(t.offset <= data_size && n <= data_size - t.offset, p, ": tensor '", t.name,
                   "': data [", t.offset, ", ", t.offset, " + ", n, ") runs past the end of the ",
                   data_size, "-byte data section (truncated file, or a wrong offset)");
      t.data = bytes_.subspan(static_cast<std::size_t>(data_offset_ + t.offset),
                              static_cast<std::size_t>(n));
    }
    // No two tensors may share bytes (empty tensors cannot exist: every ne >= 1).
    std::vector<GgufTensor const*> by_offset;
    by_offset.reserve(tensors_.size());
    for (auto const& t : tensors_) by_offset.push_back(&t);
    std::sort(by_offset.begin(), by_offset.end(),
              [](GgufTensor const* a, GgufTensor const* b) { return a->offset < b->offset; });
    for (std::size_t i = 1; i < by_offset.size(); ++i) {
      GgufTensor const& a = *by_offset[i - 1];
      GgufTensor const& b = *by_offset[i];
      QFLASH_CHECK(b.offset >= a.offset + a.bytes(), p, ": tensors '", a.name, "' (data [",
                   a.offset, ", ", a.offset + a.bytes(), ")) and '", b.name, "' (data [",
                   b.offset, ", ", b.offset + b.bytes(), ")) overlap");
    }
  }

  void parse_kv(detail::GgufReader& r, std::uint64_t i) {
    std::string const& p = *path_;
    GgufKv kv;
    kv.key = std::string(r.read_string({"metadata entry", "", i}));
    QFLASH_CHECK(!kv.key.empty(), p, ": metadata entry ", i, ": empty key");
    QFLASH_CHECK(!kv_index_.contains(kv.key), p, ": metadata key '", kv.key,
                 "' appears twice (entries ", kv_index_.find(kv.key)->second, " and ", i, ")");
    Where const w{"metadata", kv.key};
    kv.type = read_value_type(r, w, "value type");
    kv.element_type = kv.type;
    if (kv.type == GgufValueType::kArray) {
      kv.element_type = read_value_type(r, w, "array element type");
      QFLASH_CHECK(kv.element_type != GgufValueType::kArray, p, ": metadata '", kv.key,
                   "': nested arrays (arrays of arrays) are not supported");
      kv.count = r.read<std::uint64_t>(w);
    }
    if (kv.element_type == GgufValueType::kString) {
      // Each string takes at least its 8-byte length.
      QFLASH_CHECK(kv.count <= r.remaining() / 8, p, ": metadata '", kv.key, "': ", kv.count,
                   " strings cannot fit in the ", r.remaining(), " bytes left in the file");
      kv.strings.reserve(static_cast<std::size_t>(kv.count));
      for (std::uint64_t j = 0; j < kv.count; ++j)
        kv.strings.push_back(
            r.read_string({"metadata", kv.key, kv.is_array() ? j : detail::kNoIndex}));
    } else if (!kv.is_array()) {
      kv.data = r.take(gguf_value_size(kv.type), w);
    } else {
      std::size_t const size = gguf_value_size(kv.element_type);
      QFLASH_CHECK(kv.count <= r.remaining() / size, p, ": metadata '", kv.key, "': ",
                   kv.type_name(), " of ", kv.count, " elements needs ", kv.count, " x ", size,
                   " bytes, but the file has only ", r.remaining(), " left (truncated file?)");
      kv.data = r.take(kv.count * size, w);
    }
    kv_index_.emplace(kv.key, kv_.size());
    kv_.push_back(std::move(kv));
  }

  GgufValueType read_value_type(detail::GgufReader& r, Where const& w, char const* what) {
    auto const t = r.read<std::uint32_t>(w);
    QFLASH_CHECK(t <= static_cast<std::uint32_t>(GgufValueType::kF64), *path_, ": ", w, ": ",
                 what, " ", t, " is not a GGUF value type (0..12)");
    return static_cast<GgufValueType>(t);
  }

  void parse_tensor_info(detail::GgufReader& r, std::uint64_t i) {
    std::string const& p = *path_;
    GgufTensor t;
    t.file = path_.get();
    t.name = std::string(r.read_string({"tensor info", "", i}));
    QFLASH_CHECK(!t.name.empty(), p, ": tensor info ", i, ": empty tensor name");
    if (auto it = tensor_index_.find(t.name); it != tensor_index_.end())
      QFLASH_FAIL(p, ": tensor '", t.name, "' appears twice (tensor infos ", it->second, " and ",
                  i, ")");
    Where const w{"tensor", t.name};
    auto const n_dims = r.read<std::uint32_t>(w);
    QFLASH_CHECK(n_dims <= 4, p, ": tensor '", t.name, "': n_dims ", n_dims,
                 " exceeds ggml's maximum of 4");
    t.n_dims = static_cast<int>(n_dims);
    std::int64_t numel = 1;
    for (std::uint32_t d = 0; d < n_dims; ++d) {
      auto const v = r.read<std::int64_t>(w);
      QFLASH_CHECK(v > 0, p, ": tensor '", t.name, "': ne[", d, "] = ", v, " (must be >= 1)");
      QFLASH_CHECK(numel <= std::numeric_limits<std::int64_t>::max() / v, p, ": tensor '",
                   t.name, "': shape ne ", format_ne_prefix(t, d, v),
                   " has more than 2^63 - 1 elements");
      t.ne[d] = v;
      numel *= v;
    }
    auto const type_id = r.read<std::uint32_t>(w);
    GgmlTypeInfo const* info = ggml_type_info(type_id);
    QFLASH_CHECK(info != nullptr, p, ": tensor '", t.name, "': unknown ggml type id ", type_id);
    t.type = info->type;
    QFLASH_CHECK(t.ne[0] % info->block_size == 0, p, ": tensor '", t.name, "': ne[0] = ",
                 t.ne[0], " is not a multiple of ", info->name, "'s block size ",
                 info->block_size);
    QFLASH_CHECK(numel / info->block_size <=
                     std::numeric_limits<std::int64_t>::max() / info->block_bytes,
                 p, ": tensor '", t.name, "': ", format_ne(t), " of ", info->name,
                 " has a byte size above 2^63 - 1");
    t.offset = r.read<std::uint64_t>(w);
    tensor_index_.emplace(t.name, tensors_.size());
    tensors_.push_back(std::move(t));
  }

  /// ne[0..d-1] then `v`, for the overflow message before ne[d] is stored.
  static std::string format_ne_prefix(GgufTensor const& t, std::uint32_t d, std::int64_t v) {
    std::string out = "{";
    for (std::uint32_t i = 0; i < d; ++i) out += std::to_string(t.ne[i]) + ", ";
    return out + std::to_string(v) + ", ...}";
  }

  GgufKv const& required(std::string_view key, std::string_view expected) const {
    GgufKv const* kv = find_kv(key);
    QFLASH_CHECK(kv != nullptr, *path_, ": metadata '", key, "' is missing (expected ",
                 expected, ")");
    return *kv;
  }

  template <class T>
  T checked_scalar(GgufKv const& kv) const {
    constexpr GgufValueType want = gguf_type_of<T>();
    QFLASH_CHECK(kv.type == want, *path_, ": metadata '", kv.key, "': expected ", to_string(want),
                 ", got ", kv.type_name());
    return kv.element<T>(0);
  }

  std::int64_t checked_int(GgufKv const& kv) const {
    QFLASH_CHECK(!kv.is_array() && is_integer(kv.type), *path_, ": metadata '", kv.key,
                 "': expected an integer, got ", kv.type_name());
    auto v = kv.integer(0);
    QFLASH_CHECK(v.has_value(), *path_, ": metadata '", kv.key, "': uint64 value ",
                 kv.element<std::uint64_t>(0), " exceeds INT64_MAX");
    return *v;
  }

  double checked_float(GgufKv const& kv) const {
    if (kv.type == GgufValueType::kF32) return kv.element<float>(0);
    QFLASH_CHECK(kv.type == GgufValueType::kF64, *path_, ": metadata '", kv.key,
                 "': expected float32 or float64, got ", kv.type_name());
    return kv.element<double>(0);
  }

  void check_array_of(GgufKv const& kv, GgufValueType want) const {
    QFLASH_CHECK(kv.is_array() && kv.element_type == want, *path_, ": metadata '", kv.key,
                 "': expected array of ", to_string(want), ", got ", kv.type_name());
  }

  template <class T>
  std::vector<T> checked_array(GgufKv const& kv) const {
    check_array_of(kv, gguf_type_of<T>());
    std::vector<T> out;
    out.reserve(static_cast<std::size_t>(kv.count));
    for (std::size_t i = 0; i < kv.count; ++i) out.push_back(kv.element<T>(i));
    return out;
  }

  std::unique_ptr<std::string const> path_;  // heap, so GgufTensor::file survives moves
  MappedFile file_;                          // empty for from_bytes
  std::span<std::byte const> bytes_;
  std::uint32_t version_ = 0;
  std::uint64_t alignment_ = kDefaultAlignment;
  std::uint64_t data_offset_ = 0;
  std::vector<GgufKv> kv_;
  std::map<std::string, std::size_t, std::less<>> kv_index_;
  std::vector<GgufTensor> tensors_;
  std::map<std::string, std::size_t, std::less<>> tensor_index_;
};

}  // namespace qflash::io
