// kv_compression_map.json (io/kv_map.hpp): written and read back unchanged; a map for another
// model or with a bad field names the file and the field.
#include <doctest/doctest.h>

#include <fstream>
#include <string>

#include "qflash/io/kv_map.hpp"
#include "qflash/runtime/synthetic.hpp"
#include "support/expect_error.hpp"
#include "support/temp_dir.hpp"

using namespace qflash;

namespace {
void write(std::string const& path, std::string const& text) { std::ofstream(path) << text; }
}  // namespace

TEST_CASE("kv map file: round trip, and errors that name the file and field") {
  auto const cfg = runtime::synthetic_config("qwen3_6_35b_a3b", 8);  // KV in layers 3 and 7
  kv::KvMap map = kv::KvMap::uniform(cfg, {KvFormat::kBf16, KvFormat::kInt6});
  map.set(7, 1, {KvFormat::kInt8, KvFormat::kFp8E4m3});
  test::TempDir const tmp;
  std::string const path = (tmp.path / "kv_compression_map.json").string();
  io::write_kv_map(path, map, cfg, io::Json{{"budget", 0.5}});
  CHECK(io::read_kv_map(path, cfg) == map);

  std::string const head = R"({"qflash_kv_map": 1, "n_layer": 8, "n_head_kv": 2, "d_head": 256, "layers": )";
  std::string const l3 = R"("3": {"k": ["bf16", "bf16"], "v": ["int6", "int6"]})";
  auto expect = [&](std::string const& text, std::initializer_list<std::string> parts) {
    write(path, text);
    test::expect_error([&] { (void)io::read_kv_map(path, cfg); }, parts);
  };
  expect(head + "{" + l3 + "}}", {path, "no entry for full-attention layer 7"});
  expect(head + "{" + l3 + R"(, "7": {"k": ["bf16", "int5"], "v": ["int6", "int6"]}}})",
         {path, "field 'layers.7.k[1]'", "unknown KV format 'int5'"});
  expect(head + "{" + l3 + R"(, "7": {"k": ["bf16"], "v": ["int6", "int6"]}}})",
         {"field 'layers.7.k' lists 1 formats, expected one per KV head (2)"});
  expect(head + "{" + l3 + R"(, "2": {"k": ["bf16", "bf16"], "v": ["int6", "int6"]}}})",
         {"layer 2 is a linear-attention layer"});
  expect(head + "{" + l3 + R"(, "x7": {}}})", {"'layers' key 'x7' is not a layer index in [0, 8)"});
  expect(R"({"qflash_kv_map": 1, "n_layer": 40, "n_head_kv": 2, "d_head": 256, "layers": {}})",
         {"field 'n_layer' is 40, the model", "has 8: the map was made for another model"});
  expect(R"({"qflash_kv_map": 2})", {path, "field 'qflash_kv_map' must be 1"});
  expect("[1, 2", {path});
}
