#include <doctest/doctest.h>

#include <limits>
#include <span>
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

TEST_CASE("generation that fills the context ends with finish length") {
  std::string const dir = std::string(QFLASH_FIXTURES_DIR) + "/qwen3_5_moe_tiny";
  runtime::LoadOptions o;
  o.progress = false;
  o.config = io::load_config(dir);
  o.config->max_position_embeddings = 14;
  auto m = runtime::load_model_as<spec::generic>(dir, o);
  auto tok = io::Tokenizer::from_file(dir + "/tokenizer.json");
  std::vector<std::int32_t> const prompt{171, 56, 115, 66, 64, 182, 125, 75, 29, 93};
  runtime::GenerateOptions g;
  g.max_tokens = 100;
  auto res = runtime::generate(*m, tok, prompt, g);  // the model's 14 positions
  CHECK(res.finish == runtime::FinishReason::kLength);
  CHECK(res.tokens.size() == 4);
  CHECK(res.tokens == std::vector<std::int32_t>{188, 93, 39, 17});  // transformers' first 4
  g.max_context = 12;
  res = runtime::generate(*m, tok, prompt, g);
  CHECK(res.tokens.size() == 2);
  g.max_context = 10;
  CHECK_THROWS_WITH_AS(runtime::generate(*m, tok, prompt, g),
                       doctest::Contains("the prompt has 10 tokens, which leaves no room"), Error);
  g.max_context = 15;
  CHECK_THROWS_WITH_AS(runtime::generate(*m, tok, prompt, g),
                       doctest::Contains("the context size must be in [0, 14]"), Error);
}

TEST_CASE("a tokenizer with ids the model lacks is refused; ids the tokenizer lacks are never sampled") {
  std::string const dir = std::string(QFLASH_FIXTURES_DIR) + "/qwen3_5_moe_tiny";
  auto const cfg = io::load_config(dir);
  io::Json tj = io::read_json_file(dir + "/tokenizer.json");
  runtime::check_tokenizer_fits(io::Tokenizer::from_json(tj, "tokenizer.json"), cfg);
  io::Json big = tj;
  big["added_tokens"].push_back({{"id", cfg.vocab}, {"content", "<|x|>"}, {"special", true}});
  CHECK_THROWS_WITH_AS(runtime::check_tokenizer_fits(io::Tokenizer::from_json(big, "big.json"), cfg),
                       doctest::Contains("big.json: the tokenizer has ids up to 256, but the model's vocabulary is 256"),
                       Error);

  // Drop the token greedy decoding picks first (188; the fixture has no merges): generation
  // must pick another.
  runtime::LoadOptions o;
  o.progress = false;
  auto m = runtime::load_model_as<spec::generic>(dir, o);
  io::Json small = tj;
  auto& vocab = small["model"]["vocab"];
  for (auto it = vocab.begin(); it != vocab.end(); ++it)
    if (it.value() == 188) {
      vocab.erase(it);
      break;
    }
  auto const tok = io::Tokenizer::from_json(small, "small.json");
  REQUIRE_FALSE(tok.has(188));
  std::vector<std::int32_t> const prompt{171, 56, 115, 66, 64, 182, 125, 75, 29, 93};
  runtime::GenerateOptions g;
  g.max_tokens = 12;
  auto res = runtime::generate(*m, tok, prompt, g);
  REQUIRE(res.tokens.size() == 12);
  for (auto id : res.tokens) CHECK(id != 188);
  // An end-of-sequence id is still sampled when the tokenizer lacks it.
  g.eos_ids = {188};
  res = runtime::generate(*m, tok, prompt, g);
  CHECK(res.finish == runtime::FinishReason::kEos);
  CHECK(res.tokens.empty());
}

TEST_CASE("non-finite logits are an error, not text") {
  std::string const dir = std::string(QFLASH_FIXTURES_DIR) + "/qwen3_5_moe_tiny";
  runtime::LoadOptions o;
  o.progress = false;
  auto loaded = runtime::load_model(dir, o);
  std::vector<float> norm(loaded.weights.final_norm.begin(), loaded.weights.final_norm.end());
  norm[3] = std::numeric_limits<float>::infinity();
  loaded.weights.final_norm = norm;  // outlives the model
  auto m = runtime::make_model<spec::generic>(std::move(loaded));
  auto state = m->new_sequence();
  std::vector<std::int32_t> const ids{1, 2, 3};
  model::SequenceChunk c{ids, &state};
  std::vector<float> logits;
  CHECK_THROWS_WITH_AS(m->forward(std::span(&c, 1), model::LogitsFor::kLastToken, logits),
                       doctest::Contains("are not finite (NaN or Inf)"), Error);
}
