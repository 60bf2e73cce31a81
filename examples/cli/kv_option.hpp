/// @file
/// `--kv` and `--kv-map`: the KV cache formats of the commands that run or plan a model.
/// Without either, a kv_compression_map.json beside the model applies (logged), else every
/// head is f32 (or, for planning, bf16).
#pragma once

#include <CLI/CLI.hpp>

#include <filesystem>
#include <string>

#include "args.hpp"
#include "qflash/core/log.hpp"
#include "qflash/io/kv_map.hpp"
#include "qflash/kv/map.hpp"
#include "qflash/model/config.hpp"

namespace qflash::cli {

struct KvOptions {
  std::string kv;   ///< "bf16" or "K:V"; empty: not given
  std::string map;  ///< a kv_compression_map.json; empty: not given
};

inline void add_kv_options(CLI::App* cmd, KvOptions& o, std::string const& fallback = "f32") {
  auto* kv = cmd->add_option("--kv", o.kv,
                             "KV cache format of keys and values: f32 (exact), bf16, fp8_e4m3, int8, int6, or K:V "
                             "(e.g. bf16:int6); int8/int6 keep an fp16 scale and min per 64 values, fp8_e4m3 an fp32 "
                             "scale per token-head (default: " + fallback + ", or the model's " + io::kKvMapFile +
                                 " when it has one)");
  cmd->add_option("--kv-map", o.map, std::string("per-head KV formats from a ") + io::kKvMapFile +
                                         " ('qflash calibrate' writes one)")
      ->excludes(kv);
}

/// "bf16" or "K:V"; throws UsageError naming the option.
inline kv::KvFormats parse_kv_option(std::string const& text, std::string const& option = "--kv") {
  try {
    return kv::parse_kv_formats(text);
  } catch (Error const& e) {
    throw UsageError(option + ": " + e.what());
  }
}

/// Checks what the command line alone can: --kv's formats, that --kv-map is a file.
inline void check_kv_options(KvOptions const& o) {
  if (!o.kv.empty()) (void)parse_kv_option(o.kv);
  std::error_code ec;
  if (!o.map.empty() && !std::filesystem::is_regular_file(o.map, ec))
    throw UsageError("--kv-map: '" + printable(o.map) + "' is not a file");
}

/// The map the options choose for `cfg` (whose files are at `model`).
inline kv::KvMap resolve_kv(KvOptions const& o, model::ModelConfig const& cfg, std::string const& model,
                            std::string const& fallback = "f32") {
  if (!o.map.empty()) return io::read_kv_map(o.map, cfg);
  if (!o.kv.empty()) return kv::KvMap::uniform(cfg, parse_kv_option(o.kv));
  std::error_code ec;
  std::filesystem::path const beside = std::filesystem::path(model) / io::kKvMapFile;
  if (std::filesystem::is_directory(model, ec) && std::filesystem::is_regular_file(beside, ec)) {
    QFLASH_LOG_INFO("KV formats from ", beside.string(), " (--kv f32 for exact KV)");
    return io::read_kv_map(beside.string(), cfg);
  }
  return kv::KvMap::uniform(cfg, parse_kv_option(fallback));
}

/// "int6", "bf16:int6", or "mixed" for a map whose heads differ.
inline std::string describe_kv(kv::KvMap const& map) {
  auto const f = map.uniform_formats();
  return f ? kv::to_string(*f) : std::string("mixed");
}

}  // namespace qflash::cli
