/// @file
/// The Gated DeltaNet mixer of qwen3_5_moe (MODELS.md §3c): projections, the causal conv over
/// q|k|v with its carried state, the beta/g gates, the gated delta rule on the sequence's
/// recurrent state (chunked for a prompt chunk; for every sequence decoding one token, conv and
/// recurrence in one gdn_decode call, which takes the gates and the gated RMSNorm too when no
/// sequence has a prompt chunk), the gated RMSNorm and the output projection.
#pragma once

#include <cstdint>

#include "qflash/kernels/causal_conv1d/op.hpp"
#include "qflash/kernels/gated_delta/op.hpp"
#include "qflash/kernels/gated_rmsnorm/op.hpp"
#include "qflash/kernels/gdn_decode/op.hpp"
#include "qflash/kernels/gdn_gates/op.hpp"
#include "qflash/model/config.hpp"
#include "qflash/model/layers/common.hpp"
#include "qflash/model/weights.hpp"

namespace qflash::model {

/// How the delta rule runs a chunk of more than one token.
struct DeltaRuleOptions {
  kernels::DeltaRuleForm prefill_form = kernels::DeltaRuleForm::kChunked;
  int chunk = 64;
};

template <MoeSpec S, class Arch>
class GatedDeltaNet {
 public:
  GatedDeltaNet(ModelConfig const& cfg, LinearAttentionWeights const& w, std::size_t layer,
                DeltaRuleOptions opts)
      : cfg_(cfg), w_(w), layer_(layer), opts_(opts) {}

