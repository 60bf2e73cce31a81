/// @file
/// Scalar reference for kernels/expert_ffn: each (token, expert) pair on its own, weight rows
/// decoded by the reference dequantization, fp64 sums.
#pragma once

#include <cmath>
#include <vector>

#include "qflash/kernels/expert_ffn/op.hpp"
#include "qflash/kernels/linear/ref.hpp"

namespace qflash::kernels::ref {

inline void expert_ffn(ExpertFfnArgs const& a) {
  std::int64_t const d_model = a.experts[0].gate.cols;
  std::int64_t const d_ff = a.experts[0].gate.rows;
  std::vector<double> act(static_cast<std::size_t>(d_ff));
  std::vector<float> gate_row(static_cast<std::size_t>(d_model)), up_row(gate_row.size()),
      down_row(static_cast<std::size_t>(d_ff));
  for (std::int64_t t = 0; t < a.n_tokens; ++t) {
    float const* x = a.x + t * d_model;
    for (int j = 0; j < a.n_expert_used; ++j) {
      auto const& e = a.experts[static_cast<std::size_t>(a.routes[t * a.n_expert_used + j])];
      for (std::int64_t f = 0; f < d_ff; ++f) {
        dequantize_row(e.gate, f, gate_row.data());
        dequantize_row(e.up, f, up_row.data());
        double g = 0, u = 0;
        for (std::int64_t i = 0; i < d_model; ++i) {
          g += static_cast<double>(x[i]) * gate_row[static_cast<std::size_t>(i)];
          u += static_cast<double>(x[i]) * up_row[static_cast<std::size_t>(i)];
        }
        act[static_cast<std::size_t>(f)] = g / (1.0 + std::exp(-g)) * u;
      }
      double const w = a.route_weights[t * a.n_expert_used + j];
      for (std::int64_t o = 0; o < d_model; ++o) {
        dequantize_row(e.down, o, down_row.data());
        double acc = 0;
        for (std::int64_t f = 0; f < d_ff; ++f) acc += act[static_cast<std::size_t>(f)] * down_row[static_cast<std::size_t>(f)];
        a.out[t * d_model + o] += static_cast<float>(w * acc);
      }
    }
  }
}

}  // namespace qflash::kernels::ref
