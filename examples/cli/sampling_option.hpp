// The sampling flags of `qflash run` and `qflash chat` (--temperature, --top-k, --top-p, --min-p,
// --repetition-penalty, --seed): a flag given on the command line wins, every other setting comes
// from the model's generation_config.json (runtime::default_sampling), as transformers and vLLM
// read it.
#pragma once

#include <CLI/CLI.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>

#include "args.hpp"
#include "qflash/core/log.hpp"
#include "qflash/model/config.hpp"
#include "qflash/runtime/generate.hpp"
#include "qflash/runtime/sampler.hpp"

namespace qflash::cli {

struct SamplingOptions {
  runtime::SamplingParams given;  ///< the flags' values (defaults where not given)
  long long seed = -1;
  CLI::Option const* temperature = nullptr;
  CLI::Option const* top_k = nullptr;
  CLI::Option const* top_p = nullptr;
  CLI::Option const* min_p = nullptr;
  CLI::Option const* repetition_penalty = nullptr;
};

inline void add_sampling_options(CLI::App* cmd, SamplingOptions& o) {
  o.temperature = cmd->add_option("--temperature,--temp", o.given.temperature,
                                  "sampling temperature (0: greedy; default: generation_config.json's, else 0)")
                      ->check(number_in(0, INFINITY));
  o.top_k = cmd->add_option("--top-k", o.given.top_k, "keep the k most likely tokens (0: off)")->check(integer_in(0));
  o.top_p = cmd->add_option("--top-p", o.given.top_p, "nucleus sampling mass (1: off)")
                ->check(number_in(0, 1, /*lo_open=*/true));
  o.min_p = cmd->add_option("--min-p", o.given.min_p, "drop tokens below min-p x the top probability (0: off)")
                ->check(number_in(0, 1));
  o.repetition_penalty = cmd->add_option("--repetition-penalty,--repeat-penalty", o.given.repetition_penalty,
                                         "penalty for tokens already seen (1: off)")
                             ->check(number_in(0, INFINITY, /*lo_open=*/true));
  cmd->add_option("-s,--seed", o.seed, "random seed (-1: a random one, logged with -v)")
      ->check(integer_in(-1, std::numeric_limits<long long>::max()));
}

/// The sampling to use with model `cfg`: each flag given, else generation_config.json's value,
/// else the flag's default (greedy); the seed from -s or a random one. Throws UsageError when
/// the result is out of range.
inline runtime::SamplingParams resolve_sampling(SamplingOptions const& o, model::ModelConfig const& cfg) {
  runtime::SamplingParams const from_model = runtime::default_sampling(cfg);
  runtime::SamplingParams p = o.given;
  auto pick = [](CLI::Option const* flag, auto given, auto model) { return flag && flag->count() > 0 ? given : model; };
  p.temperature = pick(o.temperature, o.given.temperature, from_model.temperature);
  p.top_k = pick(o.top_k, o.given.top_k, from_model.top_k);
  p.top_p = pick(o.top_p, o.given.top_p, from_model.top_p);
  p.min_p = pick(o.min_p, o.given.min_p, from_model.min_p);
  p.repetition_penalty = pick(o.repetition_penalty, o.given.repetition_penalty, from_model.repetition_penalty);
  p.seed = o.seed >= 0 ? static_cast<std::uint64_t>(o.seed) : std::random_device{}();
  try {
    runtime::validate(p);
  } catch (Error const& e) {
    throw UsageError(e.what());
  }
  QFLASH_LOG_INFO("sampling: temperature ", p.temperature, ", top-k ", p.top_k, ", top-p ", p.top_p, ", min-p ", p.min_p,
                  ", repetition penalty ", p.repetition_penalty, ", seed ", p.seed,
                  cfg.generation.do_sample ? " (flags, then generation_config.json)" : "");
  return p;
}

}  // namespace qflash::cli
