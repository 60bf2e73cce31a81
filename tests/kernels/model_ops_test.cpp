// CPU kernels of the model's ops against their scalar references: linear and linear_group
// (every ISA path, every weight format), rope, attention, router_topk, expert_ffn.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <set>
#include <vector>

#include "qflash/kernels/attention/cpu.hpp"
#include "qflash/kernels/common/cpu_math.hpp"
#include "qflash/kernels/attention/ref.hpp"
#include "qflash/kv/layer_cache.hpp"
#include "qflash/kernels/expert_ffn/cpu.hpp"
#include "qflash/kernels/expert_ffn/ref.hpp"
#include "qflash/kernels/expert_ffn/stacked.hpp"
#include "qflash/kernels/linear/cpu.hpp"
#include "qflash/kernels/linear/ref.hpp"
#include "qflash/kernels/linear_group/cpu.hpp"
#include "qflash/kernels/rope/cpu.hpp"
#include "qflash/kernels/rope/ref.hpp"
#include "qflash/kernels/router_topk/cpu.hpp"
#include "qflash/kernels/router_topk/ref.hpp"
#include "qflash/numeric/bf16.hpp"
#include "qflash/numeric/weight_encode.hpp"
#include "qflash/spec/presets.hpp"
#include "support/expert_case.hpp"
#include "support/cpu_isas.hpp"
#include "support/random.hpp"
#include "support/tolerance.hpp"

using namespace qflash;
using namespace qflash::kernels;
using qflash::test::all_close;
using qflash::test::Tolerance;

namespace {

// fp32 sums of up to ~300 products of values in [-1, 1] against an fp64 reference: the
// accumulated rounding is a few 1e-7 relative to the sum of |terms|, so 2e-5 absolute.
constexpr Tolerance kDot{2e-5, 1e-5};

#if QFLASH_HAS_X86_SIMD
QFLASH_TARGET_AVX2 void simd_eval(float const* x, float* exp_out, float* silu_out) {
  _mm256_storeu_ps(exp_out, simd::avx2_exp(_mm256_loadu_ps(x)));
  _mm256_storeu_ps(silu_out, simd::avx2_silu(_mm256_loadu_ps(x)));
}

/// 8 vectors of 8 lanes at v: each one's avx2_reduce_add, and avx2_reduce_add8's lanes.
QFLASH_TARGET_AVX2 void reduce_both(float const* v, float* one_by_one, float* eight) {
  __m256 vs[8];
  for (int j = 0; j < 8; ++j) {
    vs[j] = _mm256_loadu_ps(v + 8 * j);
    one_by_one[j] = simd::avx2_reduce_add(vs[j]);
  }
  _mm256_storeu_ps(eight, simd::avx2_reduce_add8(vs));
}
#endif

/// The levels with code of their own in these ops (kAvx512Bf16 runs kAvx512Vnni's; kAmx has
/// linear's AMX tiles), up to this CPU's.
std::vector<arch::CpuIsa> isas_here() {
  return test::isas_here({arch::CpuIsa::kScalar, arch::CpuIsa::kAvx2, arch::CpuIsa::kAvx512,
                          arch::CpuIsa::kAvx512Vnni, arch::CpuIsa::kAmx});
}

}  // namespace

TEST_CASE("linear: every ISA path and weight format equals the reference") {
  // Shapes: odd sizes for the element formats, whole 32/256-blocks for the GGUF ones, a
  // short last int4 group, fp8 tiles cut by the matrix edge; AMX (bf16 and the integer
  // formats, >= 8 tokens, whole 32-column chunks): one token tile, odd tile counts, rows past
  // the last 16 and 32, short int4 groups.
  std::vector<std::array<int, 3>> const shapes{{1, 1, 1},     {1, 31, 7},    {3, 71, 33},  {5, 129, 64},
                                               {9, 256, 17},  {2, 512, 5},   {4, 96, 130}, {1, 768, 3},
                                               {40, 2048, 9},  // two token blocks (kTokenBlockBytes)
                                               {8, 32, 16},   {37, 96, 50},  {16, 64, 32}, {70, 256, 67},
                                               {33, 512, 80},
                                               {1, 352, 6},  // q8_0 decode: 8 blocks per step, then 3
                                               {1, 256, 1100}, {1, 512, 700}};  // decode, rows a page apart
  for (auto isa : isas_here())
    for (WeightFormat f : kAllWeightFormats)
      for (auto [n_tok, n_in, n_out] : shapes) {
        if (!row_fits(f, n_in)) continue;
        CAPTURE(to_string(isa));
        CAPTURE(to_string(f));
        CAPTURE(n_tok);
        CAPTURE(n_in);
        CAPTURE(n_out);
        auto x = test::random_floats(static_cast<std::size_t>(n_tok * n_in), 1);
        auto wf = test::random_floats(static_cast<std::size_t>(n_out * n_in), 2);
        auto w = encode_matrix(f, wf.data(), n_out, n_in);
        LinearArgs a{};
        a.w = w.view;
        a.x = x.data();
        a.n_tokens = n_tok;
        std::vector<float> y(static_cast<std::size_t>(n_tok * n_out), 0.5f), ref(y);
        a.y = ref.data();
        ref::linear(a);
        a.y = y.data();
        REQUIRE(cpu::linear(isa, a) == Status::kSuccess);
        auto r = all_close<float, float>(y, ref, kDot);
        CHECK_MESSAGE(r.ok, r.report);
        // accumulate adds onto what is there
        a.accumulate = true;
        REQUIRE(cpu::linear(isa, a) == Status::kSuccess);
        for (auto& v : ref) v *= 2;
        r = all_close<float, float>(y, ref, kDot);
        CHECK_MESSAGE(r.ok, r.report);
      }
}

TEST_CASE("linear: a NaN or infinite activation reaches the same outputs on every path") {
  // AMX splits each activation into bf16 terms: an infinite term must not leave inf - inf.
  int const n_tok = 16, n_in = 64, n_out = 32;
  auto x = test::random_floats(static_cast<std::size_t>(n_tok * n_in), 11);
  auto wf = test::random_floats(static_cast<std::size_t>(n_out * n_in), 12, 0.1f, 0.9f);  // no zero weight
  x[3] = std::numeric_limits<float>::infinity();       // token 0
  x[n_in + 5] = -std::numeric_limits<float>::infinity();  // token 1
  x[2 * n_in + 7] = std::numeric_limits<float>::quiet_NaN();  // token 2
  x[3 * n_in + 9] = 3.4e38f;  // token 3: finite, but would round up to bf16's infinity
  auto w = encode_matrix(WeightFormat::kBf16, wf.data(), n_out, n_in);
  LinearArgs a{};
  a.w = w.view;
  a.x = x.data();
  a.n_tokens = n_tok;
  std::vector<float> ref(static_cast<std::size_t>(n_tok * n_out));
  a.y = ref.data();
  ref::linear(a);
  for (auto isa : isas_here()) {
    CAPTURE(to_string(isa));
    std::vector<float> y(ref.size());
    a.y = y.data();
    REQUIRE(cpu::linear(isa, a) == Status::kSuccess);
    for (int o = 0; o < n_out; ++o) {
      CHECK(std::isinf(y[static_cast<std::size_t>(o)]));
      CHECK(y[static_cast<std::size_t>(o)] > 0);
      CHECK(std::isinf(y[static_cast<std::size_t>(n_out + o)]));
      CHECK(y[static_cast<std::size_t>(n_out + o)] < 0);
      CHECK(std::isnan(y[static_cast<std::size_t>(2 * n_out + o)]));
    }
    std::vector<float> const finite_ref(ref.begin() + 3 * n_out, ref.end()), finite(y.begin() + 3 * n_out, y.end());
    auto r = all_close<float, float>(finite, finite_ref, Tolerance{1e-3, 1e-5});
    CHECK_MESSAGE(r.ok, r.report);
  }
}

