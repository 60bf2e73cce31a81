// linear's tensor-core path for block formats on CUDA (kernels/linear/mma_blocks.hpp), run on
// the host: the weight codes and spans equal the formats' dequantizers; the stage copies fill
// what the fragments read; the A loads are free of bank conflicts; and the kernel's work, tile
// by tile through an emulated mma.sync (support/mma_emulator.hpp), equals ref::linear.
#include <doctest/doctest.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "qflash/kernels/linear/mma_blocks.hpp"
#include "qflash/kernels/linear/ref.hpp"
#include "qflash/numeric/weight_encode.hpp"
#include "support/mma_emulator.hpp"
#include "support/random.hpp"
#include "support/tolerance.hpp"

using namespace qflash;
using namespace qflash::kernels;
namespace mma = qflash::kernels::linear_cuda::mma;
namespace mb = qflash::kernels::linear_cuda::mma_blocks;
using test::Acc;
using test::Regs2;
using test::Regs4;

namespace {

constexpr WeightFormat kFormats[] = {WeightFormat::kQ8_0, WeightFormat::kQ4K, WeightFormat::kQ6K, WeightFormat::kInt4};

/// f(std::integral_constant<WeightFormat, kF>{}) for the format f names.
template <class F>
void with_block_format(WeightFormat f, F&& fn) {
  switch (f) {
    case WeightFormat::kQ8_0: return fn(std::integral_constant<WeightFormat, WeightFormat::kQ8_0>{});
    case WeightFormat::kQ4K: return fn(std::integral_constant<WeightFormat, WeightFormat::kQ4K>{});
    case WeightFormat::kQ6K: return fn(std::integral_constant<WeightFormat, WeightFormat::kQ6K>{});
    case WeightFormat::kInt4: return fn(std::integral_constant<WeightFormat, WeightFormat::kInt4>{});
    default: FAIL("not a block format");
  }
}

/// Weights whose rows and blocks differ in scale, so that every span's scale and offset count.
OwnedMatrix random_matrix(WeightFormat f, std::int64_t n, std::int64_t k, unsigned seed) {
  auto w = test::random_floats(static_cast<std::size_t>(n * k), seed, -1, 1);
  for (std::int64_t i = 0; i < n * k; ++i)
    w[static_cast<std::size_t>(i)] = w[static_cast<std::size_t>(i)] * static_cast<float>(1 + (i / k) % 5 + i % k / 32 % 3) +
                                     (i % k / 64 % 2 ? 0.5f : 0.0f);
  return encode_matrix(f, w.data(), n, k);
}

/// The kernel's workspace, as the quantize kernel writes it: codes [m][k] (bf16 bits), and per
/// group of 32 columns a row of scales and of scaled code sums [k / 32][m].
struct Workspace {
  std::vector<std::uint16_t> codes;
  std::vector<float> scales, sums;
};

Workspace quantize(WeightFormat f, std::vector<float> const& x, std::int64_t m, std::int64_t k) {
  Workspace ws;
  std::int64_t const groups = k / mb::kGroup;
  ws.codes.resize(static_cast<std::size_t>(m * k));
  ws.scales.assign(static_cast<std::size_t>(groups * m), std::numeric_limits<float>::quiet_NaN());
  ws.sums = ws.scales;
  auto put = [&](std::int64_t t, std::int64_t col, std::int8_t const* q, float d) {  // one group
    int sum = 0;
    for (int i = 0; i < mb::kGroup; ++i) {
      ws.codes[static_cast<std::size_t>(t * k + col + i)] = mb::bf16_of_code(q[i]);
      sum += q[i];
    }
    std::size_t const at = static_cast<std::size_t>(col / mb::kGroup * m + t);
    ws.scales[at] = d;
    ws.sums[at] = d * static_cast<float>(sum);
  };
  bool const q8_k = f == WeightFormat::kQ4K || f == WeightFormat::kQ6K;
  for (std::int64_t t = 0; t < m; ++t) {
    float const* row = x.data() + t * k;
    if (q8_k) {
      for (std::int64_t b = 0; b < k; b += gguf::kQ4KBlockSize) {
        gguf::BlockQ8K const q = gguf::quantize_q8_k(row + b);
        for (int j = 0; j < gguf::kQ4KBlockSize / mb::kGroup; ++j) put(t, b + 32 * j, q.qs + 32 * j, q.d);
      }
    } else {
      for (std::int64_t b = 0; b < k; b += gguf::kQ8_0BlockSize) {
        gguf::BlockQ8_0 const q = gguf::quantize_q8_0_activations(row + b);
        put(t, b, q.qs, to_float(q.d));
      }
    }
  }
  return ws;
}

/// The kernel's work on the host: y = x W^T for block-format W, tile by tile.
template <WeightFormat kF, int kMTiles>
std::vector<float> tiled_linear(WeightView const& w, std::vector<float> const& x, std::int64_t m) {
  using T = mb::Tile<kMTiles>;
  using C = mb::Codes<kF>;
  constexpr int kSpans = mb::kGroup / C::kSpan;
  std::int64_t const n = w.rows, k = w.cols;
  Workspace const ws = quantize(kF, x, m, k);
  std::vector<float> y(static_cast<std::size_t>(m * n), std::numeric_limits<float>::quiet_NaN());
  std::vector<std::uint8_t> stage(T::kStageBytes);
  auto word = [&](int byte) {
    std::uint32_t v;
    std::memcpy(&v, stage.data() + byte, 4);
    return v;
  };
  auto stage_float = [&](int byte) {
    float v;
    std::memcpy(&v, stage.data() + byte, 4);
    return v;
  };
  using WarpAcc = std::array<std::array<std::array<Acc, mma::kNTiles>, kMTiles>, 32>;
  for (std::int64_t n0 = 0; n0 < n; n0 += mma::kBlockN)
    for (std::int64_t m0 = 0; m0 < m; m0 += T::kBlockM) {
      std::array<WarpAcc, mma::kWarps> acc{};
      for (std::int64_t k0 = 0; k0 < k; k0 += mb::kGroup) {
        std::fill(stage.begin(), stage.end(), std::uint8_t{0xFF});  // NaN: a copy that is missed shows
        for (int c = 0; c < T::kCopies; ++c) {
          mb::StageCopy const s = mb::stage_copy<kMTiles>(c);
          std::int64_t const token = m0 + s.token;
          bool const valid = token < m;
          void const* src = s.what == 0   ? static_cast<void const*>(ws.codes.data() + token * k + k0 + s.col)
                            : s.what == 1 ? static_cast<void const*>(ws.scales.data() + k0 / mb::kGroup * m + token)
                                          : static_cast<void const*>(ws.sums.data() + k0 / mb::kGroup * m + token);
          if (valid)
            std::memcpy(stage.data() + s.smem, src, static_cast<std::size_t>(mb::copy_bytes(s)));
          else
            std::memset(stage.data() + s.smem, 0, static_cast<std::size_t>(mb::copy_bytes(s)));
        }
        for (int warp = 0; warp < mma::kWarps; ++warp) {
          std::array<std::array<Regs2, 32>, mma::kNTiles> b[2];
          std::array<std::array<std::array<mb::Affine, kSpans>, 2>, mma::kNTiles> affine[32];
          for (int lane = 0; lane < 32; ++lane)
            for (int nt = 0; nt < mma::kNTiles; ++nt) {
              std::int64_t const row = n0 + warp * 16 + nt * 8 + mma::group_of(lane);
              for (int ks = 0; ks < 2; ++ks) {
                std::uint32_t regs[2];
                mb::b_fragment<kF>(row < n ? w.row(row) : nullptr, k0, lane, ks, regs);
                b[ks][static_cast<std::size_t>(nt)][static_cast<std::size_t>(lane)] = {regs[0], regs[1]};
              }
              for (int e = 0; e < 2; ++e) {
                std::int64_t const o = n0 + warp * 16 + nt * 8 + mma::c_row(lane, e);
                for (int sp = 0; sp < kSpans; ++sp)
                  affine[lane][static_cast<std::size_t>(nt)][static_cast<std::size_t>(e)][static_cast<std::size_t>(sp)] =
                      o < n ? C::affine(w.row(o), k0 + sp * C::kSpan) : mb::Affine{};
              }
            }
          std::array<std::array<std::array<Acc, 32>, mma::kNTiles>, kMTiles> part{};
          for (int ks = 0; ks < 2; ++ks) {
            for (int mt = 0; mt < kMTiles; ++mt) {
              std::array<Regs4, 32> a;
              for (int lane = 0; lane < 32; ++lane) {
                int const lo = 2 * mb::a_offset(mt * 16 + mma::group_of(lane), lane, ks);
                int const hi = 2 * mb::a_offset(mt * 16 + mma::group_of(lane) + 8, lane, ks);
                a[static_cast<std::size_t>(lane)] = {word(lo), word(hi), word(lo + 4), word(hi + 4)};
              }
              for (int nt = 0; nt < mma::kNTiles; ++nt)
                test::emulate_mma(part[static_cast<std::size_t>(mt)][static_cast<std::size_t>(nt)], a,
                                  b[ks][static_cast<std::size_t>(nt)]);
            }
            if (kSpans == 1 && ks == 0) continue;  // a span of 32: both k-steps
            int const sp = kSpans == 1 ? 0 : ks;
            for (int lane = 0; lane < 32; ++lane)
              for (int mt = 0; mt < kMTiles; ++mt)
                for (int nt = 0; nt < mma::kNTiles; ++nt)
                  for (int r = 0; r < 4; ++r) {
                    int const token = mt * 16 + mma::c_token(lane, r);
                    float& p = part[static_cast<std::size_t>(mt)][static_cast<std::size_t>(nt)][static_cast<std::size_t>(lane)]
                                   [static_cast<std::size_t>(r)];
                    float& out = acc[static_cast<std::size_t>(warp)][static_cast<std::size_t>(lane)]
                                    [static_cast<std::size_t>(mt)][static_cast<std::size_t>(nt)][static_cast<std::size_t>(r)];
                    out = mb::add_span(out, p, stage_float(T::kScaleBase + 4 * token), stage_float(T::kSumBase + 4 * token),
                                       affine[lane][static_cast<std::size_t>(nt)][static_cast<std::size_t>(r % 2)]
                                             [static_cast<std::size_t>(sp)]);
                    p = 0.0f;
                  }
          }
        }
      }
      for (int warp = 0; warp < mma::kWarps; ++warp)
        for (int lane = 0; lane < 32; ++lane)
          for (int mt = 0; mt < kMTiles; ++mt)
            for (int nt = 0; nt < mma::kNTiles; ++nt)
              for (int r = 0; r < 4; ++r) {
                std::int64_t const t = m0 + mt * 16 + mma::c_token(lane, r);
                std::int64_t const o = n0 + warp * 16 + nt * 8 + mma::c_row(lane, r);
                if (t < m && o < n)
                  y[static_cast<std::size_t>(t * n + o)] =
                      acc[static_cast<std::size_t>(warp)][static_cast<std::size_t>(lane)][static_cast<std::size_t>(mt)]
                         [static_cast<std::size_t>(nt)][static_cast<std::size_t>(r)];
              }
    }
  return y;
}

template <int kMTiles>
void check_shape(WeightFormat f, std::int64_t m, std::int64_t n, std::int64_t k) {
  CAPTURE(to_string(f));
  CAPTURE(kMTiles);
  CAPTURE(m);
  CAPTURE(n);
  CAPTURE(k);
  REQUIRE(row_fits(f, k));
  REQUIRE(mb::usable(WeightView{f, nullptr, n, k}, mma::kMinTokens));
  OwnedMatrix const w = random_matrix(f, n, k, 301);
  auto const x = test::random_floats(static_cast<std::size_t>(m * k), 302, -2, 2);
  std::vector<float> got;
  with_block_format(f, [&](auto kf) { got = tiled_linear<decltype(kf)::value, kMTiles>(w.view, x, m); });
  std::vector<float> want(static_cast<std::size_t>(m * n));
  LinearArgs a{};
  a.w = w.view, a.x = x.data(), a.y = want.data(), a.n_tokens = m;
  ref::linear(a);
  // Sums of the same products in another order and rounding, as linear_gpu_test allows.
  auto const r = test::all_close<float, float>(got, want, test::Tolerance{2e-4, 1e-4});
  CHECK_MESSAGE(r.ok, r.report);
}

}  // namespace

