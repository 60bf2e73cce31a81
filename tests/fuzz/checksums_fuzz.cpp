// libFuzzer target for qflash/io/checksums.hpp's SHA256SUMS parser: any text must parse or
// throw qflash::Error, and every name it accepts must stay inside the directory. Built and
// run by scripts/fuzz.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>

#include "qflash/core/error.hpp"
#include "qflash/io/checksums.hpp"

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  namespace fs = std::filesystem;
  std::string_view const text(reinterpret_cast<char const*>(data), size);
  try {
    auto const entries = qflash::io::parse_checksums(text, "fuzz/SHA256SUMS", "/m");
    for (auto const& e : entries) {
      if (e.digest.size() != 64 || e.file.empty()) std::abort();
      std::string const p = fs::path("/m/" + e.file).lexically_normal().generic_string();
      if (!p.starts_with("/m/")) std::abort();  // a name that escapes the directory
    }
  } catch (qflash::Error const&) {
  }
  return 0;
}
