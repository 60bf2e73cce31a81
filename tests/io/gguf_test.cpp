// Tests of qflash/io/gguf.hpp and Tokenizer::from_gguf: GGUF files written here by a small
// writer (every value type, tensor types, alignment), every malformed input the parser must
// reject with an Error naming the file and the field, and the llama.cpp-made fixtures in
// tests/fixtures/gguf/ (tools/make_gguf_fixtures.py), whose tokenizer must equal the
// tokenizer.json it was converted from.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "support/expect_error.hpp"
#include "support/temp_dir.hpp"
#include "qflash/core/error.hpp"
#include "qflash/io/gguf.hpp"
#include "qflash/io/json.hpp"
#include "qflash/io/safetensors.hpp"
#include "qflash/io/tokenizer.hpp"
#include "qflash/numeric/gguf_blocks.hpp"

using namespace qflash;
using namespace qflash::io;
using qflash::test::expect_error;
using qflash::test::TempDir;
namespace fs = std::filesystem;

namespace {

constexpr char kName[] = "mem.gguf";  // the name in-memory files carry in error messages

using Bytes = std::vector<std::byte>;

template <class T>
void put(Bytes& out, T v) {
  auto const n = out.size();
  out.resize(n + sizeof(T));
  std::memcpy(out.data() + n, &v, sizeof(T));
}
void put_string(Bytes& out, std::string_view s) {
  put<std::uint64_t>(out, s.size());
  for (char c : s) out.push_back(static_cast<std::byte>(c));
}

/// A GGUF writer with knobs to produce malformed files: fields are written as given, so a
/// test can set any count, type id, shape or offset.
struct GgufWriter {
  struct Tensor {
    std::string name;
    std::vector<std::int64_t> ne;  // ggml order
    std::uint32_t type = 0;        // ggml type id
    Bytes data;
    std::optional<std::uint64_t> offset;  // default: packed, aligned
  };

  std::uint32_t version = 3;
  std::uint64_t alignment = 32;  // padding used; write general.alignment yourself to change it
  std::optional<std::uint64_t> n_kv, n_tensors;  // overrides
  std::vector<Bytes> kvs;                        // encoded entries
  std::vector<Tensor> tensors;

  /// One raw entry: key, value type id, then the value bytes `body`.
  void kv_raw(std::string_view key, std::uint32_t type, Bytes const& body) {
    Bytes e;
    put_string(e, key);
    put<std::uint32_t>(e, type);
    e.insert(e.end(), body.begin(), body.end());
    kvs.push_back(std::move(e));
  }
  template <class T>
  void kv(std::string_view key, T v) {
    Bytes b;
    if constexpr (std::is_same_v<T, bool>)
      put<std::uint8_t>(b, v ? 1 : 0);
    else
      put<T>(b, v);
    kv_raw(key, static_cast<std::uint32_t>(gguf_type_of<T>()), b);
  }
  void kv_string(std::string_view key, std::string_view v) {
    Bytes b;
    put_string(b, v);
    kv_raw(key, 8, b);
  }
  template <class T>
  void kv_array(std::string_view key, std::vector<T> const& v) {
    Bytes b;
    put<std::uint32_t>(b, static_cast<std::uint32_t>(gguf_type_of<T>()));
    put<std::uint64_t>(b, v.size());
    for (auto x : v) {
      if constexpr (std::is_same_v<T, bool>)
        put<std::uint8_t>(b, x ? 1 : 0);
      else
        put<T>(b, x);
    }
    kv_raw(key, 9, b);
  }
  void kv_strings(std::string_view key, std::vector<std::string> const& v) {
    Bytes b;
    put<std::uint32_t>(b, 8);
    put<std::uint64_t>(b, v.size());
    for (auto const& s : v) put_string(b, s);
    kv_raw(key, 9, b);
  }
  void tensor(std::string name, std::vector<std::int64_t> ne, GgmlType type, Bytes data) {
    tensors.push_back({std::move(name), std::move(ne), static_cast<std::uint32_t>(type),
                       std::move(data), std::nullopt});
  }

  [[nodiscard]] Bytes bytes() const {
    Bytes out;
    for (char c : std::string_view("GGUF")) out.push_back(static_cast<std::byte>(c));
    put<std::uint32_t>(out, version);
    put<std::uint64_t>(out, n_tensors.value_or(tensors.size()));
    put<std::uint64_t>(out, n_kv.value_or(kvs.size()));
    for (auto const& e : kvs) out.insert(out.end(), e.begin(), e.end());
    std::vector<std::uint64_t> offsets;
    std::uint64_t off = 0;
    for (auto const& t : tensors) {
      offsets.push_back(t.offset.value_or(off));
      off += (t.data.size() + alignment - 1) / alignment * alignment;
    }
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      auto const& t = tensors[i];
      put_string(out, t.name);
      put<std::uint32_t>(out, static_cast<std::uint32_t>(t.ne.size()));
      for (auto d : t.ne) put<std::int64_t>(out, d);
      put<std::uint32_t>(out, t.type);
      put<std::uint64_t>(out, offsets[i]);
    }
    if (!tensors.empty()) out.resize((out.size() + alignment - 1) / alignment * alignment);
    std::uint64_t data_start = out.size();
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      // Packed layout; an overridden offset does not move the data.
      out.resize(data_start);
      out.insert(out.end(), tensors[i].data.begin(), tensors[i].data.end());
      out.resize((out.size() + alignment - 1) / alignment * alignment);
      data_start = out.size();
    }
    return out;
  }
};

GgufFile parse(Bytes const& b) { return GgufFile::from_bytes(b, kName); }

Bytes iota_bytes(std::size_t n, int seed = 0) {
  Bytes b(n);
  for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<std::byte>((i * 7 + seed) & 0xFF);
  return b;
}

