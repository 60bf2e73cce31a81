/// @file
/// CPU kernels/qk_norm_rope: one (token, head) row per step, threaded over tokens; the norm
/// and rotation work on a row held in registers/L1. With a static d_head the row loops have
/// compile-time trip counts. The token's body is compiled under AVX-512, AVX2 and the baseline
/// target and chosen at run time, so its row loops vectorise (the cos/sin stay libm calls,
/// once per rotated pair and token).
#pragma once

#include <cmath>
#include <vector>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/core/parallel.hpp"
#include "qflash/kernels/qk_norm_rope/op.hpp"
#include "qflash/kernels/rope/op.hpp"  // rope_inv_freq

namespace qflash::kernels::cpu {

namespace qk_norm_rope_detail {

/// Token t's cos and sin of every rotated pair into cs (interleaved), then its heads normed
/// and rotated; d from the static D when given.
template <int D>
QFLASH_FORCEINLINE void token(QkNormRopeArgs const& a, std::int64_t t, float const* inv_freq, float* cs) {
  int const d = dim<D>(a.d_head);
  std::int64_t const hs = a.head_stride_or_default(), ts = a.token_stride_or_default();
  int const half = a.rotary_dim / 2;
  float const w_offset = a.weight_kind == NormWeight::kZeroCentered ? 1.0f : 0.0f;
  float const pos = static_cast<float>(a.positions[t]);
  for (int j = 0; j < half; ++j) {
    float const ang = pos * inv_freq[j];
    cs[2 * j] = static_cast<float>(std::cos(static_cast<double>(ang)));
    cs[2 * j + 1] = static_cast<float>(std::sin(static_cast<double>(ang)));
  }
  for (int h = 0; h < a.n_head; ++h) {
    float const* x = a.x + t * ts + h * hs;
    float* y = a.y + (t * a.n_head + h) * d;
    float acc[8] = {};
    for (int i = 0; i < d; ++i) acc[i % 8] += x[i] * x[i];
    float const sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    float const inv = 1.0f / std::sqrt(sum / static_cast<float>(d) + a.eps);
    for (int i = 0; i < d; ++i) y[i] = (x[i] * inv) * (a.weight[i] + w_offset);
    for (int j = 0; j < half; ++j) {
      float const c = cs[2 * j], s = cs[2 * j + 1];
      float const x0 = y[j], x1 = y[j + half];
      y[j] = x0 * c - x1 * s;
      y[j + half] = x1 * c + x0 * s;
    }
  }
}

template <int D>
using TokenFn = void (*)(QkNormRopeArgs const&, std::int64_t, float const*, float*);
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
template <int D>
__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq"))) void token_avx512(
    QkNormRopeArgs const& a, std::int64_t t, float const* inv_freq, float* cs) {
  token<D>(a, t, inv_freq, cs);
}
template <int D>
__attribute__((target("avx2,fma,f16c"))) void token_avx2(QkNormRopeArgs const& a, std::int64_t t,
                                                          float const* inv_freq, float* cs) {
  token<D>(a, t, inv_freq, cs);
}
#endif
template <int D>
void token_baseline(QkNormRopeArgs const& a, std::int64_t t, float const* inv_freq, float* cs) {
  token<D>(a, t, inv_freq, cs);
}

template <int D>
TokenFn<D> token_fn([[maybe_unused]] arch::CpuIsa isa) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (isa >= arch::CpuIsa::kAvx512) return token_avx512<D>;
  if (isa >= arch::CpuIsa::kAvx2) return token_avx2<D>;
#endif
  return token_baseline<D>;
}

}  // namespace qk_norm_rope_detail

/// The op for head width D (kDynamic: any) on ISA level `isa`; arguments already checked.
template <int D>
Status qk_norm_rope(arch::CpuIsa isa, QkNormRopeArgs const& a) {
  int const d = dim<D>(a.d_head);
  int const half = a.rotary_dim / 2;
  // The calling thread's buffer, kept across calls; workers read it through inv_freq.
  thread_local std::vector<float> inv_freq_buf;
  inv_freq_buf.resize(static_cast<std::size_t>(half));
  float* const inv_freq = inv_freq_buf.data();
  for (int j = 0; j < half; ++j) inv_freq[j] = rope_inv_freq(a.theta, j, a.rotary_dim);
  thread_local SlotScratch<float> cos_sin;  // per slot (core/parallel.hpp), kept across calls
  cos_sin.prepare();
  auto& cos_sin_of = cos_sin;
  qk_norm_rope_detail::TokenFn<D> const token = qk_norm_rope_detail::token_fn<D>(isa);
  parallel_for(0, a.n_tokens, std::int64_t{a.n_head} * d * 8, [&](std::int64_t t) {
    token(a, t, inv_freq, cos_sin_of.get(static_cast<std::size_t>(2 * half)));
  });
  if (a.keys.x) return qk_norm_rope<D>(isa, a.keys_call());
  return Status::kSuccess;
}

}  // namespace qflash::kernels::cpu

namespace qflash::kernels {

template <MoeSpec S>
Status launch_qk_norm_rope(arch::Cpu, QkNormRopeArgs const& a, stream_t) {
  if (Status s = can_implement_qk_norm_rope<S>(a); s != Status::kSuccess) return s;
  return cpu::qk_norm_rope<S.d_head>(arch::cpu_isa(), a);
}

}  // namespace qflash::kernels
