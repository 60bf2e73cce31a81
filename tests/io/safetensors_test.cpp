// Safetensors files, HF checkpoints (single file and sharded) and the progress bar, on files
// the tests write themselves, including every malformed case the loader must reject.
#include <doctest/doctest.h>

#include <unistd.h>

#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "support/expect_error.hpp"
#include "support/safetensors_writer.hpp"
#include "support/temp_dir.hpp"
#include "qflash/core/error.hpp"
#include "qflash/io/checkpoint.hpp"
#include "qflash/io/progress.hpp"
#include "qflash/io/safetensors.hpp"
#include "qflash/numeric/bf16.hpp"
#include "qflash/numeric/fp16.hpp"

using namespace qflash;
using namespace qflash::io;
namespace fs = std::filesystem;

namespace {

using qflash::test::TempDir;

using test::data_for;
using test::Entry;
using test::header_for;
using test::to_bytes;
using test::write_raw;
using test::write_safetensors;

/// Writes `header` (a JSON object for the header) verbatim with `data_bytes` bytes of data.
void write_header_json(std::string const& path, nlohmann::json const& header,
                       std::size_t data_bytes) {
  write_raw(path, header.dump(), std::vector<std::byte>(data_bytes));
}

std::uint16_t bf16_bits(float x) {  // truncation is exact for the values used here
  return static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(x) >> 16);
}

Entry f32_entry(std::string name, std::vector<std::int64_t> shape, float base = 0) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = base + static_cast<float>(i);
  return {std::move(name), "F32", std::move(shape), to_bytes(v)};
}

using qflash::test::expect_error;

}  // namespace

