// attention's tensor-core tile on CUDA (kernels/attention/mma_tile.hpp), run on the host: the
// CTA's shared-memory tiles, the fragment offsets, the scores' accumulators read back as the
// weights' fragments and the 3xTF32 products, driven through an emulated
// mma.sync.m16n8k8 tf32 (support/mma_emulator.hpp) step for step as attention/mma.cuh runs
// them, and the key splits merged as device.cuh's combine does: equal ref::attention within
// the GPU test's tolerance over every KV format, partial tiles, padded heads and splits.
// Also: the tf32 split, and the fragment loads' banks.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <vector>

#include "qflash/kernels/attention/mma_tile.hpp"
#include "qflash/kernels/attention/ref.hpp"
#include "qflash/kernels/kv_append/ref.hpp"
#include "qflash/kv/layer_cache.hpp"
#include "support/attention_problem.hpp"
#include "support/mma_emulator.hpp"
#include "support/random.hpp"
#include "support/tolerance.hpp"

using namespace qflash;
using namespace qflash::kernels;
namespace mma = qflash::kernels::attention_cuda::mma;
namespace tf32 = qflash::kernels::tf32;

namespace {

using ref::GatheredKv;
using test::Acc;
using test::all_close;
using test::emulate_mma_3xtf32;
using test::Floats2;
using test::Floats4;
using test::Tolerance;

constexpr Tolerance kDot{2e-5, 1e-5};  // kv_attention_gpu_test's

constexpr std::array<KvFormat, 5> kFormats{KvFormat::kF32, KvFormat::kBf16, KvFormat::kFp8E4m3, KvFormat::kInt8,
                                           KvFormat::kInt6};

using Lanes4 = std::array<Floats4, 32>;
using Lanes2 = std::array<Floats2, 32>;

/// The 4 lanes of each row (4g .. 4g + 3) combined as two xor shuffles (1, then 2) do.
template <class Op>
void across_row_lanes(std::array<float, 32>& v, Op op) {
  for (int m : {1, 2}) {
    std::array<float, 32> const before = v;
    for (int lane = 0; lane < 32; ++lane) v[lane] = op(before[lane], before[lane ^ m]);
  }
}

/// One warp's state, per lane: outputs (kD / 8 n-tiles), and its two rows' max and sum.
template <int kD>
struct Warp {
  std::array<std::array<Acc, kD / 8>, 32> o{};
  std::array<std::array<float, 2>, 32> mx, sum{};
  Warp() {
    for (auto& m : mx) m = {-INFINITY, -INFINITY};
  }
};

/// mma.cuh's kernel and combine on the host: out [n_tokens, n_head, d] from the decoded cache.
template <int kD>
std::vector<float> tiled_attention(AttentionArgs const& a, GatheredKv const& kv,
                                   std::vector<kv::KvFormats> const& heads, std::int64_t want_splits) {
  constexpr int kKeys = mma::keys_per_tile(kD), kKeyTiles = kKeys / 8;
  int const d = a.d_head, d8 = (d + 7) / 8, ld = mma::row_stride(d), group = a.n_head / a.n_head_kv;
  std::int64_t const rows = a.n_tokens * group, first = a.n_ctx - a.n_tokens, out_rows = a.n_tokens * a.n_head;
  // use_splits's plan.
  std::int64_t split_keys = (a.n_ctx + want_splits - 1) / want_splits;
  split_keys = (split_keys + kKeys - 1) / kKeys * kKeys;
  std::int64_t const n_split = (a.n_ctx + split_keys - 1) / split_keys;
  std::vector<float> part_o(static_cast<std::size_t>(n_split * out_rows * d), std::numeric_limits<float>::quiet_NaN());
  std::vector<float> part_ml(static_cast<std::size_t>(n_split * out_rows * 2), std::numeric_limits<float>::quiet_NaN());
  auto at = [](std::int64_t i) { return static_cast<std::size_t>(i); };

  for (std::int64_t z = 0; z < n_split; ++z)
    for (int kv_head = 0; kv_head < a.n_head_kv; ++kv_head)
      for (std::int64_t r0 = 0; r0 < rows; r0 += mma::kRows) {
        std::vector<float> sq(at(mma::kRows * ld), 0.0f), sk(at(kKeys * ld), 0.0f), sv(sk);
        for (int row = 0; row < mma::kRows; ++row)
          for (int i = 0; i < d && r0 + row < rows; ++i) {
            std::int64_t const r = r0 + row, t = r / group;
            int const h = kv_head * group + static_cast<int>(r % group);
            sq[at(row * ld + i)] = a.q[(t * a.n_head + h) * d + i];
          }
        std::int64_t const cta_keys = first + (std::min(r0 + mma::kRows, rows) - 1) / group + 1;
        std::int64_t const s_begin = z * split_keys, s_end = std::min(cta_keys, s_begin + split_keys);
        bool const k_exact = heads[at(kv_head)].k == KvFormat::kBf16, v_exact = heads[at(kv_head)].v == KvFormat::kBf16;
        std::array<Warp<kD>, mma::kWarps> warps;
        for (std::int64_t s0 = s_begin; s0 < s_end; s0 += kKeys) {
          int const n_keys = static_cast<int>(std::min<std::int64_t>(kKeys, s_end - s0));
          for (int s = 0; s < n_keys; ++s)
            for (int i = 0; i < d; ++i) {
              std::size_t const src = at(((s0 + s) * a.n_head_kv + kv_head) * d + i);
              sk[at(s * ld + i)] = kv.k[src];
              sv[at(s * ld + i)] = kv.v[src];
            }
          std::fill(sv.begin() + n_keys * ld, sv.end(), 0.0f);
          for (int warp = 0; warp < mma::kWarps; ++warp) {
            std::int64_t const warp_r0 = r0 + 16 * warp;
            if (warp_r0 >= rows) continue;
            if (s0 > first + (std::min(warp_r0 + 16, rows) - 1) / group) continue;
            Warp<kD>& w = warps[at(warp)];
            // Scores.
            std::array<std::array<Acc, 32>, kKeyTiles> s{};
            for (int ks = 0; ks < d8; ++ks) {
              Lanes4 q{};
              for (int lane = 0; lane < 32; ++lane)
                for (int r = 0; r < 4; ++r) q[lane][r] = sq[at(mma::q_offset(lane, r, warp, ks, ld))];
              for (int nt = 0; nt < kKeyTiles; ++nt) {
                Lanes2 k{};
                for (int lane = 0; lane < 32; ++lane)
                  for (int r = 0; r < 2; ++r) k[lane][r] = sk[at(mma::k_offset(lane, r, nt, ks, ld))];
                emulate_mma_3xtf32(s[at(nt)], q, k, k_exact);
              }
            }
            // Softmax.
            std::array<std::array<float, 32>, 2> tile_max;
            for (auto& m : tile_max) m.fill(-INFINITY);
            for (int lane = 0; lane < 32; ++lane) {
              std::int64_t pos[2];
              for (int h = 0; h < 2; ++h)
                pos[h] = first + std::min(warp_r0 + mma::group_of(lane) + 8 * h, rows - 1) / group;
              for (int nt = 0; nt < kKeyTiles; ++nt)
                for (int r = 0; r < 4; ++r) {
                  int const key = 8 * nt + mma::c_col(lane, r);
                  float& x = s[at(nt)][at(lane)][at(r)];
                  x = key < n_keys && s0 + key <= pos[r / 2] ? x * a.scale : -INFINITY;
                  tile_max[at(r / 2)][at(lane)] = std::max(tile_max[at(r / 2)][at(lane)], x);
                }
            }
            for (auto& m : tile_max) across_row_lanes(m, [](float x, float y) { return std::max(x, y); });
            for (int lane = 0; lane < 32; ++lane) {
              float base[2], rescale[2];
              for (int h = 0; h < 2; ++h) {
                float const new_max = std::max(w.mx[at(lane)][at(h)], tile_max[at(h)][at(lane)]);
                base[h] = new_max == -INFINITY ? 0.0f : new_max;
                rescale[h] = std::exp(w.mx[at(lane)][at(h)] - base[h]);
                w.mx[at(lane)][at(h)] = new_max;
                w.sum[at(lane)][at(h)] *= rescale[h];
              }
              for (auto& acc : w.o[at(lane)])
                for (int r = 0; r < 4; ++r) acc[at(r)] *= rescale[r / 2];
              for (int nt = 0; nt < kKeyTiles; ++nt)
                for (int r = 0; r < 4; ++r) {
                  float& x = s[at(nt)][at(lane)][at(r)];
                  x = std::exp(x - base[r / 2]);
                  w.sum[at(lane)][at(r / 2)] += x;
                }
            }
            // Outputs += weights times values.
            for (int kt = 0; kt < kKeyTiles; ++kt) {
              Lanes4 p{};
              for (int lane = 0; lane < 32; ++lane)
                for (int r = 0; r < 4; ++r) p[lane][r] = s[at(kt)][at(lane)][at(mma::p_from_c(r))];
              for (int nt = 0; nt < d8; ++nt) {
                Lanes2 v{};
                for (int lane = 0; lane < 32; ++lane)
                  for (int r = 0; r < 2; ++r) v[lane][r] = sv[at(mma::v_offset(lane, r, kt, nt, ld))];
                std::array<Acc, 32> o;
                for (int lane = 0; lane < 32; ++lane) o[at(lane)] = w.o[at(lane)][at(nt)];
                emulate_mma_3xtf32(o, p, v, v_exact);
                for (int lane = 0; lane < 32; ++lane) w.o[at(lane)][at(nt)] = o[at(lane)];
              }
            }
          }
        }
        // The splits' partial rows.
        for (int warp = 0; warp < mma::kWarps; ++warp) {
          Warp<kD>& w = warps[at(warp)];
          for (int h = 0; h < 2; ++h) {
            std::array<float, 32> sum;
            for (int lane = 0; lane < 32; ++lane) sum[at(lane)] = w.sum[at(lane)][at(h)];
            across_row_lanes(sum, [](float x, float y) { return x + y; });
            for (int lane = 0; lane < 32; ++lane) {
              std::int64_t const r = r0 + 16 * warp + mma::group_of(lane) + 8 * h;
              if (r >= rows) continue;
              std::int64_t const t = r / group;
              std::int64_t const part_row = z * out_rows + t * a.n_head + kv_head * group + r % group;
              for (int nt = 0; nt < d8; ++nt)
                for (int j = 0; j < 2; ++j) {
                  int const i = 8 * nt + 2 * mma::pair_of(lane) + j;
                  if (i < d) part_o[at(part_row * d + i)] = w.o[at(lane)][at(nt)][at(2 * h + j)];
                }
              part_ml[at(2 * part_row)] = w.mx[at(lane)][at(h)];
              part_ml[at(2 * part_row + 1)] = sum[at(lane)];
            }
          }
        }
      }
  // combine_row (one split: the kernel's own store, the same arithmetic).
  std::vector<float> out(at(out_rows * d));
  for (std::int64_t row = 0; row < out_rows; ++row) {
    float mx = -INFINITY;
    for (std::int64_t z = 0; z < n_split; ++z) mx = std::max(mx, part_ml[at(2 * (z * out_rows + row))]);
    std::vector<float> o(at(d), 0.0f);
    float sum = 0.0f;
    for (std::int64_t z = 0; z < n_split; ++z) {
      std::int64_t const zr = z * out_rows + row;
      float const w = std::exp(part_ml[at(2 * zr)] - mx);
      if (w == 0.0f) continue;
      sum = std::fma(w, part_ml[at(2 * zr + 1)], sum);
      for (int i = 0; i < d; ++i) o[at(i)] = std::fma(w, part_o[at(zr * d + i)], o[at(i)]);
    }
    std::int64_t const t = row / a.n_head, h = row % a.n_head;
    float const* gate = a.gate ? a.gate + t * a.gate_token_stride + h * a.gate_head_stride_or_default() : nullptr;
    for (int i = 0; i < d; ++i)
      out[at(row * d + i)] = gate ? o[at(i)] * (1.0f / sum) / (1.0f + std::exp(-gate[i])) : o[at(i)] * (1.0f / sum);
  }
  return out;
}


/// p over the given head formats, its keys split `splits` ways.
template <int kD>
void check(test::AttentionProblem const& p, std::int64_t splits, std::vector<kv::KvFormats> const& heads) {
  CAPTURE(p.d);
  CAPTURE(p.n_head);
  CAPTURE(p.n_kv);
  CAPTURE(p.n_ctx);
  CAPTURE(p.n_tokens);
  CAPTURE(splits);
  CAPTURE(to_string(heads[0].k));
  CAPTURE(to_string(heads[0].v));
  auto const seed = static_cast<std::uint64_t>(p.d * 13 + p.n_ctx);
  auto const q = test::random_floats(static_cast<std::size_t>(p.n_tokens * p.n_head * p.d), seed, -2, 2);
  auto const k = test::random_floats(static_cast<std::size_t>(p.n_ctx * p.n_kv * p.d), seed + 1, -2, 2);
  auto const v = test::random_floats(static_cast<std::size_t>(p.n_ctx * p.n_kv * p.d), seed + 2);
  auto const gate = test::random_floats(static_cast<std::size_t>(p.n_tokens * p.n_head * 2 * p.d), seed + 3, -3, 3);
  kv::LayerCache cache(heads, p.d, p.n_ctx);
  cache.append(k.data(), v.data(), p.n_ctx);
  GatheredKv const decoded = ref::gather_kv(cache.view(), p.n_ctx);
  for (std::size_t i = 0; i < decoded.k.size(); ++i) {  // what lets the kernel skip a bf16 head's small parts
    int const h = static_cast<int>(i / static_cast<std::size_t>(p.d)) % p.n_kv;
    if (heads[static_cast<std::size_t>(h)].k == KvFormat::kBf16) REQUIRE(tf32::split_tf32(decoded.k[i]).small == 0.0f);
    if (heads[static_cast<std::size_t>(h)].v == KvFormat::kBf16) REQUIRE(tf32::split_tf32(decoded.v[i]).small == 0.0f);
  }

  std::vector<float> want(q.size());
  AttentionArgs const a = test::attention_args(p, cache.view(), q.data(), want.data(), p.gate ? gate.data() : nullptr);
  ref::attention(a);
  std::vector<float> const got = tiled_attention<kD>(a, decoded, heads, splits);
  auto const r = all_close<float, float>(got, want, kDot);
  CHECK_MESSAGE(r.ok, r.report);
}

/// Per-head formats: head h's key in format (h + shift) and value in (h + shift + 2), so that
/// over the shifts every format is a key and a value, exact (bf16) or not.
std::vector<kv::KvFormats> mixed(int n_kv, std::size_t shift) {
  std::vector<kv::KvFormats> heads;
  for (int h = 0; h < n_kv; ++h) {
    auto const i = static_cast<std::size_t>(h) + shift;
    heads.push_back({kFormats[i % kFormats.size()], kFormats[(i + 2) % kFormats.size()]});
  }
  return heads;
}

}  // namespace