TEST_CASE("mma blocks: codes times their span's scale plus its offset are the dequantized weights") {
  for (WeightFormat f : kFormats) {
    CAPTURE(to_string(f));
    std::int64_t const n = 7, k = f == WeightFormat::kInt4 ? 416 : 512;  // int4: a short last block
    OwnedMatrix const w = random_matrix(f, n, k, 303);
    std::vector<float> want(static_cast<std::size_t>(k));
    with_block_format(f, [&](auto kf) {
      using C = mb::Codes<decltype(kf)::value>;
      for (std::int64_t r = 0; r < n; ++r) {
        dequantize_row(w.view, r, want.data());
        for (std::int64_t c = 0; c < k; c += 4) {
          CAPTURE(r);
          CAPTURE(c);
          int q[4];
          C::four(w.view.row(r), c, q);
          mb::Affine const s = C::affine(w.view.row(r), c / C::kSpan * C::kSpan);
          for (int v = 0; v < 4; ++v) {
            CHECK(std::abs(q[v]) <= 128);  // exact in bf16, and sums of 32 products exact in fp32
            CHECK(s.scale * static_cast<float>(q[v]) + s.offset == want[static_cast<std::size_t>(c + v)]);
          }
        }
      }
    });
  }
}

TEST_CASE("mma blocks: a bf16 pair of small integers holds them exactly") {
  for (int lo = -128; lo <= 128; ++lo)
    for (int hi : {-128, -33, -1, 0, 1, 15, 127, lo}) {
      std::uint32_t const p = mb::bf16_pair(lo, hi);
      CHECK(test::bf16_lo(p) == static_cast<float>(lo));
      CHECK(test::bf16_hi(p) == static_cast<float>(hi));
    }
}

