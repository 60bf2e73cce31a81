// libFuzzer target for the safetensors header parser (qflash/io/safetensors.hpp): any input
// must either open or throw qflash::Error; then every tensor it lists is read through
// read_f32 where the dtype allows. SafetensorsFile opens paths only, so each input is
// written to one temp file per process first. Built and run by scripts/fuzz.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "qflash/core/error.hpp"
#include "qflash/io/safetensors.hpp"

namespace {

std::string const& temp_path() {
  static std::string const path = [] {
    char const* dir = std::getenv("TMPDIR");
    return std::string(dir && *dir ? dir : "/tmp") + "/qflash_fuzz_" +
           std::to_string(::getpid()) + ".safetensors";
  }();
  return path;
}

bool write_all(std::uint8_t const* data, std::size_t size) {
  std::FILE* f = std::fopen(temp_path().c_str(), "wb");
  if (f == nullptr) return false;
  bool const ok = std::fwrite(data, 1, size, f) == size;
  return std::fclose(f) == 0 && ok;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  if (!write_all(data, size)) std::abort();  // the harness, not the parser, failed
  try {
    qflash::io::SafetensorsFile const f(temp_path());
    double sum = 0;
    for (auto const& t : f.tensors()) {
      if (t.dtype == qflash::DType::kF32 || t.dtype == qflash::DType::kF16 ||
          t.dtype == qflash::DType::kBF16) {
        for (float v : qflash::io::read_f32(t)) sum += v;
        if (t.numel() > 0) sum += qflash::io::read_scalar_f32(t, t.numel() - 1);
      } else if (!t.data.empty()) {
        sum += static_cast<double>(t.data.back());
      }
      sum += f.find(t.name) == &t;
    }
    for (auto const& [k, v] : f.metadata()) sum += static_cast<double>(k.size() + v.size());
    volatile double sink = sum;
    (void)sink;
    (void)f.weight_bytes();
  } catch (qflash::Error const&) {
  }
  return 0;
}
