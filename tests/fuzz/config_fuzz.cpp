// libFuzzer target for qflash/io/hf_config.hpp: load_config on a directory holding the input
// as config.json; the bytes after the input's first NUL (never valid JSON) become
// generation_config.json. Any input must load or throw qflash::Error; on success the memory
// arithmetic the CLI prints is evaluated too. load_config opens paths only, so the files are
// written to one temp directory per process first. Built and run by scripts/fuzz.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "qflash/core/error.hpp"
#include "qflash/io/hf_config.hpp"
#include "fuzz_support.hpp"

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  std::string_view const in(reinterpret_cast<char const*>(data), size);
  std::string const& dir = qflash::fuzz::temp_dir("config");
  std::string const gen = dir + "/generation_config.json";
  std::size_t const nul = in.find('\0');
  bool ok = qflash::fuzz::write_file(dir + "/config.json", in.substr(0, nul));
  if (nul == std::string_view::npos)
    std::remove(gen.c_str());
  else
    ok = ok && qflash::fuzz::write_file(gen, in.substr(nul + 1));
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
