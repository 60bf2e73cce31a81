/// @file
/// Per-head KV sensitivity and the map chosen from it, behind `qflash calibrate`.
///
/// Sensitivity of one unit (layer, KV head, K or V) in format f: the mean KL divergence, over
/// every predicted token of a calibration text, of the next-token distribution with only that
/// unit stored in f (every other head f32) from the distribution with all KV in f32. The map:
/// every unit starts in the costliest candidate format (bf16), then, while the KV bytes are
/// above the budget, the unit whose next cheaper format adds the least KL per byte saved
/// takes it (KL of units is taken as additive).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/kv/map.hpp"
#include "qflash/model/model.hpp"
#include "qflash/runtime/perplexity.hpp"

namespace qflash::runtime {

/// One (layer, KV head, K|V) of the cache.
struct KvUnit {
  std::size_t layer = 0;
  int head = 0;
  bool value = false;  ///< V (else K)
  friend bool operator==(KvUnit const&, KvUnit const&) = default;
};

struct KvSensitivity {
  std::vector<KvFormat> formats;  ///< candidates, as given
  std::vector<KvUnit> units;      ///< every unit of the model, layer by layer, K before V
  std::vector<std::vector<double>> kl;  ///< [unit][format]: mean KL, nats per token
  std::int64_t tokens = 0;              ///< predicted tokens the means are over
};

/// The units of a model's KV, layer by layer, K before V.
inline std::vector<KvUnit> kv_units(model::ModelConfig const& cfg) {
  std::vector<KvUnit> out;
  for (std::size_t l = 0; l < cfg.layer_types.size(); ++l)
    if (cfg.layer_types[l] == model::LayerKind::kFullAttention)
      for (int h = 0; h < cfg.n_head_kv; ++h)
        for (bool v : {false, true}) out.push_back({l, h, v});
  return out;
}

/// Measures every unit in every format over `ids` in windows of `context` tokens: one f32
/// forward per window, then one per (unit, format). `on_step(done, total)` reports forwards.
template <class Model>
KvSensitivity measure_kv_sensitivity(Model& m, std::span<std::int32_t const> ids, int context,
                                     std::vector<KvFormat> formats,
                                     std::function<void(std::int64_t, std::int64_t)> const& on_step = {}) {
  model::ModelConfig const& cfg = m.config();
  QFLASH_CHECK(context >= 2, "calibrate: the context must be at least 2 tokens, got ", context);
  QFLASH_CHECK(ids.size() >= 2, "calibrate: the text must have at least 2 tokens, got ", ids.size());
  QFLASH_CHECK(!formats.empty(), "calibrate: no candidate KV formats");
  KvSensitivity s;
  s.formats = std::move(formats);
  s.units = kv_units(cfg);
  QFLASH_CHECK(!s.units.empty(), cfg.source, ": the model has no full-attention layer, so no KV to calibrate");
  s.kl.assign(s.units.size(), std::vector<double>(s.formats.size(), 0.0));
  std::int64_t const vocab = cfg.vocab;
  std::size_t const window = static_cast<std::size_t>(context);
  std::int64_t const n_windows = static_cast<std::int64_t>((ids.size() - 1 + window - 1) / window);
  std::int64_t const total = n_windows * static_cast<std::int64_t>(1 + s.units.size() * s.formats.size());
  std::int64_t done = 0;
  kv::KvMap const exact = kv::KvMap::uniform(cfg, {KvFormat::kF32, KvFormat::kF32});
  std::vector<float> ref, got;
  auto run = [&](std::span<std::int32_t const> part, kv::KvMap const& map, std::vector<float>& logits) {
    auto state = m.new_sequence(map);
    model::SequenceChunk c{part, &state};
    m.forward(std::span(&c, 1), model::LogitsFor::kAllTokens, logits);
    if (on_step) on_step(++done, total);
  };
  for (std::size_t begin = 0; begin + 1 < ids.size(); begin += window) {
    std::span<std::int32_t const> const part = ids.subspan(begin, std::min(window, ids.size() - begin));
    std::int64_t const rows = static_cast<std::int64_t>(part.size()) - 1;  // the last token predicts nothing here
    if (rows < 1) break;
    run(part, exact, ref);
    for (std::size_t u = 0; u < s.units.size(); ++u)
      for (std::size_t f = 0; f < s.formats.size(); ++f) {
        kv::KvMap map = exact;
        KvUnit const& unit = s.units[u];
        kv::KvFormats hf = map.layer(unit.layer)[static_cast<std::size_t>(unit.head)];
        (unit.value ? hf.v : hf.k) = s.formats[f];
        map.set(unit.layer, unit.head, hf);
        run(part, map, got);
        s.kl[u][f] += sum_kl(ref.data(), got.data(), rows, vocab);
      }
    s.tokens += rows;
  }
  for (auto& row : s.kl)
    for (double& x : row) x /= static_cast<double>(s.tokens);
  return s;
}

struct KvChoice {
  kv::KvMap map;
  std::int64_t bytes_per_token = 0;  ///< of the chosen map
  std::int64_t bf16_bytes_per_token = 0;
  double predicted_kl = 0;  ///< sum of the chosen formats' KL (additivity assumed)
};

/// The map whose KV bytes are at most `budget` x bf16's, chosen greedily (see the file
/// comment). Throws when even the cheapest candidate everywhere is above the budget.
inline KvChoice choose_kv_map(model::ModelConfig const& cfg, KvSensitivity const& s, double budget) {
  QFLASH_CHECK(budget > 0, "calibrate: the budget must be positive, got ", budget);
  std::int64_t const d = cfg.d_head;
  auto bytes = [&](std::size_t f) { return kv_head_bytes(s.formats[f], d); };
  std::size_t costliest = 0, cheapest = 0;
  for (std::size_t f = 0; f < s.formats.size(); ++f) {
    if (bytes(f) > bytes(costliest)) costliest = f;
    if (bytes(f) < bytes(cheapest)) cheapest = f;
  }
  std::vector<std::size_t> pick(s.units.size(), costliest);
  KvChoice c;
  c.bf16_bytes_per_token = static_cast<std::int64_t>(s.units.size()) * kv_head_bytes(KvFormat::kBf16, d);
  double const target = budget * static_cast<double>(c.bf16_bytes_per_token);
  std::int64_t total = static_cast<std::int64_t>(s.units.size()) * bytes(costliest);
  std::int64_t const floor = static_cast<std::int64_t>(s.units.size()) * bytes(cheapest);
  QFLASH_CHECK(static_cast<double>(floor) <= target, "calibrate: a budget of ", budget, " x bf16 KV is below what ",
               to_string(s.formats[cheapest]), " everywhere takes (",
               static_cast<double>(floor) / static_cast<double>(c.bf16_bytes_per_token), " x bf16)");
  while (static_cast<double>(total) > target) {
    double best = std::numeric_limits<double>::infinity();
    std::size_t best_u = 0, best_f = 0;
    std::int64_t best_saved = 0;
    for (std::size_t u = 0; u < s.units.size(); ++u)
      for (std::size_t f = 0; f < s.formats.size(); ++f) {
        std::int64_t const saved = bytes(pick[u]) - bytes(f);
        if (saved <= 0) continue;
        double const cost = (s.kl[u][f] - s.kl[u][pick[u]]) / static_cast<double>(saved);
        if (cost < best || (cost == best && saved > best_saved)) {
          best = cost;
          best_u = u;
          best_f = f;
          best_saved = saved;
        }
      }
    pick[best_u] = best_f;
    total -= best_saved;
  }
  c.map = kv::KvMap::uniform(cfg, {s.formats[costliest], s.formats[costliest]});
  for (std::size_t u = 0; u < s.units.size(); ++u) {
    KvUnit const& unit = s.units[u];
    kv::KvFormats f = c.map.layer(unit.layer)[static_cast<std::size_t>(unit.head)];
    (unit.value ? f.v : f.k) = s.formats[pick[u]];
    c.map.set(unit.layer, unit.head, f);
    c.predicted_kl += s.kl[u][pick[u]];
  }
  c.bytes_per_token = total;
  return c;
}

}  // namespace qflash::runtime
