/// @file
/// CPU kernels/causal_conv1d. Work items are (block of kConvTokens tokens) x (block of
/// kConvChannels channels), over the threads; within an item, each token's K taps are
/// multiply-added across the item's channels, which are contiguous in x and y, so the loops
/// vectorise and x is read row by row. (Channel-only blocks walking down all tokens read x at a
/// stride of n_channels floats, which the prefetchers do not follow: 2x slower measured.) The
/// item's weight (and state, for the first token block) is transposed into scratch so every tap
/// is a contiguous row too. The state is updated after all items have read it. One body,
/// compiled under AVX-512, AVX2 and the baseline target and chosen at run time (arch::cpu_isa()).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/core/parallel.hpp"
#include "qflash/kernels/causal_conv1d/op.hpp"
#include "qflash/kernels/causal_conv1d/ref.hpp"
#include "qflash/kernels/gated_delta/common.hpp"

namespace qflash::kernels::cpu {

namespace causal_conv1d_detail {

/// Channels per work item: 4 KiB of a token row.
inline constexpr int kConvChannels = 1024;
/// Tokens per work item: the item's rows of x (256 KiB) stay in L2 for the K taps.
inline constexpr std::int64_t kConvTokens = 64;

/// Scratch floats of one worker: transposed weight [K][kConvChannels], state
/// [K-1][kConvChannels] and one accumulator row.
inline std::size_t scratch_floats(int d_conv) {
  return static_cast<std::size_t>(2 * d_conv) * kConvChannels;
}

/// c + a b: one fused multiply-add in the instances whose target has FMA (kFma), so that every
/// path (rows, one token, vectorised or not) rounds the same; the compiler's own contraction of
/// `acc += a * b` may fuse either product of a sum.
template <bool kFma>
QFLASH_FORCEINLINE float madd(float a, float b, float c) {
  if constexpr (kFma)
    return std::fma(a, b, c);
  else
    return c + a * b;
}

/// One output row segment: dst[c] = act(sum_j w[j][c] * src[j][c]), all K taps in one pass so
/// the sum stays in registers. K is a compile-time constant (the model's d_conv is 4).
template <int K, bool kFma>
QFLASH_FORCEINLINE void conv_row_fixed(float const* const* src, float const* wt, int nc, bool silu,
                                       float* dst) {
  float const* s[K];
  for (int j = 0; j < K; ++j) s[j] = src[j];
  if (silu) {
    for (int c = 0; c < nc; ++c) {
      float acc = wt[c] * s[0][c];
      for (int j = 1; j < K; ++j) acc = madd<kFma>(wt[j * kConvChannels + c], s[j][c], acc);
      dst[c] = gdn::silu_f32(acc);
    }
  } else {
    for (int c = 0; c < nc; ++c) {
      float acc = wt[c] * s[0][c];
      for (int j = 1; j < K; ++j) acc = madd<kFma>(wt[j * kConvChannels + c], s[j][c], acc);
      dst[c] = acc;
    }
  }
}

/// The same for any K, accumulating in `acc` [nc].
template <bool kFma>
QFLASH_FORCEINLINE void conv_row_any(float const* const* src, float const* wt, int k, int nc,
                                     bool silu, float* acc, float* dst) {
  for (int c = 0; c < nc; ++c) acc[c] = wt[c] * src[0][c];
  for (int j = 1; j < k; ++j)
    for (int c = 0; c < nc; ++c) acc[c] = madd<kFma>(wt[j * kConvChannels + c], src[j][c], acc[c]);
  for (int c = 0; c < nc; ++c) dst[c] = silu ? gdn::silu_f32(acc[c]) : acc[c];
}

/// Largest d_conv with an unrolled row kernel (MoeSpec allows d_conv <= 8).
inline constexpr int kMaxFixedConv = 8;

/// One token (decode), channels [c0, c0 + nc): the weight [c][K] and state [c][K-1] read where
/// they are, without an item's transposed copies, which cost more than the products here. Each
/// channel's products and sums are conv_row_fixed's, in its order.
template <int K, bool kFma>
QFLASH_FORCEINLINE void conv_one_token_fixed(CausalConv1dArgs const& a, std::int64_t c0, int nc) {
  float const* const w = a.weight + c0 * K;
  float const* const st = K > 1 ? a.state + c0 * (K - 1) : nullptr;
  float const* const x = a.x + c0;
  float* const y = a.y + c0;
  auto const tap = [&](int c, int j) { return j < K - 1 ? st[c * (K - 1) + j] : x[c]; };
  for (int c = 0; c < nc; ++c) {
    float acc = w[c * K] * tap(c, 0);
    for (int j = 1; j < K; ++j) acc = madd<kFma>(w[c * K + j], tap(c, j), acc);
    y[c] = a.apply_silu ? gdn::silu_f32(acc) : acc;
  }
}

/// y for tokens [t0, t0 + nt) and channels [c0, c0 + nc). Reads the state, does not write it.
template <bool kFma>
QFLASH_FORCEINLINE void conv_item(CausalConv1dArgs const& a, std::int64_t t0, std::int64_t nt,
                                  std::int64_t c0, int nc, float* scratch) {
  int const k = a.d_conv;
  if (a.n_tokens == 1) {
    switch (k) {
      case 1: return conv_one_token_fixed<1, kFma>(a, c0, nc);
      case 2: return conv_one_token_fixed<2, kFma>(a, c0, nc);
      case 3: return conv_one_token_fixed<3, kFma>(a, c0, nc);
      case 4: return conv_one_token_fixed<4, kFma>(a, c0, nc);
      case 5: return conv_one_token_fixed<5, kFma>(a, c0, nc);
      case 6: return conv_one_token_fixed<6, kFma>(a, c0, nc);
      case 7: return conv_one_token_fixed<7, kFma>(a, c0, nc);
      case 8: return conv_one_token_fixed<8, kFma>(a, c0, nc);
      default: break;
    }
  }
  std::int64_t const n_ch = a.n_channels;
  float* const wt = scratch;                           // [K][kConvChannels]    weight, tap-major
  float* const hist = wt + k * kConvChannels;          // [K-1][kConvChannels]  state, oldest first
  float* const acc = hist + (k - 1) * kConvChannels;   // [kConvChannels]
  for (int c = 0; c < nc; ++c)
    for (int j = 0; j < k; ++j) wt[j * kConvChannels + c] = a.weight[(c0 + c) * k + j];
  if (t0 < k - 1)
    for (int c = 0; c < nc; ++c)
      for (int i = 0; i < k - 1; ++i) hist[i * kConvChannels + c] = a.state[(c0 + c) * (k - 1) + i];

  std::vector<float const*> src_buf(k > kMaxFixedConv ? static_cast<std::size_t>(k) : 0);
  float const* src_fixed[kMaxFixedConv];
  float const** src = k > kMaxFixedConv ? src_buf.data() : src_fixed;
  for (std::int64_t t = t0; t < t0 + nt; ++t) {
    for (int j = 0; j < k; ++j) {
      std::int64_t const s = t - (k - 1) + j;  // input position; < 0 lies in the state
      src[j] = s >= 0 ? a.x + s * n_ch + c0 : hist + (k - 1 + s) * kConvChannels;
    }
    float* dst = a.y + t * n_ch + c0;
    switch (k) {
      case 1: conv_row_fixed<1, kFma>(src, wt, nc, a.apply_silu, dst); break;
      case 2: conv_row_fixed<2, kFma>(src, wt, nc, a.apply_silu, dst); break;
      case 3: conv_row_fixed<3, kFma>(src, wt, nc, a.apply_silu, dst); break;
      case 4: conv_row_fixed<4, kFma>(src, wt, nc, a.apply_silu, dst); break;
      case 5: conv_row_fixed<5, kFma>(src, wt, nc, a.apply_silu, dst); break;
      case 6: conv_row_fixed<6, kFma>(src, wt, nc, a.apply_silu, dst); break;
      case 7: conv_row_fixed<7, kFma>(src, wt, nc, a.apply_silu, dst); break;
      case 8: conv_row_fixed<8, kFma>(src, wt, nc, a.apply_silu, dst); break;
      default: conv_row_any<kFma>(src, wt, k, nc, a.apply_silu, acc, dst); break;
    }
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq"))) inline void
conv_item_avx512(CausalConv1dArgs const& a, std::int64_t t0, std::int64_t nt, std::int64_t c0,
                 int nc, float* scratch) {
  conv_item<true>(a, t0, nt, c0, nc, scratch);
}
__attribute__((target("avx2,fma,f16c"))) inline void conv_item_avx2(CausalConv1dArgs const& a,
                                                                    std::int64_t t0, std::int64_t nt,
                                                                    std::int64_t c0, int nc,
                                                                    float* scratch) {
  conv_item<true>(a, t0, nt, c0, nc, scratch);
}
#endif
inline void conv_item_baseline(CausalConv1dArgs const& a, std::int64_t t0, std::int64_t nt,
                               std::int64_t c0, int nc, float* scratch) {
  conv_item<false>(a, t0, nt, c0, nc, scratch);
}

/// The work item compiled for ISA level `isa`.
using ConvItemFn = void (*)(CausalConv1dArgs const&, std::int64_t, std::int64_t, std::int64_t, int, float*);
inline ConvItemFn conv_item_fn(arch::CpuIsa isa) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (isa >= arch::CpuIsa::kAvx512) return &conv_item_avx512;
  if (isa >= arch::CpuIsa::kAvx2) return &conv_item_avx2;
#endif
  (void)isa;
  return &conv_item_baseline;
}

/// New state: the last K-1 entries of [old state, x]. Position p of that sequence is
/// old[p] for p < K-1, else x[p - (K-1)]; new[i] = position n_tokens + i >= i, so updating
/// in place in increasing i reads every old entry before it is overwritten.
inline void update_state(CausalConv1dArgs const& a, std::int64_t c0, std::int64_t c1) {
  int const k = a.d_conv;
  std::int64_t const n_ch = a.n_channels;
  for (std::int64_t c = c0; c < c1; ++c)
    for (int i = 0; i < k - 1; ++i) {
      std::int64_t const p = a.n_tokens + i;
      a.state[c * (k - 1) + i] = p < k - 1 ? a.state[c * (k - 1) + p] : a.x[(p - (k - 1)) * n_ch + c];
    }
}

}  // namespace causal_conv1d_detail

/// The whole conv with an explicit ISA level (tests run every level this CPU has).
inline Status causal_conv1d(arch::CpuIsa isa, CausalConv1dArgs const& a) {
  namespace d = causal_conv1d_detail;
  if (Status s = can_implement_causal_conv1d<MoeSpec{}>(a); s != Status::kSuccess) return s;
  d::ConvItemFn const item_fn = d::conv_item_fn(isa);
  std::int64_t const n_cb = (a.n_channels + d::kConvChannels - 1) / d::kConvChannels;
  std::int64_t const n_tb = (a.n_tokens + d::kConvTokens - 1) / d::kConvTokens;
  std::int64_t const n_items = n_cb * n_tb;
  std::int64_t const n_workers = std::min<std::int64_t>(max_threads(), n_items);
  // One buffer per worker index, owned by the calling thread and kept across calls.
  thread_local std::vector<std::vector<float>> scratch_of;
  if (scratch_of.size() < static_cast<std::size_t>(n_workers)) scratch_of.resize(static_cast<std::size_t>(n_workers));
  auto& per_worker = scratch_of;
  parallel_for(0, n_workers, [&](std::int64_t w) {
    std::vector<float>& scratch = per_worker[static_cast<std::size_t>(w)];
    scratch.resize(d::scratch_floats(a.d_conv));
    for (std::int64_t it = n_items * w / n_workers; it < n_items * (w + 1) / n_workers; ++it) {
      std::int64_t const t0 = (it / n_cb) * d::kConvTokens;
      std::int64_t const c0 = (it % n_cb) * d::kConvChannels;
      item_fn(a, t0, std::min(d::kConvTokens, a.n_tokens - t0), c0,
              static_cast<int>(std::min<std::int64_t>(d::kConvChannels, a.n_channels - c0)),
              scratch.data());
    }
  });
  d::update_state(a, 0, a.n_channels);
  return Status::kSuccess;
}

}  // namespace qflash::kernels::cpu

namespace qflash::kernels {

template <MoeSpec S>
Status launch_causal_conv1d(arch::Cpu, CausalConv1dArgs const& args, stream_t) {
  if (Status s = can_implement_causal_conv1d<S>(args); s != Status::kSuccess) return s;
  return cpu::causal_conv1d(arch::cpu_isa(), args);
}

}  // namespace qflash::kernels
