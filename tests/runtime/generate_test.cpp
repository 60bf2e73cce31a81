#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "qflash/runtime/generate.hpp"
#include "qflash/runtime/load_model.hpp"

using namespace qflash;

TEST_CASE("stop-string helpers") {
  std::vector<std::string> const stop{"END", "\n\n"};
  std::size_t len = 0;
  CHECK(runtime::find_stop("abcEN", 0, stop, len) == std::string::npos);
  CHECK(runtime::find_stop("abcEND", 5, stop, len) == 3);
  CHECK(len == 3);
  CHECK(runtime::find_stop("a\n\nEND", 2, stop, len) == 1);
  CHECK(len == 2);
  CHECK(runtime::held_back("abcEN", stop) == 2);
  CHECK(runtime::held_back("abc\n", stop) == 1);
  CHECK(runtime::held_back("abc", stop) == 0);
}

TEST_CASE("generate on a fixture: greedy tokens, streaming, eos and stop strings") {
  std::string const dir = std::string(QFLASH_FIXTURES_DIR) + "/qwen3_5_moe_tiny";
  runtime::LoadOptions o;
  o.progress = false;
  auto m = runtime::load_model_as<spec::generic>(dir, o);
  auto tok = io::Tokenizer::from_file(dir + "/tokenizer.json");
  // Prompt 1 of the fixture and transformers' greedy continuation of it (reference.json).
  std::vector<std::int32_t> const prompt{171, 56, 115, 66, 64, 182, 125, 75, 29, 93};
  std::vector<std::int32_t> const want{188, 93, 39, 17, 68, 168, 93, 188, 74, 215, 41, 192};

  runtime::GenerateOptions g;
  g.max_tokens = static_cast<int>(want.size());
  std::string streamed;
  auto res = runtime::generate(*m, tok, prompt, g, [&](std::string_view t) { streamed += t; });
  CHECK(res.tokens == want);
  CHECK(res.finish == runtime::FinishReason::kLength);
  CHECK(streamed == res.text);
  CHECK(res.text == tok.decode(want));

  // An eos id stops before the token is emitted.
  g.eos_ids = {want[3]};
  res = runtime::generate(*m, tok, prompt, g);
  CHECK(res.finish == runtime::FinishReason::kEos);
  CHECK(res.tokens == std::vector<std::int32_t>(want.begin(), want.begin() + 3));

  // A stop string cuts the text where it starts, and none of it is streamed.
  g.eos_ids.clear();
  std::string const full = tok.decode(want);
  std::string const stop = full.substr(5, 2);
  g.stop = {stop};
  streamed.clear();
  res = runtime::generate(*m, tok, prompt, g, [&](std::string_view t) { streamed += t; });
  CHECK(res.finish == runtime::FinishReason::kStopString);
  CHECK(res.text == full.substr(0, full.find(stop)));
  CHECK(streamed == res.text);
}