TEST_CASE("safetensors round trip: every dtype, metadata, zero-copy spans") {
  TempDir tmp;
  std::string const path = tmp.file("all.safetensors");

  std::vector<float> f32{1.5f, -2.0f, 3.25f, 0.0f, 1e-3f, -7.0f};
  std::vector<std::uint16_t> f16{0x3C00, 0xC000, 0x3800, 0x7BFF};  // 1, -2, 0.5, 65504
  std::vector<std::uint16_t> bf16;
  for (float x : {1.0f, -3.5f, 0.15625f, 1024.0f, -0.0f, 2.5f}) bf16.push_back(bf16_bits(x));
  std::vector<std::int32_t> i32{-1, 7};
  std::vector<std::int64_t> i64{1ll << 40};
  std::vector<std::uint8_t> u8{1, 2, 3, 4, 5};
  std::vector<std::uint8_t> e4m3{0x38, 0xB8, 0x00, 0x7E};
  std::vector<std::uint8_t> e5m2{0x3C, 0xBC, 0x00};
  std::vector<float> scalar{42.0f};

  std::vector<Entry> entries{
      {"w.f32", "F32", {2, 3}, to_bytes(f32)},
      {"w.f16", "F16", {4}, to_bytes(f16)},
      {"w.bf16", "BF16", {3, 2}, to_bytes(bf16)},
      {"w.i32", "I32", {2}, to_bytes(i32)},
      {"w.i64", "I64", {1}, to_bytes(i64)},
      {"w.u8", "U8", {5}, to_bytes(u8)},
      {"w.e4m3", "F8_E4M3", {2, 2}, to_bytes(e4m3)},
      {"w.e5m2", "F8_E5M2", {3, 1, 1, 1}, to_bytes(e5m2)},
      {"w.scalar", "F32", {}, to_bytes(scalar)},
      {"w.empty", "BF16", {0, 4}, {}},
  };
  write_safetensors(path, entries, {{"format", "pt"}, {"note", "test"}});

  SafetensorsFile f(path);
  CHECK(f.path() == path);
  REQUIRE(f.tensors().size() == entries.size());
  CHECK(f.metadata() == std::map<std::string, std::string>{{"format", "pt"}, {"note", "test"}});

  // tensors() is in data order, which is the order written.
  std::map<std::string, DType> const want_dtype{
      {"w.f32", DType::kF32},      {"w.f16", DType::kF16},      {"w.bf16", DType::kBF16},
      {"w.i32", DType::kI32},      {"w.i64", DType::kI64},      {"w.u8", DType::kU8},
      {"w.e4m3", DType::kFp8E4m3}, {"w.e5m2", DType::kFp8E5m2}, {"w.scalar", DType::kF32},
      {"w.empty", DType::kBF16}};
  std::size_t total = 0;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    auto const& e = entries[i];
    auto const& t = f.tensors()[i];
    CAPTURE(e.name);
    CHECK(t.name == e.name);
    CHECK(t.dtype == want_dtype.at(e.name));
    REQUIRE(t.shape.rank == static_cast<int>(e.shape.size()));
    for (int d = 0; d < t.shape.rank; ++d) CHECK(t.shape[d] == e.shape[static_cast<std::size_t>(d)]);
    REQUIRE(t.data.size() == e.data.size());
    CHECK((e.data.empty() || std::memcmp(t.data.data(), e.data.data(), e.data.size()) == 0));
    CHECK(t.file == &f.path());
    CHECK(f.find(e.name) == &t);
    total += e.data.size();
  }
  CHECK(f.find("absent") == nullptr);
  CHECK(f.weight_bytes() == total);
  CHECK(f.find("w.scalar")->numel() == 1);
  CHECK(f.find("w.empty")->numel() == 0);

  // Spans point into the mapping, not a copy: data lies inside the file's byte range.
  std::uintmax_t const file_size = fs::file_size(path);
  auto const* first = f.tensors().front().data.data();
  auto const* last = f.tensors()[entries.size() - 2].data.data();
  CHECK(static_cast<std::uintmax_t>(last - first) < file_size);

  // Converting reads.
  CHECK(read_f32(*f.find("w.f32")) == f32);
  CHECK(read_f32(*f.find("w.f16")) == std::vector<float>{1.0f, -2.0f, 0.5f, 65504.0f});
  CHECK(read_f32(*f.find("w.bf16")) ==
        std::vector<float>{1.0f, -3.5f, 0.15625f, 1024.0f, -0.0f, 2.5f});
  CHECK(read_scalar_f32(*f.find("w.bf16"), 1) == -3.5f);
  CHECK(read_scalar_f32(*f.find("w.f16"), 3) == 65504.0f);
  CHECK(read_scalar_f32(*f.find("w.scalar"), 0) == 42.0f);
  CHECK(read_f32(*f.find("w.empty")).empty());

  // Moving keeps records valid: same mapping, and `file` points at the moved path.
  TensorRecord const* before = f.find("w.f32");
  SafetensorsFile g(std::move(f));
  CHECK(g.find("w.f32") == before);
  CHECK(*g.find("w.f32")->file == path);
  CHECK(read_scalar_f32(*g.find("w.f32"), 2) == 3.25f);
}

TEST_CASE("f16 and bf16 conversion is exact") {
  auto f16_bits_to_f32 = [](std::uint16_t h) { return to_float(Fp16{h}); };
  CHECK(f16_bits_to_f32(0x0000) == 0.0f);
  CHECK(std::signbit(f16_bits_to_f32(0x8000)));
  CHECK(f16_bits_to_f32(0x3C00) == 1.0f);
  CHECK(f16_bits_to_f32(0x3555) == 0.333251953125f);
  CHECK(f16_bits_to_f32(0x0001) == std::ldexp(1.0f, -24));   // smallest subnormal
  CHECK(f16_bits_to_f32(0x03FF) == std::ldexp(1023.0f, -24));  // largest subnormal
  CHECK(f16_bits_to_f32(0x0400) == std::ldexp(1.0f, -14));   // smallest normal
  CHECK(f16_bits_to_f32(0x7BFF) == 65504.0f);
  CHECK(std::isinf(f16_bits_to_f32(0x7C00)));
  CHECK(f16_bits_to_f32(0xFC00) < 0);
  CHECK(std::isnan(f16_bits_to_f32(0x7E00)));
  CHECK(to_float(Bf16{0x3F80}) == 1.0f);
  CHECK(to_float(Bf16{0xC0A0}) == -5.0f);
  CHECK(std::isnan(to_float(Bf16{0x7FC0})));
}

