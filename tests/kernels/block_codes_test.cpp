// The CUDA kernels' block-format codes on the host (kernels/linear/block_codes.hpp,
// mma_blocks.hpp): weight words and spans equal the formats' dequantizers, over random block
// bytes and encoded matrices; the GEMV's lanes (dp4a on 16 columns each) and the tensor-core
// path's tiles (through an emulated mma.sync, support/mma_emulator.hpp) equal ref::linear;
// the stage copies fill what the fragments read; the A loads are free of bank conflicts.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
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
namespace lc = qflash::kernels::linear_cuda;
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

/// The activations as quantize_kernel writes them (rounding.cuh's CodeRows), for rows of k
/// values padded to kp = padded_cols(k): codes [m][kp] as int8 (the GEMV's) and as bf16 bits
/// (the tensor cores'), and per group of 32 columns a row of scales and of scaled code sums
/// [kp / 32][m].
struct Workspace {
  std::vector<std::int8_t> codes8;
  std::vector<std::uint16_t> codes;
  std::vector<float> scales, sums;
  std::int64_t kp = 0;
};

Workspace quantize(WeightFormat f, std::vector<float> const& x, std::int64_t m, std::int64_t k) {
  Workspace ws;
  ws.kp = lc::padded_cols(k);
  std::int64_t const groups = ws.kp / lc::kGroup;
  ws.codes8.resize(static_cast<std::size_t>(m * ws.kp));
  ws.codes.resize(static_cast<std::size_t>(m * ws.kp));
  ws.scales.assign(static_cast<std::size_t>(groups * m), std::numeric_limits<float>::quiet_NaN());
  ws.sums = ws.scales;
  auto put = [&](std::int64_t t, std::int64_t col, std::int8_t const* q, float d) {  // one group
    int sum = 0;
    for (int i = 0; i < lc::kGroup; ++i) {
      auto const at = static_cast<std::size_t>(t * ws.kp + col + i);
      ws.codes8[at] = q[i];
      ws.codes[at] = mb::bf16_of_code(q[i]);
      sum += q[i];
    }
    std::size_t const at = static_cast<std::size_t>(col / lc::kGroup * m + t);
    ws.scales[at] = d;
    ws.sums[at] = d * static_cast<float>(sum);
  };
  bool const q8_k = f == WeightFormat::kQ4K || f == WeightFormat::kQ6K;
  for (std::int64_t t = 0; t < m; ++t) {
    float const* row = x.data() + t * k;
    if (q8_k) {
      for (std::int64_t b = 0; b < k; b += gguf::kQ4KBlockSize) {
        gguf::BlockQ8K const q = gguf::quantize_q8_k(row + b);
        for (int j = 0; j < gguf::kQ4KBlockSize / lc::kGroup; ++j) put(t, b + 32 * j, q.qs + 32 * j, q.d);
      }
    } else {
      for (std::int64_t b = 0; b < k; b += gguf::kQ8_0BlockSize) {
        float block[gguf::kQ8_0BlockSize] = {};  // a short last block padded with zeros
        std::copy_n(row + b, std::min<std::int64_t>(gguf::kQ8_0BlockSize, k - b), block);
        gguf::BlockQ8_0 const q = gguf::quantize_q8_0_activations(block);
        put(t, b, q.qs, to_float(q.d));
      }
    }
  }
  return ws;
}

/// The GEMV's work on the host (linear/device.cuh's lane_dot_codes, then the warp's sum): each
/// of 32 lanes takes 16 columns at a time, 512 apart.
template <WeightFormat kF>
std::vector<float> lane_linear(WeightView const& w, std::vector<float> const& x, std::int64_t m) {
  using C = lc::Codes<kF>;
  Workspace const ws = quantize(kF, x, m, w.cols);
  std::vector<float> y(static_cast<std::size_t>(m * w.rows));
  for (std::int64_t o = 0; o < w.rows; ++o)
    for (std::int64_t t = 0; t < m; ++t) {
      float sum = 0.0f;
      for (int lane = 0; lane < 32; ++lane) {
        float acc = 0.0f;
        for (std::int64_t c = lane * 16; c < ws.kp; c += 32 * 16) {
          std::uint32_t wv[4], av[4];
          lc::words16<kF>(w.row(o), c, wv);
          std::memcpy(av, ws.codes8.data() + t * ws.kp + c, sizeof av);
          auto const at = static_cast<std::size_t>(c / lc::kGroup * m + t);
          acc = lc::add_sixteen(acc, wv, av, ws.scales[at], ws.sums[at], C::affine(w.row(o), c / C::kSpan * C::kSpan), c);
        }
        sum += acc;
      }
      y[static_cast<std::size_t>(t * w.rows + o)] = sum;
    }
  return y;
}

