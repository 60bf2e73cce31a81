/// @file
/// `qflash budget`: the memory planner's table (runtime/memory_plan.hpp) for a model or a
/// preset, weight format, KV formats, contexts, sequence count and memory size.
#pragma once

#include <CLI/CLI.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "bench.hpp"
#include "kv_option.hpp"
#include "qflash/io/gguf.hpp"
#include "qflash/runtime/memory_plan.hpp"
#include "qflash/runtime/synthetic.hpp"
#include "qflash/runtime/weight_plan.hpp"

namespace qflash::cli {

struct BudgetOptions {
  std::string model = QFLASH_DEFAULT_MODEL_DIR;
  std::string preset;
  std::string weights = "auto";
  KvOptions kv;
  std::vector<long long> contexts{4096, 8192, 16384, 32768};
  long long seqs = 1;
  std::string memory;
  long long chunk = runtime::kDefaultChunkTokens;

  CLI::Option const* model_flag = nullptr;
  CLI::Option const* preset_flag = nullptr;
};

/// "24GiB", "24 GB", "512MiB", "1.5G", "1000000": bytes (K/M/G/T and KiB/MiB/GiB/TiB are powers
/// of 1024, KB/MB/GB/TB of 1000). Throws UsageError naming `flag` otherwise.
inline std::int64_t parse_byte_size(std::string const& text, char const* flag) {
  std::size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (std::exception const&) {
    used = 0;
  }
  std::string unit = text.substr(used);
  unit.erase(0, unit.find_first_not_of(' '));
  struct Unit {
    char const* name;
    double scale;
  };
  static constexpr Unit kUnits[] = {{"", 1},          {"B", 1},           {"K", 0x1p10},      {"KiB", 0x1p10},
                                    {"KB", 1e3},      {"M", 0x1p20},      {"MiB", 0x1p20},    {"MB", 1e6},
                                    {"G", 0x1p30},    {"GiB", 0x1p30},    {"GB", 1e9},        {"T", 0x1p40},
                                    {"TiB", 0x1p40},  {"TB", 1e12}};
  if (used > 0 && std::isfinite(v) && v > 0)
    for (Unit const& u : kUnits)
      if (unit == u.name && v * u.scale < 0x1p62) return static_cast<std::int64_t>(v * u.scale);
  throw UsageError(std::string(flag) + ": '" + printable(text) +
                   "' is not a memory size (expected e.g. 24GiB, 16GB, 512MiB or a byte count)");
}

inline void add_budget_options(CLI::App* cmd, BudgetOptions& o) {
  o.model_flag = cmd->add_option("-m,--model", o.model,
                                 "Hugging Face model directory (config.json is enough) or llama.cpp .gguf file "
                                 "(default: the embedded model)");
  o.preset_flag = cmd->add_option("--preset", o.preset,
                                  "a preset's config instead of --model (" + runtime::synthetic_preset_names() + ")");
  std::vector<std::string> schemes;
  for (auto const& [k, name] : runtime::kWeightSchemes) schemes.emplace_back(name);
  cmd->add_option("--weights", o.weights,
                  "weight format in memory, as for 'qflash run' (auto: as stored; a preset is stored in bf16)")
      ->check(CLI::IsMember(schemes))
      ->capture_default_str();
  add_kv_options(cmd, o.kv, "bf16");
  cmd->add_option("-c,--context", o.contexts, "context lengths in tokens, e.g. 4096,32768")
      ->delimiter(',')
      ->check(CLI::Range(1LL, 1LL << 40))
      ->capture_default_str();
  cmd->add_option("--seqs", o.seqs, "concurrent sequences the total is for")
      ->check(CLI::Range(1LL, 1LL << 30))
      ->capture_default_str();
  cmd->add_option("--memory", o.memory, "memory to plan for, e.g. 24GiB: adds the headroom and the sequences that fit");
  cmd->add_option("--chunk", o.chunk, "prefill chunk in tokens the scratch estimate assumes")
      ->check(CLI::Range(1LL, 1LL << 20))
      ->capture_default_str();
  cmd->footer(
      "Weights are the resident bytes of every matrix in the chosen formats (a GGUF file at --weights auto: its "
      "tensor data). KV is per sequence, in whole blocks of 16 tokens, for the full-attention layers only; "
      "int8/int6 store an fp16 scale and min per 64 values, fp8_e4m3 an fp32 scale per token-head. The DeltaNet "
      "state (conv + recurrent, fp32) is per sequence whatever its length. Scratch is an estimate of the fp32 "
      "activations of one prefill chunk plus one logits row.");
}

inline std::string signed_bytes(double b) { return (b < 0 ? "-" : "") + human_bytes(std::fabs(b)); }

inline int cmd_budget(BudgetOptions const& o) {
  bool const from_preset = o.preset_flag->count() > 0;
  if (from_preset && o.model_flag->count() > 0) throw UsageError("--preset and --model exclude each other");
  std::int64_t const memory = o.memory.empty() ? 0 : parse_byte_size(o.memory, "--memory");
  check_kv_options(o.kv);
  runtime::WeightScheme const scheme = runtime::parse_weight_scheme(o.weights);

  model::ModelConfig cfg;
  std::int64_t weight_bytes = 0;
  std::string name;
  if (from_preset) {
    try {
      cfg = runtime::synthetic_config(o.preset, runtime::synthetic_preset(o.preset).n_layer);
    } catch (Error const& e) {
      throw UsageError(std::string("--preset: ") + e.what());
    }
    weight_bytes = runtime::plan_weights(cfg, scheme, WeightFormat::kBf16).total_bytes();
    name = o.preset;
  } else {
    cfg = peek_config(o.model);
    name = std::filesystem::path(o.model).filename().string();
    if (runtime::is_gguf_file(o.model) && scheme == runtime::WeightScheme::kAuto) {
      io::GgufFile const file(o.model);
      weight_bytes = static_cast<std::int64_t>(file.bytes().size() - file.data_offset());
    } else {
      weight_bytes = runtime::plan_weights(cfg, scheme, runtime::stored_format(cfg)).total_bytes();
    }
  }
  kv::KvMap const kv = resolve_kv(o.kv, cfg, from_preset ? std::string() : o.model, "bf16");
  auto const plan = runtime::plan_memory(cfg, weight_bytes, kv, o.chunk);

  std::printf("%s: weights %s (%s), scratch %s (estimate, %lld-token chunks)\n", name.c_str(),
              human_bytes(static_cast<double>(plan.weights)).c_str(), o.weights.c_str(),
              human_bytes(static_cast<double>(plan.scratch)).c_str(), o.chunk);
  std::printf("KV %s: %lld bytes/token (%d of %d layers hold KV, %d KV heads x %d); DeltaNet state %s per sequence\n",
              describe_kv(kv).c_str(),
              static_cast<long long>(plan.kv_per_token), cfg.n_layer_of(model::LayerKind::kFullAttention), cfg.n_layer,
              cfg.n_head_kv, cfg.d_head, human_bytes(static_cast<double>(plan.state_per_sequence)).c_str());
  std::printf("\n| context | KV / seq | state / seq | total, %lld seq%s |%s\n", o.seqs, o.seqs == 1 ? "" : "s",
              memory ? " headroom | seqs that fit |" : "");
  std::printf("| ------: | -------: | ----------: | ------: |%s\n", memory ? " -------: | ------------: |" : "");
  for (long long ctx : o.contexts) {
    if (ctx > cfg.max_position_embeddings)
      QFLASH_LOG_WARN("context ", ctx, " is above the model's limit of ", cfg.max_position_embeddings, " tokens");
    std::int64_t const total = plan.total(ctx, o.seqs);
    std::printf("| %lld | %s | %s | %s |", ctx, human_bytes(static_cast<double>(plan.kv_bytes(ctx))).c_str(),
                human_bytes(static_cast<double>(plan.state_per_sequence)).c_str(), human_bytes(static_cast<double>(total)).c_str());
    if (memory)
      std::printf(" %s | %lld |", signed_bytes(static_cast<double>(memory - total)).c_str(),
                  static_cast<long long>(plan.sequences_that_fit(ctx, memory)));
    std::printf("\n");
  }
  return kExitOk;
}

}  // namespace qflash::cli
