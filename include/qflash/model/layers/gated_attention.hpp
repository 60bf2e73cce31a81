/// @file
/// The full-attention mixer of both families: q/k/v projections, per-head q/k RMSNorm fused
/// with partial RoPE (queries and keys in one call), K/V appended to the sequence's cache,
/// causal GQA attention with the optional sigmoid output gate fused in (qwen3_5_moe: q_proj
/// yields [query | gate] per head), and the output projection. K/V go to the sequence's paged cache in its heads' formats
/// (kv_append) and attention reads them there; the sequences decoding one token (those in one
/// KV pool) do both in one attention_decode call.
#pragma once

#include <cmath>
#include <cstdint>

#include "qflash/kernels/attention/op.hpp"
#include "qflash/kernels/attention_decode/op.hpp"
#include "qflash/kernels/kv_append/op.hpp"
#include "qflash/kernels/qk_norm_rope/op.hpp"
#include "qflash/model/config.hpp"
#include "qflash/model/layers/common.hpp"
#include "qflash/model/weights.hpp"

namespace qflash::model {

template <MoeSpec S, class Arch>
class GatedAttention {
 public:
  GatedAttention(ModelConfig const& cfg, AttentionWeights const& w, std::size_t layer,
                 kernels::NormWeight norm_kind)
      : cfg_(cfg), w_(w), layer_(layer), norm_kind_(norm_kind) {}

  /// out = Attention(x) for the batch's rows; appends each sequence's K/V to its cache.
  /// @param x    [n_tokens, d_model] normed input
  /// @param out  [n_tokens, d_model]; added to when accumulate
  void forward(Batch const& batch, float const* x, float* out, Scratch& s, stream_t stream,
               bool accumulate = false) const {
    int const nh = dim<S.n_head>(cfg_.n_head), nkv = dim<S.n_head_kv>(cfg_.n_head_kv);
    int const dh = dim<S.d_head>(cfg_.d_head);
    std::int64_t const T = batch.n_tokens();
    std::int64_t const q_width = std::int64_t{nh} * dh, kv_width = std::int64_t{nkv} * dh;
    bool const gated = cfg_.attn_output_gate;
    int const q_head_stride = gated ? 2 * dh : dh;  // per head [query | gate] when gated

    float* qg = s.sized(s.proj, T * w_.q.rows);
    float* q = s.sized(s.q, T * q_width);
    float* k = s.sized(s.k, T * kv_width);
    float* v = s.sized(s.v, T * kv_width);
    float* o = s.sized(s.o, T * q_width);
    ProjectionOut const qkv[] = {{&w_.q, {layer_, &LoraLayer::q}, qg},
                                 {&w_.k, {layer_, &LoraLayer::k}, k},
                                 {&w_.v, {layer_, &LoraLayer::v}, v}};
    project_group<S, Arch>(qkv, batch, x, s, stream, "q_proj, k_proj, v_proj");
    kernels::QkNormRopeArgs nr{};  // the queries out of [query | gate], the keys in place, in one call
    nr.x = qg;
    nr.token_stride = w_.q.rows;
    nr.head_stride = q_head_stride;
    nr.weight = w_.q_norm.data();
    nr.y = q;
    nr.n_head = nh;
    nr.keys = {k, kv_width, dh, w_.k_norm.data(), k, nkv};
    nr.positions = batch.on_device.positions;
    nr.n_tokens = T;
    nr.d_head = dh;
    nr.rotary_dim = cfg_.rotary_dim;
    nr.theta = cfg_.rope_theta;
    nr.eps = cfg_.rms_norm_eps;
    nr.weight_kind = norm_kind_;
    check_launch(kernels::launch_qk_norm_rope<S>(Arch{}, nr, stream), "qk_norm_rope");

    float const scale = 1.0f / std::sqrt(static_cast<float>(dh));
    // Sequences decoding one token go through attention_decode together (those in the first
    // one's KV pool: one arena); prompt chunks one by one.
    s.decode_rows.clear();
    s.decode_tables.clear();
    s.decode_n_blocks.clear();
    s.decode_n_ctx.clear();
    kv::KvView decode_kv{};
    for (std::size_t i = 0; i < batch.seqs.size(); ++i) {
      std::int64_t const b = batch.begin[i], n = batch.rows_of(i);
      SequenceState const& state = *batch.seqs[i].state;
      kv::KvView const view = state.kv(layer_);
      if (n == 1 && s.decode_rows.empty()) decode_kv = view;
      if (n == 1 && view.base == decode_kv.base) {
        s.decode_rows.push_back(b);
        s.decode_tables.push_back(view.block_table);
        s.decode_n_blocks.push_back(view.n_blocks);
        s.decode_n_ctx.push_back(state.n_past() + 1);
        continue;
      }
      kernels::KvAppendArgs ap{};
      ap.kv = view;
      ap.k = k + b * kv_width;
      ap.v = v + b * kv_width;
      ap.n_tokens = n;
      ap.start = state.n_past();
      check_launch(kernels::launch_kv_append<S>(Arch{}, ap, stream), "kv_append");
      kernels::AttentionArgs a{};
      a.q = q + b * q_width;
      a.kv = view;
      a.out = o + b * q_width;
      a.n_tokens = n;
      a.n_ctx = state.n_past() + n;
      a.n_head = nh;
      a.n_head_kv = nkv;
      a.d_head = dh;
      a.scale = scale;
      if (gated) {
        a.gate = qg + b * w_.q.rows + dh;
        a.gate_token_stride = w_.q.rows;
        a.gate_head_stride = q_head_stride;
      }
      check_launch(kernels::launch_attention<S>(Arch{}, a, stream), "attention");
    }
    if (!s.decode_rows.empty()) {
      kernels::AttentionDecodeArgs d{};
      d.q = q;
      d.k = k;
      d.v = v;
      d.out = o;
      if (gated) {
        d.gate = qg + dh;
        d.gate_token_stride = w_.q.rows;
        d.gate_head_stride = q_head_stride;
      }
      d.kv = decode_kv;
      d.rows = s.decode_rows.data();
      d.block_tables = s.decode_tables.data();
      d.n_blocks = s.decode_n_blocks.data();
      d.n_ctx = s.decode_n_ctx.data();
      d.n_seqs = static_cast<int>(s.decode_rows.size());
      d.n_head = nh;
      d.n_head_kv = nkv;
      d.d_head = dh;
      d.scale = scale;
      check_launch(kernels::launch_attention_decode<S>(Arch{}, d, stream), "attention_decode");
    }
    project<S, Arch>(w_.o, batch, {layer_, &LoraLayer::o}, o, out, s, stream, "o_proj", accumulate);
  }

 private:
  ModelConfig const& cfg_;
  AttentionWeights const& w_;
  std::size_t layer_;
  kernels::NormWeight norm_kind_;
};

}  // namespace qflash::model
