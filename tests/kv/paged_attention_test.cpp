// kv_append and attention over paged, compressed KV: every format and a per-head mix, every
// ISA, against dequantize-then-attend (ref::attention over gather_kv); the result does not
// depend on where the blocks lie; a spec compiled for one scheme refuses the others.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/kernels/attention/cpu.hpp"
#include "qflash/kernels/attention/ref.hpp"
#include "qflash/kernels/kv_append/cpu.hpp"
#include "qflash/kernels/kv_append/ref.hpp"
#include "qflash/kv/layer_cache.hpp"
#include "qflash/spec/presets.hpp"
#include "support/attention_problem.hpp"
#include "support/cpu_isas.hpp"
#include "support/random.hpp"
#include "support/tolerance.hpp"

using namespace qflash;
using namespace qflash::kernels;
using test::all_close;
using test::Tolerance;
using test::isas_here;

namespace {

// fp32 sums over the same decoded values as the fp64 reference: accumulated rounding only.
constexpr Tolerance kDot{2e-5, 1e-5};


using Problem = test::AttentionProblem;

AttentionArgs args_for(Problem const& p, kv::KvView view, std::vector<float> const& q, std::vector<float>& out) {
  return test::attention_args(p, view, q.data(), out.data());
}

}  // namespace

TEST_CASE("paged attention: every KV format and ISA equals dequantize-then-attend") {
  std::vector<kv::KvFormats> uniform;
  for (auto const& [f, name] : kKvFormats) uniform.push_back({f, f});
  // Problems: decode and prefill, GQA groups of 1, 2 and 12 (two passes of 8), odd d (scalar
  // path), contexts that end inside a block and span several softmax steps.
  std::vector<Problem> const problems{{4, 2, 64, 37, 1}, {4, 2, 32, 300, 300}, {12, 1, 16, 20, 5},
                                      {3, 3, 24, 17, 17}, {2, 1, 20, 33, 3},   {4, 2, 256, 530, 2}};
  for (Problem const& p : problems) {
    CAPTURE(p.d);
    CAPTURE(p.n_ctx);
    CAPTURE(p.n_head);
    auto const q = test::random_floats(static_cast<std::size_t>(p.n_tokens * p.n_head * p.d), 1, -2, 2);
    auto const k = test::random_floats(static_cast<std::size_t>(p.n_ctx * p.n_kv * p.d), 2, -2, 2);
    auto const v = test::random_floats(static_cast<std::size_t>(p.n_ctx * p.n_kv * p.d), 3);
    std::vector<std::vector<kv::KvFormats>> layouts;
    for (kv::KvFormats f : uniform) layouts.emplace_back(static_cast<std::size_t>(p.n_kv), f);
    std::vector<kv::KvFormats> mixed;  // each head its own K and V formats
    for (int h = 0; h < p.n_kv; ++h)
      mixed.push_back({kKvFormats[static_cast<std::size_t>(h + 1) % 5].first, kKvFormats[static_cast<std::size_t>(4 - h) % 5].first});
    layouts.push_back(mixed);
    for (auto const& heads : layouts) {
      CAPTURE(to_string(heads[0].k));
      CAPTURE(to_string(heads[0].v));
      kv::LayerCache cache(heads, p.d, p.n_ctx);
      cache.append(k.data(), v.data(), p.n_ctx);
      std::vector<float> want(q.size());
      ref::attention(args_for(p, cache.view(), q, want));
      for (auto isa : isas_here()) {
        CAPTURE(to_string(isa));
        std::vector<float> got(q.size());
        REQUIRE(cpu::attention<kDynamic>(isa, args_for(p, cache.view(), q, got)) == Status::kSuccess);
        auto r = all_close<float, float>(got, want, kDot);
        CHECK_MESSAGE(r.ok, r.report);
      }
    }
  }
}