TEST_CASE("converting reads reject other dtypes, wrong sizes and bad indices") {
  TempDir tmp;
  std::string const path = tmp.file("mixed.safetensors");
  std::vector<std::int32_t> i32{1, 2, 3};
  write_safetensors(path, {f32_entry("a.weight", {2, 2}), {"ids", "I32", {3}, to_bytes(i32)}});
  SafetensorsFile f(path);
  std::vector<float> out(3);
  expect_error([&] { read_f32(*f.find("ids"), out); }, {path, "'ids'", "I32"});
  expect_error([&] { (void)read_scalar_f32(*f.find("ids"), 0); }, {path, "'ids'", "I32"});
  expect_error([&] { read_f32(*f.find("a.weight"), out); }, {path, "'a.weight'", "3 floats", "4"});
  expect_error([&] { (void)read_scalar_f32(*f.find("a.weight"), 4); }, {path, "'a.weight'", "4"});
  expect_error([&] { (void)read_scalar_f32(*f.find("a.weight"), -1); }, {path, "'a.weight'"});
}

TEST_CASE("malformed safetensors files give errors naming the file and the tensor or field") {
  TempDir tmp;
  std::string const path = tmp.file("bad.safetensors");
  auto open = [&] { SafetensorsFile f(path); };
  auto const good = std::vector<Entry>{f32_entry("a", {2, 2}), f32_entry("b", {3})};

  SUBCASE("missing file") {
    expect_error(open, {path, "cannot open"});
  }
  SUBCASE("shorter than the length field") {
    std::ofstream(path, std::ios::binary) << "abc";
    expect_error(open, {path, "8-byte"});
  }
  SUBCASE("header length beyond the file size") {
    write_raw(path, header_for(good), data_for(good), 1'000'000);
    expect_error(open, {path, "header length 1000000", "exceeds"});
  }
  SUBCASE("header length zero") {
    write_raw(path, "", {}, 0);
    expect_error(open, {path, "header length is 0"});
  }
  SUBCASE("header is not JSON") {
    write_raw(path, "{\"a\": {\"dtype\": \"F32\",", std::vector<std::byte>(16));
    expect_error(open, {path, "not valid JSON"});
  }
  SUBCASE("header is not an object") {
    write_raw(path, "[1, 2, 3]", {});
    expect_error(open, {path, "must be a JSON object"});
  }
  SUBCASE("entry is not an object") {
    write_header_json(path, {{"a", 5}}, 0);
    expect_error(open, {path, "tensor 'a'", "must be an object"});
  }
  SUBCASE("unknown dtype") {
    write_header_json(path, {{"w", {{"dtype", "Q4_K"}, {"shape", {2}}, {"data_offsets", {0, 2}}}}}, 2);
    expect_error(open, {path, "tensor 'w'", "dtype 'Q4_K'", "BF16"});
  }
  SUBCASE("unsupported dtype") {
    write_header_json(path, {{"w", {{"dtype", "F64"}, {"shape", {1}}, {"data_offsets", {0, 8}}}}}, 8);
    expect_error(open, {path, "tensor 'w'", "'F64'"});
  }
  SUBCASE("dtype not a string") {
    write_header_json(path, {{"w", {{"dtype", 3}, {"shape", {1}}, {"data_offsets", {0, 4}}}}}, 4);
    expect_error(open, {path, "tensor 'w'", "field 'dtype'"});
  }
  SUBCASE("missing shape") {
    write_header_json(path, {{"w", {{"dtype", "F32"}, {"data_offsets", {0, 4}}}}}, 4);
    expect_error(open, {path, "tensor 'w'", "missing field 'shape'"});
  }
  SUBCASE("negative dimension") {
    write_header_json(path, {{"w", {{"dtype", "F32"}, {"shape", {-1, 2}}, {"data_offsets", {0, 4}}}}}, 4);
    expect_error(open, {path, "tensor 'w'", "field 'shape'", "[-1,2]"});
  }
  SUBCASE("rank above 4 is still validated") {
    write_header_json(path, {{"w", {{"dtype", "U8"}, {"shape", {1, 1, 1, 1, 2}}, {"data_offsets", {0, 1}}}}}, 1);
    expect_error(open, {path, "tensor 'w'", "[1,1,1,1,2]", "needs 2"});
  }
  SUBCASE("element count overflows") {
    write_header_json(path,
                      {{"w", {{"dtype", "F32"}, {"shape", {1ll << 40, 1ll << 40}}, {"data_offsets", {0, 4}}}}}, 4);
    expect_error(open, {path, "tensor 'w'", "too many elements"});
  }
  SUBCASE("data_offsets malformed") {
    write_header_json(path, {{"w", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {0}}}}}, 4);
    expect_error(open, {path, "tensor 'w'", "field 'data_offsets'"});
  }
  SUBCASE("data_offsets end before begin") {
    write_header_json(path, {{"w", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {8, 4}}}}}, 8);
    expect_error(open, {path, "tensor 'w'", "[8, 4]"});
  }
  SUBCASE("data_offsets past the end of the buffer") {
    write_header_json(path, {{"w", {{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {0, 16}}}}}, 12);
    expect_error(open, {path, "tensor 'w'", "past the end", "12 bytes"});
  }
  SUBCASE("truncated file") {
    write_safetensors(path, good);
    fs::resize_file(path, fs::file_size(path) - 3);
    expect_error(open, {path, "tensor 'b'", "truncated"});
  }
  SUBCASE("data_offsets do not match shape x dtype") {
    write_header_json(path, {{"w", {{"dtype", "BF16"}, {"shape", {3, 2}}, {"data_offsets", {0, 16}}}}}, 16);
    expect_error(open, {path, "tensor 'w'", "16 bytes", "[3,2]", "BF16", "needs 12"});
  }
  SUBCASE("overlapping tensors") {
    write_header_json(path,
                      {{"a", {{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {0, 16}}}},
                       {"b", {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {12, 20}}}}},
                      20);
    expect_error(open, {path, "'a'", "'b'", "overlap"});
  }
  SUBCASE("a tensor inside another") {
    write_header_json(path,
                      {{"big", {{"dtype", "F32"}, {"shape", {8}}, {"data_offsets", {0, 32}}}},
                       {"mid", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {20, 24}}}},
                       {"z", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {28, 32}}}}},
                      32);
    expect_error(open, {path, "'big'", "overlap"});
  }
  SUBCASE("duplicate tensor name") {
    write_raw(path,
              R"({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},)"
              R"( "w": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}})",
              std::vector<std::byte>(2));
    expect_error(open, {path, "'w'", "twice"});
  }
  SUBCASE("metadata not an object") {
    write_header_json(path, {{"__metadata__", "x"}}, 0);
    expect_error(open, {path, "__metadata__"});
  }
  SUBCASE("metadata value not a string") {
    write_header_json(path, {{"__metadata__", {{"total", 5}}}}, 0);
    expect_error(open, {path, "__metadata__", "'total'", "must be a string"});
  }
}

