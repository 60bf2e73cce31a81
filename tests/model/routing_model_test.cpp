// Dynamic routing through whole models (the embedded trained ones): what the router observer
// sees follows the policy, a batch whose sequences route differently equals each run alone
// (bit for bit; within fp32 rounding where bf16 projections of 8 tokens or more run on AMX
// tiles, kernels/linear/cpu_amx.hpp), incremental decode equals the full forward, and the
// model's routing can be switched.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/io/tokenizer.hpp"
#include "qflash/model/model.hpp"
#include "qflash/runtime/load_model.hpp"
#include "qflash/runtime/route_stats.hpp"
#include "support/tolerance.hpp"

using namespace qflash;

namespace {

std::unique_ptr<model::Model<spec::generic>> load(std::string const& name) {
  runtime::LoadOptions o;
  o.progress = false;
  return runtime::load_model_as<spec::generic>(std::string(QFLASH_SOURCE_DIR) + "/models/" + name, o);
}

std::vector<std::int32_t> prompt_ids(std::string const& name, std::string const& text) {
  return io::Tokenizer::from_file(std::string(QFLASH_SOURCE_DIR) + "/models/" + name + "/tokenizer.json").encode(text);
}

std::vector<float> run(model::Model<spec::generic>& m, std::vector<std::int32_t> const& ids,
                       model::Routing const* routing = nullptr) {
  auto state = m.new_sequence();
  model::SequenceChunk c{ids, &state, routing};
  std::vector<float> logits;
  m.forward(std::span(&c, 1), model::LogitsFor::kAllTokens, logits);
  return logits;
}

std::string const kText =
    "It was a truth universally acknowledged, that a single man in possession of a good fortune must be in want "
    "of a wife. However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families.";

}  // namespace

TEST_CASE("routing through the model: counts follow the policy; batches mixing policies equal each alone") {
  for (std::string const name : {"qwen3_5_moe-micro", "qwen3_moe-micro"}) {
    CAPTURE(name);
    auto m = load(name);
    int const k = m->config().n_expert_used;
    auto const ids = prompt_ids(name, kText);
    auto const top_k = run(*m, ids);

    // A policy that cannot drop anything is top-k, bit for bit.
    model::Routing const same = model::parse_routing("top_p=1");
    CHECK(run(*m, ids, &same) == top_k);

    // top_p: the observer sees between k_min and k experts per token, fewer on average.
    model::Routing const dyn = model::parse_routing("top_p=0.5,k_min=1");
    runtime::RouteStats stats;
    m->set_route_observer([&](model::RouteRecord const& r) { stats.add(r); });
    auto const dyn_logits = run(*m, ids, &dyn);
    m->set_route_observer({});
    CHECK(stats.token_layers == static_cast<std::int64_t>(ids.size()) * m->config().n_layer);
    CHECK(stats.experts_per_token[0] == 0);
    CHECK(stats.mean_experts() < k);
    CHECK(stats.mean_experts() >= 1);
    CHECK(dyn_logits != top_k);

    // A wider policy (k_max above the model's k) and a narrower top-k, in one batch with the
    // model's own: every sequence's logits equal its run alone.
    model::Routing const wide = model::parse_routing("threshold=0.05,k_min=2,k_max=" + std::to_string(k + 2));
    model::Routing const narrow = model::parse_routing("top_k=1");
    std::vector<std::int32_t> const a(ids.begin(), ids.begin() + 20), b(ids.begin() + 5, ids.begin() + 31),
        c(ids.begin() + 2, ids.begin() + 13);
    auto sa = m->new_sequence(), sb = m->new_sequence(), sc = m->new_sequence(), sd = m->new_sequence();
    std::vector<model::SequenceChunk> batch{{a, &sa, &wide}, {b, &sb, nullptr}, {c, &sc, &narrow}, {a, &sd, &dyn}};
    std::vector<float> logits;
    m->forward(batch, model::LogitsFor::kAllTokens, logits);
    std::size_t const vocab = static_cast<std::size_t>(m->config().vocab);
    std::size_t row = 0;
    for (auto const& [tokens, routing] : std::vector<std::pair<std::vector<std::int32_t>, model::Routing const*>>{
             {a, &wide}, {b, nullptr}, {c, &narrow}, {a, &dyn}}) {
      auto const alone = run(*m, tokens, routing);
      std::vector<float> const got(logits.begin() + static_cast<std::ptrdiff_t>(row * vocab),
                                   logits.begin() + static_cast<std::ptrdiff_t>((row + tokens.size()) * vocab));
      if (arch::cpu_isa() >= arch::CpuIsa::kAmx)
        CHECK(test::max_abs_diff(got, alone) <= 1e-5);
      else
        CHECK(got == alone);
      row += tokens.size();
    }

    // Incremental decode under a dynamic policy equals the full forward (one token at a time).
    auto const full = run(*m, a, &dyn);
    auto state = m->new_sequence();
    double max_diff = 0;
    for (std::size_t t = 0; t < a.size(); ++t) {
      model::SequenceChunk step{std::span(a).subspan(t, 1), &state, &dyn};
      m->forward(std::span(&step, 1), model::LogitsFor::kAllTokens, logits);
      for (std::size_t v = 0; v < vocab; ++v)
        max_diff = std::max(max_diff, std::fabs(static_cast<double>(logits[v]) - full[t * vocab + v]));
    }
    CHECK(max_diff <= 1e-4);

    // The model's own routing switches every later forward; bad routing is refused.
    m->set_routing(dyn);
    CHECK(run(*m, ids) == dyn_logits);
    m->set_routing({});
    CHECK(run(*m, ids) == top_k);
    CHECK_THROWS_AS(m->set_routing(model::parse_routing("top_k=99")), Error);
    model::Routing const bad = model::parse_routing("top_k=99");
    auto s = m->new_sequence();
    model::SequenceChunk one{ids, &s, &bad};
    CHECK_THROWS_AS(m->forward(std::span(&one, 1), model::LogitsFor::kAllTokens, logits), Error);
  }
}

