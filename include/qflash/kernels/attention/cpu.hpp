/// @file
/// CPU kernels/attention over paged, compressed KV. A work item is one token and one KV
/// head's group of query heads (up to kGroupPass of them per pass): each run of up to
/// kTileKeys keys inside one block is decoded once to an fp32 tile in L1 (f32 heads are
/// read in place) and shared by the group's heads. Softmax runs over steps of kKeyBlock
/// keys with a running max and sum per head (the output rescaled when the max grows), then
/// a weighted sum of value rows, and the optional sigmoid output gate. Nothing is
/// allocated. The AVX2 path decodes 8 values per instruction group (bf16 shift, fp8 via
/// F16C, int8/int6 fused scale and min), scores four keys per pass over q and uses the
/// vector exp (common/cpu_math.hpp); the scalar path is the plain loop over kv_decode.
/// Both decode to the same bits.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/core/parallel.hpp"
#include "qflash/kernels/attention/op.hpp"
#include "qflash/kernels/common/cpu_math.hpp"
#include "qflash/kernels/common/cpu_simd.hpp"
#include "qflash/kv/map.hpp"

namespace qflash::kernels::cpu {

/// Keys per softmax step.
inline constexpr int kKeyBlock = 256;
/// Keys decoded into one tile.
inline constexpr int kTileKeys = 16;
/// Query heads that share one decoded tile per pass.
inline constexpr int kGroupPass = 8;
/// The widest head the tile holds.
inline constexpr int kMaxHeadDim = 512;

/// One work item: query heads [0, n_q) of one KV head's group, for one token.
struct AttentionGroup {
  kv::KvView const* kv;
  int kv_head;
  std::int64_t n_keys;  ///< positions [0, n_keys) are visible
  int d;
  float scale;
  int n_q;
  float const* q;  // head j at q + j * d
  float const* gate;  // head j at gate + j * gate_stride, or null
  std::int64_t gate_stride;
  float* out;  // head j at out + j * d
};

/// The group's running softmax: scores of one step, max and sum per head; the outputs start at 0.
struct OnlineSoftmax {
  float p[kGroupPass][kKeyBlock];
  float mx[kGroupPass];
  float sum[kGroupPass];
  explicit OnlineSoftmax(AttentionGroup const& g) {
    for (int j = 0; j < g.n_q; ++j) {
      std::fill(g.out + j * g.d, g.out + (j + 1) * g.d, 0.0f);
      mx[j] = -INFINITY;
      sum[j] = 0;
    }
  }
};

/// Keys [s, s + n) that one tile takes: up to the end of s's block, of the range, and kTileKeys.
inline int tile_keys(kv::KvView const& kv, std::int64_t s, std::int64_t end) {
  return static_cast<int>(std::min<std::int64_t>({end - s, kv.block_tokens - s % kv.block_tokens, kTileKeys}));
}

/// n stored vectors of `bytes` each from `src`, as fp32 rows of d: in place for aligned
/// f32, else decoded into `tile`.
inline float const* tile_scalar(KvFormat f, std::uint8_t const* src, std::int32_t bytes, int n, int d, float* tile) {
  if (f == KvFormat::kF32 && reinterpret_cast<std::uintptr_t>(src) % alignof(float) == 0)
    return reinterpret_cast<float const*>(src);
  for (int r = 0; r < n; ++r) kv_decode(f, src + r * bytes, d, tile + r * d);
  return tile;
}

template <KvScheme Scheme>
void attention_group_scalar(AttentionGroup const& g) {
  kv::KvView const& kv = *g.kv;
  kv::KvHeadLayout const& hl = kv.heads[g.kv_head];
  KvFormat const kf = kv::compiled_format(Scheme, hl.k_format), vf = kv::compiled_format(Scheme, hl.v_format);
  int const d = g.d;
  float tile[kTileKeys * kMaxHeadDim];
  OnlineSoftmax st(g);
  auto& p = st.p;
  auto& mx = st.mx;
  auto& sum = st.sum;
  for (std::int64_t s0 = 0; s0 < g.n_keys; s0 += kKeyBlock) {
    std::int64_t const s1 = std::min<std::int64_t>(s0 + kKeyBlock, g.n_keys);
    for (std::int64_t s = s0; s < s1;) {
      int const n = tile_keys(kv, s, s1);
      float const* k = tile_scalar(kf, kv.key(s, g.kv_head), hl.k_bytes, n, d, tile);
      for (int j = 0; j < g.n_q; ++j)
        for (int r = 0; r < n; ++r) {
          float dot = 0;
          for (int i = 0; i < d; ++i) dot += g.q[j * d + i] * k[r * d + i];
          p[j][s - s0 + r] = dot * g.scale;
        }
      s += n;
    }
    int const nb = static_cast<int>(s1 - s0);
    for (int j = 0; j < g.n_q; ++j) {
      float const new_max = std::max(mx[j], *std::max_element(p[j], p[j] + nb));
      float const rescale = std::exp(mx[j] - new_max);  // 0 for the first step
      sum[j] *= rescale;
      for (int i = 0; i < d; ++i) g.out[j * d + i] *= rescale;
      for (int t = 0; t < nb; ++t) sum[j] += (p[j][t] = std::exp(p[j][t] - new_max));
      mx[j] = new_max;
    }
    for (std::int64_t s = s0; s < s1;) {
      int const n = tile_keys(kv, s, s1);
      float const* v = tile_scalar(vf, kv.value(s, g.kv_head), hl.v_bytes, n, d, tile);
      for (int j = 0; j < g.n_q; ++j)
        for (int r = 0; r < n; ++r)
          for (int i = 0; i < d; ++i) g.out[j * d + i] += p[j][s - s0 + r] * v[r * d + i];
      s += n;
    }
  }
  for (int j = 0; j < g.n_q; ++j) {
    float const inv = 1.0f / sum[j];
    float* o = g.out + j * d;
    for (int i = 0; i < d; ++i) o[i] *= g.gate ? inv * sigmoid(g.gate[j * g.gate_stride + i]) : inv;
  }
}

#if QFLASH_HAS_X86_SIMD
QFLASH_SIMD_BEGIN

/// 8 int6 codes (6 bytes at p; reads 8) as int32 lanes: each half of the vector takes one
/// 3-byte word into all four lanes, which then shift it by 0, 6, 12, 18.
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE __m256i avx2_int6x8(std::uint8_t const* p) {
  __m256i const bytes = _mm256_broadcastsi128_si256(_mm_loadl_epi64(reinterpret_cast<__m128i const*>(p)));
  __m256i const words = _mm256_shuffle_epi8(
      bytes, _mm256_setr_epi8(0, 1, 2, -1, 0, 1, 2, -1, 0, 1, 2, -1, 0, 1, 2, -1, 3, 4, 5, -1, 3, 4, 5, -1, 3, 4, 5, -1,
                              3, 4, 5, -1));
  return _mm256_and_si256(_mm256_srlv_epi32(words, _mm256_setr_epi32(0, 6, 12, 18, 0, 6, 12, 18)), _mm256_set1_epi32(63));
}

/// One stored vector of d values (d % 8 == 0) to fp32, equal bit for bit to kv_decode.
QFLASH_TARGET_AVX2 inline void decode_avx2(KvFormat f, std::uint8_t const* src, int d, float* y) {
  switch (f) {
    case KvFormat::kF32: std::memcpy(y, src, static_cast<std::size_t>(d) * sizeof(float)); return;
    case KvFormat::kBf16:
      for (int i = 0; i < d; i += 8) {
        __m256i const h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<__m128i const*>(src + 2 * i)));
        _mm256_storeu_ps(y + i, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
      }
      return;
    case KvFormat::kFp8E4m3: {
      __m256 const scale256 = _mm256_set1_ps(256.0f * detail::get_f32(src));
      for (int i = 0; i < d; i += 8) _mm256_storeu_ps(y + i, simd::avx2_fp8x8(src + 4 + i, scale256));
      return;
    }
    case KvFormat::kInt8:
    case KvFormat::kInt6:
      for (int g = 0; g * kKvGroup < d; ++g) {
        int const n = std::min(kKvGroup, d - g * kKvGroup);
        __m256 const scale = _mm256_set1_ps(to_float(Fp16{detail::get_u16(src + 4 * g)}));
        __m256 const min = _mm256_set1_ps(to_float(Fp16{detail::get_u16(src + 4 * g + 2)}));
        std::uint8_t const* codes = src + kv_group_codes_offset(f, d, g);
        float* yg = y + g * kKvGroup;
        for (int i = 0; i < n; i += 8) {
          __m256i const q = f == KvFormat::kInt8
                                ? _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<__m128i const*>(codes + i)))
                                : avx2_int6x8(codes + i / 8 * 6);
          _mm256_storeu_ps(yg + i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), scale, min));
        }
      }
      return;
  }
}

