/// @file
/// CPU kernels/attention: one (token, head) pair per work item, fp32 scores, softmax over
/// blocks of kKeyBlock keys with a running max and sum (the output rescaled when the max
/// grows), a weighted sum of value rows, and the optional sigmoid output gate. Scores live
/// in a stack block, so no context length needs scratch memory. The AVX2 path scores four
/// keys per pass over q and uses the vector exp (common/cpu_math.hpp); the scalar path is
/// the plain loop.
#pragma once

#include <algorithm>
#include <cmath>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/core/parallel.hpp"
#include "qflash/kernels/attention/op.hpp"
#include "qflash/kernels/common/cpu_math.hpp"

namespace qflash::kernels::cpu {

/// Keys scored per block.
inline constexpr int kKeyBlock = 256;

/// One (token, head) item's pointers and sizes.
struct AttentionItem {
  float const* q;         // [d]
  float const* k;         // key s at k + s * kv_stride
  float const* v;         // value s at v + s * kv_stride
  std::int64_t kv_stride;
  std::int64_t n_keys;
  int d;
  float scale;
  float const* gate;      // [d] or null
  float* out;             // [d]
};

inline void attention_item_scalar(AttentionItem const& it) {
  float p[kKeyBlock];
  float mx = -INFINITY, sum = 0;
  std::fill(it.out, it.out + it.d, 0.0f);
  for (std::int64_t s0 = 0; s0 < it.n_keys; s0 += kKeyBlock) {
    int const nb = static_cast<int>(std::min<std::int64_t>(kKeyBlock, it.n_keys - s0));
    float block_max = -INFINITY;
    for (int j = 0; j < nb; ++j) {
      float const* k = it.k + (s0 + j) * it.kv_stride;
      float dot = 0;
      for (int i = 0; i < it.d; ++i) dot += it.q[i] * k[i];
      p[j] = dot * it.scale;
      block_max = std::max(block_max, p[j]);
    }
    float const new_max = std::max(mx, block_max);
    float const rescale = std::exp(mx - new_max);  // 0 for the first block
    sum *= rescale;
    for (int i = 0; i < it.d; ++i) it.out[i] *= rescale;
    for (int j = 0; j < nb; ++j) {
      float const w = std::exp(p[j] - new_max);
      sum += w;
      float const* v = it.v + (s0 + j) * it.kv_stride;
      for (int i = 0; i < it.d; ++i) it.out[i] += w * v[i];
    }
    mx = new_max;
  }
  float const inv = 1.0f / sum;
  for (int i = 0; i < it.d; ++i) it.out[i] *= it.gate ? inv * sigmoid(it.gate[i]) : inv;
}

#if QFLASH_HAS_X86_SIMD
QFLASH_SIMD_BEGIN
/// Needs d % 8 == 0.
QFLASH_TARGET_AVX2 inline void attention_item_avx2(AttentionItem const& it) {
  int const d = it.d;
  float p[kKeyBlock];
  float mx = -INFINITY, sum = 0;
  std::fill(it.out, it.out + d, 0.0f);
  for (std::int64_t s0 = 0; s0 < it.n_keys; s0 += kKeyBlock) {
    int const nb = static_cast<int>(std::min<std::int64_t>(kKeyBlock, it.n_keys - s0));
    float const* k0 = it.k + s0 * it.kv_stride;
    int j = 0;
    for (; j + 4 <= nb; j += 4) {
      float const* k = k0 + j * it.kv_stride;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int i = 0; i < d; i += 8) {
        __m256 const q = _mm256_loadu_ps(it.q + i);
        a0 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + i), a0);
        a1 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + it.kv_stride + i), a1);
        a2 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + 2 * it.kv_stride + i), a2);
        a3 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + 3 * it.kv_stride + i), a3);
      }
      p[j] = simd::avx2_reduce_add(a0) * it.scale;
      p[j + 1] = simd::avx2_reduce_add(a1) * it.scale;
      p[j + 2] = simd::avx2_reduce_add(a2) * it.scale;
      p[j + 3] = simd::avx2_reduce_add(a3) * it.scale;
    }
    for (; j < nb; ++j) {
      float const* k = k0 + j * it.kv_stride;
      __m256 a = _mm256_setzero_ps();
      for (int i = 0; i < d; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(it.q + i), _mm256_loadu_ps(k + i), a);
      p[j] = simd::avx2_reduce_add(a) * it.scale;
    }
    float block_max = -INFINITY;
    for (j = 0; j < nb; ++j) block_max = std::max(block_max, p[j]);
    float const new_max = std::max(mx, block_max);
    __m256 const vmx = _mm256_set1_ps(new_max);
    __m256 vsum = _mm256_setzero_ps();
    for (j = 0; j + 8 <= nb; j += 8) {
      __m256 const e = simd::avx2_exp(_mm256_sub_ps(_mm256_loadu_ps(p + j), vmx));
      _mm256_storeu_ps(p + j, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    float block_sum = simd::avx2_reduce_add(vsum);
    for (; j < nb; ++j) block_sum += (p[j] = std::exp(p[j] - new_max));
    float const rescale = std::exp(mx - new_max);  // 0 for the first block
    sum = sum * rescale + block_sum;
    float const* v0 = it.v + s0 * it.kv_stride;
    for (int i = 0; i < d; i += 8) {
      __m256 o0 = _mm256_mul_ps(_mm256_loadu_ps(it.out + i), _mm256_set1_ps(rescale)), o1 = _mm256_setzero_ps();
      int t = 0;
      for (; t + 2 <= nb; t += 2) {
        o0 = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), _mm256_loadu_ps(v0 + t * it.kv_stride + i), o0);
        o1 = _mm256_fmadd_ps(_mm256_set1_ps(p[t + 1]), _mm256_loadu_ps(v0 + (t + 1) * it.kv_stride + i), o1);
      }
      if (t < nb) o0 = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), _mm256_loadu_ps(v0 + t * it.kv_stride + i), o0);
      _mm256_storeu_ps(it.out + i, _mm256_add_ps(o0, o1));
    }
    mx = new_max;
  }
  __m256 const inv = _mm256_set1_ps(1.0f / sum);
  for (int i = 0; i < d; i += 8) {
    __m256 o = _mm256_mul_ps(_mm256_loadu_ps(it.out + i), inv);
    if (it.gate) o = _mm256_mul_ps(o, simd::avx2_sigmoid(_mm256_loadu_ps(it.gate + i)));
    _mm256_storeu_ps(it.out + i, o);
  }
}
QFLASH_SIMD_END
#endif

