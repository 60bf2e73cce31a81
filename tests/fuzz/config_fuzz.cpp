// libFuzzer target for qflash/io/hf_config.hpp: load_config on a directory holding the input
// as config.json; the bytes after the input's first NUL (never valid JSON) become
// generation_config.json. Any input must load or throw qflash::Error; on success the memory
// arithmetic the CLI prints is evaluated too. load_config opens paths only, so the files are
// written to one temp directory per process first. Built and run by scripts/fuzz.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>

#include "qflash/core/error.hpp"
#include "qflash/core/log.hpp"
#include "qflash/io/hf_config.hpp"

namespace {

std::string const& temp_dir() {
  static std::string const dir = [] {
    char const* tmp = std::getenv("TMPDIR");
    std::string d = std::string(tmp && *tmp ? tmp : "/tmp") + "/qflash_fuzz_config_" +
                    std::to_string(::getpid());
    std::filesystem::create_directories(d);
    qflash::set_log_sink({});  // load_config logs defaulted fields
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

bool write_file(std::string const& path, std::string_view bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return false;
  bool const ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  return std::fclose(f) == 0 && ok;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  std::string_view const in(reinterpret_cast<char const*>(data), size);
  std::string const& dir = temp_dir();
  std::string const gen = dir + "/generation_config.json";
  std::size_t const nul = in.find('\0');
  bool ok = write_file(dir + "/config.json", in.substr(0, nul));
  if (nul == std::string_view::npos)
    std::remove(gen.c_str());
  else
    ok = ok && write_file(gen, in.substr(nul + 1));
  if (!ok) std::abort();  // the harness, not the parser, failed
  try {
    auto const c = qflash::io::load_config(dir);
    volatile std::int64_t sink = c.n_params_total() + c.n_params_active() +
                                 c.kv_bytes_per_token(qflash::DType::kBF16) +
                                 c.linear_state_bytes_per_sequence(qflash::DType::kBF16,
                                                                   qflash::DType::kF32);
    (void)sink;
  } catch (qflash::Error const&) {
  }
  return 0;
}