TEST_CASE("tensors of rank above 4 are validated, then set aside") {
  TempDir tmp;
  std::string const path = tmp.file("model.safetensors");
  write_header_json(path,
                    {{"conv3d", {{"dtype", "BF16"}, {"shape", {2, 1, 1, 1, 2}}, {"data_offsets", {0, 8}}}},
                     {"a", {{"dtype", "U8"}, {"shape", {2}}, {"data_offsets", {8, 10}}}}},
                    10);
  SafetensorsFile f(path);
  CHECK(f.tensors().size() == 1);
  CHECK(f.find("conv3d") == nullptr);
  CHECK(f.skipped().at("conv3d") == 5);
  Checkpoint c = Checkpoint::open(tmp.path.string());
  CHECK(c.names() == std::vector<std::string>{"a"});
  CHECK(c.skipped_names() == std::vector<std::string>{"conv3d"});
  expect_error([&] { (void)c.get("conv3d"); }, {path, "'conv3d'", "rank 5"});
  // It still takes part in the overlap check.
  write_header_json(path,
                    {{"conv3d", {{"dtype", "BF16"}, {"shape", {2, 1, 1, 1, 2}}, {"data_offsets", {0, 8}}}},
                     {"a", {{"dtype", "U8"}, {"shape", {2}}, {"data_offsets", {6, 8}}}}},
                    10);
  expect_error([&] { SafetensorsFile g(path); }, {path, "'conv3d'", "'a'", "overlap"});
}

