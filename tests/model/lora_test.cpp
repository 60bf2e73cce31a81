// PEFT LoRA adapters (runtime/lora.hpp, model/lora.hpp) against PEFT itself: the fixtures of
// tools/make_lora_fixture.py hold PEFT's logits and greedy continuation with each adapter. Applied
// unmerged (per sequence, mixed in one batch), merged at load, stacked; hostile adapter files give
// errors that name the file and what is wrong.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "qflash/io/json.hpp"
#include "qflash/io/safetensors.hpp"
#include "qflash/model/model.hpp"
#include "qflash/runtime/load_model.hpp"
#include "qflash/runtime/lora.hpp"
#include "qflash/runtime/sampler.hpp"
#include "support/tolerance.hpp"
#include "support/expect_error.hpp"
#include "support/safetensors_writer.hpp"
#include "support/temp_dir.hpp"

using namespace qflash;
using test::max_abs_diff;
namespace fs = std::filesystem;

namespace {

std::string const kFixtures = std::string(QFLASH_SOURCE_DIR) + "/tests/fixtures/lora/";

struct Reference {
  std::string base;
  std::vector<std::int32_t> prompt, greedy;
  std::vector<float> logits;
};

Reference reference(std::string const& name) {
  io::Json const j = io::read_json_file(kFixtures + name + "/reference.json");
  Reference r;
  r.base = std::string(QFLASH_SOURCE_DIR) + "/" + j.at("base_model").get<std::string>();
  r.prompt = j.at("prompt_ids").get<std::vector<std::int32_t>>();
  r.greedy = j.at("greedy_ids").get<std::vector<std::int32_t>>();
  io::SafetensorsFile const st(kFixtures + name + "/reference.safetensors");
  r.logits = io::read_f32(*st.find("logits"));
  return r;
}

runtime::LoadedModel load(std::string const& dir, runtime::WeightScheme scheme = runtime::WeightScheme::kAuto) {
  runtime::LoadOptions o;
  o.progress = false;
  o.weights = scheme;
  return runtime::load_model(dir, o);
}

using GenericModel = model::Model<spec::generic>;

std::unique_ptr<GenericModel> make(runtime::LoadedModel const& m, std::shared_ptr<model::LoraAdapter const> lora = {}) {
  model::ModelOptions o;
  o.lora = std::move(lora);
  return std::make_unique<GenericModel>(m.config, m.weights, m.storage, o);
}

/// Logits of every prompt token, and the greedy continuation of n tokens.
std::pair<std::vector<float>, std::vector<std::int32_t>> run(GenericModel& m, std::vector<std::int32_t> const& prompt,
                                                             std::size_t n) {
  auto state = m.new_sequence();
  model::SequenceChunk c{prompt, &state, nullptr};
  std::vector<float> all, logits;
  m.forward(std::span(&c, 1), model::LogitsFor::kAllTokens, all);
  std::vector<std::int32_t> out;
  std::size_t const vocab = static_cast<std::size_t>(m.config().vocab);
  std::int32_t next = runtime::argmax(std::span<float const>(all).last(vocab));
  while (out.size() < n) {
    out.push_back(next);
    model::SequenceChunk step{std::span(&out.back(), 1), &state, nullptr};
    m.forward(std::span(&step, 1), model::LogitsFor::kLastToken, logits);
    next = runtime::argmax(logits);
  }
  return {all, out};
}


}  // namespace

TEST_CASE("LoRA: logits equal PEFT's within 1e-4 and greedy continuations are identical, unmerged and merged") {
  for (std::string const name : {"austen", "tiny_qwen3_moe"}) {
    CAPTURE(name);
    Reference const ref = reference(name);
    auto const base = load(ref.base);
    auto const adapter = runtime::load_lora(kFixtures + name, base);
    CHECK(adapter->name == name);

    auto m = make(base, adapter);
    auto const [logits, greedy] = run(*m, ref.prompt, ref.greedy.size());
    double const d = max_abs_diff(logits, ref.logits);
    MESSAGE(name, " unmerged: max |logit - PEFT| = ", d);
    CHECK(d <= 1e-4);
    CHECK(greedy == ref.greedy);
    // The adapter matters: without it the logits are far from PEFT's.
    auto plain = make(base);
    CHECK(max_abs_diff(run(*plain, ref.prompt, 0).first, ref.logits) > 1e-2);

    // Merged into f32 weights: the same sums, folded once.
    auto merged = load(ref.base, runtime::WeightScheme::kF32);
    runtime::merge_lora(merged, *adapter);
    auto mm = make(merged);
    auto const [m_logits, m_greedy] = run(*mm, ref.prompt, ref.greedy.size());
    double const dm = max_abs_diff(m_logits, ref.logits);
    MESSAGE(name, " merged (f32): max |logit - PEFT| = ", dm);
    CHECK(dm <= 1e-4);
    CHECK(m_greedy == ref.greedy);
  }
}

