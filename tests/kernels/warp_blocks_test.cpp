// The CUDA linear kernels' warp decoding of block formats (kernels/linear/warp_blocks.hpp), run
// on the host: the lanes sharing a block cover each of its values once and decode the values
// the format's dequantizer gives.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "qflash/kernels/linear/warp_blocks.hpp"

using namespace qflash;
using qflash::kernels::linear_cuda::WarpBlocks;

namespace {

/// `n` blocks of random bytes whose fp16 fields (at `half_offsets`) hold values of magnitude
/// 0.25 to 2 and either sign, so every code and scale pattern occurs and a wrong code moves a
/// value by at least 0.25 times its sub-block scale.
std::vector<std::byte> random_blocks(std::size_t block_bytes, int n, std::vector<int> const& half_offsets,
                                     std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> bytes(block_bytes * n);
  for (auto& b : bytes) b = static_cast<std::byte>(rng());
  std::uniform_real_distribution<float> scale(0.25f, 2.0f);
  for (int i = 0; i < n; ++i)
    for (int at : half_offsets) {
      float const s = rng() % 2 ? scale(rng) : -scale(rng);
      std::uint16_t const h = to_fp16(s).bits;
      std::memcpy(bytes.data() + i * block_bytes + at, &h, sizeof h);
    }
  return bytes;
}

template <WeightFormat kF>
void check_format(std::vector<int> const& half_offsets, bool exact) {
  using W = WarpBlocks<kF>;
  constexpr int kBV = block_values(kF);
  constexpr int kBlocks = 64;
  std::size_t const block_bytes = static_cast<std::size_t>(row_bytes(kF, kBV));
  std::vector<std::byte> const bytes = random_blocks(block_bytes, kBlocks, half_offsets, 7 + static_cast<int>(kF));
  WeightView w{};
  w.format = kF;
  w.rows = kBlocks;
  w.cols = kBV;
  w.data = bytes.data();
  std::vector<float> want(kBV);
  for (int b = 0; b < kBlocks; ++b) {
    dequantize_row(w, b, want.data());
    std::vector<int> seen(kBV, 0);
    for (int part = 0; part < W::kLanesPerBlock; ++part) {
      float got[W::kValues];
      W::decode(bytes.data() + b * block_bytes, part, got);
      for (int v = 0; v < W::kValues; ++v) {
        int const i = W::index(part, v);
        REQUIRE(i >= 0);
        REQUIRE(i < kBV);
        ++seen[i];
        if (exact)
          REQUIRE(got[v] == want[i]);
        else  // a multiply-add the compiler may fuse or not (values below 2^11: ulps below 2^-12)
          REQUIRE(std::fabs(got[v] - want[i]) <= 1e-3f);
      }
    }
    for (int i = 0; i < kBV; ++i) REQUIRE(seen[i] == 1);
  }
}

}  // namespace

TEST_CASE("warp block decoding covers every value once and equals the dequantizer") {
  SUBCASE("q8_0") { check_format<WeightFormat::kQ8_0>({0}, true); }
  SUBCASE("q4_k") { check_format<WeightFormat::kQ4K>({0, 2}, false); }
  SUBCASE("q6_k") { check_format<WeightFormat::kQ6K>({208}, true); }
  SUBCASE("int4") { check_format<WeightFormat::kInt4>({0, 2}, false); }
}

TEST_CASE("warp block decoding: a warp's lanes split evenly over whole blocks") {
  auto check = []<WeightFormat kF>() {
    using W = WarpBlocks<kF>;
    CHECK(32 % W::kLanesPerBlock == 0);
    CHECK(W::kLanesPerBlock * W::kValues == block_values(kF));
  };
  check.template operator()<WeightFormat::kQ8_0>();
  check.template operator()<WeightFormat::kQ4K>();
  check.template operator()<WeightFormat::kQ6K>();
  check.template operator()<WeightFormat::kInt4>();
}