TEST_CASE("tf32: rounding to nearest and the two-part split (common/tf32.hpp)") {
  CHECK(tf32::tf32_round(1.0f + 0x1p-11f) == 1.0f + 0x1p-10f);  // a tie: away from zero
  CHECK(tf32::tf32_round(-(1.0f + 0x1p-11f)) == -(1.0f + 0x1p-10f));
  CHECK(tf32::tf32_round(1.0f + 0x1p-11f - 0x1p-23f) == 1.0f);
  CHECK(tf32::tf32_round(1.0f + 0x1p-10f + 0x1p-11f) == 1.0f + 0x1p-9f);  // a tie from an odd tf32
  CHECK(std::isinf(tf32::tf32_round(INFINITY)));
  CHECK(std::isnan(tf32::tf32_round(std::numeric_limits<float>::quiet_NaN())));
  // A NaN whose payload is only in the 13 bits tf32 drops stays a NaN in the other 19.
  float const quieted = tf32::tf32_round(detail::float_of(0x7F800001u));
  CHECK(std::isnan(quieted));
  CHECK((detail::bits_of(quieted) & 0x1FFFu) == 0u);
  auto xs = test::random_floats(4096, 5, -1000, 1000);
  for (float x : {0.0f, -0.0f, 1e-40f, 3.4e38f, -std::numeric_limits<float>::max()}) xs.push_back(x);
  for (float x : xs) {
    CAPTURE(x);
    auto const [big, small] = tf32::split_tf32(x);
    CHECK((detail::bits_of(big) & 0x1FFFu) == 0u);
    CHECK((detail::bits_of(small) & 0x1FFFu) == 0u);
    // Subnormals: the parts' 10 bits end at 2^-136, so the rest is at most half of that.
    CHECK(std::fabs(static_cast<double>(x) - big - small) <= std::max(0x1p-22 * std::fabs(x), 0x1p-137));
  }
  // Inf and NaN keep their value in the big part, a NaN quieted: also NaNs whose rounding in
  // bits would carry into the sign (0x7FFFFFFF, the device's canonical NaN) or out of it.
  for (std::uint32_t const bits : {0x7F800000u, 0xFF800000u, 0x7FC00000u, 0x7FFFFFFFu, 0xFFFFFFFFu, 0x7F800001u,
                                   0x7FFFF000u, 0xFF801FFFu}) {
    CAPTURE(bits);
    float const x = detail::float_of(bits);
    auto const [big, small] = tf32::split_tf32(x);
    CHECK(detail::bits_of(big) == detail::bits_of(tf32::tf32_round(x)));
    CHECK((std::isnan(x) ? std::isnan(big) : big == x));
    CHECK(std::signbit(big) == std::signbit(x));
    CHECK(detail::bits_of(small) == 0u);
  }
  // Every exponent, each sign, mantissas at and beside the rounding's edges: big is x rounded
  // to tf32 (cut toward zero where that passes the largest float), small the rest rounded.
  for (std::uint32_t sign : {0u, 0x80000000u})
    for (std::uint32_t exponent = 0; exponent < 255; ++exponent)
      for (std::uint32_t mantissa : {0x000000u, 0x000001u, 0x000FFFu, 0x001000u, 0x001001u, 0x002FFFu, 0x003000u,
                                     0x3FEFFFu, 0x400000u, 0x7FE000u, 0x7FEFFFu, 0x7FF000u, 0x7FFFFFu}) {
        float const x = detail::float_of(sign | exponent << 23 | mantissa);
        CAPTURE(x);
        auto const [big, small] = tf32::split_tf32(x);
        float const nearest = tf32::tf32_round(x);
        CHECK(big == (std::isinf(nearest) ? detail::float_of(detail::bits_of(x) & 0xFFFFE000u) : nearest));
        CHECK(std::signbit(big) == std::signbit(x));
        CHECK(detail::bits_of(small) == detail::bits_of(tf32::tf32_round(x - big)));
      }
}