TEST_CASE("linear: 8-bit activations cost at most half a step per value against fp32 ones") {
  // q8_0 / q4_k / q6_k / int4 round each activation to d * q with |x - d q| <= d / 2 (q8_0's fp16 d
  // adds up to 127 * 2^-11 d); so |y - y_fp32| <= sum_i |w_i| * bound_i, plus fp32 rounding.
  int const n_tok = 3, n_in = 512, n_out = 6;
  auto x = test::random_floats(static_cast<std::size_t>(n_tok * n_in), 5);
  auto wf = test::random_floats(static_cast<std::size_t>(n_out * n_in), 6);
  for (WeightFormat f : {WeightFormat::kQ8_0, WeightFormat::kQ4K, WeightFormat::kQ6K, WeightFormat::kInt4})
    for (auto isa : isas_here()) {
      CAPTURE(to_string(f));
      CAPTURE(to_string(isa));
      auto w = encode_matrix(f, wf.data(), n_out, n_in);
      std::vector<float> y(static_cast<std::size_t>(n_tok * n_out));
      LinearArgs a{};
      a.w = w.view;
      a.x = x.data();
      a.y = y.data();
      a.n_tokens = n_tok;
      REQUIRE(cpu::linear(isa, a) == Status::kSuccess);
      bool const q8_0_blocks = f == WeightFormat::kQ8_0 || f == WeightFormat::kInt4;
      int const block = q8_0_blocks ? 32 : 256;
      double const step_share = q8_0_blocks ? 0.5 + 127.0 / 2048 : 0.5;
      std::vector<float> row(static_cast<std::size_t>(n_in));
      bool changed = false;
      for (int o = 0; o < n_out; ++o) {
        dequantize_row(w.view, o, row.data());
        for (int t = 0; t < n_tok; ++t) {
          double exact = 0, bound = 0, scale = 0;
          for (int b = 0; b < n_in; b += block) {
            double amax = 0, wsum = 0;
            for (int i = b; i < b + block; ++i) {
              amax = std::max(amax, std::fabs(double{x[static_cast<std::size_t>(t * n_in + i)]}));
              wsum += std::fabs(double{row[static_cast<std::size_t>(i)]});
            }
            bound += wsum * step_share * amax / 127;
            for (int i = b; i < b + block; ++i) {
              double const p = double{x[static_cast<std::size_t>(t * n_in + i)]} * row[static_cast<std::size_t>(i)];
              exact += p;
              scale += std::fabs(p);
            }
          }
          double const got = y[static_cast<std::size_t>(t * n_out + o)];
          CHECK(std::fabs(got - exact) <= bound + 1e-6 * scale);
          changed = changed || got != static_cast<float>(exact);
        }
      }
      CHECK(changed);  // the activations were rounded at all
    }
}

TEST_CASE("linear: a token's sums do not depend on the tokens beside it, in every format") {
  // Prefill runs several tokens per pass through a weight row, decode one: each (row, token)
  // sum is the same chain of operations either way, so a batch gives each token its one-token
  // result, bit for bit (what a serving engine needs for batched and single runs to agree).
  // Exceptions, within fp32 rounding (kDot): the formats on AMX tiles, from kAmxMinTokens
  // tokens, q8_0 and q4_k panels (AVX2 and AVX-512), from kPanelMinTokens, and fp8 rows decoded
  // once for many tokens, from kFp8FusedMaxTokens.
  int const n_out = 67;  // rows over a few tiles, and enough for AMX (kAmxMinRows)
  for (int n_in : {512, 512 + 37, 352})  // whole GGUF blocks; columns past a vector; 8 + 3 q8_0 blocks
  for (int n_tok : {2, 5, 11, 20})
    for (WeightFormat f : kAllWeightFormats)
      for (auto isa : isas_here()) {
        if (!row_fits(f, n_in)) continue;
        CAPTURE(n_tok);
        CAPTURE(to_string(f));
        CAPTURE(to_string(isa));
        auto x = test::random_floats(static_cast<std::size_t>(n_tok * n_in), 7);
        auto wf = test::random_floats(static_cast<std::size_t>(n_out * n_in), 8);
        CAPTURE(n_in);
        auto w = encode_matrix(f, wf.data(), n_out, n_in);
        std::vector<float> batch(static_cast<std::size_t>(n_tok * n_out)), one(batch.size());
        LinearArgs a{};
        a.w = w.view;
        a.x = x.data();
        a.y = batch.data();
        a.n_tokens = n_tok;
        REQUIRE(cpu::linear(isa, a) == Status::kSuccess);
        a.n_tokens = 1;
        for (int t = 0; t < n_tok; ++t) {
          a.x = x.data() + t * n_in;
          a.y = one.data() + t * n_out;
          REQUIRE(cpu::linear(isa, a) == Status::kSuccess);
        }
        bool const fp8_decoded = f == WeightFormat::kFp8E4m3 && isa >= arch::CpuIsa::kAvx2 &&
                                 !cpu::fp8_fused_applies(isa, f, n_tok);
        if (cpu::amx_applies(isa, f, n_out, n_in, n_tok) || cpu::panels_apply(isa, f, n_tok) || fp8_decoded) {
          auto r = all_close<float, float>(batch, one, kDot);
          CHECK_MESSAGE(r.ok, r.report);
          CHECK(batch != one);  // the tiles ran
        } else {
          CHECK(batch == one);
        }
      }
}

TEST_CASE("linear_group: every part equals linear alone, bit for bit, on every ISA path") {
  // Parts big enough for AMX tiles and too small for them; one accumulating into a strided
  // output; groups of one format, and mixed ones whose parts share quantized activations
  // (q4_k and q6_k: q8_k blocks) or AMX packing (two bf16 parts) or neither.
  int const n_in = 512;
  std::vector<std::vector<WeightFormat>> groups;
  for (WeightFormat f : kAllWeightFormats) groups.push_back({f, f, f, f});
  groups.push_back({WeightFormat::kQ4K, WeightFormat::kBf16, WeightFormat::kQ6K, WeightFormat::kBf16});
  groups.push_back({WeightFormat::kInt4, WeightFormat::kQ8_0, WeightFormat::kF32, WeightFormat::kFp8E4m3});
  std::int64_t const rows[] = {67, 16, 8, 130};
  for (auto const& formats : groups)
    for (int n_tok : {1, 5, 16, 37})
      for (auto isa : isas_here()) {
        CAPTURE(to_string(formats[0]));
        CAPTURE(to_string(formats[1]));
        CAPTURE(n_tok);
        CAPTURE(to_string(isa));
        auto const x = test::random_floats(static_cast<std::size_t>(n_tok * n_in), 21);
        std::vector<OwnedMatrix> w;
        LinearGroupArgs g{};
        g.n_parts = 4;
        std::vector<std::vector<float>> grouped(4), alone(4);
        for (std::size_t i = 0; i < 4; ++i) {
          auto const wf = test::random_floats(static_cast<std::size_t>(rows[i] * n_in), 22 + static_cast<unsigned>(i));
          w.push_back(encode_matrix(formats[i], wf.data(), rows[i], n_in));
          LinearArgs& a = g.parts[i];
          a.w = w.back().view;
          a.x = x.data();
          a.n_tokens = n_tok;
          a.y_stride = i == 2 ? rows[i] + 5 : 0;
          a.accumulate = i == 2;
          grouped[i] = test::random_floats(static_cast<std::size_t>(n_tok * (rows[i] + 5)), 30 + static_cast<unsigned>(i));
          alone[i] = grouped[i];
        }
        for (std::size_t i = 0; i < 4; ++i) {
          LinearArgs a = g.parts[i];
          a.y = alone[i].data();
          REQUIRE(cpu::linear(isa, a) == Status::kSuccess);
          g.parts[i].y = grouped[i].data();
        }
        REQUIRE(cpu::linear_group(isa, g) == Status::kSuccess);
        for (std::size_t i = 0; i < 4; ++i) CHECK(grouped[i] == alone[i]);
      }
}

