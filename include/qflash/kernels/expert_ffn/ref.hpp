/// @file
/// Scalar reference for kernels/expert_ffn: each (token, expert) pair on its own, weight rows
/// decoded by the reference dequantization, activations rounded as kernels/linear rounds them
/// (the SwiGLU output to fp32 first), fp64 sums; LoRA updates on the unrounded activations.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "qflash/kernels/expert_ffn/op.hpp"
#include "qflash/kernels/linear/ref.hpp"

namespace qflash::kernels::ref {

/// B (A v) in fp64 for an update of a matrix [rows, v's length], added to acc[rows]; none when empty.
inline void add_low_rank(LowRank const& d, float const* v, double* acc) {
  if (d.empty()) return;
  auto const* a = static_cast<float const*>(d.a.data);
  auto const* b = static_cast<float const*>(d.b.data);
  std::int64_t const r = d.a.rows, n = d.a.cols;
  std::vector<double> u(static_cast<std::size_t>(r), 0.0);
  for (std::int64_t j = 0; j < r; ++j)
    for (std::int64_t i = 0; i < n; ++i) u[static_cast<std::size_t>(j)] += static_cast<double>(a[j * n + i]) * v[i];
  for (std::int64_t o = 0; o < d.b.rows; ++o)
    for (std::int64_t j = 0; j < r; ++j) acc[o] += static_cast<double>(b[o * r + j]) * u[static_cast<std::size_t>(j)];
}

/// out[t] += weight * Expert(x[t]) for one token and expert, with the expert's low-rank updates
/// (LoRA, on the unrounded activations) when given.
inline void expert_pair(ExpertWeights const& e, float const* x_in, double weight, float* out,
                        LowRank const& lora_gate = {}, LowRank const& lora_up = {}, LowRank const& lora_down = {}) {
  std::int64_t const d_model = e.gate.cols;
  std::int64_t const d_ff = e.gate.rows;
  std::vector<float> act(static_cast<std::size_t>(d_ff));
  std::vector<float> gate_row(static_cast<std::size_t>(d_model)), up_row(gate_row.size()),
      down_row(static_cast<std::size_t>(d_ff)), x_gate(x_in, x_in + d_model), x_up(x_gate);
  round_activations(e.gate.format, x_gate.data(), d_model);
  round_activations(e.up.format, x_up.data(), d_model);
  std::vector<double> gate_lora(static_cast<std::size_t>(d_ff), 0.0), up_lora(gate_lora),
      down_lora(static_cast<std::size_t>(d_model), 0.0);
  add_low_rank(lora_gate, x_in, gate_lora.data());
  add_low_rank(lora_up, x_in, up_lora.data());
  for (std::int64_t f = 0; f < d_ff; ++f) {
    dequantize_row(e.gate, f, gate_row.data());
    dequantize_row(e.up, f, up_row.data());
    double g = gate_lora[static_cast<std::size_t>(f)], u = up_lora[static_cast<std::size_t>(f)];
    for (std::int64_t i = 0; i < d_model; ++i) {
      auto const k = static_cast<std::size_t>(i);
      g += static_cast<double>(x_gate[k]) * gate_row[k];
      u += static_cast<double>(x_up[k]) * up_row[k];
    }
    act[static_cast<std::size_t>(f)] = static_cast<float>(g / (1.0 + std::exp(-g)) * u);
  }
  add_low_rank(lora_down, act.data(), down_lora.data());
  round_activations(e.down.format, act.data(), d_ff);
  for (std::int64_t o = 0; o < d_model; ++o) {
    dequantize_row(e.down, o, down_row.data());
    double acc = down_lora[static_cast<std::size_t>(o)];
    for (std::int64_t f = 0; f < d_ff; ++f)
      acc += static_cast<double>(act[static_cast<std::size_t>(f)]) * down_row[static_cast<std::size_t>(f)];
    out[o] += static_cast<float>(weight * acc);
  }
}

inline void expert_ffn(ExpertFfnArgs const& a) {
  std::int64_t const d_model = a.experts[0].gate.cols;
  if (!a.accumulate) std::fill_n(a.out, a.n_tokens * d_model, 0.0f);
  for (std::int64_t t = 0; t < a.n_tokens; ++t) {
    ExpertLora const* l = a.token_lora ? a.token_lora[t] : nullptr;
    auto routed = [&](std::span<LowRank const> d, std::int32_t e) { return d.empty() ? LowRank{} : d[static_cast<std::size_t>(e)]; };
    for (int j = 0; j < a.n_expert_used; ++j)
      if (std::int32_t const e = a.routes[t * a.n_expert_used + j]; e != kNoExpert)
        expert_pair(a.experts[static_cast<std::size_t>(e)], a.x + t * d_model, a.route_weights[t * a.n_expert_used + j],
                    a.out + t * d_model, l ? routed(l->gate, e) : LowRank{}, l ? routed(l->up, e) : LowRank{},
                    l ? routed(l->down, e) : LowRank{});
    if (a.shared)
      expert_pair(*a.shared, a.x + t * d_model, a.shared_weights[t], a.out + t * d_model,
                  l ? l->shared_gate : LowRank{}, l ? l->shared_up : LowRank{}, l ? l->shared_down : LowRank{});
  }
}

}  // namespace qflash::kernels::ref
