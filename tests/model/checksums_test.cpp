// SHA256SUMS verification of model directories.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "qflash/io/checksums.hpp"
#include "qflash/runtime/load_model.hpp"
#include "support/temp_dir.hpp"

using namespace qflash;
namespace fs = std::filesystem;

using qflash::test::TempDir;

namespace {
// FIPS 180-2 test vector: SHA-256("abc").
constexpr char kAbc[] = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
}  // namespace

TEST_CASE("SHA256SUMS: known digest, mismatch, missing file, malformed line") {
  TempDir const tmp;
  auto const dir = tmp.path;
  tmp.write("a.bin", "abc");
  CHECK(io::sha256_hex((dir / "a.bin").string()) == kAbc);

  CHECK_FALSE(io::has_checksums(dir.string()));
  tmp.write("SHA256SUMS", std::string(kAbc) + "  a.bin\n");
  CHECK(io::has_checksums(dir.string()));
  CHECK_NOTHROW(io::verify_checksums(dir.string()));
  tmp.write("SHA256SUMS", std::string(kAbc) + " *a.bin\n");  // binary-mode marker
  CHECK_NOTHROW(io::verify_checksums(dir.string()));

  tmp.write("a.bin", "abd");
  CHECK_THROWS_WITH_AS(io::verify_checksums(dir.string()),
                       doctest::Contains("a.bin: SHA-256 mismatch"), Error);
  tmp.write("SHA256SUMS", std::string(kAbc) + "  gone.bin\n");
  CHECK_THROWS_WITH_AS(io::verify_checksums(dir.string()), doctest::Contains("gone.bin: listed in SHA256SUMS but missing"), Error);
  tmp.write("SHA256SUMS", "xyz  a.bin\n");
  CHECK_THROWS_WITH_AS(io::verify_checksums(dir.string()), doctest::Contains("SHA256SUMS:1: expected"), Error);
}

TEST_CASE("Model::load verifies SHA256SUMS unless told not to") {
  auto const src = fs::path(QFLASH_FIXTURES_DIR) / "qwen3_moe_tiny";
  TempDir const tmp;
  auto const dir = tmp.path;
  for (auto const* f : {"config.json", "model.safetensors"}) fs::copy_file(src / f, dir / f);
  std::string const good = io::sha256_hex((dir / "model.safetensors").string());
  std::string bad = good;
  bad[0] = bad[0] == '0' ? '1' : '0';
  runtime::LoadOptions o;
  o.progress = false;

  tmp.write("SHA256SUMS", good + "  model.safetensors\n");
  CHECK_NOTHROW(runtime::load_model_as<spec::generic>(dir.string(), o));
  tmp.write("SHA256SUMS", bad + "  model.safetensors\n");
  CHECK_THROWS_WITH_AS(runtime::load_model_as<spec::generic>(dir.string(), o), doctest::Contains("model.safetensors: SHA-256 mismatch"), Error);
  o.verify_checksums = false;
  CHECK_NOTHROW(runtime::load_model_as<spec::generic>(dir.string(), o));
}
