/// @file
/// A fresh directory under the system temp dir, removed with its contents at scope exit;
/// unique per process and per instance, so tests running in parallel do not collide.
#pragma once

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

namespace qflash::test {

struct TempDir {
  std::filesystem::path path;

  TempDir() {
    static std::atomic<int> counter{0};
    path = std::filesystem::temp_directory_path() /
           ("qflash_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(TempDir const&) = delete;
  TempDir& operator=(TempDir const&) = delete;

  [[nodiscard]] std::string dir() const { return path.string(); }
  [[nodiscard]] std::string file(std::string const& name) const { return (path / name).string(); }
  void write(std::string const& name, std::string const& bytes) const {
    std::ofstream(path / name, std::ios::binary) << bytes;
  }
};

}  // namespace qflash::test
