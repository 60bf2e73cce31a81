// `--lora [NAME=]DIR[:SCALE]` (repeatable) and `--lora-merge`: PEFT LoRA adapters for run,
// logits, perplexity, chat (all given adapters at once) and serve (each by name, per request).
#pragma once

#include <CLI/CLI.hpp>

#include <cctype>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "args.hpp"
#include "qflash/model/lora.hpp"
#include "qflash/runtime/load_model.hpp"
#include "qflash/runtime/lora.hpp"

namespace qflash::cli {

struct LoraOptions {
  std::vector<std::string> specs;  ///< --lora values
  bool merge = false;              ///< --lora-merge
};

struct LoraSpec {
  std::string name;  ///< empty: the directory's name
  std::string dir;
  float scale = 1.0f;
};

inline void add_lora_options(CLI::App* cmd, LoraOptions& o, bool serving) {
  cmd->add_option("--lora", o.specs,
                  serving ? "a PEFT LoRA adapter requests may pick by name ('model' or 'lora' field): [NAME=]DIR[:SCALE] "
                            "(repeatable; NAME defaults to the directory's name, SCALE to 1)"
                          : "apply a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors): DIR[:SCALE] "
                            "(repeatable: all apply together; SCALE multiplies lora_alpha / r, default 1)");
  if (!serving)
    cmd->add_flag("--lora-merge", o.merge,
                  "fold the adapters into the weights at load (W + B A, re-encoded in each matrix's format) instead "
                  "of running them beside the base projections");
}

/// Parses one --lora value; throws UsageError naming the flag.
inline LoraSpec parse_lora_spec(std::string const& text) {
  LoraSpec s;
  std::string rest = text;
  if (auto eq = rest.find('='); eq != std::string::npos && rest.find('/') > eq) {
    s.name = rest.substr(0, eq);
    rest = rest.substr(eq + 1);
    try {
      model::check_adapter_name(s.name);
    } catch (Error const& e) {
      throw UsageError("--lora '" + text + "': " + e.what());
    }
  }
  if (auto colon = rest.rfind(':'); colon != std::string::npos) {
    std::string const num = rest.substr(colon + 1);
    float v = 0;
    auto const [end, ec] = std::from_chars(num.data(), num.data() + num.size(), v);
    if (ec == std::errc{} && end == num.data() + num.size()) {
      if (!std::isfinite(v)) throw UsageError("--lora '" + text + "': the scale must be a finite number");
      s.scale = v;
      rest = rest.substr(0, colon);
    }
  }
  s.dir = rest;
  if (!std::filesystem::is_directory(s.dir))
    throw UsageError("--lora '" + text + "': '" + s.dir + "' is not a directory (expected a PEFT adapter: "
                     "adapter_config.json and adapter_model.safetensors)");
  if (s.name.empty()) {
    s.name = std::filesystem::path(s.dir).lexically_normal().filename().string();
    if (s.name.empty()) s.name = std::filesystem::path(s.dir).lexically_normal().parent_path().filename().string();
    for (char& c : s.name)  // a directory name is only a default: make it a valid adapter name
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') c = '_';
    if (s.name.size() > 64) s.name.resize(64);
  }
  return s;
}

/// Checks every --lora value (before a model is read).
inline void check_lora_options(LoraOptions const& o) {
  if (o.merge && o.specs.empty()) throw UsageError("--lora-merge: no --lora adapter to merge");
  for (auto const& s : o.specs) (void)parse_lora_spec(s);
}

/// Every adapter, each read for `m`.
inline std::vector<std::shared_ptr<model::LoraAdapter const>> load_loras(LoraOptions const& o,
                                                                         runtime::LoadedModel const& m) {
  std::vector<std::shared_ptr<model::LoraAdapter const>> out;
  for (auto const& text : o.specs) {
    LoraSpec const s = parse_lora_spec(text);
    out.push_back(runtime::load_lora(s.dir, m, s.scale, s.name));
  }
  return out;
}

/// For run / logits / perplexity / chat: all adapters as one, merged into `m` (--lora-merge,
/// returning null) or returned to run beside it. Null when there are none.
inline std::shared_ptr<model::LoraAdapter const> apply_loras(LoraOptions const& o, runtime::LoadedModel& m) {
  if (o.specs.empty()) return nullptr;
  auto const adapter = runtime::combine_lora(load_loras(o, m));
  if (!o.merge) return adapter;
  runtime::merge_lora(m, *adapter);
  return nullptr;
}

}  // namespace qflash::cli
