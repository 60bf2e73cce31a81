/// @file
/// CPU kernels/expert_ffn: a counting sort of (token, slot) pairs by expert, then per expert
/// with tokens: gather rows, gate and up projections, SwiGLU, down projection, and a
/// weighted scatter-add. Projections run on the threaded kernels/linear.
#pragma once

#include <cmath>
#include <vector>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/kernels/expert_ffn/op.hpp"
#include "qflash/kernels/linear/cpu.hpp"

namespace qflash::kernels::cpu {

/// The op for the weight formats F compiles (kAny: all); arguments already checked.
template <WeightFormat F>
Status expert_ffn(arch::CpuIsa isa, ExpertFfnArgs const& a) {
  std::int64_t const d_model = a.experts[0].gate.cols;
  std::int64_t const d_ff = a.experts[0].gate.rows;
  std::int64_t const n_expert = static_cast<std::int64_t>(a.experts.size());
  std::int64_t const n_pairs = a.n_tokens * a.n_expert_used;

  // Permutation: pairs of each expert contiguous, in token order.
  std::vector<std::int64_t> offset(static_cast<std::size_t>(n_expert + 1), 0);
  for (std::int64_t p = 0; p < n_pairs; ++p) {
    std::int32_t const e = a.routes[p];
    if (e < 0 || e >= n_expert) return Status::kErrorInvalidProblem;
    ++offset[static_cast<std::size_t>(e) + 1];
  }
  for (std::int64_t e = 0; e < n_expert; ++e) offset[static_cast<std::size_t>(e + 1)] += offset[static_cast<std::size_t>(e)];
  std::vector<std::int64_t> pairs(static_cast<std::size_t>(n_pairs));
  {
    std::vector<std::int64_t> fill(offset.begin(), offset.end() - 1);
    for (std::int64_t p = 0; p < n_pairs; ++p) pairs[static_cast<std::size_t>(fill[static_cast<std::size_t>(a.routes[p])]++)] = p;
  }

  std::vector<float> xe, gate, up, down;
  for (std::int64_t e = 0; e < n_expert; ++e) {
    std::int64_t const begin = offset[static_cast<std::size_t>(e)];
    std::int64_t const n = offset[static_cast<std::size_t>(e + 1)] - begin;
    if (n == 0) continue;
    auto const& w = a.experts[static_cast<std::size_t>(e)];
    xe.resize(static_cast<std::size_t>(n * d_model));
    gate.resize(static_cast<std::size_t>(n * d_ff));
    up.resize(static_cast<std::size_t>(n * d_ff));
    down.resize(static_cast<std::size_t>(n * d_model));
    for (std::int64_t r = 0; r < n; ++r) {
      std::int64_t const t = pairs[static_cast<std::size_t>(begin + r)] / a.n_expert_used;
      std::copy_n(a.x + t * d_model, d_model, xe.data() + r * d_model);
    }
    LinearArgs l{};
    l.x = xe.data();
    l.n_tokens = n;
    l.w = w.gate;
    l.y = gate.data();
    if (Status s = linear<F>(isa, l); s != Status::kSuccess) return s;
    l.w = w.up;
    l.y = up.data();
    if (Status s = linear<F>(isa, l); s != Status::kSuccess) return s;
    for (std::int64_t i = 0; i < n * d_ff; ++i) {
      float const g = gate[static_cast<std::size_t>(i)];
      gate[static_cast<std::size_t>(i)] = g / (1.0f + std::exp(-g)) * up[static_cast<std::size_t>(i)];
    }
    l.x = gate.data();
    l.w = w.down;
    l.y = down.data();
    if (Status s = linear<F>(isa, l); s != Status::kSuccess) return s;
    for (std::int64_t r = 0; r < n; ++r) {
      std::int64_t const p = pairs[static_cast<std::size_t>(begin + r)];
      std::int64_t const t = p / a.n_expert_used;
      float const rw = a.route_weights[p];
      float* o = a.out + t * d_model;
      float const* src = down.data() + r * d_model;
      for (std::int64_t i = 0; i < d_model; ++i) o[i] += rw * src[i];
    }
  }
  return Status::kSuccess;
}

}  // namespace qflash::kernels::cpu

namespace qflash::kernels {

template <MoeSpec S>
Status launch_expert_ffn(arch::Cpu, ExpertFfnArgs const& a, stream_t) {
  if (Status s = can_implement_expert_ffn<S>(a); s != Status::kSuccess) return s;
  return cpu::expert_ffn<S.weights>(arch::cpu_isa(), a);
}

}  // namespace qflash::kernels
