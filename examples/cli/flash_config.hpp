// flash_config.json: `qflash serve`'s settings in a file beside the model (or --flash-config FILE),
// under the names the Flash design uses for them. A command-line flag wins over the file; an
// unknown key or a value of the wrong kind is an error naming the file and the key.
//
//   {"max_num_seqs": 32, "max_num_batched_tokens": 256, "max_model_len": 8192,
//    "kv_cache_memory": "4GiB", "max_queue": 512, "enable_prefix_caching": true,
//    "kv_cache_eviction_policy": "lru_with_age", "kv_cache_min_age_seconds": 60,
//    "deltanet_snapshot_every_blocks": 4, "kv_cache_dtype": "bf16:int6",
//    "kv_compression_map": "kv_compression_map.json", "flash_kernel_fallback": false,
//    "log_router_decisions": "router.jsonl"}
//
// With --device cuda, "gpu_memory_utilization": 0.8 may stand instead of kv_cache_memory.
#pragma once

#include <CLI/CLI.hpp>

#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

#include "args.hpp"
#include "budget.hpp"
#include "kv_option.hpp"
#include "qflash/core/error.hpp"
#include "qflash/core/log.hpp"
#include "qflash/io/json.hpp"
#include "serve.hpp"

namespace qflash::cli {

inline constexpr char const* kFlashConfigFile = "flash_config.json";

/// The keys flash_config.json may hold, each with the flag it stands for (empty: file only).
inline constexpr std::pair<std::string_view, std::string_view> kFlashConfigKeys[] = {
    {"max_num_seqs", "--max-num-seqs"},
    {"max_num_batched_tokens", "--max-num-batched-tokens"},
    {"max_model_len", "--max-model-len"},
    {"kv_cache_memory", "--kv-cache-memory"},
    {"gpu_memory_utilization", "--gpu-memory-utilization"},
    {"max_queue", "--max-queue"},
    {"enable_prefix_caching", "--no-prefix-cache"},
    {"kv_cache_eviction_policy", "--eviction"},
    {"kv_cache_min_age_seconds", ""},
    {"deltanet_snapshot_every_blocks", ""},
    {"kv_cache_dtype", "--kv"},
    {"kv_compression_map", "--kv-map"},
    {"flash_kernel_fallback", ""},
    {"log_router_decisions", "--log-router-decisions"},
};

/// Reads `path` (or, when empty, flash_config.json in the model directory if there is one) into
/// `o` and `kv` wherever `cmd`'s command line did not set the flag. Relative paths in the file
/// are relative to its directory. Throws Error naming the file and key.
inline void apply_flash_config(std::string path, std::string const& model, CLI::App const& cmd, ServeOptions& o,
                               KvOptions& kv) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (path.empty()) {
    if (!fs::is_directory(model, ec) || !fs::is_regular_file(fs::path(model) / kFlashConfigFile, ec)) return;
    path = (fs::path(model) / kFlashConfigFile).string();
  }
  io::Json const j = io::read_json_file(path);
  QFLASH_CHECK(j.is_object(), path, ": the top level must be a JSON object, got ", io::json_excerpt(j));
  std::string known;
  for (auto const& [key, flag] : kFlashConfigKeys) known += (known.empty() ? "" : ", ") + std::string(key);
  for (auto const& [key, value] : j.items()) {
    bool const ok = std::any_of(std::begin(kFlashConfigKeys), std::end(kFlashConfigKeys),
                                [&](auto const& k) { return k.first == key; });
    QFLASH_CHECK(ok, path, ": unknown key '", key, "' (known: ", known, ")");
  }
  io::JsonFields const f(j, path);
  fs::path const dir = fs::path(path).parent_path();
  auto use = [&](std::string_view key, std::string_view flag) {
    return f.has(key) && (flag.empty() || cmd.count(std::string(flag)) == 0);
  };
  auto& e = o.engine;
  if (use("max_num_seqs", "--max-num-seqs")) e.max_num_seqs = static_cast<int>(f.integer("max_num_seqs", 1, 1 << 20, "an integer >= 1"));
  if (use("max_num_batched_tokens", "--max-num-batched-tokens"))
    e.max_num_batched_tokens = static_cast<int>(f.integer("max_num_batched_tokens", 1, 1 << 24, "an integer >= 1"));
  if (use("max_model_len", "--max-model-len"))
    e.max_context = static_cast<int>(f.integer("max_model_len", 0, 1 << 24, "an integer >= 0 (0: the model's)"));
  if (use("max_queue", "--max-queue")) e.max_queue = static_cast<int>(f.integer("max_queue", 1, 1 << 24, "an integer >= 1"));
  // The KV budget is bytes or a share of the GPU: a flag for either wins over the file's.
  QFLASH_CHECK(!(f.has("kv_cache_memory") && f.has("gpu_memory_utilization")), path,
               ": kv_cache_memory and gpu_memory_utilization exclude each other (KV bytes, or a share of the GPU's "
               "memory)");
  bool const budget_flag = cmd.count("--kv-cache-memory") + cmd.count("--gpu-memory-utilization") > 0;
  if (!budget_flag && f.has("gpu_memory_utilization")) {
    double const u = f.number("gpu_memory_utilization");
    if (!(u > 0 && u <= 1)) f.fail("gpu_memory_utilization", "a number in (0, 1]");
    e.gpu_memory_utilization = u;
  }
  if (!budget_flag && f.has("kv_cache_memory")) {
    io::Json const& v = j["kv_cache_memory"];
    if (v.is_string()) {
      try {
        e.kv_cache_bytes = parse_byte_size(v.get<std::string>(), "kv_cache_memory");
      } catch (UsageError const& err) {
        QFLASH_FAIL(path, ": ", err.what());
      }
    } else {
      e.kv_cache_bytes = f.integer("kv_cache_memory", 1, std::int64_t{1} << 50, "bytes, or a size such as \"2GiB\"");
    }
  }
  if (use("enable_prefix_caching", "--no-prefix-cache")) e.prefix.enabled = f.boolean("enable_prefix_caching", true);
  if (use("kv_cache_eviction_policy", "--eviction")) {
    std::string const p = f.string("kv_cache_eviction_policy");
    if (p != "lru" && p != "lru_with_age") f.fail("kv_cache_eviction_policy", "\"lru\" or \"lru_with_age\"");
    e.prefix.eviction = p == "lru" ? runtime::EvictionPolicy::kLru : runtime::EvictionPolicy::kLruWithAge;
  }
  if (use("kv_cache_min_age_seconds", "")) {
    double const age = f.number("kv_cache_min_age_seconds");
    if (!(age >= 0 && age <= 1e9)) f.fail("kv_cache_min_age_seconds", "a number of seconds >= 0");
    e.prefix.min_age_seconds = age;
  }
  if (use("deltanet_snapshot_every_blocks", ""))
    e.prefix.snapshot_every_blocks =
        static_cast<int>(f.integer("deltanet_snapshot_every_blocks", 1, 1 << 20, "an integer >= 1"));
  QFLASH_CHECK(!(f.has("kv_cache_dtype") && f.has("kv_compression_map")), path,
               ": kv_cache_dtype and kv_compression_map exclude each other (one format for every head, or a map)");
  bool const kv_flags = cmd.count("--kv") + cmd.count("--kv-map") > 0;
  if (!kv_flags && f.has("kv_cache_dtype")) {
    kv.kv = f.string("kv_cache_dtype");
    try {
      (void)parse_kv_option(kv.kv);
    } catch (std::exception const& err) {
      QFLASH_FAIL(path, ": field 'kv_cache_dtype': ", err.what());
    }
  }
  if (!kv_flags && f.has("kv_compression_map")) kv.map = (dir / f.string("kv_compression_map")).string();
  if (use("flash_kernel_fallback", "")) o.kernel_fallback = f.boolean("flash_kernel_fallback", true);
  if (use("log_router_decisions", "--log-router-decisions")) {
    e.router_log_path = (dir / f.string("log_router_decisions")).string();
    QFLASH_CHECK(fs::is_directory(fs::path(e.router_log_path).parent_path(), ec), path,
                 ": field 'log_router_decisions': directory '", fs::path(e.router_log_path).parent_path().string(),
                 "' does not exist");
  }
  if (cmd.count("--http-threads") == 0) o.server.http_threads = default_http_threads(e);
  QFLASH_LOG_INFO("settings from ", path, " (command-line flags win)");
}

}  // namespace qflash::cli
