/// @file
/// Scalar reference for kernels/kv_append, and `gather_kv`: a sequence's paged, compressed
/// K/V read back into contiguous fp32 [n, n_head_kv, d_head], the "dequantize, then attend"
/// side that fused attention is checked against.
#pragma once

#include <cstdint>
#include <vector>

#include "qflash/kernels/kv_append/op.hpp"

namespace qflash::kernels::ref {

inline void kv_append(KvAppendArgs const& a) { kv::encode_positions(a.kv, a.k, a.v, a.start, a.n_tokens); }

/// Keys and values of positions [0, n).
struct GatheredKv {
  std::vector<float> k, v;
};
inline GatheredKv gather_kv(kv::KvView const& view, std::int64_t n) {
  int const d = view.d_head, nkv = view.n_head_kv;
  GatheredKv g;
  g.k.resize(static_cast<std::size_t>(n * nkv * d));
  g.v.resize(g.k.size());
  for (std::int64_t s = 0; s < n; ++s)
    for (int h = 0; h < nkv; ++h) {
      std::int64_t const row = (s * nkv + h) * d;
      kv_decode(view.heads[h].k_format, view.key(s, h), d, g.k.data() + row);
      kv_decode(view.heads[h].v_format, view.value(s, h), d, g.v.data() + row);
    }
  return g;
}

}  // namespace qflash::kernels::ref