TEST_CASE("linear_group: parts must share the input; one to four of them") {
  auto const x = test::random_floats(2 * 64, 1), wf = test::random_floats(8 * 64, 2);
  auto const w = encode_matrix(WeightFormat::kF32, wf.data(), 8, 64);
  auto const narrow = encode_matrix(WeightFormat::kF32, wf.data(), 16, 32);
  std::vector<float> y(4 * 2 * 16);
  LinearGroupArgs g{};
  g.n_parts = 2;
  for (int i = 0; i < 2; ++i) g.parts[i] = {w.view, x.data(), y.data() + i * 32, 2};
  REQUIRE(cpu::linear_group(arch::CpuIsa::kScalar, g) == Status::kSuccess);
  LinearGroupArgs bad = g;
  bad.parts[1].x = x.data() + 1;
  CHECK(cpu::linear_group(arch::CpuIsa::kScalar, bad) == Status::kErrorInvalidProblem);
  bad = g;
  bad.parts[1].n_tokens = 1;
  CHECK(cpu::linear_group(arch::CpuIsa::kScalar, bad) == Status::kErrorInvalidProblem);
  bad = g;
  bad.parts[1].x_stride = 65;
  CHECK(cpu::linear_group(arch::CpuIsa::kScalar, bad) == Status::kErrorInvalidProblem);
  bad = g;
  bad.parts[1].w = narrow.view;  // 32 columns against 64
  CHECK(cpu::linear_group(arch::CpuIsa::kScalar, bad) == Status::kErrorInvalidProblem);
  bad = g;
  bad.parts[1].y = nullptr;
  CHECK(cpu::linear_group(arch::CpuIsa::kScalar, bad) == Status::kErrorInvalidProblem);
  for (int n : {0, -1, LinearGroupArgs::kMaxParts + 1}) {
    bad = g;
    bad.n_parts = n;
    CHECK(cpu::linear_group(arch::CpuIsa::kScalar, bad) == Status::kErrorInvalidProblem);
  }
}

TEST_CASE("linear: q8_0 panels on AVX-512 VNNI give the AMX tiles' sums, bit for bit") {
  // Both add each block's exact int32 sum into fp32 as sum * (d_w * d_x), block after block.
  auto const isas = isas_here();
  if (std::find(isas.begin(), isas.end(), arch::CpuIsa::kAmx) == isas.end()) return;
  for (auto [n_tok, n_in, n_out] : {std::array<int, 3>{8, 64, 64}, {37, 352, 80}, {70, 2048, 99}}) {
    CAPTURE(n_tok);
    CAPTURE(n_in);
    CAPTURE(n_out);
    REQUIRE(cpu::amx_applies(arch::CpuIsa::kAmx, WeightFormat::kQ8_0, n_out, n_in, n_tok));
    auto const x = test::random_floats(static_cast<std::size_t>(n_tok * n_in), 11);
    auto const wf = test::random_floats(static_cast<std::size_t>(n_out * n_in), 12);
    auto const w = encode_matrix(WeightFormat::kQ8_0, wf.data(), n_out, n_in);
    std::vector<float> tiles(static_cast<std::size_t>(n_tok * n_out)), panels(tiles.size());
    LinearArgs a{};
    a.w = w.view;
    a.x = x.data();
    a.n_tokens = n_tok;
    a.y = tiles.data();
    REQUIRE(cpu::linear(arch::CpuIsa::kAmx, a) == Status::kSuccess);
    a.y = panels.data();
    REQUIRE(cpu::panels_apply(arch::CpuIsa::kAvx512Bf16, WeightFormat::kQ8_0, n_tok));
    REQUIRE(cpu::linear(arch::CpuIsa::kAvx512Bf16, a) == Status::kSuccess);
    CHECK(tiles == panels);
  }
}

TEST_CASE("linear: AVX2 panels (8 rows) give the AVX-512 panels' (16 rows) sums, bit for bit") {
  // Both add each block's exact int32 sums into fp32 in the same steps, per row and token. The
  // rows past AVX-512's last whole panel take each ISA's row kernels, whose sums differ: only
  // the rows of whole 16-row panels are compared.
  auto const isas = isas_here();
  if (std::find(isas.begin(), isas.end(), arch::CpuIsa::kAvx512Vnni) == isas.end()) {
    MESSAGE("skipped: this CPU has no AVX-512 VNNI");
    return;
  }
  for (WeightFormat f : {WeightFormat::kQ8_0, WeightFormat::kQ4K})
    for (auto [n_tok, n_in, n_out] : {std::array<int, 3>{8, 256, 16}, {37, 512, 40}, {70, 2048, 99}}) {
      CAPTURE(to_string(f));
      CAPTURE(n_tok);
      auto const x = test::random_floats(static_cast<std::size_t>(n_tok * n_in), 13);
      auto const wf = test::random_floats(static_cast<std::size_t>(n_out * n_in), 14);
      auto const w = encode_matrix(f, wf.data(), n_out, n_in);
      std::vector<float> narrow(static_cast<std::size_t>(n_tok * n_out)), wide(narrow.size());
      LinearArgs a{};
      a.w = w.view;
      a.x = x.data();
      a.n_tokens = n_tok;
      a.y = narrow.data();
      REQUIRE(cpu::panels_apply(arch::CpuIsa::kAvx2, f, n_tok));
      REQUIRE(cpu::linear(arch::CpuIsa::kAvx2, a) == Status::kSuccess);
      a.y = wide.data();
      REQUIRE(cpu::linear(arch::CpuIsa::kAvx512Vnni, a) == Status::kSuccess);
      int const panel_rows = n_out / cpu::kPanelRows * cpu::kPanelRows;
      REQUIRE(panel_rows > 0);
      for (int t = 0; t < n_tok; ++t) {
        CAPTURE(t);
        auto const row = [&](std::vector<float> const& y) {
          return std::vector<float>(y.begin() + t * n_out, y.begin() + t * n_out + panel_rows);
        };
        CHECK(row(narrow) == row(wide));
      }
    }
}

TEST_CASE("linear: q4_k panels sum the largest codes and activations without saturating") {
  // A sub-block's products add up in int16 on AVX2: 16 per lane of code 15 times |x| 127.
  int const n_tok = 8, n_in = 512, n_out = 16;
  std::vector<float> wf(static_cast<std::size_t>(n_out * n_in), 1.0f);
  for (std::size_t i = 0; i < wf.size(); i += 32) wf[i] = 0.0f;  // each sub-block: codes 0 and 15
  std::vector<float> x(static_cast<std::size_t>(n_tok * n_in));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = i / n_in % 2 == 0 ? -1.0f : 1.0f;
  auto const w = encode_matrix(WeightFormat::kQ4K, wf.data(), n_out, n_in);
  LinearArgs a{};
  a.w = w.view;
  a.x = x.data();
  a.n_tokens = n_tok;
  std::vector<float> ref(static_cast<std::size_t>(n_tok * n_out));
  a.y = ref.data();
  ref::linear(a);
  CHECK(std::fabs(ref[0] + (n_in - n_in / 32)) < 0.05 * n_in);  // the weights kept their size
  for (auto isa : isas_here()) {
    CAPTURE(to_string(isa));
    std::vector<float> y(ref.size());
    a.y = y.data();
    REQUIRE(cpu::linear(isa, a) == Status::kSuccess);
    auto r = all_close<float, float>(y, ref, kDot);
    CHECK_MESSAGE(r.ok, r.report);
  }
}

TEST_CASE("linear: the reference's decoded rows are the format's dequantization") {
  // What the format round trip loses is bounded (numeric tests bound each format); here the
  // decoded matrix must stay near the fp32 one, so a wrong row or block offset shows.
  int const rows = 7, cols = 512;
  auto wf = test::random_floats(static_cast<std::size_t>(rows * cols), 4);
  for (WeightFormat f : kAllWeightFormats) {
    CAPTURE(to_string(f));
    auto w = encode_matrix(f, wf.data(), rows, cols);
    std::vector<float> row(static_cast<std::size_t>(cols));
    double worst = 0;
    for (int r = 0; r < rows; ++r) {
      dequantize_row(w.view, r, row.data());
      for (int i = 0; i < cols; ++i) worst = std::max(worst, std::fabs(double{row[static_cast<std::size_t>(i)]} - wf[static_cast<std::size_t>(r * cols + i)]));
    }
    // int4 over [-1, 1] has a step of 2/15: the coarsest format here.
    CHECK(worst <= 0.07);
  }
}