/// A small valid file with one of each kind of thing.
GgufWriter sample() {
  GgufWriter w;
  w.kv_string("general.architecture", "qwen35moe");
  w.kv<std::uint32_t>("qwen35moe.block_count", 4);
  w.kv<float>("qwen35moe.rope.freq_base", 1e7f);
  w.kv_array<std::int32_t>("qwen35moe.rope.dimension_sections", {11, 11, 10, 0});
  w.kv_strings("tokenizer.ggml.tokens", {"a", "b", "", "Ġthe"});
  w.tensor("token_embd.weight", {8, 3}, GgmlType::kF32, iota_bytes(8 * 3 * 4));
  w.tensor("blk.0.attn_q.weight", {64, 2}, GgmlType::kQ8_0, iota_bytes(2 * 2 * 34, 1));
  w.tensor("output_norm.weight", {8}, GgmlType::kBF16, iota_bytes(16, 2));
  return w;
}

void expect_parse_error(Bytes const& b, std::initializer_list<std::string> parts) {
  std::vector<std::string> all(parts);
  all.push_back(kName);
  try {
    (void)parse(b);
  } catch (Error const& e) {
    std::string const msg = e.what();
    INFO("message: ", msg);
    for (auto const& p : all) CHECK_MESSAGE(msg.find(p) != std::string::npos, "lacks '", p, "'");
    return;
  }
  FAIL("no Error thrown (expected one mentioning '", *parts.begin(), "')");
}

}  // namespace

// --- the format -------------------------------------------------------------------------------

TEST_CASE("ggml type table: ids, names, block sizes and bytes (gguf-py GGML_QUANT_SIZES)") {
  struct Want {
    std::uint32_t id;
    char const* name;
    std::int64_t block, bytes;
  };
  for (auto const& w : {Want{0, "F32", 1, 4}, Want{1, "F16", 1, 2}, Want{30, "BF16", 1, 2},
                        Want{8, "Q8_0", 32, 34}, Want{12, "Q4_K", 256, 144},
                        Want{14, "Q6_K", 256, 210}, Want{2, "Q4_0", 32, 18},
                        Want{3, "Q4_1", 32, 20}, Want{6, "Q5_0", 32, 22}, Want{7, "Q5_1", 32, 24},
                        Want{13, "Q5_K", 256, 176}, Want{10, "Q2_K", 256, 84},
                        Want{11, "Q3_K", 256, 110}, Want{23, "IQ4_XS", 256, 136},
                        Want{15, "Q8_K", 256, 292}}) {
    CAPTURE(w.name);
    auto const* info = ggml_type_info(w.id);
    REQUIRE(info != nullptr);
    CHECK(info->name == w.name);
    CHECK(info->block_size == w.block);
    CHECK(info->block_bytes == w.bytes);
    CHECK(to_string(info->type) == w.name);
    CHECK(parse_ggml_type(w.name) == info->type);
  }
  // The block structs the kernels use agree with the table.
  CHECK(ggml_type_info(GgmlType::kQ8_0).block_bytes == sizeof(gguf::BlockQ8_0));
  CHECK(ggml_type_info(GgmlType::kQ4_K).block_bytes == sizeof(gguf::BlockQ4K));
  CHECK(ggml_row_bytes(GgmlType::kQ4_K, 512) == 288);
  for (std::uint32_t removed : {4u, 5u, 31u, 32u, 33u, 36u, 37u, 38u, 43u, 1000u})
    CHECK(ggml_type_info(removed) == nullptr);
  CHECK(to_string(static_cast<GgmlType>(4)) == "unknown");
  CHECK(to_string(GgufValueType::kF32) == "float32");
  CHECK(to_string(GgufValueType::kString) == "string");
}

