// KV formats (numeric/kv_format.hpp): each stored vector comes back within its format's
// bound, and the AVX2 decoder attention uses equals kv_decode bit for bit.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include "qflash/arch/cpu_features.hpp"
#include "qflash/kernels/attention/cpu.hpp"
#include "qflash/numeric/kv_format.hpp"
#include "support/random.hpp"

using namespace qflash;

namespace {

/// Largest error allowed for value x of a vector stored in f (scale: the stored scale of its
/// group, as kv_stored_scale reads it).
double bound(KvFormat f, double x, double scale) {
  switch (f) {
    case KvFormat::kF32: return 0;
    case KvFormat::kBf16: return std::ldexp(std::fabs(x), -8);  // half a bf16 ulp
    // e4m3: 3 mantissa bits (half ulp 2^-4 relative); below 2^-6 the step is 2^-9 (times scale)
    case KvFormat::kFp8E4m3: return std::ldexp(std::fabs(x), -4) + std::ldexp(scale, -10);
    // half a step, plus fp32 rounding of min + scale * q
    case KvFormat::kInt8:
    case KvFormat::kInt6: return scale / 2 + 4e-7 * (std::fabs(x) + 1);
  }
  return 0;
}

std::vector<float> vector_of(int d, std::uint64_t seed, int kind) {
  switch (kind) {
    case 0: return test::random_floats(static_cast<std::size_t>(d), seed, -3, 3);
    case 1: return test::random_floats(static_cast<std::size_t>(d), seed, 100, 100.5f);  // offset, narrow
    case 2: return std::vector<float>(static_cast<std::size_t>(d), -1.25f);              // constant
    default: {
      auto v = test::random_floats(static_cast<std::size_t>(d), seed, -1e-3f, 1e-3f);  // tiny with one outlier
      v[static_cast<std::size_t>(d / 2)] = 40.0f;
      return v;
    }
  }
}

}  // namespace

TEST_CASE("kv_format: every format's round trip is within its bound") {
  for (auto const& [f, name] : kKvFormats) {
    CAPTURE(name);
    for (int d : {1, 7, 8, 63, 64, 65, 100, 128, 256}) {
      CAPTURE(d);
      for (int kind = 0; kind < 4; ++kind) {
        CAPTURE(kind);
        auto const x = vector_of(d, static_cast<std::uint64_t>(d * 10 + kind), kind);
        std::vector<std::uint8_t> stored(static_cast<std::size_t>(kv_head_bytes(f, d)));
        kv_encode(f, x.data(), d, stored.data());
        std::vector<float> y(x.size());
        kv_decode(f, stored.data(), d, y.data());
        for (int i = 0; i < d; ++i) {
          double const err = std::fabs(static_cast<double>(y[static_cast<std::size_t>(i)]) - x[static_cast<std::size_t>(i)]);
          double const scale = kv_stored_scale(f, stored.data(), i / kKvGroup);
          INFO("value ", i, ": ", x[static_cast<std::size_t>(i)], " came back as ", y[static_cast<std::size_t>(i)]);
          CHECK(err <= bound(f, x[static_cast<std::size_t>(i)], scale));
        }
        if (kind == 2) CHECK(y == x);  // a constant group is exact (scale 0)
      }
    }
  }
  // The int6 bound is half a step of the group's range: 40 over 63 steps here.
  auto const x = vector_of(64, 3, 3);
  std::vector<std::uint8_t> stored(static_cast<std::size_t>(kv_head_bytes(KvFormat::kInt6, 64)));
  kv_encode(KvFormat::kInt6, x.data(), 64, stored.data());
  CHECK(kv_stored_scale(KvFormat::kInt6, stored.data(), 0) == doctest::Approx((40.0 + 1e-3) / 63).epsilon(1e-3));
}

TEST_CASE("kv_format: values beyond the fp16 range saturate instead of turning into Inf or NaN") {
  std::vector<float> x(64, 1.0f);
  x[0] = -1e6f;
  x[1] = 1e6f;
  for (KvFormat f : {KvFormat::kInt8, KvFormat::kInt6}) {
    std::vector<std::uint8_t> stored(static_cast<std::size_t>(kv_head_bytes(f, 64)));
    kv_encode(f, x.data(), 64, stored.data());
    std::vector<float> y(64);
    kv_decode(f, stored.data(), 64, y.data());
    for (float v : y) CHECK(std::isfinite(v));
  }
}

#if QFLASH_HAS_X86_SIMD
TEST_CASE("kv_format: the AVX2 decoder equals kv_decode bit for bit") {
  if (arch::detect_cpu_isa() < arch::CpuIsa::kAvx2) return;
  for (auto const& [f, name] : kKvFormats) {
    CAPTURE(name);
    for (int d : {8, 64, 72, 128, 200, 256}) {
      CAPTURE(d);
      for (int kind = 0; kind < 4; ++kind) {
        auto const x = vector_of(d, static_cast<std::uint64_t>(d + kind), kind);
        // 8 bytes of room after the vector, as the pool's arenas keep.
        std::vector<std::uint8_t> stored(static_cast<std::size_t>(kv_head_bytes(f, d) + 8));
        kv_encode(f, x.data(), d, stored.data());
        std::vector<float> want(x.size()), got(x.size());
        kv_decode(f, stored.data(), d, want.data());
        kernels::cpu::decode_avx2(f, stored.data(), d, got.data());
        for (int i = 0; i < d; ++i)
          CHECK(std::bit_cast<std::uint32_t>(got[static_cast<std::size_t>(i)]) ==
                std::bit_cast<std::uint32_t>(want[static_cast<std::size_t>(i)]));
      }
    }
  }
}
#endif