/// The op for head width D (kDynamic: any): the one spec field its loops depend on.
template <int D>
Status attention(arch::CpuIsa isa, AttentionArgs const& a) {
  int const d = dim<D>(a.d_head);
  std::int64_t const gate_hs = a.gate_head_stride ? a.gate_head_stride : d;
  int const group = a.n_head / a.n_head_kv;
  std::int64_t const n_items = a.n_tokens * a.n_head;
  parallel_for(0, n_items, 2 * a.n_ctx * d, [&](std::int64_t item) {
    // A causal row costs as many keys as it sees: rows go t = 0, n-1, 1, n-2, ..., so every
    // contiguous chunk of items (one per thread) holds about the same work.
    std::int64_t const fold = item / a.n_head;
    std::int64_t const t = fold % 2 == 0 ? fold / 2 : a.n_tokens - 1 - fold / 2;
    int const h = static_cast<int>(item % a.n_head);
    std::int64_t const row = t * a.n_head + h;
    int const kv = h / group;
    AttentionItem it{};
    it.n_keys = a.n_ctx - a.n_tokens + t + 1;
    it.q = a.q + row * d;
    it.k = a.k + kv * d;
    it.v = a.v + kv * d;
    it.kv_stride = std::int64_t{a.n_head_kv} * d;
    it.d = d;
    it.scale = a.scale;
    it.gate = a.gate ? a.gate + t * a.gate_token_stride + h * gate_hs : nullptr;
    it.out = a.out + row * d;
#if QFLASH_HAS_X86_SIMD
    if (isa >= arch::CpuIsa::kAvx2 && d % 8 == 0) return attention_item_avx2(it);
#endif
    attention_item_scalar(it);
  });
  return Status::kSuccess;
}

}  // namespace qflash::kernels::cpu

namespace qflash::kernels {

template <MoeSpec S>
Status launch_attention(arch::Cpu, AttentionArgs const& a, stream_t) {
  if (Status s = can_implement_attention<S>(a); s != Status::kSuccess) return s;
  return cpu::attention<S.d_head>(arch::cpu_isa(), a);
}

}  // namespace qflash::kernels
