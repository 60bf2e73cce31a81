/// @file
/// The decode roofline's numerator: bytes of weight matrices one decoded token reads, counted
/// from the tensors as bound (their formats and sizes), and the fraction of the memory-bound
/// limit a measured decode speed reaches (ARCHITECTURE.md §8). The denominator, the machine's
/// read bandwidth, is runtime/bandwidth.hpp. Host only.
#pragma once

#include <cstdint>

#include "qflash/model/config.hpp"
#include "qflash/model/weights.hpp"
#include "qflash/numeric/weight_format.hpp"

namespace qflash::runtime {

/// Bytes a pass over view `v` reads: its rows, plus the fp8 scale rows they use.
inline std::int64_t read_bytes(WeightView const& v) {
  std::int64_t b = v.bytes();
  if (v.format == WeightFormat::kFp8E4m3 && v.rows > 0) {
    std::int64_t const first = v.scale_row0 / kFp8BlockSize, last = (v.scale_row0 + v.rows - 1) / kFp8BlockSize;
    b += (last - first + 1) * fp8_scale_blocks(v.cols) * static_cast<std::int64_t>(sizeof(float));
  }
  return b;
}

/// The weight bytes one decoded token reads, by part. Not counted: the KV cache, the Gated
/// DeltaNet conv and recurrent state (which grow or stay per sequence, not per weight), and
/// the fp32 norm / conv / gate vectors (under 0.1% of a layer's matrices).
struct DecodeWeightBytes {
  std::int64_t embedding_row = 0;   ///< the token's row of the embedding table
  std::int64_t mixers = 0;          ///< attention q/k/v/o and Gated DeltaNet qkv/z/b/a/out
  std::int64_t routers = 0;         ///< router GEMVs (with the shared-expert gate row)
  std::int64_t routed_experts = 0;  ///< per layer, n_expert_used x the layer's mean expert
  std::int64_t shared_experts = 0;  ///< gate/up/down of each layer's shared expert
  std::int64_t lm_head = 0;

  [[nodiscard]] std::int64_t total() const {
    return embedding_row + mixers + routers + routed_experts + shared_experts + lm_head;
  }
};

/// What one decode step of model `c` with weights `w` reads (see DecodeWeightBytes).
inline DecodeWeightBytes decode_weight_bytes(model::ModelConfig const& c, model::ModelWeights const& w) {
  DecodeWeightBytes out;
  out.embedding_row = w.embed.row_bytes();
  out.lm_head = read_bytes(w.lm_head);
  for (auto const& l : w.layers) {
    if (l.kind == model::LayerKind::kFullAttention)
      out.mixers += read_bytes(l.attention.q) + read_bytes(l.attention.k) + read_bytes(l.attention.v) +
                    read_bytes(l.attention.o);
    else
      out.mixers += read_bytes(l.linear.qkv) + read_bytes(l.linear.z) + read_bytes(l.linear.b) +
                    read_bytes(l.linear.a) + read_bytes(l.linear.out);
    out.routers += read_bytes(l.moe.router);
    std::int64_t experts = 0;
    for (auto const& e : l.moe.experts) experts += read_bytes(e.gate) + read_bytes(e.up) + read_bytes(e.down);
    if (!l.moe.experts.empty())
      out.routed_experts += experts * c.n_expert_used / static_cast<std::int64_t>(l.moe.experts.size());
    if (l.moe.shared)
      out.shared_experts += read_bytes(l.moe.shared->gate) + read_bytes(l.moe.shared->up) + read_bytes(l.moe.shared->down);
  }
  return out;
}

/// The fraction of the memory-bound limit (bandwidth / bytes per token) that `tok_s` reaches.
/// @param bandwidth_gbs  read bandwidth in GB/s (1e9 bytes per second)
inline double roofline_fraction(double tok_s, std::int64_t bytes_per_token, double bandwidth_gbs) {
  return bandwidth_gbs > 0 ? tok_s * static_cast<double>(bytes_per_token) / (bandwidth_gbs * 1e9) : 0.0;
}

}  // namespace qflash::runtime
