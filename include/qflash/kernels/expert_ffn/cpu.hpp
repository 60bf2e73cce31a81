/// @file
/// CPU kernels/expert_ffn in two parallel regions per call, whatever the number of experts:
///  1. gate and up: work items are (expert, block of d_ff rows); each computes both
///     projections of the block for all the expert's tokens and applies SwiGLU to it
///     (fused_swiglu = false: one region for every gate block, one for every up block, one
///     for SwiGLU).
///  2. down and the weighted combine: work items are blocks of d_model output rows; each
///     runs every active expert's down rows of the block and adds them, weighted, into its
///     tokens' outputs (items own their output rows, so no two threads add into one value).
/// Every expert's weights are read once per call; activations read by quantized formats are
/// quantized once per call (tokens once, SwiGLU outputs once); with AMX, an expert's bf16 or
/// q8_0 projections of 8 tokens or more read its tokens packed once for the tiles (linear's
/// cpu_amx.hpp), in a short region before each of the two. The shared expert, when given,
/// is one more expert that every token uses. LoRA updates (token_lora) add B (A x) to each
/// block of gate/up rows and to each block of output rows, A x computed once per pair.
/// Scratch persists across calls (thread_local in the calling thread), so a decode step
/// allocates nothing once warm.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <numeric>
#include <vector>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/core/parallel.hpp"
#include "qflash/kernels/common/cpu_math.hpp"
#include "qflash/kernels/expert_ffn/op.hpp"
#include "qflash/kernels/linear/cpu.hpp"

