/// @file
/// CPU kernels/attention: one (token, head) pair per work item, fp32 scores, max-subtracted
/// softmax, a weighted sum of value rows, and the optional sigmoid output gate. The AVX2
/// path scores four keys per pass over q and uses the vector exp (common/cpu_math.hpp);
/// the scalar path is the plain loop.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/core/parallel.hpp"
#include "qflash/kernels/attention/op.hpp"
#include "qflash/kernels/common/cpu_math.hpp"

namespace qflash::kernels::cpu {

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
  float* p;               // [n_keys] scratch
};

inline void attention_item_scalar(AttentionItem const& it) {
  float mx = -INFINITY;
  for (std::int64_t s = 0; s < it.n_keys; ++s) {
    float const* k = it.k + s * it.kv_stride;
    float dot = 0;
    for (int i = 0; i < it.d; ++i) dot += it.q[i] * k[i];
    it.p[s] = dot * it.scale;
    mx = std::max(mx, it.p[s]);
  }
  float sum = 0;
  for (std::int64_t s = 0; s < it.n_keys; ++s) sum += (it.p[s] = std::exp(it.p[s] - mx));
  float const inv = 1.0f / sum;
  std::fill(it.out, it.out + it.d, 0.0f);
  for (std::int64_t s = 0; s < it.n_keys; ++s) {
    float const w = it.p[s] * inv;
    float const* v = it.v + s * it.kv_stride;
    for (int i = 0; i < it.d; ++i) it.out[i] += w * v[i];
  }
  if (it.gate)
    for (int i = 0; i < it.d; ++i) it.out[i] *= sigmoid(it.gate[i]);
}

#if QFLASH_HAS_X86_SIMD
QFLASH_SIMD_BEGIN
/// Needs d % 8 == 0.
QFLASH_TARGET_AVX2 inline void attention_item_avx2(AttentionItem const& it) {
  int const d = it.d;
  std::int64_t s = 0;
  for (; s + 4 <= it.n_keys; s += 4) {
    float const* k = it.k + s * it.kv_stride;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int i = 0; i < d; i += 8) {
      __m256 const q = _mm256_loadu_ps(it.q + i);
      a0 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + i), a0);
      a1 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + it.kv_stride + i), a1);
      a2 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + 2 * it.kv_stride + i), a2);
      a3 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + 3 * it.kv_stride + i), a3);
    }
    it.p[s] = simd::avx2_reduce_add(a0) * it.scale;
    it.p[s + 1] = simd::avx2_reduce_add(a1) * it.scale;
    it.p[s + 2] = simd::avx2_reduce_add(a2) * it.scale;
    it.p[s + 3] = simd::avx2_reduce_add(a3) * it.scale;
  }
  for (; s < it.n_keys; ++s) {
    float const* k = it.k + s * it.kv_stride;
    __m256 a = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(it.q + i), _mm256_loadu_ps(k + i), a);
    it.p[s] = simd::avx2_reduce_add(a) * it.scale;
  }
  float mx = -INFINITY;
  for (std::int64_t j = 0; j < it.n_keys; ++j) mx = std::max(mx, it.p[j]);
  __m256 const vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  std::int64_t j = 0;
  for (; j + 8 <= it.n_keys; j += 8) {
    __m256 const e = simd::avx2_exp(_mm256_sub_ps(_mm256_loadu_ps(it.p + j), vmx));
    _mm256_storeu_ps(it.p + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = simd::avx2_reduce_add(vsum);
  for (; j < it.n_keys; ++j) sum += (it.p[j] = std::exp(it.p[j] - mx));
  float const inv = 1.0f / sum;
  for (int i = 0; i < d; i += 8) {
    __m256 o0 = _mm256_setzero_ps(), o1 = o0;
    std::int64_t t = 0;
    for (; t + 2 <= it.n_keys; t += 2) {
      o0 = _mm256_fmadd_ps(_mm256_set1_ps(it.p[t]), _mm256_loadu_ps(it.v + t * it.kv_stride + i), o0);
      o1 = _mm256_fmadd_ps(_mm256_set1_ps(it.p[t + 1]), _mm256_loadu_ps(it.v + (t + 1) * it.kv_stride + i), o1);
    }
    if (t < it.n_keys) o0 = _mm256_fmadd_ps(_mm256_set1_ps(it.p[t]), _mm256_loadu_ps(it.v + t * it.kv_stride + i), o0);
    __m256 o = _mm256_mul_ps(_mm256_add_ps(o0, o1), _mm256_set1_ps(inv));
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
    thread_local std::vector<float> p;
    std::int64_t const t = item / a.n_head;
    int const h = static_cast<int>(item % a.n_head);
    int const kv = h / group;
    AttentionItem it{};
    it.n_keys = a.n_ctx - a.n_tokens + t + 1;
    p.resize(static_cast<std::size_t>(it.n_keys));
    it.q = a.q + item * d;
    it.k = a.k + kv * d;
    it.v = a.v + kv * d;
    it.kv_stride = std::int64_t{a.n_head_kv} * d;
    it.d = d;
    it.scale = a.scale;
    it.gate = a.gate ? a.gate + t * a.gate_token_stride + h * gate_hs : nullptr;
    it.out = a.out + item * d;
    it.p = p.data();
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