QFLASH_TARGET_AVX2 inline float const* tile_avx2(KvFormat f, std::uint8_t const* src, std::int32_t bytes, int n, int d,
                                                 float* tile) {
  if (f == KvFormat::kF32) return reinterpret_cast<float const*>(src);  // read with unaligned loads
  for (int r = 0; r < n; ++r) decode_avx2(f, src + r * bytes, d, tile + r * d);
  return tile;
}

/// Scores of K rows (stride d) against q, times scale, into p: K independent chains.
template <int K>
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE void score_block_avx2(float const* q, float const* k, int d, float scale, float* p) {
  __m256 acc[K];
  for (int r = 0; r < K; ++r) acc[r] = _mm256_setzero_ps();
  for (int i = 0; i < d; i += 8) {
    __m256 const qi = _mm256_loadu_ps(q + i);
    for (int r = 0; r < K; ++r) acc[r] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k + r * d + i), acc[r]);
  }
  if constexpr (K == 8)
    _mm256_storeu_ps(p, _mm256_mul_ps(simd::avx2_reduce_add8(acc), _mm256_set1_ps(scale)));
  else
    for (int r = 0; r < K; ++r) p[r] = simd::avx2_reduce_add(acc[r]) * scale;
}

/// Scores of n rows (stride d) against q, times scale, into p.
QFLASH_TARGET_AVX2 inline void score_rows_avx2(float const* q, float const* k, int n, int d, float scale, float* p) {
  int r = 0;
  for (; r + 8 <= n; r += 8) score_block_avx2<8>(q, k + r * d, d, scale, p + r);
  for (; r + 4 <= n; r += 4) score_block_avx2<4>(q, k + r * d, d, scale, p + r);
  for (; r < n; ++r) score_block_avx2<1>(q, k + r * d, d, scale, p + r);
}

