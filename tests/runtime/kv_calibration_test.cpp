// qflash calibrate's parts (runtime/kv_calibration.hpp): KL of distributions, the greedy map
// under a byte budget on hand-made sensitivities, and a measurement on a fixture model.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "qflash/runtime/kv_calibration.hpp"
#include "qflash/runtime/load_model.hpp"
#include "qflash/runtime/synthetic.hpp"
#include "support/expect_error.hpp"

using namespace qflash;

TEST_CASE("kv calibration: KL of two distributions, by hand") {
  std::vector<float> const a{0.0f, std::log(3.0f)};  // p = (1/4, 3/4)
  std::vector<float> const b{0.0f, 0.0f};            // q = (1/2, 1/2)
  double const want = 0.25 * std::log(0.5) + 0.75 * std::log(1.5);
  CHECK(runtime::sum_kl(a.data(), b.data(), 1, 2) == doctest::Approx(want).epsilon(1e-6));
  CHECK(runtime::sum_kl(a.data(), a.data(), 1, 2) == doctest::Approx(0.0).epsilon(1e-12));
}

TEST_CASE("kv calibration: the greedy map lowers the least sensitive units first, within the budget") {
  // Qwen3.6's shape with 4 layers: one attention layer of 2 KV heads of 256, so 4 units
  // (bf16 512 bytes, fp8_e4m3 260, int8 272, int6 208 each; 2048 in bf16).
  auto const cfg = runtime::synthetic_config("qwen3_6_35b_a3b", 4);
  runtime::KvSensitivity s;
  s.formats = {KvFormat::kBf16, KvFormat::kInt8, KvFormat::kInt6};
  s.units = runtime::kv_units(cfg);
  REQUIRE(s.units.size() == 4);
  // units: h0 K, h0 V, h1 K, h1 V
  s.kl = {{0, 1e-3, 9e-3}, {0, 1e-4, 2e-4}, {0, 5e-3, 8e-2}, {0, 2e-4, 3e-4}};
  // 0.7 x 2048 = 1433.6: the two V units go to int6 (304 bytes each saved for 2e-4, 3e-4),
  // then h0 K to int8 (240 for 1e-3): 2048 - 608 - 240 = 1200.
  auto const c = runtime::choose_kv_map(cfg, s, 0.7);
  CHECK(c.bf16_bytes_per_token == 2048);
  CHECK(c.bytes_per_token == 1200);
  CHECK(c.map.layer(3)[0] == kv::KvFormats{KvFormat::kInt8, KvFormat::kInt6});
  CHECK(c.map.layer(3)[1] == kv::KvFormats{KvFormat::kBf16, KvFormat::kInt6});
  CHECK(c.predicted_kl == doctest::Approx(1e-3 + 2e-4 + 3e-4));
  CHECK(c.map.bytes_per_token(cfg.d_head) == c.bytes_per_token);
  // A budget of 1 keeps bf16; below int6 everywhere (0.406) is refused.
  CHECK(runtime::choose_kv_map(cfg, s, 1.0).map == kv::KvMap::uniform(cfg, {KvFormat::kBf16, KvFormat::kBf16}));
  CHECK(runtime::choose_kv_map(cfg, s, 0.41).map == kv::KvMap::uniform(cfg, {KvFormat::kInt6, KvFormat::kInt6}));
  test::expect_error([&] { (void)runtime::choose_kv_map(cfg, s, 0.4); },
                     {"a budget of 0.4 x bf16 KV is below what int6 everywhere takes (0.40625 x bf16)"});
}

TEST_CASE("kv calibration: measured on a fixture, bf16 costs less KL than int6 for every unit") {
  runtime::LoadOptions o;
  o.progress = false;
  auto m = runtime::load_model_as<spec::generic>(std::string(QFLASH_FIXTURES_DIR) + "/qwen3_5_moe_tiny", o);
  std::vector<std::int32_t> ids;
  for (int i = 0; i < 80; ++i) ids.push_back(static_cast<std::int32_t>((i * 37 + 11) % m->config().vocab));
  std::int64_t steps = 0, total = 0;
  auto const s = runtime::measure_kv_sensitivity(*m, ids, 40, {KvFormat::kBf16, KvFormat::kInt6},
                                                 [&](std::int64_t done, std::int64_t all) { steps = done, total = all; });
  CHECK(s.tokens == 39 + 39);  // two windows of 40, each predicting 39
  CHECK(steps == total);
  CHECK(total == 2 * (1 + 4 * 2));  // per window: f32, then 4 units x 2 formats
  for (std::size_t u = 0; u < s.units.size(); ++u) {
    CAPTURE(u);
    CHECK(s.kl[u][0] >= 0);
    CHECK(s.kl[u][1] > s.kl[u][0]);
  }
}
