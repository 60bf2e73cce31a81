// A step of kernels/attention_decode for tests: sequences of given lengths in one KV pool
// (blocks handed out in a scrambled order, so their blocks interleave in the arena), their
// earlier positions written, and the step's q, k, v and gate rows.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "qflash/kernels/attention_decode/op.hpp"
#include "qflash/kv/block_pool.hpp"
#include "support/random.hpp"

namespace qflash::test {

inline constexpr int kDecodeBlockTokens = 16;

struct DecodeCase {
  int n_head, n_kv, d;
  bool gated;
  std::vector<std::int64_t> n_past;  ///< per sequence, before its new token
  std::vector<std::int64_t> rows;    ///< per sequence, its token's row
  int n_rows;

  /// The rows of `out` the op writes ([n_rows, n_head, d]), in sequence order.
  [[nodiscard]] std::vector<float> decoding_rows(std::vector<float> const& out) const {
    std::int64_t const width = std::int64_t{n_head} * d;
    std::vector<float> got;
    for (auto r : rows) got.insert(got.end(), out.begin() + r * width, out.begin() + (r + 1) * width);
    return got;
  }
  /// Values of `out` outside those rows that are not NaN (DecodeStep::args starts out as NaN).
  [[nodiscard]] std::int64_t written_outside(std::vector<float> const& out) const {
    std::int64_t const width = std::int64_t{n_head} * d;
    std::int64_t n = 0;
    for (std::int64_t r = 0; r < n_rows; ++r)
      if (std::find(rows.begin(), rows.end(), r) == rows.end())
        n += std::count_if(out.begin() + r * width, out.begin() + (r + 1) * width, [](float x) { return !std::isnan(x); });
    return n;
  }
};

/// One layer's pool with every sequence's first n_past positions written (the same bytes and
/// tables each time it is built), and the step's inputs.
struct DecodeStep {
  std::unique_ptr<kv::KvBlockPool> pool;
  std::vector<std::vector<std::int32_t>> tables;
  std::vector<std::int32_t const*> table_ptrs;
  std::vector<std::int64_t> n_blocks, n_ctx;
  std::vector<float> q, k, v, gate;

  DecodeStep(DecodeCase const& c, std::vector<kv::KvFormats> const& heads) {
    std::int64_t blocks = 0;
    for (auto n : c.n_past) blocks += (n + 1 + kDecodeBlockTokens - 1) / kDecodeBlockTokens;
    pool = std::make_unique<kv::KvBlockPool>(kv::KvLayout(kv::KvMap({heads}), c.n_kv, c.d, kDecodeBlockTokens), blocks);
    // Blocks handed out in a shuffled order, so sequences' blocks interleave in the arena.
    std::vector<std::int32_t> all;
    pool->allocate(blocks, all);
    std::reverse(all.begin() + static_cast<std::ptrdiff_t>(all.size() / 2), all.end());
    std::rotate(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(all.size() / 3), all.end());
    pool->release(all);
    for (std::size_t i = 0; i < c.n_past.size(); ++i) {
      std::int64_t const past = c.n_past[i];
      auto& t = tables.emplace_back();
      pool->allocate(pool->blocks_for(past + 1), t);
      auto const pk = test::random_floats(static_cast<std::size_t>(past * c.n_kv * c.d), 100 + static_cast<int>(i), -2, 2);
      auto const pv = test::random_floats(static_cast<std::size_t>(past * c.n_kv * c.d), 200 + static_cast<int>(i));
      kv::encode_positions(pool->view(0, t), pk.data(), pv.data(), 0, past);
      n_blocks.push_back(static_cast<std::int64_t>(t.size()));
      n_ctx.push_back(past + 1);
    }
    for (auto const& t : tables) table_ptrs.push_back(t.data());
    q = test::random_floats(static_cast<std::size_t>(c.n_rows * c.n_head * c.d), 1, -2, 2);
    k = test::random_floats(static_cast<std::size_t>(c.n_rows * c.n_kv * c.d), 2, -2, 2);
    v = test::random_floats(static_cast<std::size_t>(c.n_rows * c.n_kv * c.d), 3);
    gate = test::random_floats(static_cast<std::size_t>(c.n_rows * c.n_head * 2 * c.d), 4, -3, 3);
  }

  /// The op's arguments; out starts as NaN so rows it must not touch stay NaN.
  kernels::AttentionDecodeArgs args(DecodeCase const& c, std::vector<float>& out) const {
    out.assign(static_cast<std::size_t>(c.n_rows * c.n_head * c.d), NAN);
    kernels::AttentionDecodeArgs a{};
    a.q = q.data();
    a.k = k.data();
    a.v = v.data();
    a.out = out.data();
    if (c.gated) {  // qwen3_5_moe's q_proj rows: per head [query | gate]
      a.gate = gate.data() + c.d;
      a.gate_token_stride = std::int64_t{c.n_head} * 2 * c.d;
      a.gate_head_stride = 2 * c.d;
    }
    a.kv = pool->view(0, {});
    a.rows = c.rows.data();
    a.block_tables = table_ptrs.data();
    a.n_blocks = n_blocks.data();
    a.n_ctx = n_ctx.data();
    a.n_seqs = static_cast<int>(c.rows.size());
    a.n_head = c.n_head;
    a.n_head_kv = c.n_kv;
    a.d_head = c.d;
    a.scale = 0.3f;
    return a;
  }

  /// The layer's arena, every block.
  [[nodiscard]] std::vector<std::uint8_t> arena() const {
    kv::KvView const v = pool->view(0, {});
    return {v.base, v.base + pool->capacity() * v.block_bytes};
  }
};

}  // namespace qflash::test
