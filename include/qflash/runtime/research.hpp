/// @file
/// Research builds: a model of one's own compile-time spec with random weights, and two
/// fusion variants (model/fusion.hpp) of it run side by side on the same weights and tokens,
/// checked for agreement and timed. examples/custom_moe/ is the walk-through.
///
/// A translation unit that instantiates a spec outside the build's instance list (QFLASH_SPECS)
/// includes qflash/kernels/cpu.hpp, so that every CPU kernel is compiled for it there. Host only.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "qflash/arch/arch.hpp"
#include "qflash/core/error.hpp"
#include "qflash/model/fusion.hpp"
#include "qflash/model/model.hpp"
#include "qflash/model/routing.hpp"
#include "qflash/runtime/load_model.hpp"
#include "qflash/runtime/sampler.hpp"
#include "qflash/runtime/synthetic.hpp"

namespace qflash::research {

struct ModelShape {
  int n_layer = 4;  ///< qwen3_5_moe: 3 Gated DeltaNet layers, then full attention, repeated
  int vocab = 1024;
  std::uint64_t seed = 1;
};

/// A model of spec S's shapes (runtime::spec_config) with random weights in S's weight format
/// (bf16 when S.weights is kAny), bound as a checkpoint's would be.
template <MoeSpec S>
runtime::LoadedModel random_model(ModelShape const& shape = {}) {
  static_assert(valid(S), "random_model: the spec is invalid (see why_invalid)");
  constexpr WeightFormat f = S.weights == WeightFormat::kAny ? WeightFormat::kBf16 : S.weights;
  runtime::WeightScheme scheme = runtime::WeightScheme::kBf16;
  for (auto const& [k, name] : runtime::kWeightSchemes)
    if (k != runtime::WeightScheme::kAuto && name == to_string(f)) scheme = k;
  QFLASH_CHECK(to_string(scheme) == to_string(f), "random_model: no weight scheme stores every matrix as ",
               to_string(f));
  return runtime::synthetic_model(runtime::spec_config(S, shape.n_layer, shape.vocab), scheme, shape.seed,
                                  /*progress=*/false);
}

struct CompareOptions {
  int prompt = 64;   ///< tokens of the prefill (one batch)
  int decode = 16;   ///< greedy steps after it, one token each
  int repeats = 3;   ///< timed runs per variant; the fastest is reported
  model::Routing routing;  ///< both variants' (default: the model's top-k)
  /// Agreement: every logit within tolerance * max(1, the largest |logit|) of the other
  /// variant's. The variants sum the same fp32 terms in another order.
  double tolerance = 1e-4;
  std::uint64_t seed = 7;  ///< of the prompt's token ids
};

struct VariantResult {
  std::string name;
  double prefill_tok_s = 0, decode_tok_s = 0;
  double experts_per_token = 0;      ///< routed experts per token and MoE layer, mean over the run
  std::vector<float> logits;         ///< [prompt + decode, vocab]: every prompt row, then each step's
  std::vector<std::int32_t> greedy;  ///< each decode step's argmax
};

struct Comparison {
  std::string routing;         ///< both variants' (model/routing.hpp text)
  std::string device = "cpu";  ///< where they ran: "cpu", or a GPU's name and arch
  VariantResult a, b;
  double max_abs_diff = 0;  ///< over every logit
  double logit_scale = 0;   ///< the largest |logit| of a
  int greedy_mismatches = 0;
  double tolerance = 0;
  [[nodiscard]] bool agree() const {
    return greedy_mismatches == 0 && max_abs_diff <= tolerance * std::max(1.0, logit_scale);
  }
};

namespace detail {

/// Runs model `m` on `prompt`, then `decode` greedy steps fed `feed` (when given: the other
/// variant's choices, so both see the same tokens) or its own argmax.
template <class M>
VariantResult run_variant(M& m, std::vector<std::int32_t> const& prompt, CompareOptions const& o,
                          std::vector<std::int32_t> const* feed) {
  using Clock = std::chrono::steady_clock;
  VariantResult r;
  r.name = M::fusion_variant::name();
  std::size_t const vocab = static_cast<std::size_t>(m.config().vocab);
  double best_prefill = 1e300, best_decode = 1e300;
  std::int64_t routed = 0, routes = 0;
  m.set_route_observer([&](model::RouteRecord const& rec) {
    for (std::int64_t t = 0; t < rec.n_tokens; ++t) routed += static_cast<std::int64_t>(rec.used(t).size());
    routes += rec.n_tokens;
  });
  for (int rep = 0; rep < std::max(1, o.repeats); ++rep) {
    model::SequenceState seq = m.new_sequence();
    std::vector<float> logits;
    std::vector<float> all;
    std::vector<std::int32_t> greedy;
    model::SequenceChunk chunk{prompt, &seq, nullptr};
    auto const t0 = Clock::now();
    m.forward(std::span(&chunk, 1), model::LogitsFor::kAllTokens, logits);
    auto const t1 = Clock::now();
    all = logits;
    std::int32_t next = runtime::argmax(std::span<float const>(logits).last(vocab));
    for (int i = 0; i < o.decode; ++i) {
      greedy.push_back(next);
      std::int32_t const token = feed ? (*feed)[static_cast<std::size_t>(i)] : next;
      model::SequenceChunk step{std::span(&token, 1), &seq, nullptr};
      m.forward(std::span(&step, 1), model::LogitsFor::kLastToken, logits);
      all.insert(all.end(), logits.begin(), logits.end());
      next = runtime::argmax(logits);
    }
    auto const t2 = Clock::now();
    best_prefill = std::min(best_prefill, std::chrono::duration<double>(t1 - t0).count());
    best_decode = std::min(best_decode, std::chrono::duration<double>(t2 - t1).count());
    r.logits = std::move(all);
    r.greedy = std::move(greedy);
  }
  m.set_route_observer({});
  r.experts_per_token = static_cast<double>(routed) / static_cast<double>(std::max<std::int64_t>(1, routes));
  r.prefill_tok_s = static_cast<double>(prompt.size()) / best_prefill;
  r.decode_tok_s = o.decode > 0 ? o.decode / best_decode : 0;
  return r;
}

/// Runs models `ma` and `mb` (one model's two variants) on the same random prompt and greedy
/// continuation (A's choices fed to both) and compares every logit.
template <class MA, class MB>
Comparison compare_models(MA& ma, MB& mb, CompareOptions const& o) {
  QFLASH_CHECK(o.prompt >= 1 && o.decode >= 0, "compare: needs a prompt of at least 1 token");
  std::mt19937_64 rng(o.seed);
  std::uniform_int_distribution<std::int32_t> token(0, ma.config().vocab - 1);
  std::vector<std::int32_t> prompt(static_cast<std::size_t>(o.prompt));
  for (auto& t : prompt) t = token(rng);

  Comparison c;
  c.routing = model::to_string(o.routing);
  c.tolerance = o.tolerance;
  c.a = detail::run_variant(ma, prompt, o, nullptr);
  c.b = detail::run_variant(mb, prompt, o, &c.a.greedy);
  for (std::size_t i = 0; i < c.a.logits.size(); ++i) {
    c.logit_scale = std::max(c.logit_scale, std::fabs(static_cast<double>(c.a.logits[i])));
    c.max_abs_diff = std::max(c.max_abs_diff, std::fabs(static_cast<double>(c.a.logits[i]) - c.b.logits[i]));
  }
  for (std::size_t i = 0; i < c.a.greedy.size(); ++i) c.greedy_mismatches += c.a.greedy[i] != c.b.greedy[i];
  return c;
}

}  // namespace detail

/// Builds Model<S, Arch, A> and Model<S, Arch, B> on `m`'s weights (shared, not copied), runs
/// both on the same random prompt and greedy continuation (A's choices fed to both), and
/// compares every logit. On a CUDA device: compare_on_cuda (runtime/cuda/research.hpp).
template <MoeSpec S, fusion::FusionVariant A, fusion::FusionVariant B, class Arch = arch::Cpu>
  requires(!Arch::is_cuda)
Comparison compare(runtime::LoadedModel const& m, CompareOptions const& o = {}) {
  model::ModelOptions mo;
  mo.routing = o.routing;
  model::Model<S, Arch, A> ma(m.config, m.weights, m.storage, mo);
  model::Model<S, Arch, B> mb(m.config, m.weights, m.storage, mo);
  return detail::compare_models(ma, mb, o);
}

/// The comparison as a short table on `out`.
inline void print(Comparison const& c, std::FILE* out = stdout) {
  std::fprintf(out, "%-36s %14s %14s %16s   (routing %s, on %s)\n", "variant", "prefill tok/s", "decode tok/s",
               "experts/token", c.routing.c_str(), c.device.c_str());
  for (VariantResult const* r : {&c.a, &c.b})
    std::fprintf(out, "%-36s %14.1f %14.1f %16.2f\n", r->name.c_str(), r->prefill_tok_s, r->decode_tok_s,
                 r->experts_per_token);
  std::fprintf(out, "max |logit difference| %.3g (limit %.3g = %.0e x max(1, max |logit| %.3g)), greedy %zu/%zu same: %s\n",
               c.max_abs_diff, c.tolerance * std::max(1.0, c.logit_scale), c.tolerance, c.logit_scale,
               c.a.greedy.size() - static_cast<std::size_t>(c.greedy_mismatches), c.a.greedy.size(),
               c.agree() ? "agree" : "DISAGREE");
}

}  // namespace qflash::research
