/// @file
/// Scalar reference for kernels/gdn_decode: per sequence, the references of the two ops it
/// fuses (kernels/causal_conv1d, then kernels/gated_delta's recurrence on the conv's output),
/// in fp64 within each. The truth in tests.
#pragma once

#include "qflash/kernels/causal_conv1d/ref.hpp"
#include "qflash/kernels/gated_delta/ref.hpp"
#include "qflash/kernels/gdn_decode/op.hpp"

namespace qflash::kernels::ref {

inline void gdn_decode(GdnDecodeArgs const& a) {
  for (int i = 0; i < a.n_seqs; ++i) {
    causal_conv1d(a.conv_args(a.rows[i], a.d_conv > 1 ? a.conv_state[i] : nullptr));
    gated_delta(a.delta_args(a.rows[i], a.state[i]));
  }
}

}  // namespace qflash::kernels::ref