#if QFLASH_HAS_X86_SIMD
TEST_CASE("linear: fp8 rows decoded with AVX2 and AVX-512 are dequantize_row's floats, bit for bit") {
  auto same_bits = [](float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; };
  // fp8: every byte (subnormals, both zeros, the NaNs), over two 128-column scale tiles.
  int const cols = 256 + 21;
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(cols));
  for (int i = 0; i < cols; ++i) codes[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(i * 37 % 256);
  for (int i = 0; i < 256; ++i) codes[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(i);
  std::vector<float> scales{0.75f, 3.0e-3f, 1.5e4f};
  WeightView fp8{WeightFormat::kFp8E4m3, codes.data(), 1, cols};
  fp8.scales = scales.data();
  std::vector<float> want(static_cast<std::size_t>(cols)), got(want.size());
  dequantize_row(fp8, 0, want.data());
  for (auto isa : {arch::CpuIsa::kAvx2, arch::CpuIsa::kAvx512}) {
    CAPTURE(to_string(isa));
    if (arch::detect_cpu_isa() < isa) {
      MESSAGE("skipped: this CPU has no ", to_string(isa));
      continue;
    }
    std::fill(got.begin(), got.end(), -1.0f);
    if (isa == arch::CpuIsa::kAvx2)
      cpu::decode_row_avx2(fp8, 0, got.data());
    else
      cpu::decode_row_avx512(fp8, 0, got.data());
    for (int i = 0; i < cols; ++i) {
      CAPTURE(i);
      float const a = got[static_cast<std::size_t>(i)], b = want[static_cast<std::size_t>(i)];
      CHECK((same_bits(a, b) || (std::isnan(a) && std::isnan(b))));
    }
  }
}

TEST_CASE("linear: q8_0 on AVX-VNNI gives the AVX2 sign-trick kernels' sums bit for bit") {
  if (!arch::avx_vnni()) {
    MESSAGE("skipped: this CPU has no AVX-VNNI (or QFLASH_AVX_VNNI=0)");
    return;
  }
  // Random codes, and a block holding both extremes (127 and -127).
  for (std::int64_t n : {32, 7 * 32, 11 * 32}) {
    CAPTURE(n);
    int const rows = 4, tokens = 4;
    std::int64_t const nb = n / 32;
    auto wf = test::random_floats(static_cast<std::size_t>(rows * n), 41);
    wf[0] = 1.0f, wf[1] = -1.0f;  // the block's extremes: codes 127 and -127
    auto w = encode_matrix(WeightFormat::kQ8_0, wf.data(), rows, n);
    auto xf = test::random_floats(static_cast<std::size_t>(tokens * n), 42);
    std::int64_t const xs = cpu::act_row_bytes(WeightFormat::kQ8_0, n);
    std::vector<std::byte> xq(static_cast<std::size_t>(tokens * xs));
    for (int t = 0; t < tokens; ++t)
      cpu::quantize_activations(cpu::ActBlocks::kQ8_0, xf.data() + t * n, n, xq.data() + t * xs);
    auto const* wb = static_cast<gguf::BlockQ8_0 const*>(w.view.data);
    std::int64_t const stride = w.view.row_bytes();
    gguf::BlockQ8_0 const* x[tokens];
    for (int t = 0; t < tokens; ++t) x[t] = reinterpret_cast<gguf::BlockQ8_0 const*>(xq.data() + t * xs);
    auto same = [](float const* a, float const* b, int count) { return std::memcmp(a, b, sizeof(float) * count) == 0; };
    float want[16], got[16];
    cpu::dot_tile_avx2<2, 4>(wb, stride, x, nb, want);
    cpu::dot_tile_avx_vnni<2, 4>(wb, stride, x, nb, got);
    CHECK(same(want, got, 8));
    cpu::dot_tokens_avx2<3>(wb, x, nb, want);
    cpu::dot_tile_avx_vnni<1, 3>(wb, 0, x, nb, got);
    CHECK(same(want, got, 3));
    cpu::dot_avx2<4>(wb, stride, x[1], nb, want);  // decode: one token, four rows, streamed
    cpu::dot_tile_avx_vnni<4, 1, true>(wb, stride, x + 1, nb, got);
    CHECK(same(want, got, 4));
  }
}

TEST_CASE("linear: q4_k, q6_k and int4 on AVX-VNNI give the AVX2 kernels' sums bit for bit") {
  if (!arch::avx_vnni()) {
    MESSAGE("skipped: this CPU has no AVX-VNNI (or QFLASH_AVX_VNNI=0)");
    return;
  }
  constexpr int kRows = 2, kTokens = 4;
  for (WeightFormat f : {WeightFormat::kQ4K, WeightFormat::kQ6K, WeightFormat::kInt4})
    for (std::int64_t n : {256, 3 * 256}) {
      CAPTURE(to_string(f));
      CAPTURE(n);
      auto const wf = test::random_floats(static_cast<std::size_t>(kRows * n), 51);
      auto const w = encode_matrix(f, wf.data(), kRows, n);
      auto const xf = test::random_floats(static_cast<std::size_t>(kTokens * n), 52, -3, 3);
      cpu::ActBlocks const k = cpu::act_blocks(f);
      std::int64_t const xs = cpu::act_row_bytes(k, n), nb = cpu::act_row_blocks(k, n);
      std::vector<std::byte> xq(static_cast<std::size_t>(kTokens * xs));
      for (int t = 0; t < kTokens; ++t) cpu::quantize_activations(k, xf.data() + t * n, n, xq.data() + t * xs);
      auto check = [&]<class WB, class XB>() {
        auto const* wb = static_cast<WB const*>(w.view.data);
        std::int64_t const stride = w.view.row_bytes();
        XB const* x[kTokens];
        for (int t = 0; t < kTokens; ++t) x[t] = reinterpret_cast<XB const*>(xq.data() + t * xs);
        float want[kTokens], got[kTokens];
        cpu::dot_avx2<kRows, false>(wb, stride, x[1], nb, want);  // decode: one token, two rows
        cpu::dot_avx2<kRows, true>(wb, stride, x[1], nb, got);
        CHECK(std::memcmp(want, got, sizeof(float) * kRows) == 0);
        cpu::dot_tokens_avx2<kTokens, false>(wb, x, nb, want);  // prefill: one row, four tokens
        cpu::dot_tokens_avx2<kTokens, true>(wb, x, nb, got);
        CHECK(std::memcmp(want, got, sizeof(float) * kTokens) == 0);
      };
      if (f == WeightFormat::kQ4K) check.operator()<gguf::BlockQ4K, gguf::BlockQ8K>();
      if (f == WeightFormat::kQ6K) check.operator()<gguf::BlockQ6K, gguf::BlockQ8K>();
      if (f == WeightFormat::kInt4) check.operator()<BlockInt4G128, cpu::ActQ8Pair>();
    }
}

TEST_CASE("linear: fp8 rows multiplied in registers (one token) take each byte's value; NaN stays NaN") {
  // One-hot activations: output o is weight (o, i) times 1, summed with zeros and scaled by its
  // tile's scale, exactly dequantize_row's value. 6 rows: a pass of 4, then single rows. Every
  // byte but the NaNs (0x7f, 0xff) appears in each row; a NaN weight makes its row's every output
  // NaN (times 0 too), so they are checked on their own.
  int const rows = 6, cols = 256 + 21;
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(rows * cols));
  for (int o = 0; o < rows; ++o)
    for (int i = 0; i < cols; ++i) {
      auto const c = static_cast<std::uint8_t>((i + 101 * o) % 256);
      codes[static_cast<std::size_t>(o * cols + i)] = (c & 0x7f) == 0x7f ? std::uint8_t{0x80} : c;
    }
  std::vector<float> scales{0.75f, 3.0e-3f, 1.5e4f};
  WeightView fp8{WeightFormat::kFp8E4m3, codes.data(), rows, cols};
  fp8.scales = scales.data();
  std::vector<float> want(static_cast<std::size_t>(rows * cols));
  for (int o = 0; o < rows; ++o) dequantize_row(fp8, o, want.data() + o * cols);
  for (auto isa : {arch::CpuIsa::kAvx2, arch::CpuIsa::kAvx512}) {
    CAPTURE(to_string(isa));
    if (arch::detect_cpu_isa() < isa) {
      MESSAGE("skipped: this CPU has no ", to_string(isa));
      continue;
    }
    std::vector<float> x(static_cast<std::size_t>(cols)), y(static_cast<std::size_t>(rows));
    LinearArgs a{};
    a.w = fp8;
    a.x = x.data();
    a.y = y.data();
    a.n_tokens = 1;
    int wrong = 0;
    for (int i = 0; i < cols; ++i) {
      std::fill(x.begin(), x.end(), 0.0f);
      x[static_cast<std::size_t>(i)] = 1.0f;
      REQUIRE(cpu::linear(isa, a) == Status::kSuccess);
      for (int o = 0; o < rows; ++o)
        if (y[static_cast<std::size_t>(o)] != want[static_cast<std::size_t>(o * cols + i)]) ++wrong;
    }
    CHECK(wrong == 0);
    // NaN weights: 0x7f in row 1 (in the pass of 4), 0xff in row 5 (a single row), in the tail.
    std::vector<std::uint8_t> nan_codes = codes;
    nan_codes[static_cast<std::size_t>(1 * cols + 3)] = 0x7f;
    nan_codes[static_cast<std::size_t>(5 * cols + cols - 1)] = 0xff;
    a.w.data = nan_codes.data();
    std::fill(x.begin(), x.end(), 0.5f);
    REQUIRE(cpu::linear(isa, a) == Status::kSuccess);
    for (int o = 0; o < rows; ++o) {
      CAPTURE(o);
      CHECK(std::isnan(y[static_cast<std::size_t>(o)]) == (o == 1 || o == 5));
    }
  }
}
#endif