TEST_CASE("a written file round-trips: metadata of every type, tensors, alignment") {
  GgufWriter w;
  w.kv_string("general.architecture", "qwen3moe");
  w.kv<std::uint8_t>("t.u8", 200);
  w.kv<std::int8_t>("t.i8", -100);
  w.kv<std::uint16_t>("t.u16", 60000);
  w.kv<std::int16_t>("t.i16", -30000);
  w.kv<std::uint32_t>("t.u32", 4000000000u);
  w.kv<std::int32_t>("t.i32", -2000000000);
  w.kv<std::uint64_t>("t.u64", 1ull << 40);
  w.kv<std::int64_t>("t.i64", -(1ll << 40));
  w.kv<float>("t.f32", 1.5f);
  w.kv<double>("t.f64", -2.25);
  w.kv<bool>("t.bool", true);
  w.kv_string("t.string", "héllo");
  w.kv_string("t.empty_string", "");
  w.kv_array<std::int32_t>("t.arr_i32", {11, 11, 10, 0});
  w.kv_array<float>("t.arr_f32", {0.5f, -1.0f});
  w.kv_array<bool>("t.arr_bool", {true, false, true});
  w.kv_array<std::uint64_t>("t.arr_u64", {});
  w.kv_strings("t.arr_str", {"Ġa", "", "<|im_end|>"});
  w.tensor("f32", {8, 3}, GgmlType::kF32, iota_bytes(96));
  w.tensor("f16", {5}, GgmlType::kF16, iota_bytes(10, 1));
  w.tensor("bf16", {2, 3, 4, 5}, GgmlType::kBF16, iota_bytes(240, 2));
  w.tensor("q8_0", {64, 3}, GgmlType::kQ8_0, iota_bytes(6 * 34, 3));
  w.tensor("q4_k", {512, 2, 2}, GgmlType::kQ4_K, iota_bytes(8 * 144, 4));
  w.tensor("q6_k", {256}, GgmlType::kQ6_K, iota_bytes(210, 5));
  w.tensor("iq4_xs", {256}, GgmlType::kIQ4_XS, iota_bytes(136, 6));

  for (std::uint32_t version : {3u, 2u}) {
    CAPTURE(version);
    w.version = version;
    Bytes const b = w.bytes();
    GgufFile f = parse(b);
    CHECK(f.version() == version);
    CHECK(f.path() == kName);
    CHECK(f.alignment() == 32);
    CHECK(f.data_offset() % 32 == 0);
    CHECK(f.architecture() == "qwen3moe");
    CHECK(f.arch_key("block_count") == "qwen3moe.block_count");

    REQUIRE(f.metadata().size() == w.kvs.size());
    CHECK(f.metadata()[1].key == "t.u8");  // file order
    CHECK(f.get<std::uint8_t>("t.u8") == 200);
    CHECK(f.get<std::int8_t>("t.i8") == -100);
    CHECK(f.get<std::uint16_t>("t.u16") == 60000);
    CHECK(f.get<std::int16_t>("t.i16") == -30000);
    CHECK(f.get_u32("t.u32") == 4000000000u);
    CHECK(f.get_i32("t.i32") == -2000000000);
    CHECK(f.get_u64("t.u64") == 1ull << 40);
    CHECK(f.get<std::int64_t>("t.i64") == -(1ll << 40));
    CHECK(f.get_f32("t.f32") == 1.5f);
    CHECK(f.get<double>("t.f64") == -2.25);
    CHECK(f.get_bool("t.bool"));
    CHECK(f.get_string("t.string") == "héllo");
    CHECK(f.get_string("t.empty_string").empty());
    // Lenient integer / float reads.
    CHECK(f.get_int("t.u32") == 4000000000ll);
    CHECK(f.get_int("t.i8") == -100);
    CHECK(f.get_int("t.u64") == 1ll << 40);
    CHECK(f.get_float("t.f32") == 1.5);
    CHECK(f.get_float("t.f64") == -2.25);
    // Arrays.
    CHECK(f.get_array<std::int32_t>("t.arr_i32") == std::vector<std::int32_t>{11, 11, 10, 0});
    CHECK(f.get_int_array("t.arr_i32") == std::vector<std::int64_t>{11, 11, 10, 0});
    CHECK(f.get_array<float>("t.arr_f32") == std::vector<float>{0.5f, -1.0f});
    CHECK(f.get_array<bool>("t.arr_bool") == std::vector<bool>{true, false, true});
    CHECK(f.get_array<std::uint64_t>("t.arr_u64").empty());
    CHECK(f.array_size("t.arr_str") == 3);
    auto const strs = f.get_string_array("t.arr_str");
    REQUIRE(strs.size() == 3);
    CHECK(strs[0] == "Ġa");
    CHECK(strs[1].empty());
    CHECK(strs[2] == "<|im_end|>");
    CHECK(f.get_array<std::string_view>("t.arr_str").size() == 3);
    // Optional reads.
    CHECK_FALSE(f.find_u32("absent").has_value());
    CHECK_FALSE(f.find_int("absent").has_value());
    CHECK_FALSE(f.find_array<float>("absent").has_value());
    CHECK(f.find_u32("t.u32") == 4000000000u);
    CHECK(f.find_string("t.string") == "héllo");
    CHECK(f.find_float("t.f64") == -2.25);
    CHECK_FALSE(f.has("absent"));
    // Dumps.
    CHECK(format_value(*f.find_kv("t.arr_i32")) == "[11, 11, 10, 0]");
    CHECK(format_value(*f.find_kv("t.arr_i32"), 2) == "[11, 11, ... (4 total)]");
    CHECK(format_value(*f.find_kv("t.string")) == "\"héllo\"");
    CHECK(format_value(*f.find_kv("t.bool")) == "true");
    CHECK(f.find_kv("t.arr_str")->type_name() == "array of string");

    // Tensors: order, types, shapes, bytes, data in place.
    REQUIRE(f.tensors().size() == w.tensors.size());
    std::size_t total = 0;
    for (std::size_t i = 0; i < w.tensors.size(); ++i) {
      auto const& want = w.tensors[i];
      GgufTensor const& t = f.tensors()[i];
      CAPTURE(want.name);
      CHECK(t.name == want.name);
      CHECK(static_cast<std::uint32_t>(t.type) == want.type);
      CHECK(t.n_dims == static_cast<int>(want.ne.size()));
      for (std::size_t d = 0; d < 4; ++d)
        CHECK(t.ne[d] == (d < want.ne.size() ? want.ne[d] : 1));
      REQUIRE(t.bytes() == want.data.size());
      CHECK(std::memcmp(t.data.data(), want.data.data(), t.bytes()) == 0);
      CHECK(t.offset % 32 == 0);
      CHECK(static_cast<std::size_t>(t.data.data() - b.data()) == f.data_offset() + t.offset);
      CHECK(t.file == &f.path());
      CHECK(f.find_tensor(want.name) == &t);
      total += t.bytes();
    }
    CHECK(f.weight_bytes() == total);
    GgufTensor const& bf = f.tensor("bf16");
    CHECK(bf.numel() == 120);
    CHECK(bf.rows() == 60);
    CHECK(bf.row_bytes() == 4);
    CHECK(bf.shape() == Shape{5, 4, 3, 2});  // PyTorch order
    CHECK(format_ne(bf) == "{2, 3, 4, 5}");
    CHECK(f.tensor("q4_k").row_bytes() == 288);
    CHECK(f.find_tensor("absent") == nullptr);
    expect_error([&] { (void)f.tensor("absent"); }, {kName, "no tensor 'absent'"});
  }
}

