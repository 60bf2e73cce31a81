/// @file
/// CPU kernels/router_topk: fp32 softmax and a partial selection per token, threaded over
/// tokens. The softmax is plain arithmetic (gated_delta/common.hpp's exp, within a few ulp of
/// std::exp), one body compiled under AVX-512, AVX2 and the baseline target and chosen at run
/// time, so its loops vectorise.
#pragma once

#include <algorithm>
#include <cmath>
#include <numeric>
#include <span>
#include <vector>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/core/parallel.hpp"
#include "qflash/kernels/gated_delta/common.hpp"
#include "qflash/kernels/linear/cpu.hpp"
#include "qflash/kernels/router_topk/op.hpp"

namespace qflash::kernels::cpu {

namespace router_topk_detail {

/// p[0, n) = softmax(l[0, n)): the max and the sum of e^(l - max) each over 16 partial
/// results (so that they vectorise without reassociating), then p scaled by 1 / sum. Logits
/// more than 87 below the max all get e^-87 (gdn::kExpFloor): about 1e-38, where the reference
/// has 0 or a subnormal.
QFLASH_FORCEINLINE void softmax(float const* l, int n, float* p) {
  constexpr int kLanes = 16;
  float part[kLanes];
  for (int j = 0; j < kLanes; ++j) part[j] = -INFINITY;
  int e = 0;
  for (; e + kLanes <= n; e += kLanes)
    for (int j = 0; j < kLanes; ++j) part[j] = l[e + j] > part[j] ? l[e + j] : part[j];
  for (int j = 0; e < n; ++e, ++j) part[j] = l[e] > part[j] ? l[e] : part[j];
  float mx = part[0];
  for (float x : part) mx = x > mx ? x : mx;
  for (int i = 0; i < n; ++i) p[i] = gdn::exp_nonpositive_f32(l[i] - mx);
  for (float& x : part) x = 0.0f;
  for (e = 0; e + kLanes <= n; e += kLanes)
    for (int j = 0; j < kLanes; ++j) part[j] += p[e + j];
  for (int j = 0; e < n; ++e, ++j) part[j] += p[e];
  float sum = 0;
  for (float x : part) sum += x;
  float const inv = 1.0f / sum;
  for (int i = 0; i < n; ++i) p[i] *= inv;
}

using SoftmaxFn = void (*)(float const*, int, float*);
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq"))) inline void softmax_avx512(
    float const* l, int n, float* p) {
  softmax(l, n, p);
}
__attribute__((target("avx2,fma,f16c"))) inline void softmax_avx2(float const* l, int n, float* p) { softmax(l, n, p); }
#endif
inline void softmax_baseline(float const* l, int n, float* p) { softmax(l, n, p); }

inline SoftmaxFn softmax_fn([[maybe_unused]] arch::CpuIsa isa) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (isa >= arch::CpuIsa::kAvx512) return softmax_avx512;
  if (isa >= arch::CpuIsa::kAvx2) return softmax_avx2;
#endif
  return softmax_baseline;
}

}  // namespace router_topk_detail

/// The op for E experts, top-K (kDynamic: any) on ISA level `isa`: the spec fields its loops
/// depend on.
template <int E, int K>
Status router_topk(arch::CpuIsa isa, RouterTopkArgs const& a) {
  router_topk_detail::SoftmaxFn const softmax = router_topk_detail::softmax_fn(isa);
  int const n_expert = dim<E>(a.n_expert);
  int const k = a.n_expert_used == K ? K : a.n_expert_used;
  // Per-slot scratch owned by the calling thread (core/parallel.hpp), kept across calls.
  thread_local SlotScratch<float> probs;
  thread_local SlotScratch<int> orders;
  probs.prepare();
  orders.prepare();
  auto& probs_of = probs;
  auto& orders_of = orders;
  parallel_for(0, a.n_tokens, 4 * n_expert, [&](std::int64_t t) {
    std::span<float> const p(probs_of.get(static_cast<std::size_t>(n_expert)), static_cast<std::size_t>(n_expert));
    std::span<int> const order(orders_of.get(static_cast<std::size_t>(n_expert)), static_cast<std::size_t>(n_expert));
    float const* l = a.logits + t * (a.logits_stride ? a.logits_stride : n_expert);
    if (a.shared_weights) a.shared_weights[t] = 1.0f / (1.0f + std::exp(-l[n_expert]));
    softmax(l, n_expert, p.data());
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int x, int y) {
      float const px = p[static_cast<std::size_t>(x)], py = p[static_cast<std::size_t>(y)];
      return px > py || (px == py && x < y);
    });
    float* w = a.weights + t * k;  // the sorted probabilities first, for the policy
    for (int j = 0; j < k; ++j) w[j] = p[static_cast<std::size_t>(order[static_cast<std::size_t>(j)])];
    int const used = (a.token_policies ? a.token_policies[t] : a.policy).count(w, k);
    float top = 0;
    for (int j = 0; j < used; ++j) top += w[j];
    float const scale = a.renormalize ? 1.0f / top : 1.0f;
    for (int j = 0; j < k; ++j) {
      a.experts[t * k + j] = j < used ? order[static_cast<std::size_t>(j)] : kNoExpert;
      w[j] = j < used ? w[j] * scale : 0.0f;
    }
  });
  return Status::kSuccess;
}

}  // namespace qflash::kernels::cpu

namespace qflash::kernels {

template <MoeSpec S>
Status launch_router_topk(arch::Cpu, RouterTopkArgs const& a, stream_t) {
  if (Status s = can_implement_router_topk<S>(a); s != Status::kSuccess) return s;
  if (a.gemv)
    if (Status s = launch_linear<S>(arch::Cpu{}, gemv_of(a)); s != Status::kSuccess) return s;
  return cpu::router_topk<S.n_expert, S.n_expert_used>(arch::cpu_isa(), routing_of(a));
}

}  // namespace qflash::kernels
