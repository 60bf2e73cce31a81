/// @file
/// Rotary position embedding, NeoX half-split, on the first `rotary_dim` dims of each head:
/// for j < rotary_dim/2, with angle = position * theta^(-2j/rotary_dim):
///   out[j]     = x[j] cos - x[j + r/2] sin
///   out[j+r/2] = x[j + r/2] cos + x[j] sin
/// Dims rotary_dim..d_head pass through (partial rotary). In place.
#pragma once

#include <cmath>
#include <cstdint>

#include "qflash/arch/arch.hpp"
#include "qflash/core/config.hpp"
#include "qflash/core/status.hpp"
#include "qflash/spec/moe_spec.hpp"

namespace qflash::kernels {

struct RopeArgs {
  float* x = nullptr;                  // [n_tokens, n_head, d_head], in place
  std::int64_t const* positions = nullptr;  // [n_tokens]
  std::int64_t n_tokens = 0;
  int n_head = 0;
  int d_head = 0;
  int rotary_dim = 0;  ///< even, <= d_head
  float theta = 10000.0f;
};

[[nodiscard]] inline Status can_implement_rope(RopeArgs const& a) {
  if (!a.x || !a.positions || a.n_tokens < 0 || a.n_head <= 0 || a.d_head <= 0 ||
      a.rotary_dim <= 0 || a.rotary_dim % 2 != 0 || a.rotary_dim > a.d_head || !(a.theta > 0))
    return Status::kErrorInvalidProblem;
  return Status::kSuccess;
}

/// Inverse frequency of pair j, rounded to fp32 as the reference implementation keeps it.
inline float rope_inv_freq(float theta, int j, int rotary_dim) {
  return static_cast<float>(1.0 / std::pow(static_cast<double>(theta),
                                           static_cast<double>(2 * j) / rotary_dim));
}

template <MoeSpec S>
Status launch_rope(arch::Cpu, RopeArgs const& args, stream_t stream = nullptr);

}  // namespace qflash::kernels