TEST_CASE("general.alignment sets the padding and the offset rule") {
  GgufWriter w = sample();
  w.alignment = 64;
  w.kv<std::uint32_t>("general.alignment", 64);
  Bytes const b = w.bytes();
  GgufFile f = parse(b);
  CHECK(f.alignment() == 64);
  CHECK(f.data_offset() % 64 == 0);
  for (auto const& t : f.tensors()) CHECK(t.offset % 64 == 0);

  SUBCASE("not uint32") {
    GgufWriter bad = sample();
    bad.kv<std::uint64_t>("general.alignment", 32);
    expect_parse_error(bad.bytes(), {"'general.alignment'", "expected uint32, got uint64"});
  }
  SUBCASE("not a power of two") {
    for (std::uint32_t a : {0u, 48u}) {
      GgufWriter bad = sample();
      bad.kv<std::uint32_t>("general.alignment", a);
      expect_parse_error(bad.bytes(), {"'general.alignment'", "not a power of 2"});
    }
  }
  SUBCASE("offsets that are not multiples of it") {
    GgufWriter bad = sample();
    bad.tensors[1].offset = 96 + 16;
    expect_parse_error(bad.bytes(),
                       {"tensor 'blk.0.attn_q.weight'", "not a multiple of the alignment 32"});
  }
}

TEST_CASE("a file on disk: mapped, named in errors, tensors valid after a move") {
  TempDir dir;
  Bytes const b = sample().bytes();
  dir.write("m.gguf", std::string(reinterpret_cast<char const*>(b.data()), b.size()));
  GgufFile f(dir.file("m.gguf"));
  auto const* data = f.tensor("output_norm.weight").data.data();
  GgufFile moved = std::move(f);
  CHECK(moved.path() == dir.file("m.gguf"));
  GgufTensor const& t = moved.tensor("output_norm.weight");
  CHECK(t.data.data() == data);
  CHECK(*t.file == dir.file("m.gguf"));
  CHECK(std::memcmp(t.data.data(), iota_bytes(16, 2).data(), 16) == 0);
  expect_error([&] { (void)moved.get_u32("general.architecture"); },
               {dir.file("m.gguf"), "'general.architecture'", "expected uint32, got string"});

  dir.write("bad.gguf", "GGUX");
  expect_error([&] { GgufFile g(dir.file("bad.gguf")); }, {dir.file("bad.gguf"), "bad magic"});
  expect_error([&] { GgufFile g(dir.file("absent.gguf")); }, {dir.file("absent.gguf")});
}

// --- getters on the wrong type -----------------------------------------------------------------

TEST_CASE("typed getters name the key and the expected and actual types") {
  Bytes const b = sample().bytes();
  GgufFile f = parse(b);
  expect_error([&] { (void)f.get_i32("qwen35moe.block_count"); },
               {kName, "'qwen35moe.block_count'", "expected int32, got uint32"});
  expect_error([&] { (void)f.find_f32("qwen35moe.block_count"); },
               {"'qwen35moe.block_count'", "expected float32, got uint32"});
  expect_error([&] { (void)f.get_u32("qwen35moe.missing"); },
               {kName, "'qwen35moe.missing' is missing", "uint32"});
  expect_error([&] { (void)f.get_string("tokenizer.ggml.tokens"); },
               {"'tokenizer.ggml.tokens'", "expected string, got array of string"});
  expect_error([&] { (void)f.get_array<std::int32_t>("tokenizer.ggml.tokens"); },
               {"'tokenizer.ggml.tokens'", "expected array of int32, got array of string"});
  expect_error([&] { (void)f.get_array<std::uint32_t>("qwen35moe.rope.dimension_sections"); },
               {"expected array of uint32, got array of int32"});
  expect_error([&] { (void)f.get_string_array("qwen35moe.block_count"); },
               {"expected array of string, got uint32"});
  expect_error([&] { (void)f.get_int("qwen35moe.rope.freq_base"); },
               {"'qwen35moe.rope.freq_base'", "expected an integer, got float32"});
  expect_error([&] { (void)f.get_float("qwen35moe.block_count"); },
               {"expected float32 or float64, got uint32"});
  expect_error([&] { (void)f.get_int_array("tokenizer.ggml.tokens"); },
               {"expected an array of integers, got array of string"});
  expect_error([&] { (void)f.array_size("qwen35moe.block_count"); },
               {"expected an array, got uint32"});

  GgufWriter w;
  w.kv<std::uint64_t>("big", ~0ull);
  Bytes const b2 = w.bytes();
  GgufFile g = parse(b2);
  expect_error([&] { (void)g.get_int("big"); }, {"'big'", "exceeds INT64_MAX"});
  expect_error([&] { (void)g.architecture(); }, {"'general.architecture' is missing"});
}

// --- malformed files ---------------------------------------------------------------------------

TEST_CASE("every truncation of a valid file is an Error naming the file") {
  Bytes const b = sample().bytes();
  REQUIRE_NOTHROW((void)parse(b));
  // The last tensor's data ends before the final padding; cutting only padding is valid.
  GgufFile const f = parse(b);
  std::size_t const end = static_cast<std::size_t>(
      f.data_offset() + f.tensors().back().offset + f.tensors().back().bytes());
  for (std::size_t n = 0; n < end; ++n) {
    CAPTURE(n);
    Bytes const cut(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(n));
    CHECK_THROWS_WITH_AS((void)parse(cut), doctest::Contains(kName), Error);
  }
}

