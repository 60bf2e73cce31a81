// linear's tensor-core tile on CUDA (kernels/linear/mma_tile.hpp), run on the host: the stage
// copies, fragment offsets and accumulator places the kernel uses, driven through an emulated
// mma.sync.m16n8k16.row.col (support/mma_emulator.hpp), equal ref::linear over
// whole and partial tiles. Also: the activation split, and the fragment loads' banks.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "qflash/kernels/linear/mma_tile.hpp"
#include "qflash/kernels/linear/ref.hpp"
#include "qflash/numeric/weight_encode.hpp"
#include "support/mma_emulator.hpp"
#include "support/random.hpp"
#include "support/tolerance.hpp"

using namespace qflash;
using namespace qflash::kernels;
namespace mma = qflash::kernels::linear_cuda::mma;

namespace {

using test::Acc;
using test::bf16_hi;
using test::bf16_lo;
using test::emulate_mma;
using test::Regs2;
using test::Regs4;

/// The kernel's work, tile by tile on the host: y[j] = x W[j]^T for kMats matrices of one
/// shape and format (kWBytes: bf16 2, whose hi part's products are summed apart from the
/// others'; fp8 e4m3 1, whose stage sums take their block's scale).
template <int kMTiles, int kMats, int kWBytes>
std::array<std::vector<float>, kMats> tiled_linear(std::array<WeightView, kMats> const& w, std::vector<float> const& x,
                                                   std::int64_t m) {
  using T = mma::Tile<kMTiles, kMats, kWBytes>;
  std::int64_t const n = w[0].rows, k = w[0].cols;
  std::vector<std::uint16_t> parts(static_cast<std::size_t>(mma::kParts * m * k));
  for (std::int64_t i = 0; i < m * k; ++i) {
    std::uint16_t p[mma::kParts];
    mma::split3(x[static_cast<std::size_t>(i)], p);
    for (int j = 0; j < mma::kParts; ++j) parts[static_cast<std::size_t>(j * m * k + i)] = p[j];
  }
  std::array<std::vector<float>, kMats> y;
  for (auto& v : y) v.assign(static_cast<std::size_t>(m * n), std::numeric_limits<float>::quiet_NaN());
  std::vector<std::uint8_t> stage(T::kStageBytes);
  for (std::int64_t n0 = 0; n0 < n; n0 += mma::kBlockN)
    for (std::int64_t m0 = 0; m0 < m; m0 += T::kBlockM) {
      using WarpAcc = std::array<std::array<std::array<std::array<Acc, mma::kNTiles>, kMTiles>, kMats>, 32>;
      std::array<WarpAcc, mma::kWarps> acc{}, sums{};
      auto const fold = [&](auto const& scale_of) {  // acc += scale_of(j) sums
        for (int warp = 0; warp < mma::kWarps; ++warp)
          for (int lane = 0; lane < 32; ++lane)
            for (int j = 0; j < kMats; ++j)
              for (int mt = 0; mt < kMTiles; ++mt)
                for (int nt = 0; nt < mma::kNTiles; ++nt)
                  for (int r = 0; r < 4; ++r)
                    acc[warp][lane][j][mt][nt][r] =
                        std::fma(scale_of(j), sums[warp][lane][j][mt][nt][r], acc[warp][lane][j][mt][nt][r]);
      };
      for (std::int64_t k0 = 0; k0 < k; k0 += mma::kBlockK) {
        std::fill(stage.begin(), stage.end(), std::uint8_t{0xFF});  // NaN: a copy that is missed shows
        for (int c = 0; c < T::kCopies; ++c) {
          mma::StageCopy const s = mma::stage_copy<kMTiles, kMats, kWBytes>(c);
          std::int64_t const col = k0 + s.col, row = (s.weight ? n0 : m0) + s.row;
          bool const valid = col < k && row < (s.weight ? n : m);
          auto const* src = s.weight ? static_cast<std::uint8_t const*>(w[static_cast<std::size_t>(s.mat)].data) +
                                           (row * k + col) * kWBytes
                                     : reinterpret_cast<std::uint8_t const*>(parts.data() + s.part * m * k + row * k + col);
          for (int e = 0; e < mma::kCopyBytes; ++e)
            stage[static_cast<std::size_t>(s.smem + e)] = valid ? src[e] : std::uint8_t{0};
        }
        auto word = [&](int byte) {
          std::uint32_t v;
          std::memcpy(&v, stage.data() + byte, 4);
          return v;
        };
        auto b_reg = [&](int byte) {
          if constexpr (kWBytes == 2) return word(byte);
          std::uint16_t codes;
          std::memcpy(&codes, stage.data() + byte, 2);
          return mma::bf16_pair_of_e4m3(codes);
        };
        if (kWBytes == 1) sums = {};
        for (int warp = 0; warp < mma::kWarps; ++warp)
          for (int ks = 0; ks < mma::kBlockK / 16; ++ks)
            for (int j = 0; j < kMats; ++j)
              for (int nt = 0; nt < mma::kNTiles; ++nt) {
                std::array<Regs2, 32> b;
                for (int lane = 0; lane < 32; ++lane)
                  for (int r = 0; r < 2; ++r)
                    b[lane][r] = b_reg(mma::b_offset<kWBytes>(lane, r, j * mma::kBlockN + warp * 16 + nt * 8, ks));
                for (int mt = 0; mt < kMTiles; ++mt)
                  for (int part = mma::kParts - 1; part >= 0; --part) {
                    std::array<Regs4, 32> a;
                    for (int lane = 0; lane < 32; ++lane)
                      for (int r = 0; r < 4; ++r)
                        a[lane][r] = word(4 * mma::a_word<kMTiles, kMats, kWBytes>(lane, r, mt, part, ks));
                    auto& into = kWBytes == 2 && part == 0 ? acc : sums;
                    std::array<Acc, 32> c;
                    for (int lane = 0; lane < 32; ++lane) c[lane] = into[warp][lane][j][mt][nt];
                    emulate_mma(c, a, b);
                    for (int lane = 0; lane < 32; ++lane) into[warp][lane][j][mt][nt] = c[lane];
                  }
              }
        if (kWBytes == 1)
          fold([&](int j) { return w[static_cast<std::size_t>(j)].scale_row(n0)[k0 / kFp8BlockSize]; });
      }
      if (kWBytes == 2) fold([](int) { return 1.0f; });
      for (int warp = 0; warp < mma::kWarps; ++warp)
        for (int lane = 0; lane < 32; ++lane)
          for (int j = 0; j < kMats; ++j)
            for (int mt = 0; mt < kMTiles; ++mt)
              for (int nt = 0; nt < mma::kNTiles; ++nt)
                for (int r = 0; r < 4; ++r) {
                  std::int64_t const t = m0 + mt * 16 + mma::c_token(lane, r);
                  std::int64_t const o = n0 + warp * 16 + nt * 8 + mma::c_row(lane, r);
                  if (t < m && o < n)
                    y[static_cast<std::size_t>(j)][static_cast<std::size_t>(t * n + o)] = acc[warp][lane][j][mt][nt][r];
                }
    }
  return y;
}

template <int kMTiles, int kMats = 1, WeightFormat kF = WeightFormat::kBf16>
void check_shape(std::int64_t m, std::int64_t n, std::int64_t k) {
  CAPTURE(kMTiles);
  CAPTURE(kMats);
  CAPTURE(to_string(kF));
  CAPTURE(m);
  CAPTURE(n);
  CAPTURE(k);
  auto const x = test::random_floats(static_cast<std::size_t>(m * k), 202, -2, 2);
  std::vector<OwnedMatrix> w;
  std::array<WeightView, kMats> views;
  for (int j = 0; j < kMats; ++j) {
    // Rows of very different sizes, so that each fp8 block gets its own scale.
    auto wf = test::random_floats(static_cast<std::size_t>(n * k), 201 + static_cast<unsigned>(j), -1, 1);
    for (std::int64_t i = 0; i < n * k; ++i) wf[static_cast<std::size_t>(i)] *= static_cast<float>(1 + (i / k) % 5 + i % k / 128);
    w.push_back(encode_matrix(kF, wf.data(), n, k));
    views[static_cast<std::size_t>(j)] = w.back().view;
  }
  auto const got = tiled_linear<kMTiles, kMats, mma::weight_bytes(kF)>(views, x, m);
  for (int j = 0; j < kMats; ++j) {
    CAPTURE(j);
    std::vector<float> want(static_cast<std::size_t>(m * n));
    LinearArgs a{};
    a.w = views[static_cast<std::size_t>(j)];
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
  for (float v : {0.0f, -0.0f, 1.0f, 1.00390625f, 3.1415927f, 1e-30f, -1e-38f, 1e-45f, 3e38f, -7.5e-20f,
                  3.4e38f, -std::numeric_limits<float>::max()})  // the last two: past bf16's largest
    values.push_back(v);
  for (float v : values) {
    CAPTURE(v);
    std::uint16_t p[mma::kParts];
    mma::split3(v, p);
    // The parts' sum, smallest first as the kernel adds their products, is exact in double.
    double const sum = static_cast<double>(to_float(Bf16{p[2]})) + to_float(Bf16{p[1]}) + to_float(Bf16{p[0]});
    CHECK(std::fabs(sum - v) <= std::max(std::ldexp(std::fabs(static_cast<double>(v)), -24), std::ldexp(1.0, -133)));
    if (std::fabs(v) < 3.39e38f) CHECK(to_float(Bf16{p[0]}) == round_to_bf16(v));
  }
  // Inf and NaN keep their value in hi, with zero parts after it.
  for (float v : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN()}) {
    CAPTURE(v);
    std::uint16_t p[mma::kParts];
    mma::split3(v, p);
    float const hi = to_float(Bf16{p[0]});
    CHECK((std::isnan(v) ? std::isnan(hi) : hi == v));
    CHECK(p[1] == 0);
    CHECK(p[2] == 0);
  }
}

TEST_CASE("mma tile: two e4m3 codes widen to the bf16 pair of their values") {
  for (int lo = 0; lo < 256; ++lo)
    for (int hi : {0x00, 0x01, 0x38, 0x7E, 0x7F, 0x80, 0xB9, 0xFF, lo}) {
      CAPTURE(lo);
      CAPTURE(hi);
      std::uint32_t const pair = mma::bf16_pair_of_e4m3(static_cast<std::uint16_t>(lo | hi << 8));
      float const want_lo = to_float(Fp8E4m3{static_cast<std::uint8_t>(lo)});
      float const want_hi = to_float(Fp8E4m3{static_cast<std::uint8_t>(hi)});
      float const got_lo = bf16_lo(pair), got_hi = bf16_hi(pair);
      if (std::isnan(want_lo))
        CHECK(std::isnan(got_lo));
      else
        CHECK(std::bit_cast<std::uint32_t>(got_lo) == std::bit_cast<std::uint32_t>(want_lo));
      if (std::isnan(want_hi))
        CHECK(std::isnan(got_hi));
      else
        CHECK(std::bit_cast<std::uint32_t>(got_hi) == std::bit_cast<std::uint32_t>(want_hi));
    }
}

TEST_CASE("mma tile: each fragment register's 32 loads fall in 32 banks, or share a word") {
  // Lanes that read one word are served by one access; lanes that read different words of one
  // bank wait for each other.
  auto check_banks = [](auto const& byte_of_lane) {
    std::array<int, 32> word_in_bank;
    word_in_bank.fill(-1);
    for (int lane = 0; lane < 32; ++lane) {
      int const word = byte_of_lane(lane) / 4;
      int& seen = word_in_bank[static_cast<std::size_t>(word % 32)];
      CHECK((seen == -1 || seen == word));
      seen = word;
    }
  };
  for (int ks = 0; ks < mma::kBlockK / 16; ++ks) {
    for (int r = 0; r < 4; ++r)
      for (int mt = 0; mt < 4; ++mt)
        for (int p = 0; p < mma::kParts; ++p) {
          check_banks([&](int lane) { return 4 * mma::a_word<4>(lane, r, mt, p, ks); });
          check_banks([&](int lane) { return 4 * mma::a_word<4, 2, 1>(lane, r, mt, p, ks); });
        }
    for (int r = 0; r < 2; ++r)
      for (int n0 = 0; n0 < 2 * mma::kBlockN; n0 += 8) {
        check_banks([&](int lane) { return mma::b_offset<2>(lane, r, n0, ks); });
        check_banks([&](int lane) { return mma::b_offset<1>(lane, r, n0, ks); });
      }
  }
}

TEST_CASE("mma tile: the stage copies fill every byte the fragments read, once") {
  auto check = [](auto m_tiles, auto mats, auto w_bytes) {
    constexpr int kM = decltype(m_tiles)::value, kMats = decltype(mats)::value, kWB = decltype(w_bytes)::value;
    using T = mma::Tile<kM, kMats, kWB>;
    CAPTURE(kM);
    CAPTURE(kMats);
    CAPTURE(kWB);
    std::vector<int> filled(T::kStageBytes, 0);
    for (int c = 0; c < T::kCopies; ++c) {
      mma::StageCopy const s = mma::stage_copy<kM, kMats, kWB>(c);
      CHECK(s.smem % mma::kCopyBytes == 0);  // 16-byte aligned destinations
      for (int e = 0; e < mma::kCopyBytes; ++e) ++filled[static_cast<std::size_t>(s.smem + e)];
    }
    int const w_row = mma::kWLd<kWB>, a_row = mma::kLd * 2;
    for (int b = 0; b < T::kStageBytes; ++b) {
      CAPTURE(b);
      bool const data = b < T::kABase ? b % w_row < mma::kBlockK * kWB : (b - T::kABase) % a_row < mma::kBlockK * 2;
      CHECK(filled[static_cast<std::size_t>(b)] == (data ? 1 : 0));
    }
    CHECK(T::kStageBytes == T::kABase + T::kARows * a_row);
    CHECK(2 * T::kStageBytes <= 48 * 1024);  // static shared memory
  };
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  using Four = std::integral_constant<int, 4>;
  check(One{}, One{}, Two{});
  check(Four{}, One{}, Two{});
  check(One{}, Two{}, Two{});
  check(One{}, One{}, One{});
  check(Four{}, One{}, One{});
  check(One{}, Two{}, One{});
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
  // fp8 e4m3: rows and columns across several 128 x 128 scale blocks, and short of one.
  check_shape<4, 1, WeightFormat::kFp8E4m3>(70, 300, 400);
  check_shape<1, 1, WeightFormat::kFp8E4m3>(16, 64, 16);
  check_shape<1, 2, WeightFormat::kFp8E4m3>(20, 200, 272);
}
