// What the fuzz targets that parse files (the parsers open paths only) share: one temp
// directory per process, removed at exit, and writing an input into it.
#pragma once

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>

#include "qflash/core/log.hpp"

namespace qflash::fuzz {

/// `$TMPDIR/qflash_fuzz_<name>_<pid>`, created on first use with logging silenced (loaders
/// log defaulted fields and unused tensors), removed at exit.
inline std::string const& temp_dir(char const* name) {
  static std::string const dir = [name] {
    char const* tmp = std::getenv("TMPDIR");
    std::string d = std::string(tmp && *tmp ? tmp : "/tmp") + "/qflash_fuzz_" + name + "_" +
                    std::to_string(::getpid());
    std::filesystem::create_directories(d);
    set_log_sink({});
    return d;
  }();
  // Registered after `dir` is constructed, so it runs before `dir` is destroyed.
  static int const cleanup = std::atexit([] {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  });
  (void)cleanup;
  return dir;
}

/// Writes `bytes` to `path`; false when the harness (not the parser) failed.
inline bool write_file(std::string const& path, std::string_view bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return false;
  bool const ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  return std::fclose(f) == 0 && ok;
}

}  // namespace qflash::fuzz
