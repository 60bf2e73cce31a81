/// @file
/// Routed experts as one strided set: expert e's projection is the first one's view moved e
/// strides on. A stacked tensor ([n_expert * rows, cols], as GGUF files and the device upload
/// lay experts out) is such a set; the CUDA kernels read experts this way, with no table.
/// Their LoRA updates too: stack_low_rank lays one projection's out so.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <optional>
#include <span>
#include <type_traits>
#include <vector>

#include "qflash/core/config.hpp"
#include "qflash/core/error.hpp"
#include "qflash/kernels/expert_ffn/op.hpp"

namespace qflash::kernels {

struct StackedView {
  WeightView first;
  std::int64_t data_stride = 0;    ///< bytes
  std::int64_t scales_stride = 0;  ///< floats (kFp8E4m3)
  std::int64_t row0_stride = 0;    ///< tensor rows of the fp8 scale grid (kFp8E4m3)

  [[nodiscard]] QFLASH_HD WeightView at(int e) const {
    WeightView v = first;
    v.data = static_cast<std::byte const*>(first.data) + e * data_stride;
    if (v.scales) v.scales += e * scales_stride;
    v.scale_row0 += e * row0_stride;
    return v;
  }
};

/// Matrix `which` of each of `experts` (ExpertWeights, LowRank) as a StackedView: one format
/// and shape, constant strides; nullopt when they are not laid out so (or there are none).
template <class T>
std::optional<StackedView> stack(std::span<std::type_identity_t<T> const> experts, WeightView T::*which) {
  if (experts.empty()) return std::nullopt;
  WeightView const& w0 = experts[0].*which;
  StackedView s{w0};
  if (experts.size() > 1) {
    WeightView const& w1 = experts[1].*which;
    s.data_stride = static_cast<std::byte const*>(w1.data) - static_cast<std::byte const*>(w0.data);
    s.scales_stride = w1.scales - w0.scales;
    s.row0_stride = w1.scale_row0 - w0.scale_row0;
  }
  for (std::size_t e = 0; e < experts.size(); ++e) {
    WeightView const& w = experts[e].*which;
    WeightView const want = s.at(static_cast<int>(e));
    if (w.format != w0.format || w.rows != w0.rows || w.cols != w0.cols || w.data != want.data ||
        (w0.format == WeightFormat::kFp8E4m3 && (w.scales != want.scales || w.scale_row0 != want.scale_row0)))
      return std::nullopt;
  }
  return s;
}

/// One projection's routed-expert LoRA updates at one rank, the largest of theirs: expert e's A
/// is rows [e rank, (e + 1) rank) of `a` [n_expert rank, n_in], its B rows [e n_out, (e + 1) n_out)
/// of `b` [n_expert n_out, rank]. Zero rows of A and columns of B pad the smaller updates (and
/// stand for the empty ones), which leaves each update's value as it was.
struct StackedLowRank {
  std::int64_t rank = 0, n_in = 0, n_out = 0;  ///< rank 0: every update was empty
  std::vector<float> a, b;

  /// Expert e's update, as views into a and b.
  [[nodiscard]] LowRank at(std::size_t e) const {
    auto const i = static_cast<std::int64_t>(e);
    return {{WeightFormat::kF32, a.data() + i * rank * n_in, rank, n_in},
            {WeightFormat::kF32, b.data() + i * n_out * rank, n_out, rank}};
  }
};

/// `updates` (f32, each empty or of one [n_out, n_in] matrix) stacked at their largest rank.
/// Throws Error when they are not so.
inline StackedLowRank stack_low_rank(std::span<LowRank const> updates) {
  StackedLowRank s;
  for (LowRank const& u : updates)
    if (!u.empty()) s.rank = std::max(s.rank, u.rank()), s.n_in = u.a.cols, s.n_out = u.b.rows;
  if (s.rank == 0) return s;
  for (LowRank const& u : updates)
    QFLASH_CHECK(u.fits(s.n_out, s.n_in), "stack_low_rank: the experts' LoRA updates are not all f32 updates of one ",
                 s.n_out, " x ", s.n_in, " matrix");
  auto const n = static_cast<std::int64_t>(updates.size());
  s.a.assign(static_cast<std::size_t>(n * s.rank * s.n_in), 0.0f);
  s.b.assign(static_cast<std::size_t>(n * s.n_out * s.rank), 0.0f);
  for (std::int64_t e = 0; e < n; ++e) {
    LowRank const& u = updates[static_cast<std::size_t>(e)];
    if (u.empty()) continue;
    std::int64_t const r = u.rank();
    std::memcpy(s.a.data() + e * s.rank * s.n_in, u.a.data, static_cast<std::size_t>(r * s.n_in) * sizeof(float));
    for (std::int64_t o = 0; o < s.n_out; ++o)  // B's rows widen to the stack's rank
      std::memcpy(s.b.data() + (e * s.n_out + o) * s.rank, u.b.row(o), static_cast<std::size_t>(r) * sizeof(float));
  }
  return s;
}

}  // namespace qflash::kernels
