// The embedded default model (models/qwen3_5_moe-micro) against what its trainer recorded with
// transformers on the same saved BF16 checkpoint (fp32 compute): logits of the default prompt,
// the greedy continuation, and the validation perplexity.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "qflash/io/safetensors.hpp"
#include "qflash/io/tokenizer.hpp"
#include "qflash/runtime/load_model.hpp"
#include "qflash/runtime/generate.hpp"
#include "qflash/runtime/perplexity.hpp"

using namespace qflash;

namespace {

std::string const kDir = std::string(QFLASH_SOURCE_DIR) + "/models/qwen3_5_moe-micro";

nlohmann::json reference() { return nlohmann::json::parse(std::ifstream(kDir + "/reference.json")); }

std::unique_ptr<model::Model<spec::generic>> load() {
  runtime::LoadOptions o;
  o.progress = false;  // SHA256SUMS is verified (the default)
  return runtime::load_model_as<spec::generic>(kDir, o);
}

}  // namespace

TEST_CASE("default model: logits and greedy continuation equal transformers'") {
  auto const ref = reference();
  auto m = load();
  auto const ids = ref["prompt_ids"].get<std::vector<std::int32_t>>();
  auto state = m->new_sequence();
  model::SequenceChunk c{ids, &state};
  std::vector<float> logits;
  m->forward(std::span(&c, 1), model::LogitsFor::kAllTokens, logits);

  io::SafetensorsFile const st(kDir + "/reference.safetensors");
  auto const want = io::read_f32(*st.find("logits"));
  REQUIRE(logits.size() == want.size());
  double max_diff = 0, max_abs = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(logits[i]) - want[i]));
    max_abs = std::max(max_abs, std::fabs(static_cast<double>(want[i])));
  }
  MESSAGE("default model: max |dlogit| = ", max_diff, " (max |logit| ", max_abs, ")");
  // fp32 compute on both sides over 8 layers; summation order differs (see model_test).
  CHECK(max_diff <= 2e-4);

  auto tok = io::Tokenizer::from_file(kDir + "/tokenizer.json");
  CHECK(tok.encode(ref["prompt"].get<std::string>()) == ids);
  auto const new_tokens = ref["greedy"]["new_tokens"].get<std::vector<std::int32_t>>();
  runtime::GenerateOptions g;
  g.max_tokens = static_cast<int>(new_tokens.size());
  auto const res = runtime::generate(*m, tok, ids, g);
  CHECK(res.tokens == new_tokens);
  CHECK(res.text == ref["greedy"]["text"].get<std::string>());
}

TEST_CASE("default model: validation perplexity equals the trainer's within 0.5%") {
  auto const ref = reference();
  auto const& vp = ref["validation_perplexity"];
  auto m = load();
  auto tok = io::Tokenizer::from_file(kDir + "/tokenizer.json");
  std::ifstream f(kDir + "/" + vp["text_file"].get<std::string>(), std::ios::binary);
  std::string const text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  auto const ids = tok.encode(text);
  CHECK(static_cast<std::int64_t>(ids.size()) == vp["text_tokens"].get<std::int64_t>());
  auto const r = runtime::perplexity(*m, ids, vp["context"].get<int>());
  double const want = vp["perplexity"].get<double>();
  MESSAGE("validation perplexity: qflash ", r.perplexity, ", trainer ", want);
  CHECK(r.n_predicted == vp["predicted_tokens"].get<std::int64_t>());
  CHECK(std::fabs(r.perplexity - want) <= 0.005 * want);
}