TEST_CASE("linear: strided rows and argument checks") {
  std::vector<float> x(2 * 10, 1.0f), w(3 * 8, 0.25f), y(2 * 5, -1.0f);
  LinearArgs a{};
  a.w = {WeightFormat::kF32, w.data(), 3, 8};
  a.x = x.data();
  a.x_stride = 10;
  a.y = y.data();
  a.y_stride = 5;
  a.n_tokens = 2;
  REQUIRE(launch_linear<spec::generic>(arch::Cpu{}, a) == Status::kSuccess);
  for (int t = 0; t < 2; ++t) {
    for (int o = 0; o < 3; ++o) CHECK(y[static_cast<std::size_t>(t * 5 + o)] == doctest::Approx(2.0));
    CHECK(y[static_cast<std::size_t>(t * 5 + 3)] == -1.0f);  // untouched padding
  }
  a.x_stride = 4;
  CHECK(launch_linear<spec::generic>(arch::Cpu{}, a) == Status::kErrorInvalidProblem);
  a.x_stride = 0;
  a.w.format = WeightFormat::kQ8_0;  // 8 columns is not a whole q8_0 block
  CHECK(launch_linear<spec::generic>(arch::Cpu{}, a) == Status::kErrorInvalidProblem);
  a.w.format = WeightFormat::kFp8E4m3;  // no scales
  CHECK(launch_linear<spec::generic>(arch::Cpu{}, a) == Status::kErrorInvalidProblem);
  // An instance compiled for one format refuses the others.
  a.w.format = WeightFormat::kF32;
  constexpr MoeSpec bf16_only{.weights = WeightFormat::kBf16};
  CHECK(cpu::linear<bf16_only.weights>(arch::cpu_isa(), a) == Status::kErrorNotSupported);
}

TEST_CASE("rope: fp32-angle kernel equals the fp64 reference, partial and full") {
  for (int rotary : {8, 32}) {
    CAPTURE(rotary);
    int const n_tok = 7, n_head = 3, d_head = 32;
    auto x = test::random_floats(static_cast<std::size_t>(n_tok * n_head * d_head), 5);
    std::vector<std::int64_t> pos{0, 1, 2, 9, 100, 1000, 4095};
    auto y = x, ref_y = x;
    RopeArgs a{};
    a.positions = pos.data();
    a.n_tokens = n_tok;
    a.n_head = n_head;
    a.d_head = d_head;
    a.rotary_dim = rotary;
    a.theta = 1e7f;
    a.x = ref_y.data();
    ref::rope(a);
    a.x = y.data();
    REQUIRE(launch_rope<spec::generic>(arch::Cpu{}, a) == Status::kSuccess);
    // fp32 angles at position 4095 differ from fp64 ones by up to ~2e-4 rad.
    auto r = all_close<float, float>(y, ref_y, Tolerance{5e-4, 0});
    CHECK_MESSAGE(r.ok, r.report);
    // dims past rotary_dim pass through untouched; position 0 is the identity
    for (int h = 0; h < n_head; ++h)
      for (int i = 0; i < d_head; ++i) {
        std::size_t const j = static_cast<std::size_t>(h * d_head + i);
        CHECK(y[j] == x[j]);
        if (i >= rotary) CHECK(y[static_cast<std::size_t>(6 * n_head * d_head) + j] == x[static_cast<std::size_t>(6 * n_head * d_head) + j]);
      }
  }
}

TEST_CASE("attention: causal GQA equals the reference, incremental equals full") {
  int const n_head = 4, n_kv = 2, d = 16;
  for (int n_ctx : {1, 5, 33, 600}) {  // 600: three blocks of kKeyBlock keys
    CAPTURE(n_ctx);
    auto q = test::random_floats(static_cast<std::size_t>(n_ctx * n_head * d), 7, -2, 2);
    auto k = test::random_floats(static_cast<std::size_t>(n_ctx * n_kv * d), 8, -2, 2);
    auto v = test::random_floats(static_cast<std::size_t>(n_ctx * n_kv * d), 9);
    std::vector<float> out(q.size()), ref_out(q.size());
    kv::LayerCache cache(n_kv, d, kv::KvFormats{}, n_ctx);
    cache.append(k.data(), v.data(), n_ctx);
    AttentionArgs a{};
    a.q = q.data();
    a.kv = cache.view();
    a.n_tokens = n_ctx;
    a.n_ctx = n_ctx;
    a.n_head = n_head;
    a.n_head_kv = n_kv;
    a.d_head = d;
    a.scale = 0.25f;
    a.out = ref_out.data();
    ref::attention(a);
    for (auto isa : isas_here()) {
      CAPTURE(to_string(isa));
      std::vector<float> got(q.size());
      a.out = got.data();
      REQUIRE(cpu::attention<kDynamic>(isa, a) == Status::kSuccess);
      auto r = all_close<float, float>(got, ref_out, kDot);
      CHECK_MESSAGE(r.ok, r.report);
    }
    a.out = out.data();
    REQUIRE(launch_attention<spec::generic>(arch::Cpu{}, a) == Status::kSuccess);
    auto r = all_close<float, float>(out, ref_out, kDot);
    CHECK_MESSAGE(r.ok, r.report);
    // The last token alone over the whole cache gives the last row of the full result.
    std::vector<float> last(static_cast<std::size_t>(n_head * d));
    a.q = q.data() + (n_ctx - 1) * n_head * d;
    a.n_tokens = 1;
    a.out = last.data();
    REQUIRE(launch_attention<spec::generic>(arch::Cpu{}, a) == Status::kSuccess);
    for (std::size_t i = 0; i < last.size(); ++i) CHECK(last[i] == out[static_cast<std::size_t>((n_ctx - 1) * n_head * d) + i]);
  }
  AttentionArgs bad{};
  CHECK(launch_attention<spec::generic>(arch::Cpu{}, bad) == Status::kErrorInvalidProblem);
}

TEST_CASE("router_topk: same expert sets and weights as the reference on every ISA; weights sum to 1") {
  arch::CpuIsa launcher_level = arch::CpuIsa::kScalar;  // the highest level tested that it runs
  for (auto isa : isas_here())
    if (isa <= arch::cpu_isa()) launcher_level = isa;
  for (auto [n_expert, k] : std::vector<std::array<int, 2>>{{8, 2}, {31, 4}, {71, 8}, {129, 8}, {256, 8}}) {
    for (auto isa : isas_here()) {
      CAPTURE(n_expert);
      CAPTURE(to_string(isa));
      int const n_tok = 5;
      auto logits = test::random_floats(static_cast<std::size_t>(n_tok * n_expert), 11, -4, 4);
      std::vector<std::int32_t> e(static_cast<std::size_t>(n_tok * k)), e_ref(e.size());
      std::vector<float> w(e.size()), w_ref(e.size());
      RouterTopkArgs a{};
      a.logits = logits.data();
      a.n_tokens = n_tok;
      a.n_expert = n_expert;
      a.n_expert_used = k;
      a.experts = e_ref.data();
      a.weights = w_ref.data();
      ref::router_topk(a);
      a.experts = e.data();
      a.weights = w.data();
      REQUIRE(cpu::router_topk<kDynamic, kDynamic>(isa, a) == Status::kSuccess);
      for (int t = 0; t < n_tok; ++t) {
        auto row = [&](auto const& v) {
          return std::set<std::int32_t>(v.begin() + t * k, v.begin() + (t + 1) * k);
        };
        CHECK(row(e) == row(e_ref));
        float const sum = std::accumulate(w.begin() + t * k, w.begin() + (t + 1) * k, 0.0f);
        CHECK(sum == doctest::Approx(1.0).epsilon(1e-6));
        for (int j = 1; j < k; ++j) CHECK(w[static_cast<std::size_t>(t * k + j - 1)] >= w[static_cast<std::size_t>(t * k + j)]);
      }
      auto r = all_close<float, float>(w, w_ref, Tolerance{1e-6, 1e-5});
      CHECK_MESSAGE(r.ok, r.report);
      if (isa == launcher_level) {  // the launcher runs this level's body
        std::vector<std::int32_t> e_launch(e.size());
        std::vector<float> w_launch(w.size());
        a.experts = e_launch.data();
        a.weights = w_launch.data();
        REQUIRE(launch_router_topk<spec::generic>(arch::Cpu{}, a) == Status::kSuccess);
        CHECK(e_launch == e);
        CHECK(w_launch == w);
      }
    }
  }
  // The compiled spec's expert count is enforced.
  std::vector<float> l(8);
  std::vector<std::int32_t> e(2);
  std::vector<float> w(2);
  RouterTopkArgs a{};
  a.logits = l.data();
  a.experts = e.data();
  a.weights = w.data();
  a.n_tokens = 1;
  a.n_expert = 8;
  a.n_expert_used = 2;
  CHECK(launch_router_topk<spec::qwen3_6_35b_a3b>(arch::Cpu{}, a) == Status::kErrorInvalidProblem);
}