TEST_CASE("mma blocks: the stage copies fill every byte the fragments and spans read, once") {
  auto check = [](auto m_tiles) {
    constexpr int kM = decltype(m_tiles)::value;
    using T = mb::Tile<kM>;
    CAPTURE(kM);
    std::vector<int> filled(T::kStageBytes, 0);
    for (int c = 0; c < T::kCopies; ++c) {
      mb::StageCopy const s = mb::stage_copy<kM>(c);
      CHECK(s.smem % mb::copy_bytes(s) == 0);  // aligned destinations
      CHECK((s.what == 0 ? s.col * 2 : 0) + (s.what == 0 ? mma::kCopyBytes : 4) <= mb::kGroup * 2);
      for (int e = 0; e < mb::copy_bytes(s); ++e) ++filled[static_cast<std::size_t>(s.smem + e)];
    }
    std::vector<int> read(T::kStageBytes, 0);
    for (int token = 0; token < T::kBlockM; ++token)
      for (int lane = 0; lane < 32; ++lane)
        for (int ks = 0; ks < 2; ++ks)
          for (int e = 0; e < 8; ++e) read[static_cast<std::size_t>(2 * mb::a_offset(token, lane, ks) + e)] = 1;
    for (int b = T::kScaleBase; b < T::kStageBytes; ++b) read[static_cast<std::size_t>(b)] = 1;
    for (int b = 0; b < T::kStageBytes; ++b) {
      CAPTURE(b);
      CHECK(filled[static_cast<std::size_t>(b)] == read[static_cast<std::size_t>(b)]);
    }
    CHECK(2 * T::kStageBytes <= 48 * 1024);  // static shared memory
  };
  check(std::integral_constant<int, 1>{});
  check(std::integral_constant<int, 4>{});
}

