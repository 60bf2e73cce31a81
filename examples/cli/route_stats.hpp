/// @file
/// `qflash route-stats`: routing statistics (router entropy, expert load, experts per token)
/// and each routing policy's perplexity, KL from top-k, and expert compute, on a text.
#pragma once

#include <CLI/CLI.hpp>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include "args.hpp"
#include "bench.hpp"
#include "qflash/io/json.hpp"
#include "qflash/model/config.hpp"
#include "qflash/runtime/route_stats.hpp"

namespace qflash::cli {

struct RouteStatsOptions {
  std::string text;
  int context = 256;
  long long max_tokens = 8192;
  std::vector<std::string> routing{"top_p=0.95", "top_p=0.9", "top_p=0.8", "top_p=0.7", "top_p=0.5"};
  std::string json, plot;
  std::string tools_dir;  ///< where tools/plot_route_stats.py and the tools venv live
};

inline void add_route_stats_options(CLI::App* cmd, RouteStatsOptions& o) {
  cmd->add_option("--text", o.text, "UTF-8 text ('-': standard input)")->required();
  cmd->add_option("-c,--context", o.context, "window length in tokens")->check(integer_in(2))->capture_default_str();
  cmd->add_option("--max-tokens", o.max_tokens, "tokens of the text at most (its first ones)")
      ->check(integer_in(2))
      ->capture_default_str();
  cmd->add_option("--routing", o.routing,
                  "policies to compare with the model's top-k (repeatable; see 'qflash run --help')")
      ->capture_default_str();
  cmd->add_option("--json", o.json, "also write every statistic to this JSON file");
  cmd->add_option("--plot", o.plot, "also draw entropy, expert load and experts per token into this PNG (needs the tools venv)");
}

/// The policies to measure: top-k first (the KL reference), then each --routing once.
inline std::vector<model::Routing> route_stats_policies(RouteStatsOptions const& o) {
  std::vector<model::Routing> out{model::Routing{}};
  for (auto const& text : o.routing) {
    model::Routing r;
    try {
      r = model::parse_routing(text);
    } catch (Error const& e) {
      throw UsageError(std::string("--routing: ") + e.what());
    }
    if (std::find(out.begin(), out.end(), r) == out.end()) out.push_back(r);
  }
  return out;
}

inline io::Json route_stats_json(std::vector<runtime::RouteStats> const& stats, model::ModelConfig const& cfg,
                                 std::string const& model, std::string const& text, std::int64_t tokens,
                                 int context) {
  io::Json policies = io::Json::array();
  double const top_k_experts = stats.front().mean_experts();
  for (auto const& s : stats) {
    io::Json layers = io::Json::array();
    for (std::size_t l = 0; l < s.load.size(); ++l)
      layers.push_back({{"layer", l}, {"router_entropy", s.mean_entropy(l)}, {"expert_load", s.load[l]}});
    policies.push_back({{"routing", model::to_string(s.routing)},
                        {"route_slots", s.slots},
                        {"mean_experts_per_token", s.mean_experts()},
                        {"expert_flops_vs_top_k", s.mean_experts() / top_k_experts},
                        {"perplexity", s.perplexity()},
                        {"mean_kl_vs_top_k", s.mean_kl()},
                        {"experts_per_token_histogram", s.experts_per_token},
                        {"layers", layers}});
  }
  return {{"model", model},
          {"n_expert", cfg.n_expert},
          {"top_k", cfg.n_expert_used},
          {"text", text},
          {"tokens", tokens},
          {"context", context},
          {"policies", policies}};
}

/// The tables on standard output.
inline void print_route_stats(std::vector<runtime::RouteStats> const& stats, model::ModelConfig const& cfg) {
  auto const& base = stats.front();
  double const base_ppl = base.perplexity(), base_experts = base.mean_experts();
  std::printf("| routing | experts/token | expert FLOPs vs top-k | perplexity | vs top-k | mean KL vs top-k |\n");
  std::printf("|---|---:|---:|---:|---:|---:|\n");
  for (auto const& s : stats)
    std::printf("| %s | %.2f | %.3f | %.4f | %+.2f%% | %.3g |\n", model::to_string(s.routing).c_str(),
                s.mean_experts(), s.mean_experts() / base_experts, s.perplexity(),
                100.0 * (s.perplexity() / base_ppl - 1.0), s.mean_kl());
  std::printf("\nRouter entropy under top-k (nats; uniform over %d experts: %.3f) and expert load\n", cfg.n_expert,
              std::log(static_cast<double>(cfg.n_expert)));
  std::printf("| layer | entropy | busiest expert | its share | idlest expert | its share |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|\n");
  for (std::size_t l = 0; l < base.load.size(); ++l) {
    auto const& load = base.load[l];
    if (base.layer_tokens[l] == 0) continue;
    auto const [lo, hi] = std::minmax_element(load.begin(), load.end());
    double const total = static_cast<double>(std::accumulate(load.begin(), load.end(), std::int64_t{0}));
    std::printf("| %zu | %.3f | %lld | %.3f | %lld | %.3f |\n", l, base.mean_entropy(l),
                static_cast<long long>(hi - load.begin()), static_cast<double>(*hi) / total,
                static_cast<long long>(lo - load.begin()), static_cast<double>(*lo) / total);
  }
  std::printf("\nExperts per token (share of token-layers)\n| routing |");
  std::size_t width = 0;
  for (auto const& s : stats) width = std::max(width, s.experts_per_token.size());
  for (std::size_t c = 1; c < width; ++c) std::printf(" %zu |", c);
  std::printf("\n|---|");
  for (std::size_t c = 1; c < width; ++c) std::printf("---:|");
  std::printf("\n");
  for (auto const& s : stats) {
    std::printf("| %s |", model::to_string(s.routing).c_str());
    for (std::size_t c = 1; c < width; ++c) {
      std::int64_t const n = c < s.experts_per_token.size() ? s.experts_per_token[c] : 0;
      std::printf(" %.3f |", static_cast<double>(n) / static_cast<double>(s.token_layers));
    }
    std::printf("\n");
  }
}

/// Writes --json (to `json_path`) and draws --plot from it.
inline void write_route_stats_outputs(RouteStatsOptions const& o, io::Json const& j) {
  namespace fs = std::filesystem;
  std::string json_path = o.json;
  if (json_path.empty() && !o.plot.empty()) json_path = o.plot + ".json";
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    f << j.dump(1) << "\n";
    QFLASH_CHECK(f.good(), "--json: cannot write ", json_path);
    std::fprintf(stderr, "route-stats: wrote %s\n", printable(json_path).c_str());
  }
  if (o.plot.empty()) return;
  std::string const python = (fs::path(o.tools_dir) / ".venv" / "bin" / "python").string();
  std::string const script = (fs::path(o.tools_dir) / "plot_route_stats.py").string();
  std::error_code ec;
  QFLASH_CHECK(fs::exists(script, ec), "--plot: ", script, " is missing (it comes with the qflash sources)");
  QFLASH_CHECK(::access(python.c_str(), X_OK) == 0, "--plot needs matplotlib from the tools venv, and ", python,
               " does not exist; create the venv with: ", (fs::path(o.tools_dir) / "setup_venv").string());
  bench_detail::run_program({python, script, "--out", o.plot, json_path});
  std::fprintf(stderr, "route-stats: wrote %s\n", printable(o.plot).c_str());
}

}  // namespace qflash::cli