TEST_CASE("route stats: entropy, load and KL from top-k over a text") {
  auto m = load("qwen3_moe-micro");
  auto const ids = prompt_ids("qwen3_moe-micro", kText + " " + kText);
  std::vector<model::Routing> const policies{model::Routing{}, model::parse_routing("top_p=0.6"),
                                             model::parse_routing("top_k=1")};
  auto const stats = runtime::measure_routing(*m, ids, 32, policies);
  REQUIRE(stats.size() == 3);
  auto const& cfg = m->config();
  for (auto const& s : stats) {
    CHECK(s.n_predicted == static_cast<std::int64_t>(ids.size()) - static_cast<std::int64_t>((ids.size() + 31) / 32));
    CHECK(s.load.size() == static_cast<std::size_t>(cfg.n_layer));
    for (std::size_t l = 0; l < s.load.size(); ++l) {
      CHECK(s.mean_entropy(l) > 0);
      CHECK(s.mean_entropy(l) <= std::log(static_cast<double>(cfg.n_expert)) + 1e-9);
    }
  }
  CHECK(stats[0].mean_kl() == 0);
  CHECK(stats[0].mean_experts() == cfg.n_expert_used);
  CHECK(stats[1].mean_experts() < cfg.n_expert_used);
  CHECK(stats[1].mean_kl() > 0);
  CHECK(stats[2].mean_experts() == 1);
  CHECK(stats[2].mean_kl() > 0);
  // The same entropy under every policy: routing does not change the first layer's router input.
  CHECK(stats[1].mean_entropy(0) == doctest::Approx(stats[0].mean_entropy(0)).epsilon(1e-9));
  // The model's routing is restored.
  CHECK(m->routing() == model::Routing{});
  // Perplexity agrees with runtime::perplexity under top-k.
  auto const ppl = runtime::perplexity(*m, ids, 32);
  CHECK(stats[0].perplexity() == doctest::Approx(ppl.perplexity).epsilon(1e-9));
}