/// out[0, 8C) += sum_r w[r] * v[r] over n rows (stride d): C column vectors, each over two
/// chains (even and odd rows), so 2C multiply-adds are in flight.
template <int C>
QFLASH_TARGET_AVX2 QFLASH_SIMD_INLINE void accumulate_columns_avx2(float const* w, float const* v, int n, int d, float* out) {
  __m256 even[C], odd[C];
  for (int c = 0; c < C; ++c) {
    even[c] = _mm256_loadu_ps(out + 8 * c);
    odd[c] = _mm256_setzero_ps();
  }
  int r = 0;
  for (; r + 2 <= n; r += 2) {
    __m256 const w0 = _mm256_set1_ps(w[r]), w1 = _mm256_set1_ps(w[r + 1]);
    for (int c = 0; c < C; ++c) {
      even[c] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(v + r * d + 8 * c), even[c]);
      odd[c] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(v + (r + 1) * d + 8 * c), odd[c]);
    }
  }
  if (r < n)
    for (int c = 0; c < C; ++c) even[c] = _mm256_fmadd_ps(_mm256_set1_ps(w[r]), _mm256_loadu_ps(v + r * d + 8 * c), even[c]);
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + 8 * c, _mm256_add_ps(even[c], odd[c]));
}

/// out += sum_r w[r] * v[r] over n rows (stride d).
QFLASH_TARGET_AVX2 inline void accumulate_rows_avx2(float const* w, float const* v, int n, int d, float* out) {
  int i = 0;
  for (; i + 32 <= d; i += 32) accumulate_columns_avx2<4>(w, v + i, n, d, out + i);
  for (; i < d; i += 8) accumulate_columns_avx2<1>(w, v + i, n, d, out + i);
}