TEST_CASE("LoRA: sequences of one batch with and without an adapter equal each run alone; stacking adds") {
  Reference const ref = reference("austen");
  auto const base = load(ref.base);
  auto const adapter = runtime::load_lora(kFixtures + "austen", base);
  auto m = make(base);
  std::vector<std::int32_t> const other(ref.prompt.begin(), ref.prompt.begin() + 5);
  auto const alone_base = run(*m, other, 0).first;
  m->set_lora(adapter);
  auto const alone_lora = run(*m, ref.prompt, 0).first;
  m->set_lora(nullptr);

  auto s1 = m->new_sequence(), s2 = m->new_sequence();
  std::vector<model::SequenceChunk> batch{{ref.prompt, &s1, nullptr, adapter.get()}, {other, &s2, nullptr, nullptr}};
  std::vector<float> logits;
  m->forward(batch, model::LogitsFor::kAllTokens, logits);
  std::size_t const vocab = static_cast<std::size_t>(base.config.vocab);
  std::vector<float> const first(logits.begin(), logits.begin() + static_cast<std::ptrdiff_t>(ref.prompt.size() * vocab));
  std::vector<float> const second(logits.begin() + static_cast<std::ptrdiff_t>(ref.prompt.size() * vocab), logits.end());
  CHECK(max_abs_diff(first, alone_lora) <= 1e-5);
  CHECK(max_abs_diff(second, alone_base) <= 1e-5);

  // Two halves of an adapter stacked are the adapter.
  auto const half1 = runtime::load_lora(kFixtures + "austen", base, 0.25f, "a");
  auto const half2 = runtime::load_lora(kFixtures + "austen", base, 0.75f, "b");
  auto const both = runtime::combine_lora({half1, half2});
  CHECK(both->name == "a+b");
  m->set_lora(both);
  CHECK(max_abs_diff(run(*m, ref.prompt, 0).first, alone_lora) <= 1e-4);
  // Scale 0 is the base model.
  m->set_lora(runtime::load_lora(kFixtures + "austen", base, 0.0f));
  CHECK(max_abs_diff(run(*m, other, 0).first, alone_base) <= 1e-6);
}

TEST_CASE("LoRA: hostile adapters give errors naming the file and what is wrong") {
  Reference const ref = reference("austen");
  auto const base = load(ref.base);
  std::string const good = kFixtures + "austen";
  io::Json const config = io::read_json_file(good + "/adapter_config.json");

  // A copy of the good adapter with its config changed by `edit` and, when given, its tensors replaced.
  auto variant = [&](test::TempDir const& t, auto&& edit, std::vector<test::Entry> const* tensors = nullptr) {
    io::Json c = config;
    edit(c);
    t.write("adapter_config.json", c.dump());
    if (tensors)
      test::write_safetensors(t.file("adapter_model.safetensors"), *tensors);
    else
      fs::copy_file(good + "/adapter_model.safetensors", t.file("adapter_model.safetensors"));
    return t.dir();
  };
  auto fails = [&](std::string const& dir, std::initializer_list<std::string> parts) {
    test::expect_error([&] { (void)runtime::load_lora(dir, base); }, parts);
  };
  auto f32 = [](std::string name, std::vector<std::int64_t> shape, float v = 0.01f) {
    std::size_t n = 1;
    for (auto s : shape) n *= static_cast<std::size_t>(s);
    return test::Entry{std::move(name), "F32", shape, test::to_bytes(std::vector<float>(n, v))};
  };
  std::string const L0 = "base_model.model.model.layers.0.linear_attn.";

  SUBCASE("rank 0") {
    test::TempDir t;
    fails(variant(t, [](io::Json& c) { c["r"] = 0; }), {"adapter_config.json", "'r'", "positive integer"});
  }
  SUBCASE("the router as a target, in the config or as a tensor") {
    test::TempDir t1, t2, t3;
    fails(variant(t1, [](io::Json& c) { c["target_modules"].push_back("gate"); }), {"target_modules", "router", "'gate'"});
    fails(variant(t2, [](io::Json& c) { c["target_modules"] = {"q_proj", "shared_expert_gate"}; }),
          {"router", "shared_expert_gate"});
    std::vector<test::Entry> const router{f32("base_model.model.model.layers.0.mlp.gate.lora_A.weight", {4, 192}),
                                          f32("base_model.model.model.layers.0.mlp.gate.lora_B.weight", {16, 4})};
    fails(variant(t3, [](io::Json&) {}, &router), {"adapter_model.safetensors", "mlp.gate.lora_A", "router"});
  }
  SUBCASE("shape mismatch: another model's adapter, a projection's update") {
    fails(kFixtures + "tiny_qwen3_moe", {"adapter_model.safetensors", "lm_head.weight' has shape [256, 32]", "[4096, 192]"});
    test::TempDir t;
    std::vector<test::Entry> const wrong{f32(L0 + "in_proj_z.lora_A.weight", {4, 100}),
                                         f32(L0 + "in_proj_z.lora_B.weight", {256, 4})};
    fails(variant(t, [](io::Json&) {}, &wrong), {"in_proj_z in layer 0", "lora_A is [4, 100]", "needs lora_A [4, 192]"});
  }
  SUBCASE("unknown module, missing half, bad values, unsupported settings") {
    test::TempDir t1, t2, t3, t4, t5, t6, t7, t8;
    std::vector<test::Entry> const unknown{f32(L0 + "conv1d.lora_A.weight", {4, 4}), f32(L0 + "conv1d.lora_B.weight", {512, 4})};
    fails(variant(t1, [](io::Json&) {}, &unknown), {"conv1d", "does not apply adapters"});
    std::vector<test::Entry> const half{f32(L0 + "in_proj_z.lora_A.weight", {4, 192})};
    fails(variant(t2, [](io::Json&) {}, &half), {"in_proj_z", "no lora_B"});
    std::vector<test::Entry> const nan{f32(L0 + "in_proj_z.lora_A.weight", {4, 192}, std::nanf("")),
                                       f32(L0 + "in_proj_z.lora_B.weight", {256, 4})};
    fails(variant(t3, [](io::Json&) {}, &nan), {"in_proj_z.lora_A", "non-finite"});
    fails(variant(t4, [](io::Json& c) { c["use_dora"] = true; }), {"use_dora", "not supported"});
    fails(variant(t5, [](io::Json& c) { c["peft_type"] = "IA3"; }), {"peft_type", "only LORA"});
    fails(variant(t6, [](io::Json& c) { c["modules_to_save"] = {"score"}; }), {"modules_to_save", "'score'"});
    std::vector<test::Entry> const wrong_layer{f32("base_model.model.model.layers.99.self_attn.q_proj.lora_A.weight", {4, 192}),
                                               f32("base_model.model.model.layers.99.self_attn.q_proj.lora_B.weight", {512, 4})};
    fails(variant(t7, [](io::Json&) {}, &wrong_layer), {"layer '99'"});
    std::vector<test::Entry> const wrong_kind{f32("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", {4, 192}),
                                              f32("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", {512, 4})};
    fails(variant(t8, [](io::Json&) {}, &wrong_kind), {"self_attn.q_proj in layer 0", "another model"});
  }
  SUBCASE("not an adapter directory") {
    test::TempDir t;
    fails(t.dir() + "/nope", {"not a directory"});
    fails(t.dir(), {"no adapter_config.json"});
  }
}