TEST_CASE("a file with no tensors and gaps between tensors is accepted") {
  TempDir tmp;
  std::string const path = tmp.file("x.safetensors");
  write_header_json(path, {{"__metadata__", {{"format", "pt"}}}}, 0);
  CHECK(SafetensorsFile(path).tensors().empty());
  // The reference writer never leaves gaps, but a gap is harmless and is not rejected.
  write_header_json(path,
                    {{"a", {{"dtype", "U8"}, {"shape", {2}}, {"data_offsets", {0, 2}}}},
                     {"b", {{"dtype", "U8"}, {"shape", {2}}, {"data_offsets", {6, 8}}}}},
                    10);
  CHECK(SafetensorsFile(path).tensors().size() == 2);
}

TEST_CASE("Checkpoint: single file, config-only directory, shape checks") {
  TempDir tmp;
  std::string const dir = tmp.path.string();

  SUBCASE("config-only") {
    std::ofstream(tmp.file("config.json")) << "{}";
    Checkpoint c = Checkpoint::open(dir);
    CHECK_FALSE(c.has_weights());
    CHECK(c.names().empty());
    CHECK(c.weight_bytes() == 0);
    CHECK(c.find("x") == nullptr);
    expect_error([&] { (void)c.get("x"); }, {dir, "missing tensor 'x'"});
  }
  SUBCASE("not a directory") {
    expect_error([&] { (void)Checkpoint::open(tmp.file("nope")); }, {"nope", "not a directory"});
  }
  SUBCASE("unrecognized safetensors layout") {
    write_safetensors(tmp.file("consolidated.safetensors"), {f32_entry("a", {1})});
    expect_error([&] { (void)Checkpoint::open(dir); },
                 {dir, "consolidated.safetensors", "model.safetensors"});
  }
  SUBCASE("model.safetensors") {
    write_safetensors(tmp.file("model.safetensors"),
                      {f32_entry("z.weight", {2, 3}), f32_entry("a.weight", {4}),
                       f32_entry("m.bias", {1, 1, 2})});
    Checkpoint c = Checkpoint::open(dir);
    CHECK(c.has_weights());
    CHECK(c.dir() == dir);
    CHECK(c.names() == std::vector<std::string>{"a.weight", "m.bias", "z.weight"});
    CHECK(c.weight_bytes() == (6 + 4 + 2) * 4);
    REQUIRE(c.files().size() == 1);
    CHECK(&c.get("z.weight") == c.files()[0].find("z.weight"));
    CHECK(c.get("z.weight", Shape{2, 3}).shape == Shape{2, 3});
    std::string const file = tmp.file("model.safetensors");
    expect_error([&] { (void)c.get("z.weight", Shape{3, 2}); },
                 {file, "tensor 'z.weight' has shape [2, 3], expected [3, 2]"});
    expect_error([&] { (void)c.get("q.weight"); }, {dir + ": missing tensor 'q.weight'"});
    // Moving the checkpoint keeps every record valid.
    TensorRecord const* rec = &c.get("a.weight");
    Checkpoint moved = std::move(c);
    CHECK(&moved.get("a.weight") == rec);
    CHECK(read_scalar_f32(*rec, 3) == 3.0f);
  }
}