TEST_CASE("bad header: magic, version, counts") {
  expect_parse_error({}, {"shorter than the 4-byte magic"});
  Bytes b = sample().bytes();
  {
    Bytes m = b;
    m[3] = std::byte{'X'};
    expect_parse_error(m, {"bad magic 0x47475558", "expected \"GGUF\""});
  }
  GgufWriter w = sample();
  w.version = 1;
  expect_parse_error(w.bytes(), {"GGUF version 1 is not supported"});
  w.version = 4;
  expect_parse_error(w.bytes(), {"unsupported GGUF version 4", "supported: 2, 3"});
  w.version = 0x03000000;
  expect_parse_error(w.bytes(), {"big-endian"});
  w = sample();
  w.n_kv = 1ull << 62;
  expect_parse_error(w.bytes(), {"'n_kv' = 4611686018427387904", "cannot fit"});
  w = sample();
  w.n_kv = ~0ull;
  expect_parse_error(w.bytes(), {"'n_kv'"});
  w = sample();
  w.n_tensors = 1ull << 40;
  expect_parse_error(w.bytes(), {"'n_tensors' = 1099511627776", "cannot fit"});
  w = sample();
  w.n_tensors = 4;  // one more than there are: its info is read from the data section
  expect_parse_error(w.bytes(), {"tensor"});
}

TEST_CASE("bad metadata: lengths, counts, types, keys") {
  SUBCASE("string length beyond the file") {
    GgufWriter w = sample();
    Bytes body;
    put<std::uint64_t>(body, 1ull << 40);
    w.kv_raw("general.name", 8, body);
    expect_parse_error(w.bytes(), {"metadata 'general.name'", "string length 1099511627776",
                                   "exceeds the"});
  }
  SUBCASE("key length beyond the file") {
    GgufWriter w = sample();
    Bytes e;
    put<std::uint64_t>(e, ~0ull);
    w.kvs.insert(w.kvs.begin() + 1, e);
    expect_parse_error(w.bytes(), {"metadata entry 1", "string length 18446744073709551615"});
  }
  SUBCASE("array counts beyond the file") {
    GgufWriter w = sample();
    Bytes body;
    put<std::uint32_t>(body, 5);  // int32
    put<std::uint64_t>(body, 1ull << 61);
    w.kv_raw("qwen35moe.big", 9, body);
    expect_parse_error(w.bytes(), {"metadata 'qwen35moe.big'", "array of int32",
                                   "2305843009213693952 elements"});
    GgufWriter s = sample();
    Bytes sb;
    put<std::uint32_t>(sb, 8);
    put<std::uint64_t>(sb, 1ull << 50);
    s.kv_raw("tokenizer.ggml.merges", 9, sb);
    expect_parse_error(s.bytes(), {"metadata 'tokenizer.ggml.merges'", "strings cannot fit"});
  }
  SUBCASE("a string element beyond the file") {
    GgufWriter w = sample();
    Bytes body;
    put<std::uint32_t>(body, 8);
    put<std::uint64_t>(body, 2);
    put_string(body, "ok");
    put<std::uint64_t>(body, 1ull << 33);
    w.kv_raw("tokenizer.ggml.merges", 9, body);
    expect_parse_error(w.bytes(), {"metadata 'tokenizer.ggml.merges' element 1", "string length"});
  }
  SUBCASE("unknown value types and nested arrays") {
    GgufWriter w = sample();
    w.kv_raw("x.bad", 13, {});
    expect_parse_error(w.bytes(), {"metadata 'x.bad'", "value type 13 is not a GGUF value type"});
    GgufWriter a = sample();
    Bytes body;
    put<std::uint32_t>(body, 0xFFFFFFFFu);
    put<std::uint64_t>(body, 1);
    a.kv_raw("x.bad_elem", 9, body);
    expect_parse_error(a.bytes(), {"metadata 'x.bad_elem'", "array element type 4294967295"});
    GgufWriter n = sample();
    Bytes nb;
    put<std::uint32_t>(nb, 9);
    put<std::uint64_t>(nb, 1);
    n.kv_raw("x.nested", 9, nb);
    expect_parse_error(n.bytes(), {"metadata 'x.nested'", "nested arrays"});
  }
  SUBCASE("empty and duplicate keys") {
    GgufWriter w = sample();
    w.kv<std::uint32_t>("", 1);
    expect_parse_error(w.bytes(), {"metadata entry 5", "empty key"});
    GgufWriter d = sample();
    d.kv<std::uint32_t>("qwen35moe.block_count", 5);
    expect_parse_error(d.bytes(), {"'qwen35moe.block_count' appears twice", "entries 1 and 5"});
  }
  SUBCASE("a value cut by the end of the file") {
    GgufWriter w;
    w.kv_raw("x.u64", 10, {std::byte{1}, std::byte{2}});
    expect_parse_error(w.bytes(), {"metadata 'x.u64'", "needs 8 bytes"});
  }
}

