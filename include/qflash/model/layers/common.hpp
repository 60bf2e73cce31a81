/// @file
/// What every layer call shares: the ragged batch (each sequence's new tokens, their
/// positions and caches), the per-call scratch buffers, and the one way a failed launch is
/// reported. Layers include kernels' op.hpp only; the launchers come from the generated
/// instances.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "qflash/core/config.hpp"
#include "qflash/core/error.hpp"
#include "qflash/core/memory.hpp"
#include "qflash/core/status.hpp"
#include "qflash/kernels/linear/op.hpp"
#include "qflash/kernels/linear_group/op.hpp"
#include "qflash/model/cache.hpp"
#include "qflash/model/lora.hpp"
#include "qflash/model/routing.hpp"

namespace qflash::model {

/// One sequence's new tokens in a batch, and its caches (owned by the runtime).
struct SequenceChunk {
  std::span<std::int32_t const> tokens;
  SequenceState* state = nullptr;
  Routing const* routing = nullptr;  ///< this sequence's experts per token (null: the model's)
  /// This sequence's LoRA adapter (null: the model's, if any); checked once by Model::check_lora.
  LoraAdapter const* adapter = nullptr;
};

/// Rows [begin, end) of a batch whose sequences use one adapter.
struct AdapterRun {
  std::int64_t begin = 0, end = 0;
  LoraAdapter const* adapter = nullptr;
};

/// A ragged batch laid out as rows: sequence i owns rows [begin[i], begin[i + 1]). The model
/// builds the arrays on the host; kernels read them through `on_device`: the same arrays for a
/// CPU model, copies in the model's device memory for a CUDA one.
struct Batch {
  std::span<SequenceChunk const> seqs;
  std::vector<std::int64_t> begin;      // [n_seqs + 1]
  std::vector<std::int64_t> positions;  // [n_tokens]
  std::vector<std::int32_t> tokens;     // [n_tokens]
  int route_slots = 0;                   ///< route slots per token (the most experts any token may use)
  kernels::RoutingPolicy policy;         ///< every token's, unless token_policies is set
  std::vector<kernels::RoutingPolicy> token_policies;  ///< [n_tokens] when sequences route differently
  std::vector<LoraAdapter const*> seq_adapter;  ///< [n_seqs] each sequence's adapter (null: none)
  std::vector<AdapterRun> adapter_runs;          ///< the rows with an adapter, in runs of one adapter

  /// Where kernels read positions, tokens and token_policies (null: no per-token policies).
  struct KernelArrays {
    std::int64_t const* positions = nullptr;
    std::int32_t const* tokens = nullptr;
    kernels::RoutingPolicy const* token_policies = nullptr;
  } on_device;

  [[nodiscard]] std::int64_t n_tokens() const { return static_cast<std::int64_t>(tokens.size()); }
  [[nodiscard]] std::int64_t rows_of(std::size_t i) const { return begin[i + 1] - begin[i]; }
};

/// Per-call scratch, reused across calls and layers, in the model's Memory (but for the LoRA
/// expert tables, which only CPU models read, and the host arrays of decoding sequences).
struct Scratch {
  Memory* memory = host_memory().get();
  MemoryVector<float> proj, q, k, v, o, conv, z, beta, g, router, shared_gate;
  MemoryVector<std::int32_t> routes;
  MemoryVector<float> route_weights;
  MemoryVector<float> lora;  ///< A x of a low-rank update
  /// A device model's routing of every MoE layer in a step, for the route observer after it.
  MemoryVector<float> step_router, step_route_weights;
  MemoryVector<std::int32_t> step_routes;
  std::vector<kernels::ExpertLora> expert_lora;
  std::vector<kernels::ExpertLora const*> token_lora;
  /// A layer's sequences decoding one token: their rows, and their states (Gated DeltaNet,
  /// kernels/gdn_decode) or block tables and lengths (attention, kernels/attention_decode);
  /// the kernels take these arrays on the host.
  std::vector<std::int64_t> decode_rows;
  std::vector<float*> decode_conv_state, decode_state;
  std::vector<std::int32_t const*> decode_tables;
  std::vector<std::int64_t> decode_n_blocks, decode_n_ctx;

  /// Puts every buffer in `m` (emptied).
  void place_in(Memory* m) {
    memory = m;
    MemoryAllocator<float> const a(m);
    for (auto* f : {&proj, &q, &k, &v, &o, &conv, &z, &beta, &g, &router, &shared_gate, &route_weights, &lora,
                    &step_router, &step_route_weights})
      *f = MemoryVector<float>(a);
    routes = MemoryVector<std::int32_t>(MemoryAllocator<std::int32_t>(m));
    step_routes = MemoryVector<std::int32_t>(MemoryAllocator<std::int32_t>(m));
  }