TEST_CASE("router_topk: experts far below the max, or at -inf, get weight ~0 and follow in index order") {
  // 5 finite logits, expert 0 100 below the max (its e^(l - max) is past the exp's clamp, as
  // -inf's is), the rest -inf; k = 8 reaches 3 of the far ones: 0, 1 and 2 on every path.
  int const n_expert = 16, k = 8;
  std::vector<float> logits(n_expert, -INFINITY);
  for (auto [e, v] : std::vector<std::pair<int, float>>{{3, 1.5f}, {7, -2.0f}, {8, 3.0f}, {12, 0.25f}, {15, -3.5f}})
    logits[static_cast<std::size_t>(e)] = v;
  logits[0] = 3.0f - 100.0f;
  std::vector<std::int32_t> e_ref(k), e(k);
  std::vector<float> w_ref(k), w(k);
  RouterTopkArgs a{};
  a.logits = logits.data();
  a.n_tokens = 1;
  a.n_expert = n_expert;
  a.n_expert_used = k;
  a.experts = e_ref.data();
  a.weights = w_ref.data();
  ref::router_topk(a);
  CHECK(std::vector<std::int32_t>(e_ref.begin() + 5, e_ref.end()) == std::vector<std::int32_t>{0, 1, 2});
  for (auto isa : isas_here()) {
    CAPTURE(to_string(isa));
    a.experts = e.data();
    a.weights = w.data();
    REQUIRE(cpu::router_topk<kDynamic, kDynamic>(isa, a) == Status::kSuccess);
    CHECK(e == e_ref);
    auto r = all_close<float, float>(w, w_ref, Tolerance{1e-6, 1e-5});
    CHECK_MESSAGE(r.ok, r.report);
    for (int j = 5; j < k; ++j) CHECK(w[static_cast<std::size_t>(j)] < 1e-30f);
  }
}

TEST_CASE("expert_ffn: grouped experts equal the per-pair reference, in every weight format and ISA path") {
  int const n_expert = 5, k = 2;
  for (WeightFormat f : kAllWeightFormats)
    for (int n_tok : {1, 4, 11, 40}) {
      // GGUF blocks need whole blocks along both the d_model and d_ff rows; 40 tokens put
      // 16 on each expert, whole 32-column chunks let bf16 and the integer formats run on
      // AMX tiles.
      bool const k_blocks = f == WeightFormat::kQ4K || f == WeightFormat::kQ6K;
      bool const chunks = n_tok == 40;
      int const d_model = k_blocks ? 256 : f == WeightFormat::kQ8_0 || chunks ? 64 : 24;
      int const d_ff = k_blocks ? 256 : chunks ? 96 : f == WeightFormat::kQ8_0 ? 32 : 13;
      CAPTURE(n_tok);
      CAPTURE(to_string(f));
      test::ExpertCase c;
      c.add_experts(n_expert, f, f, d_model, d_ff, 100);
      c.set_tokens(n_tok, d_model, k, 3);
      for (int t = 0; t < n_tok; ++t) {
        c.routes.insert(c.routes.end(), {(t * 3) % n_expert, (t * 3 + 1 + t % 2) % n_expert});
        c.route_weights.insert(c.route_weights.end(), {0.7f, 0.3f});
      }
      std::vector<float> out(static_cast<std::size_t>(n_tok * d_model), 1.0f), ref_out(out);
      ExpertFfnArgs a = c.args(ref_out.data());
      ref::expert_ffn(a);
      for (auto isa : isas_here())
        for (bool fused : {true, false}) {  // fusion::SwiGluInExperts, fusion::SwiGluSeparate
          CAPTURE(to_string(isa));
          CAPTURE(fused);
          std::fill(out.begin(), out.end(), 1.0f);
          a.out = out.data();
          a.fused_swiglu = fused;
          REQUIRE(cpu::expert_ffn<WeightFormat::kAny>(isa, a) == Status::kSuccess);
          auto r = all_close<float, float>(out, ref_out, Tolerance{5e-5, 1e-5});
          CHECK_MESSAGE(r.ok, r.report);
        }
      std::fill(out.begin(), out.end(), 1.0f);
      a.out = out.data();
      REQUIRE(launch_expert_ffn<spec::generic>(arch::Cpu{}, a) == Status::kSuccess);  // the launcher: cpu_isa()
      auto const r = all_close<float, float>(out, ref_out, Tolerance{5e-5, 1e-5});
      CHECK_MESSAGE(r.ok, r.report);
      // Not accumulating: out is written whatever it held (NaN here), as if added to zeros.
      std::vector<float> from_zeros(out.size(), 0.0f);
      a.out = from_zeros.data();
      REQUIRE(launch_expert_ffn<spec::generic>(arch::Cpu{}, a) == Status::kSuccess);
      std::fill(out.begin(), out.end(), std::numeric_limits<float>::quiet_NaN());
      a.out = out.data();
      a.accumulate = false;
      REQUIRE(launch_expert_ffn<spec::generic>(arch::Cpu{}, a) == Status::kSuccess);
      CHECK(out == from_zeros);
      std::vector<float> ref_written(out.size(), std::numeric_limits<float>::quiet_NaN());
      a.out = ref_written.data();
      ref::expert_ffn(a);
      auto const rw = all_close<float, float>(ref_written, out, Tolerance{5e-5, 1e-5});
      CHECK_MESSAGE(rw.ok, rw.report);
      a.accumulate = true;
      c.routes[0] = n_expert;
      CHECK(launch_expert_ffn<spec::generic>(arch::Cpu{}, a) == Status::kErrorInvalidProblem);
    }
}

TEST_CASE("expert_ffn: float formats give each token its one-token result, bit for bit") {
  // Rows and columns off the tiles' multiples, so that a row's sum is stored by a different
  // tile (8 or 4 rows, or one) in a batch than alone; the routing weight is applied as it is
  // stored. AMX tiles (bf16 from kAmxMinTokens) sum in another order and are left out.
  int const n_expert = 5, k = 2, d_model = 44, d_ff = 24, n_tok = 9;
  for (WeightFormat f : {WeightFormat::kF32, WeightFormat::kBf16, WeightFormat::kF16}) {
    CAPTURE(to_string(f));
    test::ExpertCase c;
    c.add_experts(n_expert, f, f, d_model, d_ff, 40);
    c.shared = c.expert(f, f, d_model, 28, 80);
    c.set_tokens(n_tok, d_model, k, 11);
    for (int t = 0; t < n_tok; ++t) {
      c.routes.insert(c.routes.end(), {t % 2, 2 + t % 3});  // experts 0 and 1 get 4-5 tokens each
      c.route_weights.insert(c.route_weights.end(), {0.6f, 0.4f});
      c.shared_weights.push_back(0.3f);
    }
    for (auto isa : isas_here()) {
      if (isa >= arch::CpuIsa::kAmx) continue;
      CAPTURE(to_string(isa));
      std::vector<float> batch(static_cast<std::size_t>(n_tok * d_model), 0.5f), one(batch);
      ExpertFfnArgs a = c.args(batch.data());
      REQUIRE(cpu::expert_ffn<WeightFormat::kAny>(isa, a) == Status::kSuccess);
      for (int t = 0; t < n_tok; ++t) {
        ExpertFfnArgs b = c.args(one.data() + t * d_model);
        b.n_tokens = 1;
        b.x = c.x.data() + t * d_model;
        b.routes = c.routes.data() + t * k;
        b.route_weights = c.route_weights.data() + t * k;
        b.shared_weights = c.shared_weights.data() + t;
        REQUIRE(cpu::expert_ffn<WeightFormat::kAny>(isa, b) == Status::kSuccess);
      }
      CHECK(batch == one);
    }
  }
}

