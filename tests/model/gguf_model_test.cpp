// llama.cpp GGUF files through the same model: F32 files equal qflash on the HF directory they
// were converted from; the Q8_0/Q4_K/Q6_K files (llama-quantize --pure) agree with llama.cpp's
// own logits on them; qflash's load-time q8_0 blocks equal llama-quantize's bit for bit; and
// GGUF files qflash cannot run are refused with the file and the reason.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "qflash/io/npy.hpp"
#include "qflash/io/safetensors.hpp"
#include "qflash/numeric/bf16.hpp"
#include "qflash/runtime/load_model.hpp"
#include "support/tolerance.hpp"
#include "support/safetensors_writer.hpp"
#include "support/temp_dir.hpp"

using namespace qflash;
using test::max_abs_diff;

namespace {

std::string const kFixtures = QFLASH_FIXTURES_DIR;
std::string const kGguf = kFixtures + "/gguf/";

runtime::LoadOptions quiet(runtime::WeightScheme w = runtime::WeightScheme::kAuto) {
  runtime::LoadOptions o;
  o.progress = false;
  o.weights = w;
  return o;
}

std::vector<std::int32_t> prompt(std::string const& fixture, int i) {
  auto const ref = nlohmann::json::parse(std::ifstream(kFixtures + "/" + fixture + "/reference.json"));
  return ref["prompts"][static_cast<std::size_t>(i)].get<std::vector<std::int32_t>>();
}

template <class M>
std::vector<float> logits_of(M& m, std::vector<std::int32_t> const& ids) {
  auto state = m.new_sequence();
  model::SequenceChunk c{ids, &state};
  std::vector<float> out;
  m.forward(std::span(&c, 1), model::LogitsFor::kAllTokens, out);
  return out;
}


struct Agreement {
  double mean_kl = 0;  ///< KL(reference || ours), mean over tokens
  double top1 = 0;     ///< fraction of tokens with the same argmax
};

Agreement agreement(std::vector<float> const& ours, std::vector<float> const& ref, std::size_t vocab) {
  REQUIRE(ours.size() == ref.size());
  std::size_t const n = ours.size() / vocab;
  Agreement a;
  for (std::size_t t = 0; t < n; ++t) {
    float const* p = ref.data() + t * vocab;
    float const* q = ours.data() + t * vocab;
    auto logsumexp = [&](float const* x) {
      double const mx = *std::max_element(x, x + vocab);
      double s = 0;
      for (std::size_t i = 0; i < vocab; ++i) s += std::exp(x[i] - mx);
      return mx + std::log(s);
    };
    double const lp = logsumexp(p), lq = logsumexp(q);
    double kl = 0;
    for (std::size_t i = 0; i < vocab; ++i) kl += std::exp(p[i] - lp) * ((p[i] - lp) - (q[i] - lq));
    a.mean_kl += kl / static_cast<double>(n);
    a.top1 += (std::max_element(p, p + vocab) - p == std::max_element(q, q + vocab) - q) / static_cast<double>(n);
  }
  return a;
}

}  // namespace

TEST_CASE("F32 GGUF files equal qflash on the HF directories they were converted from") {
  for (std::string const name : {"qwen3_5_moe_tiny", "qwen3_moe_tiny"}) {
    CAPTURE(name);
    auto hf = runtime::load_model_as<spec::generic>(kFixtures + "/" + name, quiet());
    auto gguf = runtime::load_model_as<spec::generic>(kGguf + name + "-F32.gguf", quiet());
    CHECK(gguf->config().n_layer == hf->config().n_layer);
    CHECK(gguf->config().vocab == hf->config().vocab);
    CHECK(gguf->weights().embed.format == WeightFormat::kF32);
    for (int i = 0; i < 3; ++i) {
      CAPTURE(i);
      auto const ids = prompt(name, i);
      CHECK(max_abs_diff(logits_of(*gguf, ids), logits_of(*hf, ids)) <= 1e-4);
    }
    // And llama.cpp's logits on the same file (prompt 2): fp32 both sides.
    auto const want = io::read_npy_f32(kGguf + name + "-F32.logits.npy");
    CHECK(max_abs_diff(logits_of(*gguf, prompt(name, 2)), want.data) <= 1e-4);
  }
}