TEST_CASE("bad tensor infos: dims, shapes, types, names") {
  auto with = [](auto&& change) {
    GgufWriter w = sample();
    change(w.tensors[1]);
    return w.bytes();
  };
  std::string const t = "tensor 'blk.0.attn_q.weight'";
  expect_parse_error(with([](auto& x) { x.ne = {64, 2, 1, 1, 1}; }),
                     {t, "n_dims 5 exceeds ggml's maximum of 4"});
  expect_parse_error(with([](auto& x) { x.ne = {64, 0}; }), {t, "ne[1] = 0 (must be >= 1)"});
  expect_parse_error(with([](auto& x) { x.ne = {-64, 2}; }), {t, "ne[0] = -64"});
  expect_parse_error(with([](auto& x) { x.ne = {1ll << 32, 1ll << 31, 2}; }),
                     {t, "more than 2^63 - 1 elements"});
  expect_parse_error(with([](auto& x) {
                       x.type = 0;
                       x.ne = {1ll << 31, 1ll << 31};
                     }),
                     {t, "{2147483648, 2147483648} of F32 has a byte size above 2^63 - 1"});
  expect_parse_error(with([](auto& x) { x.type = 4; }), {t, "unknown ggml type id 4"});
  expect_parse_error(with([](auto& x) { x.type = 99; }), {t, "unknown ggml type id 99"});
  expect_parse_error(with([](auto& x) { x.ne = {33, 2}; }),
                     {t, "ne[0] = 33 is not a multiple of Q8_0's block size 32"});
  expect_parse_error(with([](auto& x) { x.offset = 1ull << 40; }),
                     {t, "runs past the end of the", "data section"});
  expect_parse_error(with([](auto& x) { x.offset = ~0ull - 31; }), {t, "runs past the end"});
  expect_parse_error(with([](auto& x) { x.offset = 0; }),
                     {"tensors 'token_embd.weight'", "and 'blk.0.attn_q.weight'", "overlap"});
  expect_parse_error(with([](auto& x) { x.name = "token_embd.weight"; }),
                     {"tensor 'token_embd.weight' appears twice (tensor infos 0 and 1)"});
  expect_parse_error(with([](auto& x) { x.name = ""; }), {"tensor info 1", "empty tensor name"});

  SUBCASE("data section start past the end of the file") {
    GgufWriter w;
    w.tensor("x", {1}, GgmlType::kF32, {});
    Bytes b = w.bytes();
    // Drop the padding and the data: the infos end at a non-aligned offset at the file end.
    b.resize(4 + 4 + 8 + 8 + 8 + 1 + 4 + 8 + 4 + 8);
    expect_parse_error(b, {"data section would start at offset 64", "past the end"});
  }
  SUBCASE("zero-dimensional tensors hold one value") {
    GgufWriter w;
    w.tensor("scalar", {}, GgmlType::kF32, iota_bytes(4));
    Bytes const b = w.bytes();
    GgufFile f = parse(b);
    CHECK(f.tensor("scalar").numel() == 1);
    CHECK(f.tensor("scalar").bytes() == 4);
    CHECK(f.tensor("scalar").shape().rank == 0);
  }
}

// --- tokenizer ---------------------------------------------------------------------------------

namespace {

/// tokenizer.ggml.* from a tokenizer.json, as llama.cpp's converter writes them
/// (conversion/base.py get_vocab_base + gguf.SpecialVocab): every id below `vocab_size`,
/// holes as "[PAD<id>]" of type UNUSED, added tokens as CONTROL (special, or looking like
/// <|...|>) or USER_DEFINED, the rest NORMAL; merges as "a b" strings.
void add_tokenizer_metadata(GgufWriter& w, Json const& j, std::string_view pre,
                            std::int64_t vocab_size) {
  std::vector<std::string> tokens(static_cast<std::size_t>(vocab_size));
  std::vector<std::int32_t> types(tokens.size(), 5);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = "[PAD" + std::to_string(i) + "]";
  for (auto const& [tok, id] : j.at("model").at("vocab").items()) {
    tokens[id.get<std::size_t>()] = tok;
    types[id.get<std::size_t>()] = 1;
  }
  for (auto const& a : j.at("added_tokens")) {
    auto const id = a.at("id").get<std::size_t>();
    std::string const c = a.at("content").get<std::string>();
    tokens[id] = c;
    bool const looks = c.starts_with("<|") && c.ends_with("|>");
    types[id] = a.at("special").get<bool>() || looks ? 3 : 4;
  }
  std::vector<std::string> merges;
  for (auto const& m : j.at("model").at("merges"))
    merges.push_back(m.is_string() ? m.get<std::string>()
                                   : m[0].get<std::string>() + " " + m[1].get<std::string>());
  w.kv_string("tokenizer.ggml.model", "gpt2");
  w.kv_string("tokenizer.ggml.pre", pre);
  w.kv_strings("tokenizer.ggml.tokens", tokens);
  w.kv_array<std::int32_t>("tokenizer.ggml.token_type", types);
  w.kv_strings("tokenizer.ggml.merges", merges);
}

/// Every fixture text gives the same ids (and each id the same token) through both loaders.
void check_same_as_json(Tokenizer const& from_gguf, Tokenizer const& from_json) {
  Json const cases = read_json_file(QFLASH_FIXTURES_DIR "/tokenizer/encodings.json");
  REQUIRE(cases.size() > 0);
  for (std::size_t i = 0; i < cases.size(); ++i) {
    std::string const text = cases[i].at("text").get<std::string>();
    auto const want = cases[i].at("ids").get<std::vector<std::int32_t>>();
    CAPTURE(text);
    auto const ids = from_gguf.encode(text);
    CHECK(ids == want);
    CHECK(from_gguf.encode(text, false) == from_json.encode(text, false));
    CHECK(from_gguf.decode(want) == from_json.decode(want));
    CHECK(from_gguf.decode(want, true) == from_json.decode(want, true));
  }
  CHECK(from_gguf.vocab_size() == from_json.vocab_size());
  for (std::int32_t id = 0; id < from_json.vocab_size(); ++id) {
    CAPTURE(id);
    CHECK(from_gguf.token(id) == from_json.token(id));
    CHECK(from_gguf.token_bytes(id) == from_json.token_bytes(id));
    CHECK(from_gguf.is_special(id) == from_json.is_special(id));
    CHECK(from_gguf.is_added(id) == from_json.is_added(id));
  }
}

}  // namespace

TEST_CASE("Tokenizer::from_gguf equals the tokenizer.json it was converted from") {
  std::string const path = QFLASH_FIXTURES_DIR "/tokenizer/tokenizer.json";
  Json const j = read_json_file(path);
  auto const from_json = Tokenizer::from_file(path);
  GgufWriter w;
  w.kv_string("general.architecture", "qwen35moe");
  add_tokenizer_metadata(w, j, "qwen35", from_json.vocab_size() + 5);  // padded like a model
  w.kv<std::uint32_t>("tokenizer.ggml.eos_token_id", 1026);
  w.kv<std::uint32_t>("tokenizer.ggml.padding_token_id", 1024);
  w.kv<bool>("tokenizer.ggml.add_bos_token", false);
  Bytes const b = w.bytes();
  GgufFile f = parse(b);
  auto const tok = Tokenizer::from_gguf(f);
  CHECK(tok.source() == kName);
  // The [PAD] fill is not part of the vocabulary: ids past it are holes, as in the json.
  CHECK(tok.vocab_size() == from_json.vocab_size());
  check_same_as_json(tok, from_json);
  CHECK(tok.token_id("<|im_end|>") == 1026);

  auto const special = gguf_special_tokens(f);
  CHECK(special.eos == 1026);
  CHECK(special.pad == 1024);
  CHECK_FALSE(special.bos.has_value());
  CHECK(special.add_bos == false);
  CHECK_FALSE(special.add_eos.has_value());
}