TEST_CASE("LoRA: adapters built in code are checked against the model's matrices") {
  auto const base = load(reference("austen").base);
  auto const& layers = base.weights.layers;
  std::size_t const deltanet = static_cast<std::size_t>(
      std::find_if(layers.begin(), layers.end(), [](auto const& l) { return l.kind != model::LayerKind::kFullAttention; }) -
      layers.begin());
  REQUIRE(deltanet < layers.size());
  std::int64_t const d_model = base.weights.embed.cols;
  std::vector<float> a(2 * 8192, 0.01f), b(8192 * 2, 0.01f);  // check_adapter reads shapes only
  auto update = [&](std::int64_t in, std::int64_t out) {
    REQUIRE((in <= 8192 && out <= 8192));
    return kernels::LowRank{WeightView{WeightFormat::kF32, a.data(), 2, in}, WeightView{WeightFormat::kF32, b.data(), out, 2}};
  };
  model::LoraAdapter ad;
  ad.name = "coded";
  ad.layers.resize(layers.size());
  std::string const L = "layer " + std::to_string(deltanet) + " ";

  // Every projection of the table, in a layer that has it: accepted.
  model::LoraLayer& u = ad.layers[deltanet];
  for (auto const& p : model::kLoraProjections)
    if (WeightView const* m = p.base(layers[deltanet])) u.*p.update = update(m->cols, m->rows);
  CHECK_NOTHROW(model::check_adapter(ad, base.weights));
  CHECK(!u.qkv.empty());

  // An attention projection in a Gated DeltaNet layer.
  u.q = update(d_model, 8);
  test::expect_error([&] { model::check_adapter(ad, base.weights); },
                     {"'coded'", L, "Gated DeltaNet layer", "self_attn.q_proj"});
  u.q = {};
  // An update whose output size is not its matrix's.
  u.z = update(d_model, layers[deltanet].linear.z.rows + 1);
  test::expect_error([&] { model::check_adapter(ad, base.weights); }, {L + "linear_attn.in_proj_z", "does not fit"});
  u.z = {};
  // Expert updates for fewer experts than the model has.
  u.down.assign(1, update(layers[deltanet].moe.experts[0].down.cols, d_model));
  test::expect_error([&] { model::check_adapter(ad, base.weights); }, {"down_proj updates for 1 experts"});
  u.down.clear();
  // Depth.
  ad.layers.pop_back();
  test::expect_error([&] { model::check_adapter(ad, base.weights); }, {"has " + std::to_string(layers.size() - 1) + " layers"});
}