TEST_CASE("attention mma: every fragment load of a warp falls in 32 banks, inside its tile") {
  for (int d = 1; d <= mma::kWidestHead; ++d) {
    CAPTURE(d);
    int const ld = mma::row_stride(d), d8 = (d + 7) / 8;
    int const keys = mma::keys_per_tile(mma::head_bucket(d));
    for (int r = 0; r < 4; ++r) {
      std::set<int> q_banks, k_banks, v_banks;
      for (int lane = 0; lane < 32; ++lane) {
        q_banks.insert(mma::q_offset(lane, r, 0, 0, ld) % 32);
        if (r < 2) {
          k_banks.insert(mma::k_offset(lane, r, 0, 0, ld) % 32);
          v_banks.insert(mma::v_offset(lane, r, 0, 0, ld) % 32);
        }
        // The last k-step's and n-tile's loads stay in the padded rows.
        CHECK(mma::q_offset(lane, r, mma::kWarps - 1, d8 - 1, ld) < mma::kRows * ld);
        CHECK((mma::q_offset(lane, r, 0, d8 - 1, ld) % ld) < 8 * d8);
        if (r < 2) {
          CHECK(mma::k_offset(lane, r, keys / 8 - 1, d8 - 1, ld) < keys * ld);
          CHECK(mma::v_offset(lane, r, keys / 8 - 1, d8 - 1, ld) < keys * ld);
        }
      }
      CHECK(q_banks.size() == 32);
      if (r < 2) {
        CHECK(k_banks.size() == 32);
        CHECK(v_banks.size() == 32);
      }
    }
  }
}

