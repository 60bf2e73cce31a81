/// @file
/// The model spec: the shape facts that change generated code, as a structural aggregate
/// usable as a template argument. Any field may be kDynamic (known only at run time); the
/// all-dynamic `spec::generic` runs any shape. Layer count, vocabulary, RoPE base and
/// epsilons are run-time facts and live in the model config, not here.
#pragma once

#include <string>
#include <string_view>

#include "qflash/spec/kv_scheme.hpp"

namespace qflash {

inline constexpr int kDynamic = -1;

enum class ModelFamily : int {
  kAny = -1,
  kQwen3Moe = 0,   ///< qwen3_moe: GQA attention every layer, plain RMSNorm, no shared expert
  kQwen35Moe = 1,  ///< qwen3_5_moe: Gated DeltaNet + gated attention, (1+w) norms, shared expert
};

constexpr std::string_view to_string(ModelFamily f) {
  switch (f) {
    case ModelFamily::kAny: return "any";
    case ModelFamily::kQwen3Moe: return "qwen3_moe";
    case ModelFamily::kQwen35Moe: return "qwen3_5_moe";
  }
  return "unknown";
}

struct MoeSpec {
  ModelFamily family = ModelFamily::kAny;
  int d_model = kDynamic;          ///< hidden size
  int n_head = kDynamic;           ///< query heads of full attention
  int n_head_kv = kDynamic;        ///< key/value heads of full attention
  int d_head = kDynamic;           ///< full-attention head dim
  int n_expert = kDynamic;         ///< routed experts
  int n_expert_used = kDynamic;    ///< top-k
  int d_ff_expert = kDynamic;      ///< routed expert FFN width
  int d_ff_shared = kDynamic;      ///< shared expert FFN width; 0 = no shared expert
  int n_head_k_linear = kDynamic;  ///< Gated DeltaNet q/k heads; 0 = no linear attention
  int n_head_v_linear = kDynamic;  ///< Gated DeltaNet value heads
  int d_head_k_linear = kDynamic;  ///< Gated DeltaNet q/k head dim
  int d_head_v_linear = kDynamic;  ///< Gated DeltaNet value head dim
  int d_conv = kDynamic;           ///< causal conv kernel width
  KvScheme kv = KvScheme::kAny;
  /// Weight formats the linear and expert kernels are compiled for: kAny compiles every
  /// format (each tensor's own format is dispatched once per call); a single format compiles
  /// that path alone, and such an instance runs only models whose matrices all use it.
  WeightFormat weights = WeightFormat::kAny;

