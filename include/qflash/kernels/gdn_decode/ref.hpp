/// @file
/// Scalar reference for kernels/gdn_decode: per sequence, the references of the two ops it
/// fuses (kernels/causal_conv1d, then kernels/gated_delta's recurrence on the conv's output),
/// in fp64 within each. The truth in tests.
#pragma once

#include <cstdint>

#include "qflash/kernels/causal_conv1d/ref.hpp"
#include "qflash/kernels/gated_delta/ref.hpp"
#include "qflash/kernels/gdn_decode/op.hpp"

namespace qflash::kernels::ref {

inline void gdn_decode(GdnDecodeArgs const& a) {
  std::int64_t const cd = a.conv_dim(), key_dim = std::int64_t{a.n_head_k} * a.d_k;
  for (int i = 0; i < a.n_seqs; ++i) {
    std::int64_t const r = a.rows[i];
    CausalConv1dArgs c{};
    c.x = a.x + r * cd;
    c.weight = a.conv_weight;
    c.state = a.d_conv > 1 ? a.conv_state[i] : nullptr;
    c.y = a.conv_out + r * cd;
    c.n_tokens = 1;
    c.n_channels = static_cast<int>(cd);
    c.d_conv = a.d_conv;
    causal_conv1d(c);

    GatedDeltaArgs d{};
    d.q = a.conv_out + r * cd;
    d.k = d.q + key_dim;
    d.v = d.q + 2 * key_dim;
    d.q_stride = d.k_stride = d.v_stride = cd;
    d.g = a.g + r * a.n_head_v;
    d.beta = a.beta + r * a.n_head_v;
    d.state = a.state[i];
    d.out = a.out + r * std::int64_t{a.n_head_v} * a.d_v;
    d.n_tokens = 1;
    d.n_head_k = a.n_head_k;
    d.n_head_v = a.n_head_v;
    d.d_k = a.d_k;
    d.d_v = a.d_v;
    d.l2norm_eps = a.l2norm_eps;
    d.tiled_value_heads = a.tiled_value_heads;
    d.form = DeltaRuleForm::kRecurrent;
    gated_delta(d);
  }
}

}  // namespace qflash::kernels::ref