/// p[0, n) = exp(p - max) in place; returns their sum.
QFLASH_TARGET_AVX2 inline float exp_sum_avx2(float* p, int n, float max) {
  __m256 const vmx = _mm256_set1_ps(max);
  __m256 vsum = _mm256_setzero_ps();
  int t = 0;
  for (; t + 8 <= n; t += 8) {
    __m256 const e = simd::avx2_exp(_mm256_sub_ps(_mm256_loadu_ps(p + t), vmx));
    _mm256_storeu_ps(p + t, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = simd::avx2_reduce_add(vsum);
  for (; t < n; ++t) sum += (p[t] = std::exp(p[t] - max));
  return sum;
}

/// Needs d % 8 == 0.
template <KvScheme Scheme>
QFLASH_TARGET_AVX2 void attention_group_avx2(AttentionGroup const& g) {
  kv::KvView const& kv = *g.kv;
  kv::KvHeadLayout const& hl = kv.heads[g.kv_head];
  KvFormat const kf = kv::compiled_format(Scheme, hl.k_format), vf = kv::compiled_format(Scheme, hl.v_format);
  int const d = g.d;
  alignas(32) float tile[kTileKeys * kMaxHeadDim];
  OnlineSoftmax st(g);
  auto& p = st.p;
  auto& mx = st.mx;
  auto& sum = st.sum;
  for (std::int64_t s0 = 0; s0 < g.n_keys; s0 += kKeyBlock) {
    std::int64_t const s1 = std::min<std::int64_t>(s0 + kKeyBlock, g.n_keys);
    for (std::int64_t s = s0; s < s1;) {
      int const n = tile_keys(kv, s, s1);
      float const* k = tile_avx2(kf, kv.key(s, g.kv_head), hl.k_bytes, n, d, tile);
      // The next tile of stored vectors comes while this one is computed on.
      if (s + n < g.n_keys) simd::prefetch_bytes(kv.key(s + n, g.kv_head), std::int64_t{tile_keys(kv, s + n, g.n_keys)} * hl.k_bytes);
      for (int j = 0; j < g.n_q; ++j) score_rows_avx2(g.q + j * d, k, n, d, g.scale, p[j] + (s - s0));
      s += n;
    }
    int const nb = static_cast<int>(s1 - s0);
    for (int j = 0; j < g.n_q; ++j) {
      float const new_max = std::max(mx[j], *std::max_element(p[j], p[j] + nb));
      float const rescale = std::exp(mx[j] - new_max);  // 0 for the first step
      sum[j] = sum[j] * rescale + exp_sum_avx2(p[j], nb, new_max);
      __m256 const r = _mm256_set1_ps(rescale);
      for (int i = 0; i < d; i += 8) _mm256_storeu_ps(g.out + j * d + i, _mm256_mul_ps(_mm256_loadu_ps(g.out + j * d + i), r));
      mx[j] = new_max;
    }
    for (std::int64_t s = s0; s < s1;) {
      int const n = tile_keys(kv, s, s1);
      float const* v = tile_avx2(vf, kv.value(s, g.kv_head), hl.v_bytes, n, d, tile);
      if (s + n < g.n_keys) simd::prefetch_bytes(kv.value(s + n, g.kv_head), std::int64_t{tile_keys(kv, s + n, g.n_keys)} * hl.v_bytes);
      for (int j = 0; j < g.n_q; ++j) accumulate_rows_avx2(p[j] + (s - s0), v, n, d, g.out + j * d);
      s += n;
    }
  }
  for (int j = 0; j < g.n_q; ++j) {
    __m256 const inv = _mm256_set1_ps(1.0f / sum[j]);
    float* o = g.out + j * d;
    for (int i = 0; i < d; i += 8) {
      __m256 x = _mm256_mul_ps(_mm256_loadu_ps(o + i), inv);
      if (g.gate) x = _mm256_mul_ps(x, simd::avx2_sigmoid(_mm256_loadu_ps(g.gate + j * g.gate_stride + i)));
      _mm256_storeu_ps(o + i, x);
    }
  }
}

QFLASH_SIMD_END
#endif

/// Work item (token t, pass `pass` over KV head kvh's query heads) of the op with heads of d.
template <KvScheme Scheme>
void attention_item([[maybe_unused]] arch::CpuIsa isa, AttentionArgs const& a, int d, std::int64_t t, int kvh,
                    int pass) {
  int const group = a.n_head / a.n_head_kv;
  int const h0 = kvh * group + pass * kGroupPass;
  std::int64_t const gate_hs = a.gate_head_stride_or_default();
  AttentionGroup g{};
  g.kv = &a.kv;
  g.kv_head = kvh;
  g.n_keys = a.n_ctx - a.n_tokens + t + 1;
  g.d = d;
  g.scale = a.scale;
  g.n_q = std::min(kGroupPass, (kvh + 1) * group - h0);
  g.q = a.q + (t * a.n_head + h0) * d;
  g.gate = a.gate ? a.gate + t * a.gate_token_stride + h0 * gate_hs : nullptr;
  g.gate_stride = gate_hs;
  g.out = a.out + (t * a.n_head + h0) * d;
#if QFLASH_HAS_X86_SIMD
  if (isa >= arch::CpuIsa::kAvx2 && d % 8 == 0) return attention_group_avx2<Scheme>(g);
#endif
  attention_group_scalar<Scheme>(g);
}

/// Passes of up to kGroupPass query heads over one KV head's group.
inline int group_passes(AttentionArgs const& a) {
  int const group = a.n_head / a.n_head_kv;
  return (group + kGroupPass - 1) / kGroupPass;
}

/// The op for head width D (kDynamic: any) and KV scheme Scheme: the spec fields its loops
/// depend on.
template <int D, KvScheme Scheme = KvScheme::kAny>
Status attention(arch::CpuIsa isa, AttentionArgs const& a) {
  int const d = dim<D>(a.d_head);
  if (d > kMaxHeadDim) return Status::kErrorNotSupported;
  int const group = a.n_head / a.n_head_kv;
  int const passes = group_passes(a);
  std::int64_t const per_token = std::int64_t{a.n_head_kv} * passes;
  parallel_for(0, a.n_tokens * per_token, 2 * a.n_ctx * d * std::min(group, kGroupPass), [&](std::int64_t item) {
    // A causal row costs as many keys as it sees: rows go t = 0, n-1, 1, n-2, ..., so every
    // contiguous chunk of items (one per thread) holds about the same work.
    std::int64_t const fold = item / per_token;
    std::int64_t const t = fold % 2 == 0 ? fold / 2 : a.n_tokens - 1 - fold / 2;
    attention_item<Scheme>(isa, a, d, t, static_cast<int>(item % per_token / passes), static_cast<int>(item % passes));
  });
  return Status::kSuccess;
}

}  // namespace qflash::kernels::cpu

namespace qflash::kernels {

template <MoeSpec S>
Status launch_attention(arch::Cpu, AttentionArgs const& a, stream_t) {
  if (Status s = can_implement_attention<S>(a); s != Status::kSuccess) return s;
  return cpu::attention<S.d_head, S.kv>(arch::cpu_isa(), a);
}

}  // namespace qflash::kernels