TEST_CASE("mma blocks: each half-warp's 8-byte A loads fall in 32 banks") {
  // A warp's 8-byte shared loads are served a half-warp at a time; 16 lanes reading 16 words
  // pairs in distinct banks take one access.
  for (int ks = 0; ks < 2; ++ks)
    for (int mt = 0; mt < 4; ++mt)
      for (int row8 = 0; row8 < 2; ++row8)
        for (int half = 0; half < 2; ++half) {
          std::array<int, 32> seen{};
          for (int lane = 16 * half; lane < 16 * half + 16; ++lane) {
            int const word = mb::a_offset(mt * 16 + mma::group_of(lane) + 8 * row8, lane, ks) / 2;
            CHECK(word % 2 == 0);  // 8-byte aligned
            ++seen[static_cast<std::size_t>(word % 32)];
            ++seen[static_cast<std::size_t>((word + 1) % 32)];
          }
          for (int bank = 0; bank < 32; ++bank) CHECK(seen[static_cast<std::size_t>(bank)] == 1);
        }
}

TEST_CASE("mma blocks: the tiles' products equal ref::linear in every block format") {
  for (WeightFormat f : kFormats) {
    bool const k_quant = f == WeightFormat::kQ4K || f == WeightFormat::kQ6K;
    // Whole tiles; rows and tokens short of a tile; many k-groups.
    check_shape<4>(f, 64, 64, 256);
    check_shape<4>(f, 70, 130, 512);
    check_shape<1>(f, 16, 64, 256);
    check_shape<1>(f, 17, 72, k_quant ? 768 : 96);
    check_shape<4>(f, 33, 5, 1024);
  }
  check_shape<4>(WeightFormat::kInt4, 20, 40, 160);  // a short last int4 block
}