  /// v's data with room for n elements. Buffers only grow, and the queued kernels are waited
  /// for first (growing writes and may move the buffer on the host): the host never touches a
  /// device's memory while a kernel runs.
  template <class T>
  T* sized(MemoryVector<T>& v, std::int64_t n) const {
    std::size_t const want = static_cast<std::size_t>(n);
    if (want > v.size()) {
      memory->synchronize(nullptr);
      v.resize(want);
    }
    return v.data();
  }
};

/// Throws Error naming the op when a launcher refused its arguments: a shape the model
/// handed a kernel that the compiled instance cannot run is a bug or an unsupported model.
inline void check_launch(Status s, char const* op) { QFLASH_CHECK_STATUS(s, op); }

/// y = x Wᵀ (y += x Wᵀ when accumulate) for `rows` token rows: every projection of the layers.
/// @param x  [rows, w.cols]
/// @param y  [rows, w.rows]
template <MoeSpec S, class Arch>
void project(WeightView const& w, float const* x, std::int64_t rows, float* y, stream_t stream,
             char const* what = "linear", bool accumulate = false) {
  kernels::LinearArgs a{};
  a.w = w;
  a.x = x;
  a.y = y;
  a.n_tokens = rows;
  a.accumulate = accumulate;
  check_launch(kernels::launch_linear<S>(Arch{}, a, stream), what);
}

/// Which update of which layer a projection takes from the batch's adapters.
struct LoraSite {
  std::size_t layer;
  LowRank LoraLayer::*update;
};

/// For the rows of each sequence with an adapter that updates this projection,
/// y += B (A x) (two more projections through the same kernels, so any Arch runs them).
/// @param x [rows, w.cols]; @param y [rows, w.rows]
template <MoeSpec S, class Arch>
void add_lora(WeightView const& w, Batch const& b, LoraSite site, float const* x, float* y, Scratch& s,
              stream_t stream) {
  for (AdapterRun const& run : b.adapter_runs) {
    LowRank const& d = run.adapter->layers[site.layer].*site.update;
    if (d.empty()) continue;
    std::int64_t const n = run.end - run.begin;
    float* t = s.sized(s.lora, n * d.rank());
    project<S, Arch>(d.a, x + run.begin * w.cols, n, t, stream, "lora A");
    project<S, Arch>(d.b, t, n, y + run.begin * w.rows, stream, "lora B", /*accumulate=*/true);
  }
}

/// project(), plus the batch's adapters' updates of it (add_lora).
template <MoeSpec S, class Arch>
void project(WeightView const& w, Batch const& b, LoraSite site, float const* x, float* y, Scratch& s,
             stream_t stream, char const* what = "linear", bool accumulate = false) {
  project<S, Arch>(w, x, b.n_tokens(), y, stream, what, accumulate);
  add_lora<S, Arch>(w, b, site, x, y, s, stream);
}

/// One of several projections of the same input (project_group).
struct ProjectionOut {
  WeightView const* w;
  LoraSite site;
  float* y;  ///< [rows, w->rows]
};

/// y_i = x W_iᵀ for every part in one call (kernels/linear_group: on CPU one parallel region,
/// the activations quantized or packed once), plus each part's adapter updates.
/// @param x [b.n_tokens(), cols of every part]
template <MoeSpec S, class Arch>
void project_group(std::span<ProjectionOut const> parts, Batch const& b, float const* x, Scratch& s,
                   stream_t stream, char const* what) {
  kernels::LinearGroupArgs g{};
  QFLASH_CHECK(parts.size() <= static_cast<std::size_t>(kernels::LinearGroupArgs::kMaxParts), what, ": ",
               parts.size(), " projections in one group (at most ", kernels::LinearGroupArgs::kMaxParts, ")");
  g.n_parts = static_cast<int>(parts.size());
  for (std::size_t i = 0; i < parts.size(); ++i) g.parts[i] = {*parts[i].w, x, parts[i].y, b.n_tokens()};
  check_launch(kernels::launch_linear_group<S>(Arch{}, g, stream), what);
  for (ProjectionOut const& p : parts) add_lora<S, Arch>(*p.w, b, p.site, x, p.y, s, stream);
}

}  // namespace qflash::model
