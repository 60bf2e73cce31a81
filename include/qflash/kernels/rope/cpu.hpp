/// @file
/// CPU kernels/rope: one cos/sin table per call (fp32 angles, as the reference model
/// computes them), then rotation threaded over tokens.
#pragma once

#include <cmath>
#include <vector>

#include "qflash/core/parallel.hpp"
#include "qflash/kernels/rope/op.hpp"

namespace qflash::kernels {

template <MoeSpec S>
Status launch_rope(arch::Cpu, RopeArgs const& a, stream_t) {
  if (Status s = can_implement_rope(a); s != Status::kSuccess) return s;
  int const half = a.rotary_dim / 2;
  // The calling thread's buffer, kept across calls; workers read it through inv_freq.
  thread_local std::vector<float> inv_freq_buf;
  inv_freq_buf.resize(static_cast<std::size_t>(half));
  float* const inv_freq = inv_freq_buf.data();
  for (int j = 0; j < half; ++j) inv_freq[j] = rope_inv_freq(a.theta, j, a.rotary_dim);
  parallel_for(0, a.n_tokens, a.n_head * a.rotary_dim * 4, [&](std::int64_t t) {
    float const pos = static_cast<float>(a.positions[t]);
    for (int j = 0; j < half; ++j) {
      float const ang = pos * inv_freq[j];
      float const c = static_cast<float>(std::cos(static_cast<double>(ang)));
      float const s = static_cast<float>(std::sin(static_cast<double>(ang)));
      for (int h = 0; h < a.n_head; ++h) {
        float* v = a.x + (t * a.n_head + h) * a.d_head;
        float const x0 = v[j], x1 = v[j + half];
        v[j] = x0 * c - x1 * s;
        v[j + half] = x1 * c + x0 * s;
      }
    }
  });
  return Status::kSuccess;
}

}  // namespace qflash::kernels
