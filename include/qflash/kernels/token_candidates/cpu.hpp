/// @file
/// CPU kernels/token_candidates: per row, one pass keeps the k best in a heap (most ids fall
/// below its worst at one comparison) and a second sums in id order, exactly as the sampler
/// and the engine's log-probabilities sum a full row. Threaded over rows.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "qflash/core/parallel.hpp"
#include "qflash/kernels/token_candidates/op.hpp"

namespace qflash::kernels::cpu {

/// The op (no spec field changes it); arguments already checked.
inline Status token_candidates(TokenCandidatesArgs const& a) {
  std::int64_t const ld = a.ld ? a.ld : a.vocab;
  auto const k = static_cast<std::size_t>(a.k);
  parallel_for(0, a.rows, a.vocab, [&](std::int64_t r) {
    float const* const l = a.logits + r * ld;
    std::int32_t const* const ex_end = a.excluded + a.n_excluded;
    // The row as the op reads it, id by id.
    auto for_each_value = [&](auto&& fn) {
      std::int32_t const* ex = a.excluded;
      for (std::int32_t i = 0; i < a.vocab; ++i) {
        bool const skip = ex != ex_end && *ex == i;
        ex += skip ? 1 : 0;
        fn(i, skip ? -INFINITY : l[i]);
      }
    };
    using Entry = std::pair<float, std::int32_t>;
    auto const better = [](Entry const& x, Entry const& y) {
      return x.first > y.first || (x.first == y.first && x.second < y.second);
    };
    std::vector<Entry> best;  // a heap whose front is the worst kept
    best.reserve(k);
    std::int64_t non_finite = 0;
    float mx = -INFINITY;
    for (std::int32_t i = 0; i < a.vocab; ++i) non_finite += std::isfinite(l[i]) ? 0 : 1;
    for_each_value([&](std::int32_t i, float v) {
      mx = std::max(mx, v);
      Entry const e{v, i};
      if (best.size() < k) {
        best.push_back(e);
        std::push_heap(best.begin(), best.end(), better);
      } else if (better(e, best.front())) {
        std::pop_heap(best.begin(), best.end(), better);
        best.back() = e;
        std::push_heap(best.begin(), best.end(), better);
      }
    });
    std::sort_heap(best.begin(), best.end(), better);
    for (std::size_t j = 0; j < k; ++j) {
      Entry const e = j < best.size() ? best[j] : Entry{-INFINITY, -1};
      a.values[r * a.k + static_cast<std::int64_t>(j)] = e.first;
      a.ids[r * a.k + static_cast<std::int64_t>(j)] = e.second;
    }

    CandidateStats& st = a.stats[r];
    st = CandidateStats{mx, -INFINITY, 0.0, non_finite};
    if (mx == -INFINITY) return;
    float const t = a.temperature && a.temperature[r] > 0.0f ? a.temperature[r] : 1.0f;
    double norm = 0, mass = 0;
    for_each_value([&](std::int32_t, float v) {
      norm += std::exp(static_cast<double>(v - mx));
      mass += std::exp((v - mx) / t);
    });
    st.log_norm = mx + static_cast<float>(std::log(norm));
    st.mass = mass;
  });
  return Status::kSuccess;
}

}  // namespace qflash::kernels::cpu

namespace qflash::kernels {

template <MoeSpec S>
Status launch_token_candidates(arch::Cpu, TokenCandidatesArgs const& a, stream_t) {
  if (Status s = can_implement_token_candidates<S>(a); s != Status::kSuccess) return s;
  return cpu::token_candidates(a);
}

}  // namespace qflash::kernels
