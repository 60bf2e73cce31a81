/// @file
/// CPU kernels/causal_conv1d. Work items are (block of kConvTokens tokens) x (block of
/// kConvChannels channels), over the threads; within an item, each token's K taps are
/// multiply-added across the item's channels, which are contiguous in x and y, so the loops
/// vectorise and x is read row by row. (Channel-only blocks walking down all tokens read x at a
/// stride of n_channels floats, which the prefetchers do not follow: 2x slower measured.) The
/// item's weight (and state, for the first token block) is transposed into scratch so every tap
/// is a contiguous row too. The state is updated after all items have read it.
///
/// One token (decode) is a channel loop of its own, conv_token: it transposes 64 channels at a
/// time onto the stack (with AVX2 shuffles when d_conv is 4), runs the same row kernel, and moves
/// those channels' state on by the token. One body, compiled under AVX-512, AVX2 and the
/// baseline target and chosen at run time (arch::cpu_isa()).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/core/parallel.hpp"
#include "qflash/kernels/causal_conv1d/op.hpp"
#include "qflash/kernels/causal_conv1d/ref.hpp"
#include "qflash/kernels/common/cpu_simd.hpp"
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

/// One output row segment: dst[c] = act(sum_j wt[j][c] * src[j][c]) (wt's rows `ld` floats
/// apart), all K taps in one pass so the sum stays in registers. K is a compile-time constant
/// (the model's d_conv is 4).
template <int K, bool kFma>
QFLASH_FORCEINLINE void conv_row_fixed(float const* const* src, float const* wt, std::int64_t ld, int nc,
                                       bool silu, float* dst) {
  float const* s[K];
  for (int j = 0; j < K; ++j) s[j] = src[j];
  if (silu) {
    for (int c = 0; c < nc; ++c) {
      float acc = wt[c] * s[0][c];
      for (int j = 1; j < K; ++j) acc = madd<kFma>(wt[j * ld + c], s[j][c], acc);
      dst[c] = gdn::silu_f32(acc);
    }
  } else {
    for (int c = 0; c < nc; ++c) {
      float acc = wt[c] * s[0][c];
      for (int j = 1; j < K; ++j) acc = madd<kFma>(wt[j * ld + c], s[j][c], acc);
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

/// Channels [c_begin, c_end) of a weight w [c][k] and, unless st is null, a state st [c][k-1]
/// as tap-major rows `ld` floats apart: wt [k], hist [k-1].
QFLASH_FORCEINLINE void transpose_taps(float const* w, float const* st, int k, int c_begin, int c_end, float* wt,
                                       float* hist, std::int64_t ld) {
  for (int c = c_begin; c < c_end; ++c)
    for (int j = 0; j < k; ++j) wt[j * ld + c] = w[c * k + j];
  if (st)
    for (int c = c_begin; c < c_end; ++c)
      for (int i = 0; i < k - 1; ++i) hist[i * ld + c] = st[c * (k - 1) + i];
}

/// y for tokens [t0, t0 + nt) and channels [c0, c0 + nc). Reads the state, does not write it.
template <bool kFma>
QFLASH_FORCEINLINE void conv_item(CausalConv1dArgs const& a, std::int64_t t0, std::int64_t nt,
                                  std::int64_t c0, int nc, float* scratch) {
  int const k = a.d_conv;
  std::int64_t const n_ch = a.n_channels;
  float* const wt = scratch;                           // [K][kConvChannels]    weight, tap-major
  float* const hist = wt + k * kConvChannels;          // [K-1][kConvChannels]  state, oldest first
  float* const acc = hist + (k - 1) * kConvChannels;   // [kConvChannels]
  transpose_taps(a.weight + c0 * k, t0 < k - 1 ? a.state + c0 * (k - 1) : nullptr, k, 0, nc, wt, hist, kConvChannels);

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
      case 1: conv_row_fixed<1, kFma>(src, wt, kConvChannels, nc, a.apply_silu, dst); break;
      case 2: conv_row_fixed<2, kFma>(src, wt, kConvChannels, nc, a.apply_silu, dst); break;
      case 3: conv_row_fixed<3, kFma>(src, wt, kConvChannels, nc, a.apply_silu, dst); break;
      case 4: conv_row_fixed<4, kFma>(src, wt, kConvChannels, nc, a.apply_silu, dst); break;
      case 5: conv_row_fixed<5, kFma>(src, wt, kConvChannels, nc, a.apply_silu, dst); break;
      case 6: conv_row_fixed<6, kFma>(src, wt, kConvChannels, nc, a.apply_silu, dst); break;
      case 7: conv_row_fixed<7, kFma>(src, wt, kConvChannels, nc, a.apply_silu, dst); break;
      case 8: conv_row_fixed<8, kFma>(src, wt, kConvChannels, nc, a.apply_silu, dst); break;
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

/// Channels one conv_token pass transposes onto the stack.
inline constexpr int kTokenChannels = 64;

#if QFLASH_HAS_X86_SIMD
/// d_conv 4 on AVX2, 8 channels at a time: the weight [8][4] and state [8][3] are transposed
/// to tap-major rows by shuffles, and the new state is interleaved back. In a state vector
/// of 8 channels, channel c's entry i is float 3c + i of 24: lane (3c + i) % 8 of vector
/// (3c + i) / 8. As 3 is odd, the 8 channels of one entry land in 8 different lanes, so one
/// entry is two blends (which vector each lane comes from) and a permute (which lane each
/// channel comes from); writing back is the inverse.
namespace k4 {
/// The channel whose entry i is in lane `lane` of its state vector.
constexpr int channel_in_lane(int i, int lane) {
  for (int c = 0; c < 8; ++c)
    if ((3 * c + i) % 8 == lane) return c;
  return -1;
}
/// Lanes of state vector v that hold entry i (of some channel).
constexpr int entry_lanes(int i, int v) {
  int mask = 0;
  for (int lane = 0; lane < 8; ++lane)
    if ((3 * channel_in_lane(i, lane) + i) / 8 == v) mask |= 1 << lane;
  return mask;
}
/// Lanes of state vector v that hold entry i when the vectors are written.
constexpr int written_lanes(int v, int i) {
  int mask = 0;
  for (int lane = 0; lane < 8; ++lane)
    if ((8 * v + lane) % 3 == i) mask |= 1 << lane;
  return mask;
}

/// Entry i of 8 channels, from their state vectors v0..v2.
template <int I>
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m256 state_entry(__m256 v0, __m256 v1, __m256 v2) {
  constexpr int kFrom1 = entry_lanes(I, 1), kFrom2 = entry_lanes(I, 2);  // immediates, also at -O0
  __m256 const m = _mm256_blend_ps(_mm256_blend_ps(v0, v1, kFrom1), v2, kFrom2);
  __m256i const lane_of_channel = _mm256_setr_epi32((3 * 0 + I) % 8, (3 * 1 + I) % 8, (3 * 2 + I) % 8,
                                                    (3 * 3 + I) % 8, (3 * 4 + I) % 8, (3 * 5 + I) % 8,
                                                    (3 * 6 + I) % 8, (3 * 7 + I) % 8);
  return _mm256_permutevar8x32_ps(m, lane_of_channel);
}

/// Entry i of 8 channels moved to the lanes it takes in the written state vectors.
template <int I>
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m256 to_state_lanes(__m256 e) {
  return _mm256_permutevar8x32_ps(
      e, _mm256_setr_epi32(channel_in_lane(I, 0), channel_in_lane(I, 1), channel_in_lane(I, 2),
                           channel_in_lane(I, 3), channel_in_lane(I, 4), channel_in_lane(I, 5),
                           channel_in_lane(I, 6), channel_in_lane(I, 7)));
}

/// State vector V from entries 0..2 already in their lanes.
template <int V>
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m256 state_vector(__m256 e0, __m256 e1, __m256 e2) {
  constexpr int kFrom1 = written_lanes(V, 1), kFrom2 = written_lanes(V, 2);
  return _mm256_blend_ps(_mm256_blend_ps(e0, e1, kFrom1), e2, kFrom2);
}
}  // namespace k4

/// Tap-major rows (`ld` floats apart) of n8 blocks of 8 channels: wt [4] from w [c][4], and
/// hist [3] from st [c][3].
QFLASH_TARGET_AVX2 inline void transpose_taps_k4_avx2(float const* w, float const* st, int n8, float* wt,
                                                      float* hist, std::int64_t ld) {
  QFLASH_SIMD_BEGIN
  // After the unpacks a tap's lanes hold channels 0 2 4 6 1 3 5 7; this puts them in order.
  __m256i const in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int b = 0; b < n8; ++b, w += 32, st += 24) {
    __m256 const r0 = _mm256_loadu_ps(w), r1 = _mm256_loadu_ps(w + 8);
    __m256 const r2 = _mm256_loadu_ps(w + 16), r3 = _mm256_loadu_ps(w + 24);
    __m256d const t0 = _mm256_castps_pd(_mm256_unpacklo_ps(r0, r1));  // taps 0 1 of channels 0 2 | 1 3
    __m256d const t1 = _mm256_castps_pd(_mm256_unpackhi_ps(r0, r1));  // taps 2 3
    __m256d const t2 = _mm256_castps_pd(_mm256_unpacklo_ps(r2, r3));  // taps 0 1 of channels 4 6 | 5 7
    __m256d const t3 = _mm256_castps_pd(_mm256_unpackhi_ps(r2, r3));
    __m256 const tap[4] = {_mm256_castpd_ps(_mm256_unpacklo_pd(t0, t2)), _mm256_castpd_ps(_mm256_unpackhi_pd(t0, t2)),
                           _mm256_castpd_ps(_mm256_unpacklo_pd(t1, t3)), _mm256_castpd_ps(_mm256_unpackhi_pd(t1, t3))};
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(wt + j * ld + 8 * b, _mm256_permutevar8x32_ps(tap[j], in_order));

    __m256 const v0 = _mm256_loadu_ps(st), v1 = _mm256_loadu_ps(st + 8), v2 = _mm256_loadu_ps(st + 16);
    _mm256_storeu_ps(hist + 8 * b, k4::state_entry<0>(v0, v1, v2));
    _mm256_storeu_ps(hist + ld + 8 * b, k4::state_entry<1>(v0, v1, v2));
    _mm256_storeu_ps(hist + 2 * ld + 8 * b, k4::state_entry<2>(v0, v1, v2));
  }
  QFLASH_SIMD_END
}

/// st [c][3] of n8 blocks of 8 channels from the entries' rows e0, e1, e2.
QFLASH_TARGET_AVX2 inline void interleave_state_k4_avx2(float const* e0, float const* e1, float const* e2, int n8,
                                                        float* st) {
  QFLASH_SIMD_BEGIN
  for (int b = 0; b < n8; ++b, st += 24) {
    __m256 const p0 = k4::to_state_lanes<0>(_mm256_loadu_ps(e0 + 8 * b));
    __m256 const p1 = k4::to_state_lanes<1>(_mm256_loadu_ps(e1 + 8 * b));
    __m256 const p2 = k4::to_state_lanes<2>(_mm256_loadu_ps(e2 + 8 * b));
    _mm256_storeu_ps(st, k4::state_vector<0>(p0, p1, p2));
    _mm256_storeu_ps(st + 8, k4::state_vector<1>(p0, p1, p2));
    _mm256_storeu_ps(st + 16, k4::state_vector<2>(p0, p1, p2));
  }
  QFLASH_SIMD_END
}
#endif

/// One token, channels [c0, c0 + nc): y, then these channels' state moves on by the token.
/// kTokenChannels at a time, the weight and state are transposed to tap-major rows on the
/// stack and conv_row_fixed runs over them, so each channel's products and sums are the
/// multi-token path's, in its order. kAvx2: the instance may use AVX2 shuffles.
template <int K, bool kFma, bool kAvx2>
QFLASH_FORCEINLINE void conv_token_fixed(CausalConv1dArgs const& a, std::int64_t c0, int nc) {
  constexpr int kLd = kTokenChannels;
  constexpr int kHist = K > 1 ? K - 1 : 1;
  alignas(32) float wt[K * kLd];
  alignas(32) float hist[kHist * kLd];
  for (int b = 0; b < nc; b += kLd) {
    int const n = std::min(kLd, nc - b);
    std::int64_t const c = c0 + b;
    float const* const w = a.weight + c * K;
    float* const st = K > 1 ? a.state + c * (K - 1) : nullptr;
    float const* const x = a.x + c;
    int shuffled = 0;  // channels transposed by shuffles
#if QFLASH_HAS_X86_SIMD
    if constexpr (kAvx2 && K == 4) {
      shuffled = n / 8 * 8;
      transpose_taps_k4_avx2(w, st, n / 8, wt, hist, kLd);
    }
#endif
    transpose_taps(w, st, K, shuffled, n, wt, hist, kLd);
    float const* src[K];
    for (int i = 0; i < K - 1; ++i) src[i] = hist + i * kLd;
    src[K - 1] = x;
    conv_row_fixed<K, kFma>(src, wt, kLd, n, a.apply_silu, a.y + c);

    if constexpr (K > 1) {  // the new state: entries 1..K-2 of the old one, then x
      shuffled = 0;
#if QFLASH_HAS_X86_SIMD
      if constexpr (kAvx2 && K == 4) {
        shuffled = n / 8 * 8;
        interleave_state_k4_avx2(hist + kLd, hist + 2 * kLd, x, n / 8, st);
      }
#endif
      for (int ch = shuffled; ch < n; ++ch) {
        for (int i = 0; i < K - 2; ++i) st[ch * (K - 1) + i] = hist[(i + 1) * kLd + ch];
        st[ch * (K - 1) + K - 2] = x[ch];
      }
    }
  }
}

/// One token, channels [c0, c0 + nc): y and these channels' new state. d_conv above
/// kMaxFixedConv goes through the work item (scratch: scratch_floats(d_conv)).
template <bool kFma, bool kAvx2>
QFLASH_FORCEINLINE void conv_token(CausalConv1dArgs const& a, std::int64_t c0, int nc, float* scratch) {
  switch (a.d_conv) {
    case 1: return conv_token_fixed<1, kFma, kAvx2>(a, c0, nc);
    case 2: return conv_token_fixed<2, kFma, kAvx2>(a, c0, nc);
    case 3: return conv_token_fixed<3, kFma, kAvx2>(a, c0, nc);
    case 4: return conv_token_fixed<4, kFma, kAvx2>(a, c0, nc);
    case 5: return conv_token_fixed<5, kFma, kAvx2>(a, c0, nc);
    case 6: return conv_token_fixed<6, kFma, kAvx2>(a, c0, nc);
    case 7: return conv_token_fixed<7, kFma, kAvx2>(a, c0, nc);
    case 8: return conv_token_fixed<8, kFma, kAvx2>(a, c0, nc);
    default:
      conv_item<kFma>(a, 0, 1, c0, nc, scratch);
      update_state(a, c0, c0 + nc);
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq"))) inline void
conv_token_avx512(CausalConv1dArgs const& a, std::int64_t c0, int nc, float* scratch) {
  conv_token<true, true>(a, c0, nc, scratch);
}
__attribute__((target("avx2,fma,f16c"))) inline void conv_token_avx2(CausalConv1dArgs const& a, std::int64_t c0,
                                                                     int nc, float* scratch) {
  conv_token<true, true>(a, c0, nc, scratch);
}
#endif
inline void conv_token_baseline(CausalConv1dArgs const& a, std::int64_t c0, int nc, float* scratch) {
  conv_token<false, false>(a, c0, nc, scratch);
}

/// conv_token compiled for ISA level `isa`.
using ConvTokenFn = void (*)(CausalConv1dArgs const&, std::int64_t, int, float*);
inline ConvTokenFn conv_token_fn(arch::CpuIsa isa) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (isa >= arch::CpuIsa::kAvx512) return &conv_token_avx512;
  if (isa >= arch::CpuIsa::kAvx2) return &conv_token_avx2;
#endif
  (void)isa;
  return &conv_token_baseline;
}

}  // namespace causal_conv1d_detail

/// The whole conv with an explicit ISA level (tests run every level this CPU has).
inline Status causal_conv1d(arch::CpuIsa isa, CausalConv1dArgs const& a) {
  namespace d = causal_conv1d_detail;
  if (Status s = can_implement_causal_conv1d<MoeSpec{}>(a); s != Status::kSuccess) return s;
  d::ConvItemFn const item_fn = d::conv_item_fn(isa);
  d::ConvTokenFn const token_fn = d::conv_token_fn(isa);
  bool const one_token = a.n_tokens == 1;  // items write their own channels' state
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
      int const nc = static_cast<int>(std::min<std::int64_t>(d::kConvChannels, a.n_channels - c0));
      if (one_token)
        token_fn(a, c0, nc, scratch.data());
      else
        item_fn(a, t0, std::min(d::kConvTokens, a.n_tokens - t0), c0, nc, scratch.data());
    }
  });
  if (!one_token) d::update_state(a, 0, a.n_channels);
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