TEST_CASE("expert_ffn: a shared expert of another width and mixed formats, in one call") {
  // q4_k_m-like: gate/up q4_k, down q6_k; the shared expert wider and in bf16; many tokens.
  int const n_expert = 6, k = 3, d_model = 256, d_ff = 256, d_ff_shared = 512;
  for (int n_tok : {1, 2, 37}) {
    CAPTURE(n_tok);
    test::ExpertCase c;
    c.add_experts(n_expert, WeightFormat::kQ4K, WeightFormat::kQ6K, d_model, d_ff, 10);
    c.shared = c.expert(WeightFormat::kBf16, WeightFormat::kBf16, d_model, d_ff_shared, 90);
    c.set_tokens(n_tok, d_model, k, 7);
    for (int t = 0; t < n_tok; ++t) {
      for (int j = 0; j < k; ++j) {
        c.routes.push_back((t * 5 + j * 2) % n_expert);
        c.route_weights.push_back(0.2f + 0.1f * static_cast<float>(j));
      }
      c.shared_weights.push_back(0.5f + 0.01f * static_cast<float>(t));
    }
    std::vector<float> out(static_cast<std::size_t>(n_tok * d_model), 0.25f), ref_out(out);
    ExpertFfnArgs a = c.args(ref_out.data());
    ref::expert_ffn(a);
    for (auto isa : isas_here()) {
      CAPTURE(to_string(isa));
      std::vector<float> got(out);
      a.out = got.data();
      REQUIRE(cpu::expert_ffn<WeightFormat::kAny>(isa, a) == Status::kSuccess);
      // The SwiGLU output is quantized to q8_k for the q6_k down rows: an fp32 difference
      // from the fp64 reference can move one code by one step (|d| ~ 1e-3 * |w| ~ 5e-4).
      auto r = all_close<float, float>(got, ref_out, Tolerance{2e-3, 1e-4});
      CHECK_MESSAGE(r.ok, r.report);
    }
    a.shared_weights = nullptr;
    CHECK(launch_expert_ffn<spec::generic>(arch::Cpu{}, a) == Status::kErrorInvalidProblem);
  }
}

TEST_CASE("expert_ffn: LoRA updates per token (two adapters and none), routed and shared, equal the reference") {
  int const n_expert = 5, k = 2, d_model = 64, d_ff = 32, d_ff_shared = 48;
  test::ExpertCase weights;
  auto low_rank = [&](int r, std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
    return LowRank{weights.matrix(WeightFormat::kF32, r, cols, seed), weights.matrix(WeightFormat::kF32, rows, r, seed + 1)};
  };
  weights.add_experts(n_expert, WeightFormat::kQ8_0, WeightFormat::kQ8_0, d_model, d_ff, 10);
  weights.shared = weights.expert(WeightFormat::kBf16, WeightFormat::kBf16, d_model, d_ff_shared, 90);
  // Adapter 1 (rank 4) updates every routed projection and the shared down; adapter 2 (rank 2)
  // only the routed up projections, so some pairs have updates and others not.
  std::vector<LowRank> g1, u1, d1, u2;
  for (int e = 0; e < n_expert; ++e) {
    g1.push_back(low_rank(4, d_ff, d_model, 200 + 10 * e));
    u1.push_back(low_rank(4, d_ff, d_model, 202 + 10 * e));
    d1.push_back(low_rank(4, d_model, d_ff, 204 + 10 * e));
    u2.push_back(low_rank(2, d_ff, d_model, 300 + 10 * e));
  }
  ExpertLora l1{g1, u1, d1, {}, {}, low_rank(4, d_model, d_ff_shared, 400)};
  ExpertLora l2{{}, u2, {}, {}, {}, {}};
  for (int n_tok : {1, 7}) {
    CAPTURE(n_tok);
    test::ExpertCase& c = weights;
    c.set_tokens(n_tok, d_model, k, 7);
    c.routes.clear(), c.route_weights.clear(), c.shared_weights.clear();
    std::vector<ExpertLora const*> token_lora;
    for (int t = 0; t < n_tok; ++t) {
      for (int j = 0; j < k; ++j) {
        c.routes.push_back((t * 3 + j * 2) % n_expert);
        c.route_weights.push_back(0.3f + 0.2f * static_cast<float>(j));
      }
      c.shared_weights.push_back(0.5f);
      token_lora.push_back(t % 3 == 0 ? &l1 : t % 3 == 1 ? &l2 : nullptr);
    }
    std::vector<float> out(static_cast<std::size_t>(n_tok * d_model), 0.25f), ref_out(out), base_out(out);
    ExpertFfnArgs a = c.args(base_out.data());
    ref::expert_ffn(a);  // without the adapters: must differ where a token has one
    a.token_lora = token_lora.data();
    a.out = ref_out.data();
    ref::expert_ffn(a);
    CHECK(std::abs(ref_out[0] - base_out[0]) > 1e-3f);
    for (bool fused : {true, false}) {
      CAPTURE(fused);
      std::vector<float> got(out);
      a.out = got.data();
      a.fused_swiglu = fused;
      REQUIRE(launch_expert_ffn<spec::generic>(arch::Cpu{}, a) == Status::kSuccess);
      auto r = all_close<float, float>(got, ref_out, Tolerance{2e-4, 1e-4});
      CHECK_MESSAGE(r.ok, r.report);
    }
    // An update of the wrong shape is refused.
    ExpertLora bad = l1;
    bad.shared_down = low_rank(4, d_model, d_ff, 500);
    token_lora[0] = &bad;
    CHECK(launch_expert_ffn<spec::generic>(arch::Cpu{}, a) == Status::kErrorInvalidProblem);
  }
}

TEST_CASE("expert_ffn: LoRA updates stacked at one rank, as CUDA reads them, keep their values") {
  int const n_expert = 4, k = 2, d_model = 64, d_ff = 32;
  test::ExpertCase c;
  c.add_experts(n_expert, WeightFormat::kBf16, WeightFormat::kBf16, d_model, d_ff, 10);
  // Ranks 4, 2, none and 3: stacked at rank 4, zero rows and columns pad the others.
  std::vector<LowRank> gate, down;
  for (int e = 0; e < n_expert; ++e) {
    int const r = std::array{4, 2, 0, 3}[static_cast<std::size_t>(e)];
    auto const seed = 200 + 10 * static_cast<std::uint64_t>(e);
    gate.push_back(r ? LowRank{c.matrix(WeightFormat::kF32, r, d_model, seed), c.matrix(WeightFormat::kF32, d_ff, r, seed + 1)}
                     : LowRank{});
    down.push_back(r ? LowRank{c.matrix(WeightFormat::kF32, r, d_ff, seed + 2), c.matrix(WeightFormat::kF32, d_model, r, seed + 3)}
                     : LowRank{});
  }
  StackedLowRank const sg = stack_low_rank(gate), sd = stack_low_rank(down);
  REQUIRE(sg.rank == 4);
  CHECK(sd.n_in == d_ff);
  CHECK(sd.n_out == d_model);
  CHECK(stack_low_rank(std::vector<LowRank>(3)).rank == 0);
  std::vector<LowRank> mixed = gate;  // another expert's shape among them: refused
  mixed[2] = down[0];
  CHECK_THROWS_AS((void)stack_low_rank(mixed), Error);
  std::vector<LowRank> stacked_gate, stacked_down;
  for (std::size_t e = 0; e < gate.size(); ++e) stacked_gate.push_back(sg.at(e)), stacked_down.push_back(sd.at(e));
  for (auto m : {&LowRank::a, &LowRank::b}) {  // one strided set each, where the ragged updates are none
    std::optional<StackedView> const s = stack(stacked_gate, m);
    REQUIRE(s.has_value());
    CHECK(s->at(3).data == (stacked_gate[3].*m).data);
    CHECK_FALSE(stack(gate, m).has_value());
  }
  c.set_tokens(9, d_model, k, 7);
  for (int t = 0; t < 9; ++t)
    for (int j = 0; j < k; ++j) {
      c.routes.push_back((t + 3 * j) % n_expert);
      c.route_weights.push_back(0.5f);
    }
  ExpertLora const ragged{gate, {}, down, {}, {}, {}}, even{stacked_gate, {}, stacked_down, {}, {}, {}};
  std::vector<float> want(9 * d_model, 0.0f), got(want);
  std::vector<ExpertLora const*> token_lora(9, &ragged);
  ExpertFfnArgs a = c.args(want.data());
  a.token_lora = token_lora.data();
  REQUIRE(launch_expert_ffn<spec::generic>(arch::Cpu{}, a) == Status::kSuccess);
  std::fill(token_lora.begin(), token_lora.end(), &even);
  a.out = got.data();
  REQUIRE(launch_expert_ffn<spec::generic>(arch::Cpu{}, a) == Status::kSuccess);
  auto const r = all_close<float, float>(got, want, Tolerance{1e-6, 1e-6});  // sums of more terms, the extra ones 0
  CHECK_MESSAGE(r.ok, r.report);
}

