/// @file
/// Routed experts as one strided set: expert e's projection is the first one's view moved e
/// strides on. A stacked tensor ([n_expert * rows, cols], as GGUF files and the device upload
/// lay experts out) is such a set; the CUDA kernels read experts this way, with no table.
#pragma once

#include <cstddef>
#include <optional>
#include <span>

#include "qflash/core/config.hpp"
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

/// Projection `which` of `experts` as a StackedView: one format and shape, constant strides;
/// nullopt when they are not laid out so (or there are none).
inline std::optional<StackedView> stack(std::span<ExpertWeights const> experts, WeightView ExpertWeights::*which) {
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

}  // namespace qflash::kernels
