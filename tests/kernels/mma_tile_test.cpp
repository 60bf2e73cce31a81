// linear's tensor-core tile on CUDA (kernels/linear/mma_tile.hpp), run on the host: the stage
// copies, fragment offsets and accumulator places the kernel uses, driven through an emulated
// mma.sync.m16n8k16.row.col that places each register's values where the PTX ISA says
// ("Matrix Fragments for mma.m16n8k16 with floating point type"), equal ref::linear over
// whole and partial tiles. Also: the activation split, and the fragment loads' banks.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "qflash/kernels/linear/mma_tile.hpp"
#include "qflash/kernels/linear/ref.hpp"
#include "support/random.hpp"
#include "support/tolerance.hpp"

using namespace qflash;
using namespace qflash::kernels;
namespace mma = qflash::kernels::linear_cuda::mma;

namespace {

using Regs4 = std::array<std::uint32_t, 4>;
using Regs2 = std::array<std::uint32_t, 2>;
using Acc = std::array<float, 4>;

float bf16_lo(std::uint32_t word) { return to_float(Bf16{static_cast<std::uint16_t>(word & 0xFFFF)}); }
float bf16_hi(std::uint32_t word) { return to_float(Bf16{static_cast<std::uint16_t>(word >> 16)}); }

/// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 over a warp's registers, from the PTX
/// ISA's fragment tables (g = lane >> 2, t = lane % 4):
///   A 16x16: register r holds A[g + 8 (r % 2)][2t + 8 (r / 2) + {0, 1}] (low half first);
///   B 16x8:  register r holds B[2t + 8 r + {0, 1}][g];
///   C 16x8:  c[r] is C[g + 8 (r / 2)][2t + r % 2].
void emulate_mma(std::array<Acc, 32>& c, std::array<Regs4, 32> const& a, std::array<Regs2, 32> const& b) {
  float A[16][16], B[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    int const g = lane >> 2, t = lane % 4;
    for (int r = 0; r < 4; ++r) {
      A[g + 8 * (r % 2)][2 * t + 8 * (r / 2)] = bf16_lo(a[lane][r]);
      A[g + 8 * (r % 2)][2 * t + 8 * (r / 2) + 1] = bf16_hi(a[lane][r]);
    }
    for (int r = 0; r < 2; ++r) {
      B[2 * t + 8 * r][g] = bf16_lo(b[lane][r]);
      B[2 * t + 8 * r + 1][g] = bf16_hi(b[lane][r]);
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    int const g = lane >> 2, t = lane % 4;
    for (int r = 0; r < 4; ++r) {
      int const i = g + 8 * (r / 2), j = 2 * t + r % 2;
      float s = c[lane][r];
      for (int k = 0; k < 16; ++k) s += A[i][k] * B[k][j];
      c[lane][r] = s;
    }
  }
}

/// The kernel's work, tile by tile on the host: y[j] = x W[j]^T for kMats matrices of one shape.
template <int kMTiles, int kMats>
std::array<std::vector<float>, kMats> tiled_linear(std::array<std::vector<std::uint16_t>, kMats> const& w,
                                                   std::vector<float> const& x, std::int64_t m, std::int64_t n,
                                                   std::int64_t k) {
  using T = mma::Tile<kMTiles, kMats>;
  std::vector<std::uint16_t> parts(static_cast<std::size_t>(mma::kParts * m * k));
  for (std::int64_t i = 0; i < m * k; ++i) {
    std::uint16_t p[mma::kParts];
    mma::split3(x[static_cast<std::size_t>(i)], p);
    for (int j = 0; j < mma::kParts; ++j) parts[static_cast<std::size_t>(j * m * k + i)] = p[j];
  }
  std::array<std::vector<float>, kMats> y;
  for (auto& v : y) v.assign(static_cast<std::size_t>(m * n), std::numeric_limits<float>::quiet_NaN());
  std::vector<std::uint16_t> stage(T::kStageElems);
  for (std::int64_t n0 = 0; n0 < n; n0 += mma::kBlockN)
    for (std::int64_t m0 = 0; m0 < m; m0 += T::kBlockM) {
      using WarpAcc = std::array<std::array<std::array<std::array<Acc, mma::kNTiles>, kMTiles>, kMats>, 32>;
      std::array<WarpAcc, mma::kWarps> acc{};
      for (std::int64_t k0 = 0; k0 < k; k0 += mma::kBlockK) {
        std::fill(stage.begin(), stage.end(), std::uint16_t{0xFFFF});  // NaN: a copy that is missed shows
        for (int c = 0; c < T::kCopies; ++c) {
          mma::StageCopy const s = mma::stage_copy<kMTiles, kMats>(c);
          std::int64_t const col = k0 + s.col, row = (s.weight ? n0 : m0) + s.row;
          bool const valid = col < k && row < (s.weight ? n : m);
          std::uint16_t const* src = s.weight ? w[static_cast<std::size_t>(s.mat)].data() : parts.data() + s.part * m * k;
          for (int e = 0; e < mma::kChunk; ++e)
            stage[static_cast<std::size_t>(s.smem + e)] = valid ? src[row * k + col + e] : 0;
        }
        auto word = [&](int i) {
          std::uint32_t v;
          std::memcpy(&v, stage.data() + 2 * i, 4);
          return v;
        };
        for (int warp = 0; warp < mma::kWarps; ++warp)
          for (int ks = 0; ks < mma::kBlockK / 16; ++ks)
            for (int j = 0; j < kMats; ++j)
              for (int nt = 0; nt < mma::kNTiles; ++nt) {
                std::array<Regs2, 32> b;
                for (int lane = 0; lane < 32; ++lane)
                  for (int r = 0; r < 2; ++r)
                    b[lane][r] = word(mma::b_word(lane, r, j * mma::kBlockN + warp * 16 + nt * 8, ks));
                for (int mt = 0; mt < kMTiles; ++mt)
                  for (int part = mma::kParts - 1; part >= 0; --part) {
                    std::array<Regs4, 32> a;
                    for (int lane = 0; lane < 32; ++lane)
                      for (int r = 0; r < 4; ++r) a[lane][r] = word(mma::a_word<kMTiles, kMats>(lane, r, mt, part, ks));
                    std::array<Acc, 32> c;
                    for (int lane = 0; lane < 32; ++lane) c[lane] = acc[warp][lane][j][mt][nt];
                    emulate_mma(c, a, b);
                    for (int lane = 0; lane < 32; ++lane) acc[warp][lane][j][mt][nt] = c[lane];
                  }
              }
      }
      for (int warp = 0; warp < mma::kWarps; ++warp)
        for (int lane = 0; lane < 32; ++lane)
          for (int j = 0; j < kMats; ++j)
            for (int mt = 0; mt < kMTiles; ++mt)
              for (int nt = 0; nt < mma::kNTiles; ++nt)
                for (int r = 0; r < 4; ++r) {
                  std::int64_t const t = m0 + mt * 16 + mma::c_token(lane, r);
                  std::int64_t const o = n0 + warp * 16 + nt * 8 + mma::c_row(lane, r);
                  if (t < m && o < n) y[static_cast<std::size_t>(j)][static_cast<std::size_t>(t * n + o)] = acc[warp][lane][j][mt][nt][r];
                }
    }
  return y;
}

template <int kMTiles, int kMats = 1>
void check_shape(std::int64_t m, std::int64_t n, std::int64_t k) {
  CAPTURE(kMTiles);
  CAPTURE(kMats);
  CAPTURE(m);
  CAPTURE(n);
  CAPTURE(k);
  auto const x = test::random_floats(static_cast<std::size_t>(m * k), 202, -2, 2);
  std::array<std::vector<std::uint16_t>, kMats> w;
  for (int j = 0; j < kMats; ++j) {
    auto const wf = test::random_floats(static_cast<std::size_t>(n * k), 201 + static_cast<unsigned>(j), -1, 1);
    for (float v : wf) w[static_cast<std::size_t>(j)].push_back(to_bf16(v).bits);
  }
  auto const got = tiled_linear<kMTiles, kMats>(w, x, m, n, k);
  for (int j = 0; j < kMats; ++j) {
    CAPTURE(j);
    std::vector<float> want(static_cast<std::size_t>(m * n));
    LinearArgs a{};
    a.w = WeightView{WeightFormat::kBf16, w[static_cast<std::size_t>(j)].data(), n, k};
    a.x = x.data(), a.y = want.data(), a.n_tokens = m;
    ref::linear(a);
    // fp32 sums of the same products in another order, as linear_gpu_test allows (the split
    // leaves out 2^-24 |x|, less than the sums' rounding).
    auto const r = test::all_close<float, float>(got[static_cast<std::size_t>(j)], want, test::Tolerance{2e-4, 1e-4});
    CHECK_MESSAGE(r.ok, r.report);
  }
}

}  // namespace

TEST_CASE("mma tile: the three bf16 parts of an fp32 sum back to it within 2^-24 of it") {
  auto const xs = test::random_floats(4096, 203, -1e4f, 1e4f);
  std::vector<float> values(xs.begin(), xs.end());
  for (float v : {0.0f, -0.0f, 1.0f, 1.00390625f, 3.1415927f, 1e-30f, -1e-38f, 1e-45f, 3e38f, -7.5e-20f})
    values.push_back(v);
  for (float v : values) {
    CAPTURE(v);
    std::uint16_t p[mma::kParts];
    mma::split3(v, p);
    // The parts' sum, smallest first as the kernel adds their products, is exact in double.
    double const sum = static_cast<double>(to_float(Bf16{p[2]})) + to_float(Bf16{p[1]}) + to_float(Bf16{p[0]});
    CHECK(std::fabs(sum - v) <= std::max(std::ldexp(std::fabs(static_cast<double>(v)), -24), std::ldexp(1.0, -133)));
    CHECK(to_float(Bf16{p[0]}) == round_to_bf16(v));
  }
}

TEST_CASE("mma tile: each fragment register's 32 loads fall in 32 banks") {
  for (int ks = 0; ks < mma::kBlockK / 16; ++ks) {
    for (int r = 0; r < 4; ++r)
      for (int mt = 0; mt < 4; ++mt)
        for (int p = 0; p < mma::kParts; ++p) {
          std::array<int, 32> seen{};
          for (int lane = 0; lane < 32; ++lane) ++seen[static_cast<std::size_t>(mma::a_word<4>(lane, r, mt, p, ks) % 32)];
          for (int bank = 0; bank < 32; ++bank) CHECK(seen[static_cast<std::size_t>(bank)] == 1);
        }
    for (int r = 0; r < 2; ++r)
      for (int n0 = 0; n0 < mma::kBlockN; n0 += 8) {
        std::array<int, 32> seen{};
        for (int lane = 0; lane < 32; ++lane) ++seen[static_cast<std::size_t>(mma::b_word(lane, r, n0, ks) % 32)];
        for (int bank = 0; bank < 32; ++bank) CHECK(seen[static_cast<std::size_t>(bank)] == 1);
      }
  }
}

TEST_CASE("mma tile: the stage copies fill every element the fragments read, once") {
  auto check = [](auto m_tiles, auto mats) {
    constexpr int kM = decltype(m_tiles)::value, kMats = decltype(mats)::value;
    using T = mma::Tile<kM, kMats>;
    std::vector<int> filled(T::kStageElems, 0);
    for (int c = 0; c < T::kCopies; ++c) {
      mma::StageCopy const s = mma::stage_copy<kM, kMats>(c);
      CHECK(s.smem % mma::kChunk == 0);  // 16-byte aligned destinations
      for (int e = 0; e < mma::kChunk; ++e) ++filled[static_cast<std::size_t>(s.smem + e)];
    }
    for (int row = 0; row < T::kWRows + T::kARows; ++row)
      for (int col = 0; col < mma::kLd; ++col)
        CHECK(filled[static_cast<std::size_t>(row * mma::kLd + col)] == (col < mma::kBlockK ? 1 : 0));
  };
  check(std::integral_constant<int, 1>{}, std::integral_constant<int, 1>{});
  check(std::integral_constant<int, 4>{}, std::integral_constant<int, 1>{});
  check(std::integral_constant<int, 1>{}, std::integral_constant<int, 2>{});
}

TEST_CASE("mma tile: the tiles' products equal ref::linear") {
  // Whole tiles; rows, tokens and columns short of a tile; one token; columns a single copy.
  check_shape<4>(64, 64, 64);
  check_shape<4>(70, 130, 136);
  check_shape<4>(129, 200, 520);
  check_shape<1>(16, 64, 32);
  check_shape<1>(17, 72, 40);
  check_shape<1>(1, 8, 8);
  check_shape<4>(33, 5, 1024);
  // Two matrices a stage (the experts' gate and up).
  check_shape<1, 2>(16, 64, 64);
  check_shape<1, 2>(11, 100, 72);
}
