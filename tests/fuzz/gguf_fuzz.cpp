// libFuzzer target for qflash/io/gguf.hpp (and Tokenizer::from_gguf on what parses): any
// input must either parse or throw qflash::Error; a crash, hang, leak or sanitizer report is
// a bug. Built and run by scripts/fuzz.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "qflash/core/error.hpp"
#include "qflash/io/gguf.hpp"
#include "qflash/io/tokenizer.hpp"

namespace {

/// Reads everything the parser promised is valid, so that a wrong promise shows up here.
std::size_t touch(qflash::io::GgufFile const& f) {
  using namespace qflash::io;
  std::size_t sum = 0;
  for (auto const& kv : f.metadata()) {
    sum += format_value(kv, 4).size();
    for (auto s : kv.strings) sum += s.empty() ? 0 : static_cast<unsigned char>(s.back());
    if (!kv.data.empty()) sum += static_cast<unsigned char>(kv.data.back());
  }
  for (auto const& t : f.tensors()) {
    sum += static_cast<std::size_t>(t.numel() + t.rows() + t.row_bytes()) + t.shape().rank;
    if (!t.data.empty())
      sum += static_cast<unsigned char>(t.data.front()) + static_cast<unsigned char>(t.data.back());
    sum += f.find_tensor(t.name) == &t;
  }
  return sum;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  std::span<std::byte const> bytes(reinterpret_cast<std::byte const*>(data), size);
  try {
    auto const f = qflash::io::GgufFile::from_bytes(bytes, "fuzz.gguf");
    volatile std::size_t sink = touch(f);
    (void)sink;
    if (f.has("general.architecture")) (void)f.arch_key("block_count");
    if (f.has("tokenizer.ggml.model")) {
      (void)qflash::io::gguf_special_tokens(f);
      auto const tok = qflash::io::Tokenizer::from_gguf(f);
      auto const ids = tok.encode("Hello, world! 123 \xC3\xA9t\xC3\xA9 <|im_end|>");
      (void)tok.decode(ids);
    }
  } catch (qflash::Error const&) {
  }
  return 0;
}