TEST_CASE("Checkpoint: sharded with index, and every index inconsistency") {
  TempDir tmp;
  std::string const dir = tmp.path.string();
  std::string const index = tmp.file("model.safetensors.index.json");
  std::string const s1 = "model-00001-of-00002.safetensors";
  std::string const s2 = "model-00002-of-00002.safetensors";
  write_safetensors(tmp.file(s1), {f32_entry("embed.weight", {4, 2}), f32_entry("l0.w", {2, 2})});
  write_safetensors(tmp.file(s2), {f32_entry("l1.w", {2, 2}, 100), f32_entry("head.weight", {4, 2})});
  nlohmann::json map = {{"embed.weight", s1}, {"l0.w", s1}, {"l1.w", s2}, {"head.weight", s2}};
  auto write_index = [&](nlohmann::json const& j) { std::ofstream(index) << j.dump(2); };
  auto open = [&] { (void)Checkpoint::open(dir); };

  SUBCASE("consistent") {
    write_index({{"metadata", {{"total_size", 96}}}, {"weight_map", map}});
    Checkpoint c = Checkpoint::open(dir);
    CHECK(c.has_weights());
    CHECK(c.files().size() == 2);
    CHECK(c.names() == std::vector<std::string>{"embed.weight", "head.weight", "l0.w", "l1.w"});
    CHECK(c.weight_bytes() == 96);
    CHECK(*c.get("l1.w").file == tmp.file(s2));
    CHECK(*c.get("l0.w").file == tmp.file(s1));
    CHECK(read_scalar_f32(c.get("l1.w", Shape{2, 2}), 1) == 101.0f);
  }
  SUBCASE("model.safetensors wins over an index, as in transformers") {
    write_index({{"weight_map", map}});
    write_safetensors(tmp.file("model.safetensors"), {f32_entry("only", {1})});
    CHECK(Checkpoint::open(dir).names() == std::vector<std::string>{"only"});
  }
  SUBCASE("index is not JSON") {
    std::ofstream(index) << "{\"weight_map\": {";
    expect_error(open, {index, "invalid JSON"});
  }
  SUBCASE("index without weight_map") {
    write_index({{"metadata", {}}});
    expect_error(open, {index, "'weight_map'"});
  }
  SUBCASE("weight_map not an object") {
    write_index({{"weight_map", {1, 2}}});
    expect_error(open, {index, "field 'weight_map'"});
  }
  SUBCASE("weight_map value not a string") {
    map["l0.w"] = 3;
    write_index({{"weight_map", map}});
    expect_error(open, {index, "'l0.w'"});
  }
  SUBCASE("shard outside the directory") {
    map["l0.w"] = "../elsewhere.safetensors";
    write_index({{"weight_map", map}});
    expect_error(open, {index, "'l0.w'", "../elsewhere.safetensors"});
  }
  SUBCASE("shard file missing") {
    map["l1.w"] = "model-00003-of-00002.safetensors";
    write_index({{"weight_map", map}});
    expect_error(open, {index, "model-00003-of-00002.safetensors", "'l1.w'", "missing"});
  }
  SUBCASE("tensor listed in the map but absent from its shard") {
    map["ghost.weight"] = s2;
    write_index({{"weight_map", map}});
    expect_error(open, {index, "'ghost.weight'", s2, "does not contain"});
  }
  SUBCASE("tensor found in a shard but mapped to the other shard") {
    // Both shards hold l0.w; the index says shard 1. Shard 2's copy is the inconsistency.
    write_safetensors(tmp.file(s2), {f32_entry("l1.w", {2, 2}), f32_entry("head.weight", {4, 2}),
                                     f32_entry("l0.w", {2, 2})});
    write_index({{"weight_map", map}});
    expect_error(open, {tmp.file(s2), "'l0.w'", "maps it to '" + s1 + "'"});
  }
  SUBCASE("tensor in a shard but not in the index") {
    map.erase("head.weight");
    write_index({{"weight_map", map}});
    expect_error(open, {tmp.file(s2), "'head.weight'", "not listed in the index"});
  }
  SUBCASE("a malformed shard names the shard") {
    write_index({{"weight_map", map}});
    fs::resize_file(tmp.file(s2), 4);
    expect_error(open, {tmp.file(s2), "8-byte"});
  }
}

TEST_CASE("Progress draws only when enabled and ends on 100%") {
  std::FILE* out = std::tmpfile();
  REQUIRE(out != nullptr);
  {
    Progress p("loading weights", 1000, true, out);
    p.advance(400, 2);
    p.advance(600, 3);
    CHECK(p.done_bytes() == 1000);
    CHECK(p.done_items() == 5);
    p.finish();
    p.finish();  // idempotent
  }
  std::rewind(out);
  std::string text;
  for (int ch; (ch = std::fgetc(out)) != EOF;) text += static_cast<char>(ch);
  std::fclose(out);
  CHECK(text.find("loading weights") != std::string::npos);
  CHECK(text.find("100%") != std::string::npos);
  CHECK(text.find("5 items") != std::string::npos);
  CHECK(text.back() == '\n');

  std::FILE* quiet = std::tmpfile();
  REQUIRE(quiet != nullptr);
  {
    Progress p("silent", 10, false, quiet);
    p.advance(10);
  }
  CHECK(std::ftell(quiet) == 0);
  std::fclose(quiet);
}
