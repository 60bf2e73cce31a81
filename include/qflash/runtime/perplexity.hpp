/// @file
/// Perplexity of a token sequence: consecutive non-overlapping windows of `context` tokens
/// (the last may be shorter; one of fewer than 2 tokens is skipped), each run as a fresh
/// sequence; the NLL of token t+1 given tokens 0..t within each window; perplexity =
/// exp(total NLL / predicted tokens). tools/train_default.py records the same measure.
/// Optionally also the mean KL divergence of each next-token distribution from the one with
/// KV stored another way (e.g. bf16), the measure the KV formats are compared by.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "qflash/core/error.hpp"
#include "qflash/kv/map.hpp"
#include "qflash/model/model.hpp"

namespace qflash::runtime {

struct PerplexityResult {
  double perplexity = 0;
  double total_nll = 0;
  std::int64_t n_predicted = 0;
  std::int64_t n_windows = 0;
  double mean_kl = 0;  ///< nats per predicted token, from the `kl_base` KV's distributions; 0 without one
};

/// sum over rows of KL(softmax(ref) || softmax(got)), both [rows, vocab].
inline double sum_kl(float const* ref, float const* got, std::int64_t rows, std::int64_t vocab) {
  double total = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    float const* a = ref + r * vocab;
    float const* b = got + r * vocab;
    double const ma = *std::max_element(a, a + vocab), mb = *std::max_element(b, b + vocab);
    double sa = 0, sb = 0;
    for (std::int64_t i = 0; i < vocab; ++i) {
      sa += std::exp(a[i] - ma);
      sb += std::exp(b[i] - mb);
    }
    double const la = ma + std::log(sa), lb = mb + std::log(sb);  // log-sum-exp
    double kl = 0;
    for (std::int64_t i = 0; i < vocab; ++i) {
      double const lpa = a[i] - la;
      kl += std::exp(lpa) * (lpa - (b[i] - lb));
    }
    total += std::max(0.0, kl);
  }
  return total;
}

/// `on_window(tokens_done, tokens_total)` is called after each window, for progress; KV is
/// stored as `kv` says (empty: every head f32). With `kl_base`, every window runs a second
/// time with KV stored as it says, for `mean_kl`.
template <class Model>
PerplexityResult perplexity(Model& model, std::span<std::int32_t const> ids, int context, kv::KvMap const& kv = {},
                            std::function<void(std::size_t, std::size_t)> const& on_window = {},
                            kv::KvMap const* kl_base = nullptr) {
  QFLASH_CHECK(context >= 2 && context <= model.config().max_position_embeddings,
               "perplexity: the context must be in [2, ", model.config().max_position_embeddings,
               "] tokens (max_position_embeddings), got ", context);
  QFLASH_CHECK(ids.size() >= 2, "perplexity: needs at least 2 tokens, got ", ids.size());
  std::int64_t const vocab = model.config().vocab;
  PerplexityResult r;
  std::vector<float> logits, base_logits;
  double total_kl = 0;
  for (std::size_t begin = 0; begin < ids.size(); begin += static_cast<std::size_t>(context)) {
    std::size_t const len = std::min<std::size_t>(static_cast<std::size_t>(context), ids.size() - begin);
    if (len < 2) break;
    auto state = model.new_sequence(kv);
    model::SequenceChunk c{ids.subspan(begin, len), &state};
    model.forward(std::span(&c, 1), model::LogitsFor::kAllTokens, logits);
    if (kl_base) {
      auto base_state = model.new_sequence(*kl_base);
      model::SequenceChunk b{ids.subspan(begin, len), &base_state};
      model.forward(std::span(&b, 1), model::LogitsFor::kAllTokens, base_logits);
      total_kl += sum_kl(base_logits.data(), logits.data(), static_cast<std::int64_t>(len) - 1, vocab);
    }
    for (std::size_t t = 0; t + 1 < len; ++t) {
      float const* l = logits.data() + static_cast<std::int64_t>(t) * vocab;
      double const mx = *std::max_element(l, l + vocab);
      double sum = 0;
      for (std::int64_t i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(l[i]) - mx);
      r.total_nll += std::log(sum) + mx - l[ids[begin + t + 1]];
      ++r.n_predicted;
    }
    ++r.n_windows;
    if (on_window) on_window(begin + len, ids.size());
  }
  r.perplexity = std::exp(r.total_nll / static_cast<double>(r.n_predicted));
  r.mean_kl = total_kl / static_cast<double>(r.n_predicted);
  return r;
}

}  // namespace qflash::runtime
