/// @file
/// `--kv`: the KV cache formats of the commands that run or plan a model.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

#include "args.hpp"
#include "qflash/kv/map.hpp"

namespace qflash::cli {

inline constexpr char const* kKvHelp =
    "KV cache format of keys and values: f32 (exact), bf16, fp8_e4m3, int8, int6, or K:V (e.g. bf16:int6); "
    "int8/int6 keep an fp16 scale and min per 64 values, fp8_e4m3 an fp32 scale per token-head";

inline void add_kv_option(CLI::App* cmd, std::string& kv) { cmd->add_option("--kv", kv, kKvHelp)->capture_default_str(); }

/// "bf16" or "K:V"; throws UsageError naming --kv.
inline kv::KvFormats parse_kv_option(std::string const& text) {
  try {
    return kv::parse_kv_formats(text);
  } catch (Error const& e) {
    throw UsageError(std::string("--kv: ") + e.what());
  }
}

}  // namespace qflash::cli