TEST_CASE("kv_append: the op writes the bytes the reference writes, in three appends") {
  int const nkv = 2, d = 40;
  std::int64_t const n = 45;
  auto const k = test::random_floats(static_cast<std::size_t>(n * nkv * d), 4, -3, 3);
  auto const v = test::random_floats(static_cast<std::size_t>(n * nkv * d), 5, -3, 3);
  std::vector<kv::KvFormats> const heads{{KvFormat::kInt6, KvFormat::kFp8E4m3}, {KvFormat::kBf16, KvFormat::kInt8}};
  kv::LayerCache a(heads, d, n), b(heads, d, n);
  std::vector<std::int32_t> ref_table;
  a.pool().allocate(a.pool().blocks_for(n), ref_table);
  kv::KvView const va = a.pool().view(0, ref_table);
  ref::kv_append(KvAppendArgs{va, k.data(), v.data(), n, 0});
  std::vector<std::int32_t> table;
  b.pool().allocate(b.pool().blocks_for(n), table);
  kv::KvView view = b.pool().view(0, table);
  for (std::int64_t start : {std::int64_t{0}, std::int64_t{1}, std::int64_t{17}}) {  // three appends
    std::int64_t const len = start == 0 ? 1 : (start == 1 ? 16 : n - 17);
    KvAppendArgs ap{view, k.data() + start * nkv * d, v.data() + start * nkv * d, len, start};
    REQUIRE(launch_kv_append<spec::generic>(arch::Cpu{}, ap) == Status::kSuccess);
  }
  for (std::int64_t s = 0; s < n; ++s)
    for (int h = 0; h < nkv; ++h) {
      CHECK(std::memcmp(va.key(s, h), view.key(s, h), static_cast<std::size_t>(va.heads[h].k_bytes)) == 0);
      CHECK(std::memcmp(va.value(s, h), view.value(s, h), static_cast<std::size_t>(va.heads[h].v_bytes)) == 0);
    }
  KvAppendArgs past_end{view, k.data(), v.data(), 2, view.capacity() - 1};  // one past the last block
  CHECK(launch_kv_append<spec::generic>(arch::Cpu{}, past_end) == Status::kErrorInvalidProblem);
}

TEST_CASE("paged attention: shuffled blocks with their table give the same bits") {
  Problem const p{4, 2, 64, 150, 3};
  auto const q = test::random_floats(static_cast<std::size_t>(p.n_tokens * p.n_head * p.d), 6, -2, 2);
  auto const k = test::random_floats(static_cast<std::size_t>(p.n_ctx * p.n_kv * p.d), 7, -2, 2);
  auto const v = test::random_floats(static_cast<std::size_t>(p.n_ctx * p.n_kv * p.d), 8);
  std::vector<kv::KvFormats> const heads(2, {KvFormat::kInt6, KvFormat::kInt6});
  kv::LayerCache in_order(heads, p.d, p.n_ctx);
  in_order.append(k.data(), v.data(), p.n_ctx);
  // A pool whose free list was shuffled hands its blocks out in that order.
  kv::LayerCache shuffled(heads, p.d, p.n_ctx);
  std::vector<std::int32_t> all;
  shuffled.pool().allocate(shuffled.pool().capacity(), all);
  std::shuffle(all.begin(), all.end(), std::mt19937(9));
  shuffled.pool().release(all);
  shuffled.append(k.data(), v.data(), p.n_ctx);
  REQUIRE(shuffled.block_table() != in_order.block_table());
  std::vector<float> a(q.size()), b(q.size());
  REQUIRE(launch_attention<spec::generic>(arch::Cpu{}, args_for(p, in_order.view(), q, a)) == Status::kSuccess);
  REQUIRE(launch_attention<spec::generic>(arch::Cpu{}, args_for(p, shuffled.view(), q, b)) == Status::kSuccess);
  CHECK(a == b);
}

namespace {
constexpr MoeSpec kInt6Only = [] {
  MoeSpec s = spec::generic;
  s.kv = KvScheme::kInt6;
  return s;
}();
}  // namespace

TEST_CASE("paged attention: a spec compiled for one KV scheme runs it and refuses others") {
  Problem const p{4, 2, 32, 20, 2};
  auto const q = test::random_floats(static_cast<std::size_t>(p.n_tokens * p.n_head * p.d), 10, -2, 2);
  auto const k = test::random_floats(static_cast<std::size_t>(p.n_ctx * p.n_kv * p.d), 11, -2, 2);
  auto const v = test::random_floats(static_cast<std::size_t>(p.n_ctx * p.n_kv * p.d), 12);
  kv::LayerCache int6(p.n_kv, p.d, {KvFormat::kInt6, KvFormat::kInt6}, p.n_ctx);
  kv::LayerCache bf16(p.n_kv, p.d, {KvFormat::kBf16, KvFormat::kBf16}, p.n_ctx);
  int6.append(k.data(), v.data(), p.n_ctx);
  bf16.append(k.data(), v.data(), p.n_ctx);
  std::vector<float> fixed(q.size()), any(q.size());
  REQUIRE(launch_attention<kInt6Only>(arch::Cpu{}, args_for(p, int6.view(), q, fixed)) == Status::kSuccess);
  REQUIRE(launch_attention<spec::generic>(arch::Cpu{}, args_for(p, int6.view(), q, any)) == Status::kSuccess);
  CHECK(fixed == any);
  CHECK(launch_attention<kInt6Only>(arch::Cpu{}, args_for(p, bf16.view(), q, fixed)) == Status::kErrorNotSupported);
  // A context longer than the block table covers is refused.
  AttentionArgs past = args_for(p, int6.view(), q, fixed);
  past.n_ctx = int6.view().capacity() + 1;
  CHECK(launch_attention<spec::generic>(arch::Cpu{}, past) == Status::kErrorInvalidProblem);
}