/// The kernel's work on the host: y = x W^T for block-format W, tile by tile.
template <WeightFormat kF, int kMTiles>
std::vector<float> tiled_linear(WeightView const& w, std::vector<float> const& x, std::int64_t m) {
  using T = mb::Tile<kMTiles>;
  using C = lc::Codes<kF>;
  constexpr int kSpans = lc::kGroup / C::kSpan;
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
      for (std::int64_t k0 = 0; k0 < ws.kp; k0 += lc::kGroup) {  // the activations' padded columns
        std::fill(stage.begin(), stage.end(), std::uint8_t{0xFF});  // NaN: a copy that is missed shows
        for (int c = 0; c < T::kCopies; ++c) {
          mb::StageCopy const s = mb::stage_copy<kMTiles>(c);
          std::int64_t const token = m0 + s.token;
          bool const valid = token < m;
          void const* src = s.what == 0   ? static_cast<void const*>(ws.codes.data() + token * ws.kp + k0 + s.col)
                            : s.what == 1 ? static_cast<void const*>(ws.scales.data() + k0 / lc::kGroup * m + token)
                                          : static_cast<void const*>(ws.sums.data() + k0 / lc::kGroup * m + token);
          if (valid)
            std::memcpy(stage.data() + s.smem, src, static_cast<std::size_t>(mb::copy_bytes(s)));
          else
            std::memset(stage.data() + s.smem, 0, static_cast<std::size_t>(mb::copy_bytes(s)));
        }
        for (int warp = 0; warp < mma::kWarps; ++warp) {
          std::array<std::array<Regs2, 32>, mma::kNTiles> b[2];
          std::array<std::array<std::array<lc::Affine, kSpans>, 2>, mma::kNTiles> affine[32];
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
                      o < n ? C::affine(w.row(o), k0 + sp * C::kSpan) : lc::Affine{};
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
                    out = lc::add_span(out, p, stage_float(T::kScaleBase + 4 * token), stage_float(T::kSumBase + 4 * token),
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

/// Every run of four columns of rows of w: its word's codes times their span's scale plus its
/// offset are the dequantized values (exactly, or for q4_k and int4, whose products the
/// compiler may fuse with the offset or not, to 1e-3).
template <WeightFormat kF>
void check_words(WeightView const& w, bool exact) {
  using C = lc::Codes<kF>;
  std::vector<float> want(static_cast<std::size_t>(w.cols));
  for (std::int64_t r = 0; r < w.rows; ++r) {
    dequantize_row(w, r, want.data());
    for (std::int64_t c = 0; c + 16 <= w.cols; c += 16) {  // the GEMV's 16 columns: four words
      std::uint32_t four[4];
      lc::words16<kF>(w.row(r), c, four);
      for (int v = 0; v < 4; ++v) REQUIRE(four[v] == C::word(w.row(r), c + 4 * v));
    }
    for (std::int64_t c = 0; c < w.cols; c += 4) {
      std::uint32_t const word = C::word(w.row(r), c);
      lc::Affine const s = C::affine(w.row(r), c / C::kSpan * C::kSpan);
      for (int v = 0; v < 4 && c + v < w.cols; ++v) {
        int const q = lc::code_of(word, v);
        float const got = s.scale * static_cast<float>(q) + s.offset, x = want[static_cast<std::size_t>(c + v)];
        if (exact ? got != x : std::fabs(got - x) > 1e-3f) {
          CAPTURE(r);
          CAPTURE(c + v);
          CAPTURE(q);
          REQUIRE(got == x);
        }
      }
    }
  }
}

/// `n` blocks of random bytes whose fp16 fields (at `half_offsets`) hold values of magnitude
/// 0.25 to 2 and either sign, so that every code and scale pattern occurs.
std::vector<std::byte> random_blocks(std::size_t block_bytes, int n, std::vector<int> const& half_offsets,
                                     std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> bytes(block_bytes * static_cast<std::size_t>(n));
  for (auto& b : bytes) b = static_cast<std::byte>(rng());
  std::uniform_real_distribution<float> scale(0.25f, 2.0f);
  for (int i = 0; i < n; ++i)
    for (int at : half_offsets) {
      float const v = rng() % 2 ? scale(rng) : -scale(rng);
      std::uint16_t const h = to_fp16(v).bits;
      std::memcpy(bytes.data() + static_cast<std::size_t>(i) * block_bytes + at, &h, sizeof h);
    }
  return bytes;
}

}  // namespace

TEST_CASE("block codes: words of codes times their span's scale plus offset are the dequantized weights") {
  for (WeightFormat f : kFormats) {
    CAPTURE(to_string(f));
    bool const exact = f == WeightFormat::kQ8_0 || f == WeightFormat::kQ6K;
    // Encoded matrices (int4: a short last block) ...
    std::int64_t const k = f == WeightFormat::kInt4 ? 416 : 512;
    OwnedMatrix const w = random_matrix(f, 7, k, 303);
    with_block_format(f, [&](auto kf) { check_words<decltype(kf)::value>(w.view, exact); });
    // ... and random block bytes: every code, sign and scale pattern.
    int const bv = block_values(f);
    std::vector<int> const halves = f == WeightFormat::kQ6K ? std::vector<int>{208} : std::vector<int>{0, 2};
    std::vector<std::byte> const bytes =
        random_blocks(static_cast<std::size_t>(row_bytes(f, bv)), 64, f == WeightFormat::kQ8_0 ? std::vector<int>{0} : halves,
                      7 + static_cast<int>(f));
    WeightView r{};
    r.format = f, r.data = bytes.data(), r.rows = 64, r.cols = bv;
    with_block_format(f, [&](auto kf) { check_words<decltype(kf)::value>(r, exact); });
  }
}

TEST_CASE("block codes: dp4a's host twin sums four int8 products") {
  std::mt19937 rng(5);
  for (int i = 0; i < 10000; ++i) {
    std::uint32_t const a = rng(), b = rng();
    int const c = static_cast<int>(rng() % 20001) - 10000;
    int want = c;
    for (int v = 0; v < 4; ++v)
      want += static_cast<std::int8_t>(a >> (8 * v)) * static_cast<std::int8_t>(b >> (8 * v));
    CHECK(lc::dot4(a, b, c) == want);
  }
}

TEST_CASE("block codes: the GEMV's lanes equal ref::linear in every block format") {
  for (WeightFormat f : kFormats) {
    bool const k_quant = f == WeightFormat::kQ4K || f == WeightFormat::kQ6K;
    // One column step and several; whole and partial steps of 512; int4's short last block.
    for (std::int64_t k : {k_quant ? 256 : 96, 512, k_quant ? 1280 : 1056, f == WeightFormat::kInt4 ? 200 : 768}) {
      CAPTURE(to_string(f));
      CAPTURE(k);
      REQUIRE(row_fits(f, k));
      OwnedMatrix const w = random_matrix(f, 9, k, 304);
      auto const x = test::random_floats(static_cast<std::size_t>(3 * k), 305, -2, 2);
      std::vector<float> got;
      with_block_format(f, [&](auto kf) { got = lane_linear<decltype(kf)::value>(w.view, x, 3); });
      std::vector<float> want(static_cast<std::size_t>(3 * 9));
      LinearArgs a{};
      a.w = w.view, a.x = x.data(), a.y = want.data(), a.n_tokens = 3;
      ref::linear(a);
      auto const r = test::all_close<float, float>(got, want, test::Tolerance{2e-4, 1e-4});
      CHECK_MESSAGE(r.ok, r.report);
    }
  }
}

TEST_CASE("block codes, tensor cores: a bf16 pair of small integers holds them exactly") {
  for (int lo = -128; lo <= 128; ++lo)
    for (int hi : {-128, -33, -1, 0, 1, 15, 127, lo}) {
      std::uint32_t const p = mb::bf16_pair(lo, hi);
      CHECK(test::bf16_lo(p) == static_cast<float>(lo));
      CHECK(test::bf16_hi(p) == static_cast<float>(hi));
    }
}

TEST_CASE("block codes, tensor cores: the stage copies fill every byte the fragments and spans read, once") {
  auto check = [](auto m_tiles) {
    constexpr int kM = decltype(m_tiles)::value;
    using T = mb::Tile<kM>;
    CAPTURE(kM);
    std::vector<int> filled(T::kStageBytes, 0);
    for (int c = 0; c < T::kCopies; ++c) {
      mb::StageCopy const s = mb::stage_copy<kM>(c);
      CHECK(s.smem % mb::copy_bytes(s) == 0);  // aligned destinations
      CHECK((s.what == 0 ? s.col * 2 : 0) + (s.what == 0 ? mma::kCopyBytes : 4) <= lc::kGroup * 2);
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

TEST_CASE("block codes, tensor cores: each half-warp's 8-byte A loads fall in 32 banks") {
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

TEST_CASE("block codes, tensor cores: the tiles' products equal ref::linear in every block format") {
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
  // int4 rows that end mid-group: the last group padded with zero activation codes.
  check_shape<4>(WeightFormat::kInt4, 40, 33, 200);
  check_shape<1>(WeightFormat::kInt4, 16, 20, 100);
  check_shape<1>(WeightFormat::kInt4, 5, 9, 7);
}
