/// @file
/// Scalar reference for kernels/attention_decode: per sequence, the references of the two ops
/// it fuses (kernels/kv_append, then kernels/attention over the sequence's cache). The truth
/// in tests.
#pragma once

#include "qflash/kernels/attention/ref.hpp"
#include "qflash/kernels/attention_decode/op.hpp"
#include "qflash/kernels/kv_append/ref.hpp"

namespace qflash::kernels::ref {

inline void attention_decode(AttentionDecodeArgs const& a) {
  for (int i = 0; i < a.n_seqs; ++i) {
    kv_append(a.append_args(i));
    attention(a.attention_args(i));
  }
}

}  // namespace qflash::kernels::ref