TEST_CASE("expert_ffn: experts sliced from stacked tensors are one strided set; others are not") {
  int const n_expert = 4, d_model = 256, d_ff = 512;
  for (WeightFormat f : {WeightFormat::kBf16, WeightFormat::kFp8E4m3, WeightFormat::kQ4K}) {
    CAPTURE(to_string(f));
    // Stacked tensors [n_expert * rows, cols], each expert a slice (fp8: one scale grid, the
    // slices' scale rows moving by rows).
    auto const gate_up = test::random_floats(static_cast<std::size_t>(n_expert * d_ff * d_model), 1);
    auto const down = test::random_floats(static_cast<std::size_t>(n_expert * d_model * d_ff), 2);
    OwnedMatrix const g = encode_matrix(f, gate_up.data(), n_expert * d_ff, d_model);
    OwnedMatrix const d = encode_matrix(f, down.data(), n_expert * d_model, d_ff);
    std::vector<ExpertWeights> experts;
    for (int e = 0; e < n_expert; ++e)
      experts.push_back({g.view.slice_rows(e * d_ff, d_ff), g.view.slice_rows(e * d_ff, d_ff),
                         d.view.slice_rows(e * d_model, d_model)});
    for (auto which : {&ExpertWeights::gate, &ExpertWeights::down}) {
      std::optional<StackedView> const s = stack(experts, which);
      REQUIRE(s.has_value());
      for (int e = 0; e < n_expert; ++e) {
        WeightView const want = experts[static_cast<std::size_t>(e)].*which, got = s->at(e);
        CHECK(got.data == want.data);
        CHECK(got.rows == want.rows);
        if (f == WeightFormat::kFp8E4m3)
          for (std::int64_t r : {std::int64_t{0}, want.rows - 1}) CHECK(got.scale_row(r) == want.scale_row(r));
      }
    }
    // Experts out of order, of another shape or format, or none: not a strided set.
    std::swap(experts[1].down, experts[2].down);
    CHECK_FALSE(stack(experts, &ExpertWeights::down).has_value());
    std::swap(experts[1].down, experts[2].down);
    experts[3].gate.rows -= 1;
    CHECK_FALSE(stack(experts, &ExpertWeights::gate).has_value());
    experts[3].gate.rows += 1;
    experts[0].up.format = WeightFormat::kF32;
    CHECK_FALSE(stack(experts, &ExpertWeights::up).has_value());
    CHECK_FALSE(stack({}, &ExpertWeights::up).has_value());
  }
  // Separate fp8 matrices one after another, each with its own scale grid after the last:
  // the scale pointer moves instead of the scale row.
  test::ExpertCase c;
  std::vector<std::byte> bytes;
  std::vector<float> scales;
  for (int e = 0; e < 3; ++e) {
    WeightView const w = c.matrix(WeightFormat::kFp8E4m3, 130, 300, 10 + static_cast<std::uint64_t>(e));
    bytes.insert(bytes.end(), static_cast<std::byte const*>(w.data), static_cast<std::byte const*>(w.data) + w.bytes());
    scales.insert(scales.end(), w.scales, w.scales + fp8_scale_blocks(130) * fp8_scale_blocks(300));
  }
  std::vector<ExpertWeights> experts(3);
  for (int e = 0; e < 3; ++e) {
    WeightView& w = experts[static_cast<std::size_t>(e)].gate;
    w = c.store[static_cast<std::size_t>(e)].view;
    w.data = bytes.data() + e * w.bytes();
    w.scales = scales.data() + e * fp8_scale_blocks(130) * fp8_scale_blocks(300);
  }
  std::optional<StackedView> const s = stack(experts, &ExpertWeights::gate);
  REQUIRE(s.has_value());
  CHECK(s->row0_stride == 0);
  CHECK(s->at(2).scale_row(129) == experts[2].gate.scale_row(129));
}

TEST_CASE("avx2_reduce_add8: each lane is avx2_reduce_add of its vector, bit for bit") {
  // Lanes of magnitudes 2^-20 to 2^20 and both signs: another order of the adds rounds
  // differently (checked: the plain left-to-right sum differs on 574 of these 1600).
#if QFLASH_HAS_X86_SIMD
  if (arch::detect_cpu_isa() < arch::CpuIsa::kAvx2) return;
  auto const u = test::random_floats(64 * 200, 31);
  int differs_from_serial = 0;
  for (std::size_t c = 0; c < 200; ++c) {
    float v[64];
    for (int i = 0; i < 64; ++i) v[i] = std::ldexp(u[c * 64 + static_cast<std::size_t>(i)], (i * 7 + static_cast<int>(c)) % 41 - 20);
    float one[8], eight[8];
    reduce_both(v, one, eight);
    for (int j = 0; j < 8; ++j) {
      CHECK(std::memcmp(&one[j], &eight[j], sizeof(float)) == 0);
      float serial = 0;
      for (int l = 0; l < 8; ++l) serial += v[8 * j + l];
      differs_from_serial += serial != one[j];
    }
  }
  CHECK(differs_from_serial > 200);  // the data tells orders apart
#endif
}

TEST_CASE("vector exp and SiLU: within 2 ulp of std::exp, limits and NaN") {
#if QFLASH_HAS_X86_SIMD
  if (arch::detect_cpu_isa() < arch::CpuIsa::kAvx2) return;
  std::vector<float> xs;
  for (float v = -87.0f; v <= 88.0f; v += 0.0137f) xs.push_back(v);
  for (float v : {0.0f, -0.0f, 1e-30f, -1e-30f, 1.0f, -1.0f}) xs.push_back(v);
  while (xs.size() % 8) xs.push_back(0.5f);
  double worst = 0;
  for (std::size_t i = 0; i < xs.size(); i += 8) {
    float got[8], silu_got[8];
    simd_eval(xs.data() + i, got, silu_got);
    for (int l = 0; l < 8; ++l) {
      double const want = std::exp(double{xs[i + static_cast<std::size_t>(l)]});
      worst = std::max(worst, std::fabs(got[l] - want) / want);
      double const s = xs[i + static_cast<std::size_t>(l)] / (1.0 + std::exp(-double{xs[i + static_cast<std::size_t>(l)]}));
      CHECK(std::fabs(silu_got[l] - s) <= 1e-6 * std::fabs(s) + 1e-37);
    }
  }
  MESSAGE("vector exp: worst relative error ", worst);
  CHECK(worst <= 2.4e-7);  // 2 ulp
  float const edge[8] = {-200.0f, -88.0f, 89.0f, 1000.0f, INFINITY, -INFINITY, NAN, 0.0f};
  float e[8], sl[8];
  simd_eval(edge, e, sl);
  CHECK(e[0] == 0.0f);
  CHECK(e[1] == 0.0f);
  CHECK(std::isinf(e[2]));
  CHECK(std::isinf(e[3]));
  CHECK(std::isinf(e[4]));
  CHECK(e[5] == 0.0f);
  CHECK(std::isnan(e[6]));
  CHECK(e[7] == 1.0f);
  CHECK(sl[3] == 1000.0f);  // silu(x) -> x
  CHECK(sl[0] == 0.0f);     // silu(-200) -> -0
  CHECK(std::isnan(sl[6]));
#endif
}
