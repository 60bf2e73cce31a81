// SHA256SUMS verification of model directories.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "qflash/io/checksums.hpp"
#include "qflash/model/model.hpp"

using namespace qflash;
namespace fs = std::filesystem;

namespace {
void write(fs::path const& p, std::string const& text) {
  std::ofstream(p, std::ios::binary) << text;
}
// FIPS 180-2 test vector: SHA-256("abc").
constexpr char kAbc[] = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
}  // namespace

TEST_CASE("SHA256SUMS: known digest, mismatch, missing file, malformed line") {
  auto const dir = fs::temp_directory_path() / "qflash_checksums_test";
  fs::remove_all(dir);
  fs::create_directories(dir);
  write(dir / "a.bin", "abc");
  CHECK(io::sha256_hex((dir / "a.bin").string()) == kAbc);

  CHECK_FALSE(io::has_checksums(dir.string()));
  write(dir / "SHA256SUMS", std::string(kAbc) + "  a.bin\n");
  CHECK(io::has_checksums(dir.string()));
  CHECK_NOTHROW(io::verify_checksums(dir.string()));
  write(dir / "SHA256SUMS", std::string(kAbc) + " *a.bin\n");  // binary-mode marker
  CHECK_NOTHROW(io::verify_checksums(dir.string()));

  write(dir / "a.bin", "abd");
  CHECK_THROWS_WITH_AS(io::verify_checksums(dir.string()),
                       doctest::Contains("a.bin: SHA-256 mismatch"), Error);
  write(dir / "SHA256SUMS", std::string(kAbc) + "  gone.bin\n");
  CHECK_THROWS_WITH_AS(io::verify_checksums(dir.string()), doctest::Contains("gone.bin: listed in SHA256SUMS but missing"), Error);
  write(dir / "SHA256SUMS", "xyz  a.bin\n");
  CHECK_THROWS_WITH_AS(io::verify_checksums(dir.string()), doctest::Contains("SHA256SUMS:1: expected"), Error);
  fs::remove_all(dir);
}

TEST_CASE("Model::load verifies SHA256SUMS unless told not to") {
  auto const src = fs::path(QFLASH_FIXTURES_DIR) / "qwen3_moe_tiny";
  auto const dir = fs::temp_directory_path() / "qflash_checksums_model";
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (auto const* f : {"config.json", "model.safetensors"}) fs::copy_file(src / f, dir / f);
  std::string const good = io::sha256_hex((dir / "model.safetensors").string());
  std::string bad = good;
  bad[0] = bad[0] == '0' ? '1' : '0';
  model::ModelOptions o;
  o.progress = false;

  write(dir / "SHA256SUMS", good + "  model.safetensors\n");
  CHECK_NOTHROW(model::Model<>::load(dir.string(), o));
  write(dir / "SHA256SUMS", bad + "  model.safetensors\n");
  CHECK_THROWS_WITH_AS(model::Model<>::load(dir.string(), o), doctest::Contains("model.safetensors: SHA-256 mismatch"), Error);
  o.verify_checksums = false;
  CHECK_NOTHROW(model::Model<>::load(dir.string(), o));
  fs::remove_all(dir);
}