TEST_CASE("BF16 GGUF files: bf16 weights used in place, close to llama.cpp on them") {
  for (std::string const name : {"qwen3_5_moe_tiny", "qwen3_moe_tiny"}) {
    CAPTURE(name);
    auto m = runtime::load_model_as<spec::generic>(kGguf + name + "-BF16.gguf", quiet());
    CHECK(m->weights().embed.format == WeightFormat::kBf16);
    auto const want = io::read_npy_f32(kGguf + name + "-BF16.logits.npy");
    auto const got = logits_of(*m, prompt(name, 2));
    auto const a = agreement(got, want.data, static_cast<std::size_t>(m->config().vocab));
    MESSAGE(name, " BF16 vs llama.cpp: max |dlogit| ", max_abs_diff(got, want.data), ", mean KL ", a.mean_kl, ", top-1 ", a.top1);
    // llama.cpp rounds activations to bf16 in its bf16 matmuls; qflash keeps them fp32.
    CHECK(a.top1 >= 0.9);
    CHECK(a.mean_kl <= 0.05);
  }
}

TEST_CASE("quantized GGUF files agree with llama.cpp's logits on them") {
  std::string const name = "qwen3_5_moe_256";
  auto const ids = prompt(name, 2);
  // Like llama.cpp, qflash rounds activations to 8-bit blocks for these weights (q8_0 blocks
  // for Q8_0, q8_K for Q4_K / Q6_K), so its logits follow llama.cpp's quantized run, not the
  // run on the same weights dequantized to F32 (on this tiny random model the rounding alone
  // moves logits by up to 2.5). What remains is fp32 summation order, which on this model can
  // move an activation code by one step in a later layer. Measured: mean KL 3e-5 (Q8_0),
  // 2.7e-5 (Q4_K), 6e-14 (Q6_K, the same order as llama.cpp's by chance), max |dlogit| <= 0.09;
  // vs the dequantized run max |dlogit| 0.4-2.5.
  for (auto const& [type, format] : std::vector<std::pair<std::string, WeightFormat>>{
           {"Q8_0", WeightFormat::kQ8_0}, {"Q4_K", WeightFormat::kQ4K}, {"Q6_K", WeightFormat::kQ6K}}) {
    CAPTURE(type);
    auto m = runtime::load_model_as<spec::generic>(kGguf + name + "-" + type + ".gguf", quiet());
    CHECK(m->weights().layers[0].moe.experts[0].gate.format == format);
    auto const got = logits_of(*m, ids);
    std::size_t const vocab = static_cast<std::size_t>(m->config().vocab);
    auto const native = io::read_npy_f32(kGguf + name + "-" + type + ".logits.npy");
    auto const dequantized = io::read_npy_f32(kGguf + name + "-" + type + ".dequantized_f32.logits.npy");
    auto const a = agreement(got, native.data, vocab);
    MESSAGE(type, ": vs llama.cpp quantized: max |dlogit| ", max_abs_diff(got, native.data), ", mean KL ", a.mean_kl,
            ", top-1 ", a.top1, "; vs llama.cpp on the weights dequantized to F32: max |dlogit| ",
            max_abs_diff(got, dequantized.data));
    CHECK(a.top1 >= 0.95);
    CHECK(a.mean_kl <= 2e-4);
  }
}

TEST_CASE("load-time q8_0 quantization equals llama-quantize's blocks bit for bit") {
  // qwen3_5_moe_256's weights are bf16 values, so the F32 GGUF llama-quantize read holds the
  // same floats the HF directory does; experts and shared experts are not reordered.
  auto ours = runtime::load_model(kFixtures + "/qwen3_5_moe_256", quiet(runtime::WeightScheme::kQ8_0));
  auto theirs = runtime::load_model(kGguf + "qwen3_5_moe_256-Q8_0.gguf", quiet());
  auto same = [](WeightView const& a, WeightView const& b) {
    REQUIRE(a.format == WeightFormat::kQ8_0);
    REQUIRE(b.format == WeightFormat::kQ8_0);
    REQUIRE(a.bytes() == b.bytes());
    return std::memcmp(a.data, b.data, static_cast<std::size_t>(a.bytes())) == 0;
  };
  for (std::size_t l = 0; l < ours.weights.layers.size(); ++l) {
    CAPTURE(l);
    auto const& a = ours.weights.layers[l].moe;
    auto const& b = theirs.weights.layers[l].moe;
    for (std::size_t e = 0; e < a.experts.size(); ++e) {
      CHECK(same(a.experts[e].gate, b.experts[e].gate));
      CHECK(same(a.experts[e].up, b.experts[e].up));
      CHECK(same(a.experts[e].down, b.experts[e].down));
    }
    CHECK(same(a.shared->down, b.shared->down));
  }
  CHECK(same(ours.weights.embed, theirs.weights.embed));
}