TEST_CASE("Tokenizer::from_gguf: the qwen2 pre-tokenizer splits combining marks, qwen35 not") {
  // Ids 0..255 are the bytes; 256 = U+0301 (CC 81), 257 = "x" + U+0301, which has no NFC
  // composite. "qwen35" keeps a letter with its marks in one piece, so it can merge them;
  // "qwen2" (\p{L}+ without \p{M}) cuts before the mark.
  auto bl = [](std::string_view bytes) {
    std::string s;
    qflash::io::detail::append_byte_level(s, bytes);
    return s;
  };
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.push_back(bl(std::string(1, static_cast<char>(b))));
  tokens.push_back(bl("\xCC\x81"));
  tokens.push_back(bl("x\xCC\x81"));
  auto build = [&](std::string_view pre) {
    GgufWriter w;
    w.kv_string("tokenizer.ggml.model", "gpt2");
    w.kv_string("tokenizer.ggml.pre", pre);
    w.kv_strings("tokenizer.ggml.tokens", tokens);
    w.kv_strings("tokenizer.ggml.merges", {bl("\xCC") + " " + bl("\x81"), bl("x") + " " + tokens[256]});
    return w.bytes();
  };
  Bytes const b2 = build("qwen2"), b35 = build("qwen35");
  auto const t2 = Tokenizer::from_gguf(parse(b2));
  auto const t35 = Tokenizer::from_gguf(parse(b35));
  std::string const text = "x\xCC\x81 x\xCC\x81";
  CHECK(t35.encode(text) == std::vector<std::int32_t>{257, ' ', 257});
  CHECK(t2.encode(text) == std::vector<std::int32_t>{'x', 256, ' ', 'x', 256});
  CHECK(t2.decode(t2.encode(text)) == text);
  CHECK(t2.vocab_size() == 258);
}

TEST_CASE("Tokenizer::from_gguf rejects what it cannot reproduce, naming the key") {
  Json const j = read_json_file(QFLASH_FIXTURES_DIR "/tokenizer/tokenizer.json");
  auto fails = [&](auto&& change, std::initializer_list<std::string> parts) {
    GgufWriter w;
    add_tokenizer_metadata(w, j, "qwen35", 1027);
    change(w);
    Bytes const b = w.bytes();
    GgufFile f = parse(b);
    expect_error([&] { (void)Tokenizer::from_gguf(f); }, parts);
  };
  auto replace = [](GgufWriter& w, std::string_view key, auto&& add) {
    GgufWriter tmp;
    add(tmp);
    for (auto& e : w.kvs) {
      std::uint64_t n;
      std::memcpy(&n, e.data(), 8);
      if (std::string_view(reinterpret_cast<char const*>(e.data() + 8), n) == key) e = tmp.kvs[0];
    }
  };
  fails([&](GgufWriter& w) { replace(w, "tokenizer.ggml.pre", [](GgufWriter& t) {
          t.kv_string("tokenizer.ggml.pre", "llama-bpe"); }); },
        {kName, "'tokenizer.ggml.pre'", "\"llama-bpe\"", "qwen2", "qwen35"});
  fails([&](GgufWriter& w) { replace(w, "tokenizer.ggml.model", [](GgufWriter& t) {
          t.kv_string("tokenizer.ggml.model", "llama"); }); },
        {kName, "'tokenizer.ggml.model'", "\"llama\"", "gpt2"});
  fails([&](GgufWriter& w) { replace(w, "tokenizer.ggml.token_type", [](GgufWriter& t) {
          t.kv_array<std::int32_t>("tokenizer.ggml.token_type", {1, 1}); }); },
        {"'tokenizer.ggml.token_type'", "2 entries", "1027 tokens"});
  fails([&](GgufWriter& w) { replace(w, "tokenizer.ggml.token_type", [](GgufWriter& t) {
          t.kv_array<std::int32_t>("tokenizer.ggml.token_type", std::vector<std::int32_t>(1027, 6)); }); },
        {"'tokenizer.ggml.token_type'", "element 0", "type 6"});
  fails([&](GgufWriter& w) { replace(w, "tokenizer.ggml.merges", [](GgufWriter& t) {
          t.kv_strings("tokenizer.ggml.merges", {"Ġ t", "nope"}); }); },
        {"'tokenizer.ggml.merges' element 1", "\"nope\""});
  fails([&](GgufWriter& w) { replace(w, "tokenizer.ggml.merges", [](GgufWriter& t) {
          t.kv_strings("tokenizer.ggml.merges", {"zz qq"}); }); },
        {"'tokenizer.ggml.merges' element 0", "not a token"});
  fails([&](GgufWriter& w) { replace(w, "tokenizer.ggml.tokens", [](GgufWriter& t) {
          t.kv_array<std::int32_t>("tokenizer.ggml.tokens", {1}); }); },
        {"'tokenizer.ggml.tokens'", "expected array of string, got array of int32"});
  GgufWriter none;
  none.kv_string("general.architecture", "qwen35moe");
  Bytes const nb = none.bytes();
  expect_error([&] { (void)Tokenizer::from_gguf(parse(nb)); },
               {kName, "'tokenizer.ggml.model' is missing"});
}