namespace qflash::kernels::cpu {

#if QFLASH_HAS_X86_SIMD
QFLASH_SIMD_BEGIN
QFLASH_TARGET_AVX2 inline void swiglu_avx2(float* gate, float const* up, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(gate + i, _mm256_mul_ps(simd::avx2_silu(_mm256_loadu_ps(gate + i)), _mm256_loadu_ps(up + i)));
  for (; i < n; ++i) gate[i] = silu(gate[i]) * up[i];
}
QFLASH_SIMD_END
#endif

/// gate[i] = silu(gate[i]) * up[i].
inline void swiglu(arch::CpuIsa isa, float* gate, float const* up, std::int64_t n) {
#if QFLASH_HAS_X86_SIMD
  if (isa >= arch::CpuIsa::kAvx2) return swiglu_avx2(gate, up, n);
#endif
  (void)isa;
  for (std::int64_t i = 0; i < n; ++i) gate[i] = silu(gate[i]) * up[i];
}

/// What one call keeps between its steps; reused across calls.
struct ExpertScratch {
  struct Active {
    ExpertWeights const* w;
    std::int64_t begin;  ///< its first row in the pair order (tokens, weights, act rows)
    std::int64_t n;      ///< its tokens
    std::int32_t expert;  ///< its id; -1: the shared expert
  };
  std::vector<Active> active;
  std::vector<std::int64_t> count;
  std::vector<std::int32_t> tokens;  ///< [pairs] token of each pair, grouped by expert
  std::vector<float> weights;        ///< [pairs] its route weight
  std::vector<float> gate, up;       ///< [pairs, d_ff_max]; gate ends as the SwiGLU output
  std::vector<std::byte> xq[kActBlockKinds], act_q[kActBlockKinds];
  SlotScratch<float> rows;  ///< kernels/linear's per-slot scratch
  /// AMX: each active expert's tokens (x) and SwiGLU outputs (act) packed for tiles, at
  /// offsets [active]; -1: not packed (too few tokens, neither bf16 nor q8_0).
  std::vector<std::byte> amx_x, amx_act;
  std::vector<std::int64_t> amx_x_at, amx_act_at;
  /// LoRA: each pair's updates of gate, up and down (null: none), [pairs, 3], and A times the
  /// pair's input for each, lora_rank floats apiece, [pairs, 3, lora_rank].
  std::vector<LowRank const*> lora;
  std::vector<float> lora_u;
  std::int64_t lora_rank = 0;
};

/// y[o] += sum_j B[o, j] u[j] for rows [o0, o1) of an update's B.
inline void add_low_rank_rows(LowRank const& d, float const* u, std::int64_t o0, std::int64_t o1, float* y,
                              float scale = 1.0f) {
  auto const* b = static_cast<float const*>(d.b.data);
  std::int64_t const r = d.rank();
  for (std::int64_t o = o0; o < o1; ++o) {
    float acc = 0;
    for (std::int64_t j = 0; j < r; ++j) acc += b[o * r + j] * u[j];
    y[o] += scale * acc;
  }
}

/// u = A v for an update's A [r, n].
inline void low_rank_project(LowRank const& d, float const* v, float* u) {
  auto const* a = static_cast<float const*>(d.a.data);
  std::int64_t const n = d.a.cols;
  for (std::int64_t j = 0; j < d.rank(); ++j) {
    float acc = 0;
#pragma omp simd reduction(+ : acc)
    for (std::int64_t i = 0; i < n; ++i) acc += a[j * n + i] * v[i];
    u[j] = acc;
  }
}

/// Packs, for AMX tiles, what projection `which` (gate and up: 0; down: 2) of each active
/// expert reads, where it runs on them; rows_of(e, which) is the projection's LinearRows.
template <class RowsOf>
void amx_pack_experts(arch::CpuIsa isa, ExpertScratch& s, int which, RowsOf const& rows_of, std::vector<std::byte>& buf,
                      std::vector<std::int64_t>& at) {
  at.assign(s.active.size(), -1);
  std::int64_t size = 0;
  for (std::size_t i = 0; i < s.active.size(); ++i) {
    auto const& e = s.active[i];
    WeightView const& w = which == 2 ? e.w->down : e.w->gate;  // up runs on them when its format is gate's
    if (!amx_applies(isa, w.format, w.rows, w.cols, e.n)) continue;
    at[i] = size;
    size += amx_packed_bytes(w.format, e.n, w.cols);
  }
  if (size == 0) return;
  buf.resize(static_cast<std::size_t>(size));
  parallel_for(0, static_cast<std::int64_t>(s.active.size()), 16 * s.active[0].w->gate.cols, [&](std::int64_t i) {
    std::int64_t const offset = at[static_cast<std::size_t>(i)];
    if (offset < 0) return;
    LinearRows const p = rows_of(s.active[static_cast<std::size_t>(i)], which);
    for (std::int64_t j = 0; j < (p.n_tokens + kAmxTokens - 1) / kAmxTokens; ++j)
      amx_pack_tile(p, j, buf.data() + offset);
  });
}

/// Fills s.lora for the pairs whose token has an adapter; false when no pair has an update.
inline bool bind_expert_lora(ExpertFfnArgs const& a, ExpertScratch& s, std::int64_t total) {
  s.lora.assign(static_cast<std::size_t>(total * 3), nullptr);
  s.lora_rank = 0;
  for (auto const& e : s.active)
    for (std::int64_t p = e.begin; p < e.begin + e.n; ++p) {
      ExpertLora const* l = a.token_lora[s.tokens[static_cast<std::size_t>(p)]];
      if (!l) continue;
      auto const& d = e.expert < 0 ? std::array<LowRank const*, 3>{&l->shared_gate, &l->shared_up, &l->shared_down}
                                   : std::array<LowRank const*, 3>{
                                         l->gate.empty() ? nullptr : &l->gate[static_cast<std::size_t>(e.expert)],
                                         l->up.empty() ? nullptr : &l->up[static_cast<std::size_t>(e.expert)],
                                         l->down.empty() ? nullptr : &l->down[static_cast<std::size_t>(e.expert)]};
      for (int k = 0; k < 3; ++k)
        if (d[static_cast<std::size_t>(k)] && !d[static_cast<std::size_t>(k)]->empty()) {
          s.lora[static_cast<std::size_t>(p * 3 + k)] = d[static_cast<std::size_t>(k)];
          s.lora_rank = std::max(s.lora_rank, d[static_cast<std::size_t>(k)]->rank());
        }
    }
  if (s.lora_rank == 0) return false;
  s.lora_u.resize(static_cast<std::size_t>(total * 3 * s.lora_rank));
  return true;
}

/// The op for the weight formats F compiles (kAny: all); arguments already checked.
template <WeightFormat F>
Status expert_ffn(arch::CpuIsa isa, ExpertFfnArgs const& a) {
  thread_local ExpertScratch scratch;
  ExpertScratch& s = scratch;  // workers must reach the caller's scratch, not their own
  s.rows.prepare();
  std::int64_t const d_model = a.experts[0].gate.cols;
  std::int64_t const n_expert = static_cast<std::int64_t>(a.experts.size());
  std::int64_t const n_slots = a.n_tokens * a.n_expert_used;

  // Pairs grouped by expert in token order (a counting sort), the shared expert's last;
  // unused slots (kNoExpert) make none.
  s.count.assign(static_cast<std::size_t>(n_expert + 1), 0);
  for (std::int64_t p = 0; p < n_slots; ++p) {
    std::int32_t const e = a.routes[p];
    if (e == kNoExpert) continue;
    if (e < 0 || e >= n_expert) return Status::kErrorInvalidProblem;
    ++s.count[static_cast<std::size_t>(e) + 1];
  }
  std::int64_t const n_pairs = std::accumulate(s.count.begin(), s.count.end(), std::int64_t{0});
  std::int64_t const total = n_pairs + (a.shared ? a.n_tokens : 0);
  s.active.clear();
  for (std::int64_t e = 0; e < n_expert; ++e) {
    std::int64_t const n = s.count[static_cast<std::size_t>(e + 1)];
    if (n > 0)
      s.active.push_back({&a.experts[static_cast<std::size_t>(e)], s.count[static_cast<std::size_t>(e)], n,
                          static_cast<std::int32_t>(e)});
    s.count[static_cast<std::size_t>(e + 1)] += s.count[static_cast<std::size_t>(e)];
  }
  s.tokens.resize(static_cast<std::size_t>(total));
  s.weights.resize(static_cast<std::size_t>(total));
  for (std::int64_t p = 0; p < n_slots; ++p) {
    if (a.routes[p] == kNoExpert) continue;
    std::int64_t const slot = s.count[static_cast<std::size_t>(a.routes[p])]++;
    s.tokens[static_cast<std::size_t>(slot)] = static_cast<std::int32_t>(p / a.n_expert_used);
    s.weights[static_cast<std::size_t>(slot)] = a.route_weights[p];
  }
  if (a.shared) {
    s.active.push_back({a.shared, n_pairs, a.n_tokens, -1});
    for (std::int64_t t = 0; t < a.n_tokens; ++t) {
      s.tokens[static_cast<std::size_t>(n_pairs + t)] = static_cast<std::int32_t>(t);
      s.weights[static_cast<std::size_t>(n_pairs + t)] = a.shared_weights[t];
    }
  }

  if (!a.accumulate) std::fill_n(a.out, a.n_tokens * d_model, 0.0f);

  // The shared expert's d_ff may differ: scratch rows are d_ff_max wide.
  std::int64_t d_ff_max = 0;
  bool needs_xq[kActBlockKinds] = {};
  for (auto const& e : s.active) {
    d_ff_max = std::max(d_ff_max, e.w->gate.rows);
    needs_xq[static_cast<int>(act_blocks(e.w->gate.format))] = true;
    needs_xq[static_cast<int>(act_blocks(e.w->up.format))] = true;
  }
  s.gate.resize(static_cast<std::size_t>(total * d_ff_max));
  s.up.resize(s.gate.size());

  // Tokens quantized once per kind of activation block any projection reads.
  std::byte const* xq[kActBlockKinds] = {};
  for (int k = 1; k < kActBlockKinds; ++k) {
    if (!needs_xq[k]) continue;
    std::int64_t const stride = act_row_bytes(static_cast<ActBlocks>(k), d_model);
    s.xq[k].resize(static_cast<std::size_t>(a.n_tokens * stride));
    quantize_rows(static_cast<ActBlocks>(k), a.x, d_model, a.n_tokens, d_model, s.xq[k].data(), stride);
    xq[k] = s.xq[k].data();
  }

  // LoRA: A x of every pair's gate and up updates, once per call.
  bool const lora = a.token_lora && bind_expert_lora(a, s, total);
  auto lora_u = [&](std::int64_t pair, int k) { return s.lora_u.data() + (pair * 3 + k) * s.lora_rank; };
  if (lora)
    parallel_for(0, total, 2 * s.lora_rank * d_model, [&](std::int64_t p) {
      for (int k = 0; k < 2; ++k)
        if (LowRank const* d = s.lora[static_cast<std::size_t>(p * 3 + k)])
          low_rank_project(*d, a.x + s.tokens[static_cast<std::size_t>(p)] * d_model, lora_u(p, k));
    });

  // Expert e's projection `which` (gate: 0, up: 1, down: 2) over its tokens, as the row
  // kernels see it (down reads the SwiGLU outputs and their 8-bit blocks, set below).
  std::byte* act_q[kActBlockKinds] = {};
  std::int64_t act_q_stride[kActBlockKinds] = {};
  auto rows_of = [&](ExpertScratch::Active const& e, int which) {
    LinearRows p{};
    p.scratch = &s.rows;
    p.n_tokens = e.n;
    if (which == 2) {
      int const k = static_cast<int>(act_blocks(e.w->down.format));
      p.w = e.w->down;
      p.x = s.gate.data() + e.begin * d_ff_max;
      p.xs = d_ff_max;
      p.xq = act_q[k] ? act_q[k] + e.begin * act_q_stride[k] : nullptr;
      p.xq_stride = act_q_stride[k];
      p.y = a.out;
      p.ys = d_model;
      p.y_index = s.tokens.data() + e.begin;
      p.y_scale = s.weights.data() + e.begin;
    } else {
      p.w = which == 0 ? e.w->gate : e.w->up;
      ActBlocks const k = act_blocks(p.w.format);
      p.x = a.x;
      p.xs = d_model;
      p.x_index = s.tokens.data() + e.begin;
      p.xq = xq[static_cast<int>(k)];
      p.xq_stride = act_row_bytes(k, d_model);
      p.y = (which == 0 ? s.gate.data() : s.up.data()) + e.begin * d_ff_max;
      p.ys = d_ff_max;
    }
    std::int64_t const i = &e - s.active.data();
    std::vector<std::int64_t> const& at = which == 2 ? s.amx_act_at : s.amx_x_at;
    if (i < static_cast<std::int64_t>(at.size()) && at[static_cast<std::size_t>(i)] >= 0)
      p.amx = {(which == 2 ? s.amx_act : s.amx_x).data() + at[static_cast<std::size_t>(i)], p.w.cols / kAmxCols,
               which == 2 ? e.w->down.format : e.w->gate.format};
    return p;
  };

  // AMX: the tokens packed once per expert for gate and up.
  s.amx_act_at.clear();
  s.amx_x_at.clear();
  amx_pack_experts(isa, s, 0, rows_of, s.amx_x, s.amx_x_at);
  // Row blocks of whole AMX passes, or of whole 16-row q8_0 / q4_k panels.
  std::int64_t const rows_multiple = isa >= arch::CpuIsa::kAmx          ? 2 * kAmxRows
                                     : isa >= arch::CpuIsa::kAvx512Vnni ? kPanelRows
                                                                         : kTileRows;

  // 1. gate, up, SwiGLU: items (expert, row block).
  int const threads = max_threads();
  std::int64_t const block = row_block(d_ff_max, threads, rows_multiple);
  std::int64_t const blocks_per_expert = (d_ff_max + block - 1) / block;
  std::int64_t const n_items = static_cast<std::int64_t>(s.active.size()) * blocks_per_expert;
  std::int64_t const item_work = 2 * block * d_model * std::max<std::int64_t>(1, total / std::max<std::int64_t>(1, static_cast<std::int64_t>(s.active.size())));
  // An item's rows [o0, o1) of its expert's `which` projection (gate: 0, up: 1) into `y`.
  auto project_rows = [&](std::int64_t item, int which, std::int64_t& o0, std::int64_t& o1) -> ExpertScratch::Active const* {
    auto const& e = s.active[static_cast<std::size_t>(item / blocks_per_expert)];
    o0 = item % blocks_per_expert * block;
    o1 = std::min(e.w->gate.rows, o0 + block);
    if (o0 >= o1) return nullptr;
    LinearRows const p = rows_of(e, which);
    linear_rows<F>(isa, p, o0, o1);
    if (lora)
      for (std::int64_t q = e.begin; q < e.begin + e.n; ++q)
        if (LowRank const* d = s.lora[static_cast<std::size_t>(q * 3 + which)])
          add_low_rank_rows(*d, lora_u(q, which), o0, o1, p.y + (q - e.begin) * d_ff_max);
    return &e;
  };
  auto swiglu_rows = [&](ExpertScratch::Active const& e, std::int64_t o0, std::int64_t o1) {
    for (std::int64_t r = 0; r < e.n; ++r) {
      std::int64_t const row = (e.begin + r) * d_ff_max;
      swiglu(isa, s.gate.data() + row + o0, s.up.data() + row + o0, o1 - o0);
    }
  };
  if (a.fused_swiglu) {
    parallel_for(0, n_items, item_work, [&](std::int64_t item) {
      std::int64_t o0 = 0, o1 = 0;
      if (auto const* e = project_rows(item, 0, o0, o1)) {
        project_rows(item, 1, o0, o1);
        swiglu_rows(*e, o0, o1);
      }
    });
  } else {  // three passes: every gate block, every up block, then SwiGLU over whole rows
    for (int which : {0, 1})
      parallel_for(0, n_items, item_work / 2, [&](std::int64_t item) {
        std::int64_t o0 = 0, o1 = 0;
        project_rows(item, which, o0, o1);
      });
    parallel_for(0, static_cast<std::int64_t>(s.active.size()), d_ff_max * std::max<std::int64_t>(1, total),
                 [&](std::int64_t i) {
                   auto const& e = s.active[static_cast<std::size_t>(i)];
                   swiglu_rows(e, 0, e.w->gate.rows);
                 });
  }

  // LoRA: A act of every pair's down update, on the unrounded SwiGLU output.
  if (lora)
    parallel_for(0, total, s.lora_rank * d_ff_max, [&](std::int64_t p) {
      if (LowRank const* d = s.lora[static_cast<std::size_t>(p * 3 + 2)])
        low_rank_project(*d, s.gate.data() + p * d_ff_max, lora_u(p, 2));
    });

  // SwiGLU outputs quantized once for the down projections that read blocks.
  bool needs_act_q[kActBlockKinds] = {};
  for (auto const& e : s.active) needs_act_q[static_cast<int>(act_blocks(e.w->down.format))] = true;
  for (int k = 1; k < kActBlockKinds; ++k) {
    if (!needs_act_q[k]) continue;
    act_q_stride[k] = act_row_bytes(static_cast<ActBlocks>(k), d_ff_max);
    s.act_q[k].resize(static_cast<std::size_t>(total * act_q_stride[k]));
    act_q[k] = s.act_q[k].data();
  }
  if (std::any_of(needs_act_q + 1, needs_act_q + kActBlockKinds, [](bool b) { return b; })) {
    parallel_for(0, static_cast<std::int64_t>(s.active.size()), d_ff_max * 4 * std::max<std::int64_t>(1, total / static_cast<std::int64_t>(s.active.size())), [&](std::int64_t i) {
      auto const& e = s.active[static_cast<std::size_t>(i)];
      int const k = static_cast<int>(act_blocks(e.w->down.format));
      if (k == 0) return;
      for (std::int64_t r = e.begin; r < e.begin + e.n; ++r)
        quantize_activations(static_cast<ActBlocks>(k), s.gate.data() + r * d_ff_max, e.w->down.cols,
                             act_q[k] + r * act_q_stride[k]);
    });
  }

  amx_pack_experts(isa, s, 2, rows_of, s.amx_act, s.amx_act_at);

  // 2. down + weighted combine: items are output row blocks, each over every active expert.
  std::int64_t const out_block = row_block(d_model, threads, rows_multiple);
  std::int64_t const out_items = (d_model + out_block - 1) / out_block;
  parallel_for(0, out_items, out_block * d_ff_max * std::max<std::int64_t>(1, total), [&](std::int64_t item) {
    std::int64_t const o0 = item * out_block;
    std::int64_t const o1 = std::min(d_model, o0 + out_block);
    for (auto const& e : s.active) {
      LinearRows const p = rows_of(e, 2);
      linear_rows<F>(isa, p, o0, o1);
      if (lora)
        for (std::int64_t q = e.begin; q < e.begin + e.n; ++q)
          if (LowRank const* d = s.lora[static_cast<std::size_t>(q * 3 + 2)])
            add_low_rank_rows(*d, lora_u(q, 2), o0, o1, a.out + s.tokens[static_cast<std::size_t>(q)] * d_model,
                              s.weights[static_cast<std::size_t>(q)]);
    }
  });
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
