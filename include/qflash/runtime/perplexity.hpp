/// @file
/// Perplexity of a token sequence: consecutive non-overlapping windows of `context` tokens
/// (the last may be shorter; one of fewer than 2 tokens is skipped), each run as a fresh
/// sequence; the NLL of token t+1 given tokens 0..t within each window; perplexity =
/// exp(total NLL / predicted tokens). tools/train_default.py records the same measure.
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
};

/// `on_window(tokens_done, tokens_total)` is called after each window, for progress; KV is
/// stored as `kv` says (empty: every head f32).
template <class Model>
PerplexityResult perplexity(Model& model, std::span<std::int32_t const> ids, int context, kv::KvMap const& kv = {},
                            std::function<void(std::size_t, std::size_t)> const& on_window = {}) {
  QFLASH_CHECK(context >= 2 && context <= model.config().max_position_embeddings,
               "perplexity: the context must be in [2, ", model.config().max_position_embeddings,
               "] tokens (max_position_embeddings), got ", context);
  QFLASH_CHECK(ids.size() >= 2, "perplexity: needs at least 2 tokens, got ", ids.size());
  std::int64_t const vocab = model.config().vocab;
  PerplexityResult r;
  std::vector<float> logits;
  for (std::size_t begin = 0; begin < ids.size(); begin += static_cast<std::size_t>(context)) {
    std::size_t const len = std::min<std::size_t>(static_cast<std::size_t>(context), ids.size() - begin);
    if (len < 2) break;
    auto state = model.new_sequence(kv);
    model::SequenceChunk c{ids.subspan(begin, len), &state};
    model.forward(std::span(&c, 1), model::LogitsFor::kAllTokens, logits);
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
  return r;
}

}  // namespace qflash::runtime