  friend constexpr bool operator==(MoeSpec const&, MoeSpec const&) = default;
};

namespace detail {
constexpr bool positive_or_dynamic(int v) { return v == kDynamic || v > 0; }
constexpr bool nonneg_or_dynamic(int v) { return v == kDynamic || v >= 0; }
constexpr bool known(int v) { return v != kDynamic; }
}  // namespace detail

/// Why `s` is not a valid spec, or an empty view when it is. Used by `static_assert` on
/// compile-time specs and by config loading on run-time ones, so both say the same thing.
constexpr std::string_view why_invalid(MoeSpec const& s) {
  using detail::known;
  using detail::nonneg_or_dynamic;
  using detail::positive_or_dynamic;
  if (!positive_or_dynamic(s.d_model)) return "d_model must be positive";
  if (!positive_or_dynamic(s.n_head)) return "n_head must be positive";
  if (!positive_or_dynamic(s.n_head_kv)) return "n_head_kv must be positive";
  if (!positive_or_dynamic(s.d_head)) return "d_head must be positive";
  if (known(s.d_head) && s.d_head % 2 != 0) return "d_head must be even (RoPE rotates pairs)";
  if (known(s.n_head) && known(s.n_head_kv) && s.n_head % s.n_head_kv != 0)
    return "n_head must be a multiple of n_head_kv (grouped-query attention)";
  if (!positive_or_dynamic(s.n_expert)) return "n_expert must be positive";
  if (!positive_or_dynamic(s.n_expert_used)) return "n_expert_used must be positive";
  if (known(s.n_expert) && known(s.n_expert_used) && s.n_expert_used > s.n_expert)
    return "n_expert_used must not exceed n_expert";
  if (!positive_or_dynamic(s.d_ff_expert)) return "d_ff_expert must be positive";
  if (!nonneg_or_dynamic(s.d_ff_shared)) return "d_ff_shared must be >= 0 (0: no shared expert)";
  if (!nonneg_or_dynamic(s.n_head_k_linear)) return "n_head_k_linear must be >= 0 (0: no linear attention)";
  if (!nonneg_or_dynamic(s.n_head_v_linear)) return "n_head_v_linear must be >= 0";
  if (!nonneg_or_dynamic(s.d_head_k_linear)) return "d_head_k_linear must be >= 0";
  if (!nonneg_or_dynamic(s.d_head_v_linear)) return "d_head_v_linear must be >= 0";
  if (known(s.n_head_k_linear) && known(s.n_head_v_linear) && s.n_head_k_linear > 0 &&
      s.n_head_v_linear % s.n_head_k_linear != 0)
    return "n_head_v_linear must be a multiple of n_head_k_linear";
  if (known(s.d_conv) && (s.d_conv < 0 || s.d_conv > 8)) return "d_conv must be in [0, 8]";
  if (s.family == ModelFamily::kQwen3Moe) {
    if (known(s.d_ff_shared) && s.d_ff_shared != 0) return "qwen3_moe has no shared expert (d_ff_shared must be 0)";
    if (known(s.n_head_k_linear) && s.n_head_k_linear != 0)
      return "qwen3_moe has no linear attention (n_head_k_linear must be 0)";
  }
  if (s.family == ModelFamily::kQwen35Moe) {
    if (known(s.n_head_k_linear) && s.n_head_k_linear == 0)
      return "qwen3_5_moe needs Gated DeltaNet heads (n_head_k_linear > 0)";
    if (known(s.d_ff_shared) && s.d_ff_shared == 0)
      return "qwen3_5_moe needs a shared expert (d_ff_shared > 0)";
  }
  return {};
}

constexpr bool valid(MoeSpec const& s) { return why_invalid(s).empty(); }

/// True when every shape field is known at compile time (kAny weights or KV is a static
/// choice: every format, dispatched per tensor or per head at run time).
constexpr bool is_static(MoeSpec const& s) {
  using detail::known;
  return s.family != ModelFamily::kAny && known(s.d_model) && known(s.n_head) &&
         known(s.n_head_kv) && known(s.d_head) && known(s.n_expert) && known(s.n_expert_used) &&
         known(s.d_ff_expert) && known(s.d_ff_shared) && known(s.n_head_k_linear) &&
         known(s.n_head_v_linear) && known(s.d_head_k_linear) && known(s.d_head_v_linear) &&
         known(s.d_conv);
}

/// True when the compiled spec `c` can run the run-time spec `r`: every field of `c` is
/// dynamic or equal to `r`'s.
constexpr bool matches(MoeSpec const& c, MoeSpec const& r) {
  auto f = [](int cv, int rv) { return cv == kDynamic || cv == rv; };
  return (c.family == ModelFamily::kAny || c.family == r.family) && f(c.d_model, r.d_model) &&
         f(c.n_head, r.n_head) && f(c.n_head_kv, r.n_head_kv) && f(c.d_head, r.d_head) &&
         f(c.n_expert, r.n_expert) && f(c.n_expert_used, r.n_expert_used) &&
         f(c.d_ff_expert, r.d_ff_expert) && f(c.d_ff_shared, r.d_ff_shared) &&
         f(c.n_head_k_linear, r.n_head_k_linear) && f(c.n_head_v_linear, r.n_head_v_linear) &&
         f(c.d_head_k_linear, r.d_head_k_linear) && f(c.d_head_v_linear, r.d_head_v_linear) &&
         f(c.d_conv, r.d_conv) && (c.kv == KvScheme::kAny || c.kv == r.kv) &&
         (c.weights == WeightFormat::kAny || c.weights == r.weights);
}

/// A spec's value of a dimension: the compile-time constant when known, else `runtime`.
template <int Static>
constexpr int dim(int runtime) {
  if constexpr (Static == kDynamic)
    return runtime;
  else
    return Static;
}

/// `{family=qwen3_5_moe d_model=2048 ... kv=bf16}`; dynamic fields print as `?`.
inline std::string to_string(MoeSpec const& s) {
  auto num = [](int v) { return v == kDynamic ? std::string("?") : std::to_string(v); };
  std::string out = "{family=";
  out += to_string(s.family);
  out += " d_model=" + num(s.d_model) + " n_head=" + num(s.n_head) +
         " n_head_kv=" + num(s.n_head_kv) + " d_head=" + num(s.d_head) +
         " n_expert=" + num(s.n_expert) + " n_expert_used=" + num(s.n_expert_used) +
         " d_ff_expert=" + num(s.d_ff_expert) + " d_ff_shared=" + num(s.d_ff_shared) +
         " n_head_k_linear=" + num(s.n_head_k_linear) +
         " n_head_v_linear=" + num(s.n_head_v_linear) +
         " d_head_k_linear=" + num(s.d_head_k_linear) +
         " d_head_v_linear=" + num(s.d_head_v_linear) + " d_conv=" + num(s.d_conv) + " kv=";
  out += to_string(s.kv);
  out += " weights=";
  out += to_string(s.weights);
  return out + "}";
}

}  // namespace qflash
