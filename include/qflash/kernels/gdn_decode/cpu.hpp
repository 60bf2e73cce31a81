/// @file
/// CPU kernels/gdn_decode: one parallel region for every decoding sequence of a layer. A work
/// item is (sequence, q/k head): it convolves that head's q and k channels and its value heads'
/// v channels (and moves them into the conv state), normalises q and k once, and runs the
/// recurrent step of each of its value heads on the state in place, a kTile of columns at a
/// time, then norms each value head's out row when the op has the norm. Items own disjoint
/// channels, state and rows, so nothing is shared between threads.
///
/// The arithmetic is kernels/causal_conv1d's, kernels/gated_delta's and kernels/gated_rmsnorm's
/// for one token: their own one-token conv, row and norm kernels, so the results are theirs bit
/// for bit. Raw gates go through kernels/gdn_gates' own kernel first, a row at a time.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/kernels/causal_conv1d/cpu.hpp"
#include "qflash/kernels/gated_delta/cpu.hpp"
#include "qflash/kernels/gated_rmsnorm/cpu.hpp"
#include "qflash/kernels/gdn_gates/cpu.hpp"
#include "qflash/kernels/gdn_decode/op.hpp"

namespace qflash::kernels::cpu {

namespace gdn_decode_detail {

using gated_delta_detail::kTile;
using gated_delta_detail::pad16;
using gated_delta_detail::RowKernels;
using causal_conv1d_detail::ConvTokenFn;

/// Channels [c0, c0 + n) of the token: y = silu(conv) from the state, and the state moved on
/// by the token, through causal_conv1d's own one-token loop (its arithmetic, bit for bit).
inline void conv_channels(ConvTokenFn token, CausalConv1dArgs const& a, std::int64_t c0, std::int64_t n, float* scratch) {
  for (std::int64_t b = c0; b < c0 + n; b += causal_conv1d_detail::kConvChannels)
    token(a, b, static_cast<int>(std::min<std::int64_t>(causal_conv1d_detail::kConvChannels, c0 + n - b)), scratch);
}

/// Scratch floats of one worker: q̂ and k̂ [d_k, padded], u and δ [kTile], the conv item's.
inline std::size_t scratch_floats(int d_k, int d_conv) {
  return static_cast<std::size_t>(2 * pad16(d_k) + 2 * kTile) + causal_conv1d_detail::scratch_floats(d_conv);
}

/// Item (sequence i, q/k head kh).
inline void decode_item(GdnDecodeArgs const& a, RowKernels const& rk, ConvTokenFn conv_token,
                        gated_rmsnorm_detail::RowsFn norm_rows, int i, int kh, float* buf) {
  int const dk = a.d_k, dv = a.d_v, hv = a.n_head_v;
  std::int64_t const key_dim = std::int64_t{a.n_head_k} * dk;
  std::int64_t const r = a.rows[i];
  CausalConv1dArgs const c = a.conv_args(r, a.d_conv > 1 ? a.conv_state[i] : nullptr);
  float* const y = c.y;
  int const group = hv / a.n_head_k;
  auto value_head = [&](int j) { return a.value_head(kh, j); };

  float* const qn = buf;
  float* const kn = qn + pad16(dk);
  float* const u = kn + pad16(dk);
  float* const delta = u + kTile;
  float* const conv_scratch = delta + kTile;
  conv_channels(conv_token, c, std::int64_t{kh} * dk, dk, conv_scratch);
  conv_channels(conv_token, c, key_dim + std::int64_t{kh} * dk, dk, conv_scratch);
  for (int j = 0; j < group; ++j)
    conv_channels(conv_token, c, 2 * key_dim + std::int64_t{value_head(j)} * dv, dv, conv_scratch);

  rk.l2norm_scaled(y + std::int64_t{kh} * dk, dk, a.l2norm_eps, a.q_scale(), qn);
  rk.l2norm_scaled(y + key_dim + std::int64_t{kh} * dk, dk, a.l2norm_eps, 1.0f, kn);
  for (int j = 0; j < group; ++j) {
    int const h = value_head(j);
    float* const s = a.state[i] + std::int64_t{h} * dk * dv;
    float const decay = std::exp(a.g[r * hv + h]);
    float const beta = a.beta[r * hv + h];
    float const* const v = y + 2 * key_dim + std::int64_t{h} * dv;
    float* const o = a.out + r * std::int64_t{hv} * dv + std::int64_t{h} * dv;
    for (int c0 = 0; c0 < dv; c0 += kTile) {  // in place, as gated_delta's one-token items
      int const nc = std::min(kTile, dv - c0);
      rk.row_gemv(dk, kn, s + c0, dv, nc, u, 1.0f, 0.0f);  // u = S_{t-1}ᵀ k̂
      for (int c = 0; c < nc; ++c) delta[c] = beta * (v[c0 + c] - decay * u[c]);
      rk.rank1_project(dk, decay, kn, delta, qn, s + c0, dv, nc, o + c0);
    }
    if (a.norm_weight) norm_rows(a.norm_args(r), h, h + 1);  // row h of gated_rmsnorm's call
  }
}

}  // namespace gdn_decode_detail

/// The op with an explicit ISA level (tests run every level this CPU has).
inline Status gdn_decode(arch::CpuIsa isa, GdnDecodeArgs const& a) {
  namespace d = gdn_decode_detail;
  if (Status s = can_implement_gdn_decode<MoeSpec{}>(a); s != Status::kSuccess) return s;
  if (a.n_seqs == 0) return Status::kSuccess;
  if (a.dt_bias)
    for (int i = 0; i < a.n_seqs; ++i)
      if (Status s = gdn_gates<kDynamic>(isa, a.gates_args(a.rows[i])); s != Status::kSuccess) return s;
  gated_delta_detail::RowKernels const rk = gated_delta_detail::row_kernels(isa);
  d::ConvTokenFn const conv_token = causal_conv1d_detail::conv_token_fn(isa);
  std::int64_t const hk = a.n_head_k;
  gated_rmsnorm_detail::RowsFn const norm_rows = gated_rmsnorm_detail::rows_fn(isa);
  gated_delta_detail::for_each_item(a.n_seqs * hk, d::scratch_floats(a.d_k, a.d_conv),
                                    [&](std::int64_t item, float* buf) {
                                      d::decode_item(a, rk, conv_token, norm_rows, static_cast<int>(item / hk),
                                                     static_cast<int>(item % hk), buf);
                                    });
  return Status::kSuccess;
}

}  // namespace qflash::kernels::cpu

namespace qflash::kernels {

template <MoeSpec S>
Status launch_gdn_decode(arch::Cpu, GdnDecodeArgs const& args, stream_t) {
  if (Status s = can_implement_gdn_decode<S>(args); s != Status::kSuccess) return s;
  return cpu::gdn_decode(arch::cpu_isa(), args);
}

}  // namespace qflash::kernels
