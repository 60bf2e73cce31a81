/// @file
/// Scalar reference for kernels/gdn_decode: per sequence, the references of the ops it fuses
/// (kernels/gdn_gates when the gates come raw, kernels/causal_conv1d, then kernels/gated_delta's
/// recurrence on the conv's output, then kernels/gated_rmsnorm when asked), in fp64 within each. The truth in tests.
#pragma once

#include "qflash/kernels/causal_conv1d/ref.hpp"
#include "qflash/kernels/gated_delta/ref.hpp"
#include "qflash/kernels/gdn_decode/op.hpp"
#include "qflash/kernels/gated_rmsnorm/ref.hpp"
#include "qflash/kernels/gdn_gates/ref.hpp"

namespace qflash::kernels::ref {

inline void gdn_decode(GdnDecodeArgs const& a) {
  for (int i = 0; i < a.n_seqs; ++i) {
    if (a.dt_bias) gdn_gates(a.gates_args(a.rows[i]));
    causal_conv1d(a.conv_args(a.rows[i], a.d_conv > 1 ? a.conv_state[i] : nullptr));
    gated_delta(a.delta_args(a.rows[i], a.state[i]));
    if (a.norm_weight) gated_rmsnorm(a.norm_args(a.rows[i]));
  }
}

}  // namespace qflash::kernels::ref
