// libFuzzer target for qflash/io/tokenizer.hpp on tokenizer.json text: parse_json, then
// Tokenizer::from_json; what loads encodes fixed strings and the input's own bytes, decodes
// the ids, and decodes ids no token has (negative, past the vocabulary), whole and streamed.
// Any input must load or throw qflash::Error; a crash, hang, leak or sanitizer report is a
// bug. Built and run by scripts/fuzz.
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/io/json.hpp"
#include "qflash/io/tokenizer.hpp"

namespace {

std::size_t exercise(qflash::io::Tokenizer const& tok, std::string_view text) {
  std::size_t sum = 0;
  for (bool allow_special : {true, false}) {
    try {
      auto const ids = tok.encode(text, allow_special);
      sum += tok.decode(ids).size() + tok.decode(ids, /*skip_special=*/true).size();
      qflash::io::StreamDecoder stream(tok);
      for (std::int32_t id : ids) sum += stream.push(id).size();
      sum += stream.flush().size();
    } catch (qflash::Error const&) {  // invalid UTF-8, a regex over its match limit
    }
  }
  return sum;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  std::string_view const in(reinterpret_cast<char const*>(data), size);
  try {
    auto const tok =
        qflash::io::Tokenizer::from_json(qflash::io::parse_json(in, "fuzz/tokenizer.json"),
                                         "fuzz/tokenizer.json");
    std::size_t sum = 0;
    for (std::string_view s : {"Hello, world! 123 \xC3\xA9t\xC3\xA9 <|im_end|>",
                               "  \n\n\t x  y'll 1234567 \xF0\x9F\x98\x80 e\xCC\x81", ""})
      sum += exercise(tok, s);
    sum += exercise(tok, in.substr(0, 512));
    sum += exercise(tok, in.substr(in.size() / 2, 512));

    std::int32_t const n = tok.vocab_size();
    std::int32_t const max = std::numeric_limits<std::int32_t>::max();
    std::vector<std::int32_t> const odd{-1, 0, n - 1, n, n + 1, max, std::numeric_limits<std::int32_t>::min()};
    sum += tok.decode(odd).size() + tok.decode(odd, true).size();
    qflash::io::StreamDecoder stream(tok, /*skip_special=*/true);
    for (std::int32_t id : odd) {
      sum += stream.push(id).size() + tok.token(id).size() + tok.token_bytes(id).size();
      sum += tok.is_special(id) + tok.is_added(id);
      if (auto back = tok.token_id(tok.token(id)); back) sum += static_cast<std::size_t>(*back);
    }
    sum += stream.flush().size();
    for (auto const& t : tok.added_tokens()) sum += tok.token_id(t.content).value_or(0);
    volatile std::size_t sink = sum;
    (void)sink;
  } catch (qflash::Error const&) {
  }
  return 0;
}
