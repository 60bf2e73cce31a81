#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "qflash/numeric/fp8_block.hpp"

using namespace qflash;

namespace {

/// A quantized weight and its scale grid.
struct Fp8Weight {
  std::vector<std::uint8_t> q;    // [rows, cols]
  std::vector<float> scale_inv;   // [ceil(rows / 128), ceil(cols / 128)]
  Fp8BlockScaleDims grid;
};

Fp8Weight quantize(std::vector<float> const& w, std::size_t rows, std::size_t cols) {
  Fp8Weight out{std::vector<std::uint8_t>(rows * cols, 0xAA), {}, fp8_block_scale_dims(rows, cols)};
  out.scale_inv.assign(out.grid.rows * out.grid.cols, -1.0f);
  quantize_fp8_block(w.data(), rows, cols, out.q.data(), out.scale_inv.data());
  return out;
}

std::vector<float> dequantize(Fp8Weight const& f, std::size_t rows, std::size_t cols) {
  std::vector<float> y(rows * cols);
  for (std::size_t r = 0; r < rows; ++r) {
    dequantize_fp8_row(f.q.data() + r * cols, f.scale_inv.data() + r / 128 * f.grid.cols, cols,
                       y.data() + r * cols);
  }
  return y;
}

}  // namespace

static_assert(fp8_block_scale_dims(130, 257).rows == 2 && fp8_block_scale_dims(130, 257).cols == 3);

TEST_CASE("fp8_block: scale grid shape") {
  auto dims = [](std::size_t r, std::size_t c) {
    Fp8BlockScaleDims const d = fp8_block_scale_dims(r, c);
    return std::pair{d.rows, d.cols};
  };
  CHECK(dims(1, 1) == std::pair<std::size_t, std::size_t>{1, 1});
  CHECK(dims(128, 128) == std::pair<std::size_t, std::size_t>{1, 1});
  CHECK(dims(129, 128) == std::pair<std::size_t, std::size_t>{2, 1});
  CHECK(dims(130, 257) == std::pair<std::size_t, std::size_t>{2, 3});
  CHECK(dims(7168, 2048) == std::pair<std::size_t, std::size_t>{56, 16});
}

TEST_CASE("fp8_block: a hand-worked tile") {
  // One 2 x 3 tile, amax 896 -> scale 2; q = e4m3(w / 2).
  std::vector<float> const w = {896.0f, -3.0f, 0.5f, 1e-3f, -896.0f, 100.0f};
  Fp8Weight const f = quantize(w, 2, 3);
  REQUIRE(f.scale_inv.size() == 1);
  CHECK(f.scale_inv[0] == 2.0f);
  CHECK(f.q[0] == 0x7E);  // 448, the largest e4m3
  CHECK(f.q[4] == 0xFE);  // -448
  CHECK(f.q[1] == 0xBC);  // -1.5 = -(1 + 4/8) * 2^0: sign, exponent 7, mantissa 4
  std::vector<float> const y = dequantize(f, 2, 3);
  CHECK(y[0] == 896.0f);
  CHECK(y[1] == -3.0f);
  CHECK(y[2] == 0.5f);
  CHECK(y[3] == 0.0f);     // 5e-4 is below half the smallest e4m3 subnormal (2^-9)
  CHECK(y[4] == -896.0f);
  CHECK(y[5] == 96.0f);    // 50 ties between 48 and 52 and goes to even 48
}

TEST_CASE("fp8_block: round trip on 130 x 257, tiles of different magnitude, one all zero") {
  std::size_t const rows = 130;
  std::size_t const cols = 257;
  std::mt19937_64 rng(0xF8B1);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::uniform_real_distribution<float> expo(-30.0f, 0.0f);
  std::vector<float> w(rows * cols);
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t c = 0; c < cols; ++c) {
      std::size_t const tr = r / 128;
      std::size_t const tc = c / 128;
      float v = uni(rng) * std::ldexp(1.0f, static_cast<int>(3 * tc) - static_cast<int>(9 * tr));
      if (tr == 0 && tc == 2) v = std::copysign(std::exp2(expo(rng)), uni(rng));  // wide range
      if (tr == 1 && tc == 1) v = 0.0f;
      w[r * cols + c] = v;
    }
  }
  Fp8Weight const f = quantize(w, rows, cols);
  REQUIRE(f.grid.rows == 2);
  REQUIRE(f.grid.cols == 3);
  std::vector<float> const y = dequantize(f, rows, cols);

  // Per tile: scale_inv = amax / 448 (1 for the zero tile), and the amax element encodes as
  // +-448.
  for (std::size_t tr = 0; tr < 2; ++tr) {
    for (std::size_t tc = 0; tc < 3; ++tc) {
      float amax = 0.0f;
      std::size_t arg = 0;
      for (std::size_t r = tr * 128; r < std::min(rows, tr * 128 + 128); ++r) {
        for (std::size_t c = tc * 128; c < std::min(cols, tc * 128 + 128); ++c) {
          if (std::fabs(w[r * cols + c]) > amax) {
            amax = std::fabs(w[r * cols + c]);
            arg = r * cols + c;
          }
        }
      }
      CAPTURE(tr);
      CAPTURE(tc);
      float const s = f.scale_inv[tr * 3 + tc];
      if (tr == 1 && tc == 1) {
        CHECK(amax == 0.0f);
        CHECK(s == 1.0f);
      } else {
        CHECK(s == amax / 448.0f);
        CHECK((f.q[arg] & 0x7F) == 0x7E);
        // 448 * fl(amax / 448): two fp32 roundings away from amax.
        CHECK(std::fabs(y[arg] - w[arg]) <= std::ldexp(amax, -22));
      }
    }
  }

  // Per element: half an e4m3 ulp relative in the normal range, else half the smallest
  // subnormal (2^-10 * scale) absolute; both plus fp32 rounding of w / scale and q * scale.
  int n_bad = 0;
  int n_normal = 0;
  int n_subnormal = 0;
  double max_rel = 0.0;
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t c = 0; c < cols; ++c) {
      std::size_t const i = r * cols + c;
      double const s = f.scale_inv[r / 128 * 3 + c / 128];
      double const x = w[i];
      double const err = std::fabs(static_cast<double>(y[i]) - x);
      bool ok = false;
      if (std::fabs(x) / s >= std::ldexp(1.0, -6)) {
        ++n_normal;
        max_rel = std::max(max_rel, err / std::fabs(x));
        ok = err <= (std::ldexp(1.0, -4) + std::ldexp(1.0, -20)) * std::fabs(x);
      } else {
        ++n_subnormal;
        ok = err <= std::ldexp(1.0, -10) * s * (1 + std::ldexp(1.0, -20));
      }
      ok = ok && y[i] == to_float(Fp8E4m3{f.q[i]}) * static_cast<float>(s);
      if (r >= 128 && c >= 128 && c < 256) ok = ok && f.q[i] == 0 && y[i] == 0.0f;
      if (!ok && ++n_bad <= 3) {
        CAPTURE(r);
        CAPTURE(c);
        CAPTURE(x);
        CAPTURE(y[i]);
        CAPTURE(s);
        CHECK(ok);
      }
    }
  }
  CHECK(n_bad == 0);
  // The data reach both regimes, and the relative bound is nearly attained (not vacuous).
  CHECK(n_subnormal > 100);
  CHECK(n_normal > 20000);
  CHECK(max_rel > 0.055);
}