TEST_CASE("attention mma: the tiles on an emulated tensor core equal ref::attention") {
  // Every format as key and value (a group of 2, whole and partial row tiles and key tiles).
  for (std::size_t shift = 0; shift < kFormats.size(); ++shift)
    check<64>({4, 2, 64, 300, 150, false}, 1, mixed(2, shift));
  // Qwen3.6's heads (16 of 256 over 2), gated, one split and three; Qwen3-30B's (32 of 128 over 4).
  check<256>({16, 2, 256, 100, 70, true}, 1, mixed(2, 1));
  check<256>({16, 2, 256, 100, 9, true}, 3, mixed(2, 3));
  check<128>({32, 4, 128, 90, 6, false}, 2, mixed(4, 0));
  // Padded heads (d not a multiple of 8 or 16), groups of 1 and 8, splits that start past a
  // warp's keys and past a whole CTA's (the first CTA of the last case: keys [0, 64) of 200).
  check<64>({8, 1, 40, 90, 20, true}, 2, mixed(1, 4));
  check<64>({2, 2, 20, 200, 64, false}, 4, mixed(2, 2));
  check<64>({2, 2, 20, 200, 200, false}, 4, mixed(2, 3));
  check<64>({6, 3, 5, 70, 65, false}, 1, mixed(3, 1));
  check<128>({4, 1, 100, 33, 33, true}, 1, mixed(1, 0));
}
