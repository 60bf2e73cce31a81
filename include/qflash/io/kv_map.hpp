/// @file
/// kv_compression_map.json: the per-(layer, KV head, K|V) formats `qflash calibrate` chooses
/// and `--kv-map` (or the file beside a model) applies. Schema (version 1):
///
///     {
///       "qflash_kv_map": 1,
///       "n_layer": 8, "n_head_kv": 4, "d_head": 64,      // the model it was made for
///       "layers": {                                     // every full-attention layer, no other
///         "0": {"k": ["bf16", "int6", ...], "v": [...]}, // one format per KV head
///         ...
///       },
///       "calibration": {...}                            // optional; what calibrate measured
///     }
///
/// Formats are kv_format.hpp's names. Reading checks the map against the model and names the
/// file and field of the first mismatch. Host only.
#pragma once

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/io/json.hpp"
#include "qflash/kv/map.hpp"
#include "qflash/model/config.hpp"

namespace qflash::io {

/// The map's name beside a model.
inline constexpr char const* kKvMapFile = "kv_compression_map.json";

inline kv::KvMap read_kv_map(std::string const& path, model::ModelConfig const& cfg) {
  Json const j = read_json_file(path);
  JsonFields const top(j, path);
  (void)top.integer("qflash_kv_map", 1, 1, "1 (the schema version this qflash reads)");
  auto expect = [&](char const* key, int want) {
    int const got = top.positive_int(key);
    QFLASH_CHECK(got == want, path, ": field '", key, "' is ", got, ", the model (", cfg.source, ") has ", want,
                 ": the map was made for another model");
  };
  expect("n_layer", cfg.n_layer);
  expect("n_head_kv", cfg.n_head_kv);
  expect("d_head", cfg.d_head);
  JsonFields const layers = top.object("layers");
  std::vector<std::vector<kv::KvFormats>> out(cfg.layer_types.size());
  for (auto it = layers.json().begin(); it != layers.json().end(); ++it) {
    std::string const& key = it.key();
    std::size_t used = 0;
    long l = -1;
    try {
      l = std::stol(key, &used);
    } catch (std::exception const&) {
      used = 0;
    }
    QFLASH_CHECK(used == key.size() && l >= 0 && l < cfg.n_layer, path, ": 'layers' key '", key,
                 "' is not a layer index in [0, ", cfg.n_layer, ")");
    QFLASH_CHECK(cfg.layer_types[static_cast<std::size_t>(l)] == model::LayerKind::kFullAttention, path,
                 ": field 'layers.", key, "': layer ", l, " is a linear-attention layer, which holds no KV");
    JsonFields const layer = layers.object(key);
    std::vector<std::string> const k = layer.string_list("k"), v = layer.string_list("v");
    for (auto const* list : {&k, &v})
      QFLASH_CHECK(list->size() == static_cast<std::size_t>(cfg.n_head_kv), path, ": field 'layers.", key, ".",
                   list == &k ? "k" : "v", "' lists ", list->size(), " formats, expected one per KV head (",
                   cfg.n_head_kv, ")");
    for (std::size_t h = 0; h < k.size(); ++h) {
      kv::KvFormats f;
      for (auto const* list : {&k, &v}) {
        try {
          (list == &k ? f.k : f.v) = parse_kv_format((*list)[h]);
        } catch (Error const& e) {
          QFLASH_FAIL(path, ": field 'layers.", key, ".", list == &k ? "k" : "v", "[", h, "]': ", e.what());
        }
      }
      out[static_cast<std::size_t>(l)].push_back(f);
    }
  }
  for (std::size_t l = 0; l < cfg.layer_types.size(); ++l)
    QFLASH_CHECK(cfg.layer_types[l] != model::LayerKind::kFullAttention || !out[l].empty(), path,
                 ": field 'layers' has no entry for full-attention layer ", l);
  return kv::KvMap(std::move(out));
}

/// Writes `map` for the model `cfg`, with `calibration` (an object, or null for none).
inline void write_kv_map(std::string const& path, kv::KvMap const& map, model::ModelConfig const& cfg,
                         Json const& calibration = Json()) {
  nlohmann::ordered_json j;
  j["qflash_kv_map"] = 1;
  j["n_layer"] = cfg.n_layer;
  j["n_head_kv"] = cfg.n_head_kv;
  j["d_head"] = cfg.d_head;
  nlohmann::ordered_json layers = nlohmann::ordered_json::object();
  for (std::size_t l = 0; l < map.n_layer(); ++l) {
    if (map.layer(l).empty()) continue;
    nlohmann::ordered_json k = nlohmann::ordered_json::array(), v = nlohmann::ordered_json::array();
    for (kv::KvFormats const& f : map.layer(l)) {
      k.push_back(std::string(to_string(f.k)));
      v.push_back(std::string(to_string(f.v)));
    }
    layers[std::to_string(l)] = {{"k", k}, {"v", v}};
  }
  j["layers"] = layers;
  if (!calibration.is_null()) j["calibration"] = nlohmann::ordered_json::parse(calibration.dump());
  std::string const tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    QFLASH_CHECK(f, path, ": cannot write (", tmp, ")");
    f << j.dump(2) << "\n";
    QFLASH_CHECK(f.good(), path, ": write failed");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  QFLASH_CHECK(!ec, path, ": cannot replace it: ", ec.message());
}

}  // namespace qflash::io