TEST_CASE("GGUF files qflash cannot run are refused, naming the file and the reason") {
  // A vocabulary-only conversion has no architecture qflash runs and no weights.
  CHECK_THROWS_WITH_AS(runtime::load_model(kGguf + "tokenizer-qwen35.gguf", quiet()),
                       doctest::Contains("tokenizer-qwen35.gguf"), Error);
}

namespace {

/// A copy of a fixture GGUF with `from` replaced by `to` (same length) at its first occurrence.
std::string patched(std::string const& fixture, std::string const& from, std::string const& to,
                    std::string const& dir) {
  REQUIRE(from.size() == to.size());
  std::ifstream in(kGguf + fixture, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto const at = bytes.find(from);
  REQUIRE(at != std::string::npos);
  bytes.replace(at, from.size(), to);
  std::string const path = dir + "/" + fixture;
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

}  // namespace

TEST_CASE("GGUF models with an unknown architecture, a missing key or an unsupported type are refused") {
  test::TempDir const tmp;
  std::string const f = "qwen3_5_moe_tiny-F32.gguf";
  CHECK_THROWS_WITH_AS(runtime::load_model(patched(f, "qwen35moe", "qwen99moe", tmp.dir()), quiet()),
                       doctest::Contains("general.architecture 'qwen99moe' is not supported"), Error);
  CHECK_THROWS_WITH_AS(runtime::load_model(patched(f, "qwen35moe.expert_count", "qwen35moe.expert_cxxxt", tmp.dir()), quiet()),
                       doctest::Contains("qwen35moe.expert_count"), Error);
  // token_embd.weight's type id (after its name, n_dims and two ne) from F32 to I32: same size,
  // so the file parses, but qflash cannot compute with it.
  std::ifstream in(kGguf + f, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::string const name = "token_embd.weight";
  auto const at = bytes.find(name);
  REQUIRE(at != std::string::npos);
  std::size_t const type_at = at + name.size() + 4 + 2 * 8;
  std::uint32_t type = 0;
  std::memcpy(&type, bytes.data() + type_at, 4);
  REQUIRE(type == 0);  // F32
  type = 26;           // I32
  std::memcpy(bytes.data() + type_at, &type, 4);
  std::string const path = tmp.dir() + "/i32.gguf";
  std::ofstream(path, std::ios::binary) << bytes;
  CHECK_THROWS_WITH_AS(runtime::load_model(path, quiet()),
                       doctest::Contains("tensor 'token_embd.weight' has type I32 (supported: F32, F16, BF16, Q8_0, Q4_K, Q6_K)"),
                       Error);
}

TEST_CASE("BF16 GGUF files equal qflash on the HF directory holding the same values") {
  // llama.cpp's converter stores matrices in bf16 and keeps norms, routers, the shared-expert
  // gate, conv and DeltaNet gate parameters in f32: write an HF directory with exactly those
  // roundings (as f32 values) and both must give the same logits.
  for (std::string const name : {"qwen3_5_moe_tiny", "qwen3_moe_tiny"}) {
    CAPTURE(name);
    test::TempDir const tmp;
    io::SafetensorsFile const src(kFixtures + "/" + name + "/model.safetensors");
    std::vector<test::Entry> entries;
    for (auto const& t : src.tensors()) {
      auto v = io::read_f32(t);
      bool const bf16 = t.shape.rank == 2 && !t.name.ends_with("mlp.gate.weight") &&
                        !t.name.ends_with("shared_expert_gate.weight");
      if (bf16)
        for (float& x : v) x = round_to_bf16(x);
      std::vector<std::int64_t> shape(t.shape.dims.begin(), t.shape.dims.begin() + t.shape.rank);
      entries.push_back({t.name, "F32", shape, test::to_bytes(v)});
    }
    test::write_safetensors(tmp.file("model.safetensors"), entries);
    std::filesystem::copy_file(kFixtures + "/" + name + "/config.json", tmp.path / "config.json");
    auto hf = runtime::load_model_as<spec::generic>(tmp.dir(), quiet());
    auto gguf = runtime::load_model_as<spec::generic>(kGguf + name + "-BF16.gguf", quiet());
    for (int i = 0; i < 3; ++i) {
      CAPTURE(i);
      auto const ids = prompt(name, i);
      CHECK(max_abs_diff(logits_of(*gguf, ids), logits_of(*hf, ids)) <= 1e-4);
    }
  }
}