// --- fixtures made by llama.cpp ----------------------------------------------------------------

namespace {

std::string const kGgufDir = QFLASH_FIXTURES_DIR "/gguf";

bool have_fixture(std::string const& name) {
  bool const ok = fs::exists(kGgufDir + "/" + name);
  if (!ok) MESSAGE("missing fixture ", name, "; make it with tools/make_gguf_fixtures.py");
  return ok;
}

}  // namespace

TEST_CASE("llama.cpp fixtures: every file parses, with the architecture and types expected") {
  struct Fixture {
    char const* file;
    char const* arch;
    char const* hf_dir;
    GgmlType matrix_type;  // the type of the 2-D projection weights
  };
  for (auto const& fx : {
           Fixture{"qwen3_5_moe_tiny-F32.gguf", "qwen35moe", "qwen3_5_moe_tiny", GgmlType::kF32},
           Fixture{"qwen3_5_moe_tiny-BF16.gguf", "qwen35moe", "qwen3_5_moe_tiny", GgmlType::kBF16},
           Fixture{"qwen3_moe_tiny-F32.gguf", "qwen3moe", "qwen3_moe_tiny", GgmlType::kF32},
           Fixture{"qwen3_moe_tiny-BF16.gguf", "qwen3moe", "qwen3_moe_tiny", GgmlType::kBF16},
           Fixture{"qwen3_5_moe_256-Q8_0.gguf", "qwen35moe", "qwen3_5_moe_256", GgmlType::kQ8_0},
           Fixture{"qwen3_5_moe_256-Q4_K.gguf", "qwen35moe", "qwen3_5_moe_256", GgmlType::kQ4_K},
       }) {
    CAPTURE(fx.file);
    if (!have_fixture(fx.file)) continue;
    GgufFile f(kGgufDir + "/" + fx.file);
    CHECK(f.version() == 3);
    CHECK(f.architecture() == fx.arch);
    Json const cfg = read_json_file(std::string(QFLASH_FIXTURES_DIR "/") + fx.hf_dir + "/config.json");
    auto const hidden = cfg.at("hidden_size").get<std::int64_t>();
    auto const vocab = cfg.at("vocab_size").get<std::int64_t>();
    auto const layers = cfg.at("num_hidden_layers").get<std::int64_t>();
    // transformers 5 writes qwen3_moe's expert count as num_local_experts
    auto const experts =
        cfg.value("num_experts", cfg.value("num_local_experts", std::int64_t{-1}));
    CHECK(f.get_int(f.arch_key("block_count")) == layers);
    CHECK(f.get_int(f.arch_key("embedding_length")) == hidden);
    CHECK(f.get_int(f.arch_key("expert_count")) == experts);
    GgufTensor const& emb = f.tensor("token_embd.weight");
    CHECK(emb.n_dims == 2);
    CHECK(emb.ne[0] == hidden);
    CHECK(emb.ne[1] == vocab);
    CHECK(f.tensor("output.weight").type == fx.matrix_type);
    CHECK(f.tensor("output_norm.weight").type == GgmlType::kF32);
    GgufTensor const& down = f.tensor("blk.0.ffn_down_exps.weight");
    CHECK(down.n_dims == 3);
    CHECK(down.ne[2] == experts);
    CHECK(down.type == fx.matrix_type);
    CHECK(f.array_size("tokenizer.ggml.tokens") == static_cast<std::uint64_t>(vocab));
  }
}

TEST_CASE("llama.cpp fixtures: F32 tensors hold the HF weights (reversed shape)") {
  if (!have_fixture("qwen3_moe_tiny-F32.gguf")) return;
  GgufFile f(kGgufDir + "/qwen3_moe_tiny-F32.gguf");
  SafetensorsFile hf(QFLASH_FIXTURES_DIR "/qwen3_moe_tiny/model.safetensors");
  // Tensors the converter copies unchanged (qwen3moe norms are plain weights).
  for (auto const& [gguf_name, hf_name] :
       {std::pair{"token_embd.weight", "model.embed_tokens.weight"},
        std::pair{"output.weight", "lm_head.weight"},
        std::pair{"blk.1.attn_k.weight", "model.layers.1.self_attn.k_proj.weight"},
        std::pair{"blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"}}) {
    CAPTURE(gguf_name);
    GgufTensor const& t = f.tensor(gguf_name);
    TensorRecord const* r = hf.find(hf_name);
    REQUIRE(r != nullptr);
    CHECK(t.shape() == r->shape);
    REQUIRE(t.bytes() == r->bytes());
    CHECK(std::memcmp(t.data.data(), r->data.data(), t.bytes()) == 0);
  }
}

TEST_CASE("llama.cpp fixtures: the converted tokenizer equals the tokenizer.json") {
  for (auto const& [gguf, json] :
       {std::pair{"tokenizer-qwen35.gguf", "tokenizer/tokenizer.json"},
        std::pair{"qwen3_5_moe_tiny-F32.gguf", "qwen3_5_moe_tiny/tokenizer.json"},
        std::pair{"qwen3_moe_tiny-BF16.gguf", "qwen3_moe_tiny/tokenizer.json"}}) {
    CAPTURE(gguf);
    if (!have_fixture(gguf)) continue;
    GgufFile f(kGgufDir + "/" + gguf);
    auto const tok = Tokenizer::from_gguf(f);
    auto const ref = Tokenizer::from_file(std::string(QFLASH_FIXTURES_DIR "/") + json);
    if (std::string_view(gguf) == "tokenizer-qwen35.gguf") {
      check_same_as_json(tok, ref);
    } else {
      for (char const* text : {"Hello, world!", "déjà vu 123\n\tx", "日本語のテキスト"})
        CHECK(tok.encode(text) == ref.encode(text));
      CHECK(tok.vocab_size() == ref.vocab_size());
    }
  }
}