  /// out = GatedDeltaNet(x) for the batch's rows; advances each sequence's conv and recurrent
  /// state. @param x [n_tokens, d_model] normed input; @param out [n_tokens, d_model] (added to when accumulate)
  void forward(Batch const& batch, float const* x, float* out, Scratch& s, stream_t stream,
               bool accumulate = false) const {
    int const hk = dim<S.n_head_k_linear>(cfg_.n_head_k_linear);
    int const hv = dim<S.n_head_v_linear>(cfg_.n_head_v_linear);
    int const dk = dim<S.d_head_k_linear>(cfg_.d_head_k_linear);
    int const dv = dim<S.d_head_v_linear>(cfg_.d_head_v_linear);
    std::int64_t const T = batch.n_tokens();
    std::int64_t const key_dim = std::int64_t{hk} * dk, value_dim = std::int64_t{hv} * dv;
    std::int64_t const conv_dim = 2 * key_dim + value_dim;

    float* mixed = s.sized(s.proj, T * conv_dim);  // pre-conv q | k | v
    float* conv = s.sized(s.conv, T * conv_dim);
    float* z = s.sized(s.z, T * value_dim);
    float* beta = s.sized(s.beta, T * hv);
    float* g = s.sized(s.g, T * hv);
    float* o = s.sized(s.o, T * value_dim);
    ProjectionOut const in_proj[] = {{&w_.qkv, {layer_, &LoraLayer::qkv}, mixed},
                                     {&w_.z, {layer_, &LoraLayer::z}, z},
                                     {&w_.b, {layer_, &LoraLayer::b}, beta},
                                     {&w_.a, {layer_, &LoraLayer::a}, g}};
    project_group<S, Arch>(in_proj, batch, x, s, stream, "in_proj_qkv, in_proj_z, in_proj_b, in_proj_a");

    // A step of decoding sequences alone leaves the gates and the norm to gdn_decode.
    bool decode_only = true;
    for (std::size_t i = 0; i < batch.seqs.size(); ++i) decode_only = decode_only && batch.rows_of(i) == 1;
    if (!decode_only) {
      kernels::GdnGatesArgs ga{};
      ga.beta = beta;
      ga.g = g;
      ga.dt_bias = w_.dt_bias.data();
      ga.neg_a = w_.neg_a.data();
      ga.n_tokens = T;
      ga.n_head_v = hv;
      check_launch(kernels::launch_gdn_gates<S>(Arch{}, ga, stream), "gdn_gates");
    }

    // Sequences decoding one token go through gdn_decode together; prompt chunks one by one.
    s.decode_rows.clear();
    s.decode_conv_state.clear();
    s.decode_state.clear();
    for (std::size_t i = 0; i < batch.seqs.size(); ++i) {
      std::int64_t const b = batch.begin[i], n = batch.rows_of(i);
      LinearState& st = batch.seqs[i].state->linear(layer_);
      if (n == 1) {
        s.decode_rows.push_back(b);
        s.decode_conv_state.push_back(st.conv.data());
        s.decode_state.push_back(st.recurrent.data());
        continue;
      }
      kernels::CausalConv1dArgs c{};
      c.x = mixed + b * conv_dim;
      c.weight = w_.conv.data();
      c.state = st.conv.data();
      c.y = conv + b * conv_dim;
      c.n_tokens = n;
      c.n_channels = static_cast<int>(conv_dim);
      c.d_conv = dim<S.d_conv>(cfg_.d_conv);
      check_launch(kernels::launch_causal_conv1d<S>(Arch{}, c, stream), "causal_conv1d");

      kernels::GatedDeltaArgs a{};
      float const* rows = conv + b * conv_dim;  // q, k, v read in place from [q | k | v]
      a.q = rows;
      a.k = rows + key_dim;
      a.v = rows + 2 * key_dim;
      a.q_stride = a.k_stride = a.v_stride = conv_dim;
      a.g = g + b * hv;
      a.beta = beta + b * hv;
      a.state = st.recurrent.data();
      a.out = o + b * value_dim;
      a.n_tokens = n;
      a.n_head_k = hk;
      a.n_head_v = hv;
      a.d_k = dk;
      a.d_v = dv;
      a.tiled_value_heads = cfg_.tiled_value_heads;
      a.form = opts_.prefill_form;
      a.chunk_size = opts_.chunk;
      check_launch(kernels::launch_gated_delta<S>(Arch{}, a, stream), "gated_delta");
    }
    if (!s.decode_rows.empty()) {
      kernels::GdnDecodeArgs d{};
      d.x = mixed;
      d.g = g;
      d.beta = beta;
      d.conv_out = conv;
      d.out = o;
      d.rows = s.decode_rows.data();
      d.conv_state = s.decode_conv_state.data();
      d.state = s.decode_state.data();
      d.conv_weight = w_.conv.data();
      d.n_seqs = static_cast<int>(s.decode_rows.size());
      d.n_head_k = hk;
      d.n_head_v = hv;
      d.d_k = dk;
      d.d_v = dv;
      d.d_conv = dim<S.d_conv>(cfg_.d_conv);
      d.tiled_value_heads = cfg_.tiled_value_heads;
      if (decode_only) {
        d.dt_bias = w_.dt_bias.data(), d.neg_a = w_.neg_a.data();
        d.norm_weight = w_.norm.data(), d.z = z, d.norm_eps = cfg_.rms_norm_eps;
      }
      check_launch(kernels::launch_gdn_decode<S>(Arch{}, d, stream), "gdn_decode");
    }

    if (!decode_only) {
      kernels::GatedRmsNormArgs gn{};
      gn.x = o;
      gn.z = z;
      gn.weight = w_.norm.data();
      gn.y = o;
      gn.n_rows = T * hv;
      gn.n_cols = dv;
      gn.eps = cfg_.rms_norm_eps;
      check_launch(kernels::launch_gated_rmsnorm<S>(Arch{}, gn, stream), "gated_rmsnorm");
    }
    project<S, Arch>(w_.out, batch, {layer_, &LoraLayer::out}, o, out, s, stream, "out_proj", accumulate);
  }

 private:
  ModelConfig const& cfg_;
  LinearAttentionWeights const& w_;
  std::size_t layer_;
  DeltaRuleOptions opts_;
};

}  // namespace qflash::model
