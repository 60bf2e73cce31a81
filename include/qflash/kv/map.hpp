/// @file
/// Which format each full-attention layer's KV heads keep, K and V apart: uniform (one
/// format for every key, one for every value) or a per-(layer, KV head, K|V) map chosen by
/// calibration. What the paged pool lays its blocks out by and the planner counts.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/model/config.hpp"
#include "qflash/numeric/kv_format.hpp"
#include "qflash/spec/kv_scheme.hpp"

namespace qflash::kv {

/// The formats of keys and of values (keys are usually the more sensitive).
struct KvFormats {
  KvFormat k = KvFormat::kF32;
  KvFormat v = KvFormat::kF32;
  friend bool operator==(KvFormats const&, KvFormats const&) = default;
};

/// "bf16" (K and V alike) or "K:V" such as "bf16:int6"; throws Error naming the formats.
inline KvFormats parse_kv_formats(std::string const& text) {
  auto const colon = text.find(':');
  if (colon == std::string::npos) {
    KvFormat const f = parse_kv_format(text);
    return {f, f};
  }
  return {parse_kv_format(text.substr(0, colon)), parse_kv_format(text.substr(colon + 1))};
}

inline std::string to_string(KvFormats f) {
  return f.k == f.v ? std::string(to_string(f.k)) : std::string(to_string(f.k)) + ":" + std::string(to_string(f.v));
}

/// The uniform scheme that stores only `f`.
constexpr KvScheme scheme_of(KvFormat f) {
  switch (f) {
    case KvFormat::kF32: return KvScheme::kF32;
    case KvFormat::kBf16: return KvScheme::kBf16;
    case KvFormat::kFp8E4m3: return KvScheme::kFp8E4m3;
    case KvFormat::kInt8: return KvScheme::kInt8;
    case KvFormat::kInt6: return KvScheme::kInt6;
  }
  return KvScheme::kMixed;
}

/// Whether code compiled for scheme `s` reads and writes format `f`.
constexpr bool allows(KvScheme s, KvFormat f) {
  return s == KvScheme::kAny || s == KvScheme::kMixed || s == scheme_of(f);
}

/// The format code compiled for scheme `s` runs on a head stored in `f`: the scheme's own
/// when uniform, so that a switch on it folds away at compile time; `f` otherwise.
constexpr KvFormat compiled_format(KvScheme s, KvFormat f) {
  switch (s) {
    case KvScheme::kF32: return KvFormat::kF32;
    case KvScheme::kBf16: return KvFormat::kBf16;
    case KvScheme::kFp8E4m3: return KvFormat::kFp8E4m3;
    case KvScheme::kInt8: return KvFormat::kInt8;
    case KvScheme::kInt6: return KvFormat::kInt6;
    case KvScheme::kAny:
    case KvScheme::kMixed: return f;
  }
  return f;
}

/// Formats per model layer and KV head; layers without KV (linear attention) have none.
class KvMap {
 public:
  KvMap() = default;
  /// Formats per layer and head, as given.
  explicit KvMap(std::vector<std::vector<KvFormats>> layers) : layers_(std::move(layers)) {}

  /// Every full-attention layer's heads in `f`.
  static KvMap uniform(model::ModelConfig const& cfg, KvFormats f) {
    KvMap m;
    m.layers_.resize(cfg.layer_types.size());
    for (std::size_t l = 0; l < cfg.layer_types.size(); ++l)
      if (cfg.layer_types[l] == model::LayerKind::kFullAttention)
        m.layers_[l].assign(static_cast<std::size_t>(cfg.n_head_kv), f);
    return m;
  }

  [[nodiscard]] std::size_t n_layer() const { return layers_.size(); }
  [[nodiscard]] std::vector<KvFormats> const& layer(std::size_t l) const { return layers_[l]; }
  void set(std::size_t layer, int head, KvFormats f) {
    QFLASH_CHECK(layer < layers_.size() && head >= 0 && static_cast<std::size_t>(head) < layers_[layer].size(),
                 "KV map: layer ", layer, " has no KV head ", head);
    layers_[layer][static_cast<std::size_t>(head)] = f;
  }

  /// The formats every head shares, or nullopt when they differ or there is no head.
  [[nodiscard]] std::optional<KvFormats> uniform_formats() const {
    std::optional<KvFormats> seen;
    for (auto const& l : layers_)
      for (KvFormats const& f : l) {
        if (seen && !(*seen == f)) return std::nullopt;
        seen = f;
      }
    return seen;
  }

  /// The one scheme that covers every head: a uniform format's (when keys and values share
  /// it), else kMixed (kAny for a map without heads).
  [[nodiscard]] KvScheme scheme() const {
    std::optional<KvFormats> const f = uniform_formats();
    if (f) return f->k == f->v ? scheme_of(f->k) : KvScheme::kMixed;
    for (auto const& l : layers_)
      if (!l.empty()) return KvScheme::kMixed;
    return KvScheme::kAny;
  }

  /// K and V bytes of one token over every layer and head.
  /// True when some key or value is stored in fewer than 16 bits (fp8, int8, int6): the
  /// compressed levels of the KV hierarchy.
  [[nodiscard]] bool compressed() const {
    for (auto const& l : layers_)
      for (KvFormats const& f : l)
        for (KvFormat x : {f.k, f.v})
          if (x == KvFormat::kFp8E4m3 || x == KvFormat::kInt8 || x == KvFormat::kInt6) return true;
    return false;
  }
  [[nodiscard]] std::int64_t bytes_per_token(std::int64_t d_head) const {
    std::int64_t b = 0;
    for (auto const& l : layers_)
      for (KvFormats const& f : l) b += kv_head_bytes(f.k, d_head) + kv_head_bytes(f.v, d_head);
    return b;
  }

  friend bool operator==(KvMap const&, KvMap const&) = default;

 private:
  std::vector<std::vector<KvFormats>> layers_;
};

}  // namespace qflash::kv
