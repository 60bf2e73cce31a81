// The memory planner (runtime/memory_plan.hpp) and KV format sizes (numeric/kv_format.hpp):
// byte counts by hand for Qwen3.6-35B-A3B's config (MODELS.md: 20,480 B/token of bf16 KV,
// 62.8 MiB of fp32 DeltaNet state), whole KV blocks, and the sequences that fit.
#include <doctest/doctest.h>

#include <cstdint>

#include "qflash/numeric/kv_format.hpp"
#include "qflash/runtime/memory_plan.hpp"
#include "qflash/runtime/synthetic.hpp"
#include "support/expect_error.hpp"

using namespace qflash;

TEST_CASE("kv_format: bytes per token-head, scales included, short last group") {
  CHECK(kv_head_bytes(KvFormat::kBf16, 256) == 512);
  CHECK(kv_head_bytes(KvFormat::kFp8E4m3, 256) == 256 + 4);
  CHECK(kv_head_bytes(KvFormat::kInt8, 256) == 256 + 4 * 4);
  CHECK(kv_head_bytes(KvFormat::kInt6, 256) == 4 * (48 + 4));
  // 100 values: a group of 64 (48 bytes) and one of 36 (27 bytes), each with scale and min
  CHECK(kv_head_bytes(KvFormat::kInt6, 100) == 48 + 27 + 8);
  CHECK(kv_head_bytes(KvFormat::kInt6, 66) == 48 + 3 + 8);  // 2 values pad to one 3-byte word
  CHECK(kv_head_bytes(KvFormat::kInt8, 100) == 100 + 8);
  CHECK(parse_kv_format("fp8") == KvFormat::kFp8E4m3);
  CHECK(parse_kv_format("int6") == KvFormat::kInt6);
  test::expect_error([] { (void)parse_kv_format("int5"); },
                     {"unknown KV format 'int5' (expected one of: f32, bf16, fp8_e4m3, int8, int6)"});
}

TEST_CASE("memory plan: Qwen3.6-35B-A3B's KV and state per sequence, by hand") {
  auto const c = runtime::synthetic_config("qwen3_6_35b_a3b", 40);
  auto const bf16 = runtime::plan_memory(c, 0, kv::KvMap::uniform(c, {KvFormat::kBf16, KvFormat::kBf16}));
  CHECK(bf16.kv_per_token == 10 * 2 * 2 * 256 * 2);  // 10 layers, K+V, 2 heads, 256 dims, 2 bytes
  CHECK(bf16.kv_bytes(4096) == 80ll << 20);
  CHECK(bf16.kv_bytes(32768) == 640ll << 20);
  CHECK(bf16.kv_bytes(1) == 16 * bf16.kv_per_token);  // whole blocks of 16 tokens
  CHECK(bf16.kv_bytes(17) == 32 * bf16.kv_per_token);
  // 30 layers x (conv [2*16*128 + 32*128, 3] + state [32, 128, 128]) in fp32
  std::int64_t const state = 30ll * ((2 * 16 * 128 + 32 * 128) * 3 + 32 * 128 * 128) * 4;
  CHECK(bf16.state_per_sequence == state);
  auto const int6 = runtime::plan_memory(c, 0, kv::KvMap::uniform(c, {KvFormat::kInt6, KvFormat::kInt6}));
  CHECK(int6.kv_per_token == 10 * 2 * 2 * 208);
  auto const mixed = runtime::plan_memory(c, 0, kv::KvMap::uniform(c, {KvFormat::kBf16, KvFormat::kInt6}));
  CHECK(mixed.kv_per_token == 10 * 2 * (512 + 208));
  CHECK(int6.scratch == bf16.scratch);
  CHECK(bf16.scratch > 0);
}

TEST_CASE("memory plan: totals and the sequences that fit") {
  runtime::MemoryPlan p;
  p.weights = 1000;
  p.scratch = 100;
  p.kv_per_token = 10;
  p.state_per_sequence = 40;
  CHECK(p.per_sequence(16) == 160 + 40);
  CHECK(p.total(16, 3) == 1100 + 3 * 200);
  CHECK(p.sequences_that_fit(16, 1100 + 3 * 200) == 3);
  CHECK(p.sequences_that_fit(16, 1100 + 3 * 200 - 1) == 2);
  CHECK(p.sequences_that_fit(16, 1000) == 0);  // weights and scratch alone do not fit
}

TEST_CASE("memory plan: the KV bytes a GPU memory utilization leaves") {
  std::int64_t const gib = std::int64_t{1} << 30;
  qflash::Memory::DeviceUse const use{.free = 100 * gib, .total = 140 * gib};  // 40 GiB in use
  // 0.5 of 140 = 70 GiB allowed; 40 in use and 2 reserved leave 28.
  CHECK(runtime::kv_bytes_within(0.5, use, 2 * gib) == 28 * gib);
  CHECK(runtime::kv_bytes_within(1.0, use, 0) == 100 * gib);
  // Nothing left: the error gives the figures and what to do.
  test::expect_error([&] { (void)runtime::kv_bytes_within(0.25, use, 0); },
                     {"0.25", "35.00 GiB", "140.00 GiB", "40.00 GiB are in use", "raise the utilization"});
  test::expect_error([&] { (void)runtime::kv_bytes_within(0.3, use, 2 * gib); }, {"2.00 GiB more"});
  test::expect_error([&] { (void)runtime::kv_bytes_within(0.0, use, 0); }, {"(0, 1]"});
  test::expect_error([&] { (void)runtime::kv_bytes_within(1.5, use, 0); }, {"(0, 1]"});
  test::expect_error([&] { (void)runtime::kv_bytes_within(0.5, {.free = 2, .total = 1}, 0); }, {"2 bytes free of 1"});
}

TEST_CASE("memory plan: a device step's reserve covers the scratch estimate and grows with the tokens") {
  auto const c = runtime::synthetic_config("qwen3_6_35b_a3b", 40);
  CHECK(runtime::device_step_reserve(c, 512) > runtime::scratch_bytes(c, 512));
  CHECK(runtime::device_step_reserve(c, 2048) > runtime::device_step_reserve(c, 512));
}
