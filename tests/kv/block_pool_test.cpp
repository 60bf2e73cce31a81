// The paged KV pool (kv/block_pool.hpp): layout per head format, block reuse, growth that
// keeps contents, and exhaustion that changes nothing.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "qflash/kv/block_pool.hpp"
#include "qflash/kv/layer_cache.hpp"
#include "qflash/runtime/synthetic.hpp"
#include "support/expect_error.hpp"
#include "support/random.hpp"

using namespace qflash;

TEST_CASE("kv layout: each head's K and V in its own format, one block of every layer per id") {
  auto const cfg = runtime::synthetic_config("qwen3_6_35b_a3b", 8);  // layers 3 and 7 hold KV
  kv::KvMap map = kv::KvMap::uniform(cfg, {KvFormat::kBf16, KvFormat::kInt6});
  map.set(7, 1, {KvFormat::kF32, KvFormat::kFp8E4m3});
  CHECK(map.scheme() == KvScheme::kMixed);
  CHECK(kv::KvMap::uniform(cfg, {KvFormat::kInt6, KvFormat::kInt6}).scheme() == KvScheme::kInt6);
  kv::KvLayout const lay(cfg, map);
  CHECK_FALSE(lay.holds_kv(0));
  REQUIRE(lay.holds_kv(3));
  auto const h = lay.heads(7);
  REQUIRE(h.size() == 2);
  CHECK(h[0].k_bytes == 512);
  CHECK(h[0].v_bytes == 208);
  CHECK(h[1].k_bytes == 1024);
  CHECK(h[1].v_bytes == 260);
  CHECK(h[0].v_offset == 16 * 512);
  CHECK(h[1].k_offset == 16 * (512 + 208));
  CHECK(lay.layer_block_bytes(7) == 16 * (512 + 208 + 1024 + 260));
  CHECK(lay.block_bytes() == lay.layer_block_bytes(3) + lay.layer_block_bytes(7));
  CHECK(lay.block_bytes() == 16 * map.bytes_per_token(cfg.d_head));

  kv::KvMap wrong = kv::KvMap::uniform(runtime::synthetic_config("qwen3_6_35b_a3b", 4), {});
  test::expect_error([&] { kv::KvLayout(cfg, wrong); }, {"KV map: 4 layers, the model has 8"});
}

TEST_CASE("kv pool: blocks are reused, growth keeps contents, a full pool refuses and changes nothing") {
  std::vector<kv::KvFormats> heads(2, kv::KvFormats{KvFormat::kInt8, KvFormat::kBf16});
  kv::LayerCache cache(heads, 32, 5 * 16);  // five blocks
  auto const k = test::random_floats(70 * 2 * 32, 1), v = test::random_floats(70 * 2 * 32, 2);
  cache.append(k.data(), v.data(), 40);
  CHECK(cache.block_table().size() == 3);
  CHECK(cache.pool().free_blocks() == 2);
  auto const before = cache.block_table();
  std::vector<std::int32_t> table = before;
  test::expect_error([&] { cache.pool().allocate(3, table); },
                     {"KV cache full: 3 more blocks of 16 tokens needed, 2 of 5 free"});
  CHECK(table == before);
  CHECK(cache.pool().free_blocks() == 2);
  test::expect_error([&] { cache.append(k.data(), v.data(), 70); }, {"KV cache full"});
  CHECK(cache.size() == 40);
  CHECK(cache.block_table() == before);

  // Released blocks come back first.
  std::vector<std::int32_t> extra;
  cache.pool().allocate(2, extra);
  CHECK(cache.pool().free_blocks() == 0);
  cache.pool().release(extra);
  std::vector<std::int32_t> again;
  cache.pool().allocate(1, again);
  CHECK(again[0] == extra[1]);

  // An on-demand pool grows its arenas as blocks are first used, keeping what they hold.
  auto const cfg = runtime::synthetic_config("qwen3_6_35b_a3b", 4);
  kv::KvBlockPool pool(kv::KvLayout(cfg, kv::KvMap::uniform(cfg, {KvFormat::kInt6, KvFormat::kInt6})), 100,
                       kv::KvBlockPool::Allocation::kOnDemand);
  CHECK(pool.reserved_bytes() == 0);
  std::vector<std::int32_t> t;
  pool.allocate(1, t);
  std::size_t const layer = 3;
  REQUIRE(pool.layout().holds_kv(layer));
  kv::KvView view = pool.view(layer, t);
  std::vector<float> x = test::random_floats(static_cast<std::size_t>(cfg.d_head), 3);
  kv_encode(KvFormat::kInt6, x.data(), cfg.d_head, view.key(5, 1));
  std::vector<float> want(x.size()), got(x.size());
  kv_decode(KvFormat::kInt6, view.key(5, 1), cfg.d_head, want.data());
  pool.allocate(40, t);
  CHECK(pool.reserved_bytes() >= 41 * pool.layout().block_bytes());
  view = pool.view(layer, t);
  kv_decode(KvFormat::kInt6, view.key(5, 1), cfg.d_head, got.data());
  CHECK(got == want);
}
