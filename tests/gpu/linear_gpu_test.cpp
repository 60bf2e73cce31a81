// linear on CUDA: every compiled instance (spec x arch) this device runs, every weight format
// the spec compiles, against the CPU twin and ref::linear: decode and prefill token counts,
// aligned and unaligned rows (the vector and the scalar path), int4's short last group (the
// GEMV and the tensor cores),
// strided x and y, accumulate, token tiles past the grid's, bf16's and fp8's tensor-core
// tiles (4096 columns too), fp8 rows sliced from a larger tensor, linear_group's parts, and
// weights at an address the kernels cannot read (refused).
// Tolerance: fp32 sums in another order over the same decoded weights and rounded activations;
// on the emulator also each output's distance from the exact sum, in units of 2^-24 sum|x w|
// (kEmulatedUnits).
#include "gpu/gpu_main.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

#include "qflash/kernels/linear/cpu.hpp"
#include "qflash/kernels/linear/ref.hpp"
#include "qflash/kernels/linear_group/cpu.hpp"
#include "qflash/numeric/weight_encode.hpp"
#include "support/random.hpp"
#include "support/tolerance.hpp"

using namespace qflash;
using namespace qflash::kernels;
using test::all_close;
using test::Tolerance;
using test::gpu::DeviceArray;

namespace {

constexpr Tolerance kSum{2e-4, 1e-4};

/// On the emulator, which rounds each addition to nearest in the kernels' order: the most that
/// sums may lie from the exact ones, in units of 2^-24 sum_i |x_i w_i|. Every path is within
/// 1.4 (the CPU's too); the tensor cores' running sums took 3.7 when the mid and lo parts'
/// products went into them.
constexpr double kEmulatedUnits = 2;

/// The largest |y - x W^T| over y [tokens, ys] (no accumulation), in units of 2^-24 sum_i
/// |x_i w_i|, with x [tokens, xs] rounded as the op rounds it and W decoded, exactly in fp64;
/// NaN where y holds one.
double rounding_units(WeightView const& w, std::vector<float> const& x, std::int64_t xs, std::int64_t tokens,
                      std::vector<float> const& y, std::int64_t ys) {
  std::vector<float> xr(static_cast<std::size_t>(tokens * w.cols)), row(static_cast<std::size_t>(w.cols));
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::copy_n(x.begin() + t * xs, w.cols, xr.begin() + t * w.cols);
    ref::round_activations(w.format, xr.data() + t * w.cols, w.cols);
  }
  double worst = 0;
  for (std::int64_t o = 0; o < w.rows; ++o) {
    dequantize_row(w, o, row.data());
    for (std::int64_t t = 0; t < tokens; ++t) {
      float const* const xt = xr.data() + t * w.cols;
      double exact = 0, magnitude = 0;
      for (std::int64_t i = 0; i < w.cols; ++i) {
        double const p = static_cast<double>(xt[i]) * row[static_cast<std::size_t>(i)];
        exact += p;
        magnitude += std::abs(p);
      }
      double const off = std::abs(y[static_cast<std::size_t>(t * ys + o)] - exact);
      if (std::isnan(off)) return off;
      worst = std::max(worst, off == 0 ? 0 : off / (magnitude * 0x1p-24));
    }
  }
  return worst;
}

struct Case {
  WeightFormat format;
  std::int64_t rows, cols, tokens;
  std::int64_t x_pad = 0;  ///< extra floats between tokens of x
  std::int64_t y_pad = 0;  ///< ... of y
  bool accumulate = false;
  std::int64_t row0 = 0;  ///< the rows are a slice from this row of a larger matrix (fp8: its scale_row0)
};

template <MoeSpec S, class Tag>
void check_case(Case const& c) {
  CAPTURE(to_string(c.format));
  CAPTURE(c.rows);
  CAPTURE(c.cols);
  CAPTURE(c.tokens);
  CAPTURE(c.x_pad);
  CAPTURE(c.y_pad);
  CAPTURE(c.accumulate);
  CAPTURE(c.row0);
  auto const w = test::random_floats(static_cast<std::size_t>((c.row0 + c.rows) * c.cols), 101, -1, 1);
  OwnedMatrix const m = encode_matrix(c.format, w.data(), c.row0 + c.rows, c.cols);
  WeightView const hw = m.view.slice_rows(c.row0, c.rows);
  std::int64_t const xs = c.cols + c.x_pad, ys = c.rows + c.y_pad;
  auto const x = test::random_floats(static_cast<std::size_t>(c.tokens * xs), 102, -2, 2);
  auto const y0 = test::random_floats(static_cast<std::size_t>(c.tokens * ys), 103, -1, 1);
  auto args = [&](WeightView wv, float const* xp, float* yp) {
    LinearArgs a{};
    a.w = wv, a.x = xp, a.y = yp, a.n_tokens = c.tokens, a.x_stride = xs, a.y_stride = ys, a.accumulate = c.accumulate;
    return a;
  };
  std::vector<float> want = y0, cpu = y0;
  ref::linear(args(hw, x.data(), want.data()));
  REQUIRE(launch_linear<S>(arch::Cpu{}, args(hw, x.data(), cpu.data())) == Status::kSuccess);
  DeviceArray<std::byte> bytes(m.bytes);
  DeviceArray<float> scales(m.scales), dx(x), dy(y0);
  WeightView dw = hw;
  dw.data = bytes.get() + c.row0 * hw.row_bytes();
  dw.scales = c.format == WeightFormat::kFp8E4m3 ? scales.get() : nullptr;
  REQUIRE(launch_linear<S>(Tag{}, args(dw, dx.get(), dy.get()), nullptr) == Status::kSuccess);
  QFLASH_TEST_CUDA(cudaDeviceSynchronize());
  auto const got = dy.download();
  auto const vs_cpu = all_close<float, float>(got, cpu, kSum);
  CHECK_MESSAGE(vs_cpu.ok, "GPU vs CPU twin: ", vs_cpu.report);
  auto const vs_ref = all_close<float, float>(got, want, kSum);
  CHECK_MESSAGE(vs_ref.ok, "GPU vs ref: ", vs_ref.report);
  if (test::gpu::kEmulated && !c.accumulate) CHECK(rounding_units(hw, x, xs, c.tokens, got, ys) <= kEmulatedUnits);
  if (c.format != WeightFormat::kFp8E4m3 && c.tokens == 1) {  // weights at an odd address: refused
    WeightView odd = dw;
    odd.data = bytes.get() + 1;
    CHECK(launch_linear<S>(Tag{}, args(odd, dx.get(), dy.get()), nullptr) == Status::kErrorMisalignedOperand);
  }
}

/// linear_group: three parts of one input (one accumulating at a stride) against the CPU's;
/// part 1 in format f1 (one launch when the parts share a format and take the GEMV path).
template <MoeSpec S, class Tag>
void check_group(WeightFormat f, std::int64_t tokens, WeightFormat f1) {
  CAPTURE(to_string(f));
  CAPTURE(to_string(f1));
  CAPTURE(tokens);
  std::int64_t const cols = 512, rows[] = {300, 17, 70};
  auto const x = test::random_floats(static_cast<std::size_t>(tokens * cols), 111, -2, 2);
  std::vector<OwnedMatrix> m;
  std::deque<DeviceArray<std::byte>> bytes;  // deque: its elements never move
  std::deque<DeviceArray<float>> scales;
  std::vector<std::vector<float>> cpu;
  std::deque<DeviceArray<float>> dy;
  DeviceArray<float> dx(x);
  LinearGroupArgs on_cpu{}, on_gpu{};
  on_cpu.n_parts = on_gpu.n_parts = 3;
  for (std::size_t i = 0; i < 3; ++i) {
    auto const w = test::random_floats(static_cast<std::size_t>(rows[i] * cols), 112 + static_cast<unsigned>(i), -1, 1);
    WeightFormat const fi = i == 1 ? f1 : f;
    m.push_back(encode_matrix(fi, w.data(), rows[i], cols));
    bytes.emplace_back(m.back().bytes);
    scales.emplace_back(m.back().scales);
    std::int64_t const ys = i == 1 ? rows[i] + 3 : rows[i];
    cpu.push_back(test::random_floats(static_cast<std::size_t>(tokens * ys), 115 + static_cast<unsigned>(i), -1, 1));
    dy.emplace_back(cpu.back());
    LinearArgs a{};
    a.w = m.back().view, a.x = x.data(), a.y = cpu.back().data(), a.n_tokens = tokens, a.y_stride = ys;
    a.accumulate = i == 1;
    on_cpu.parts[i] = a;
    a.w.data = bytes.back().get();
    a.w.scales = fi == WeightFormat::kFp8E4m3 ? scales.back().get() : nullptr;
    a.x = dx.get(), a.y = dy.back().get();
    on_gpu.parts[i] = a;
  }
  REQUIRE(launch_linear_group<S>(arch::Cpu{}, on_cpu) == Status::kSuccess);
  REQUIRE(launch_linear_group<S>(Tag{}, on_gpu, nullptr) == Status::kSuccess);
  QFLASH_TEST_CUDA(cudaDeviceSynchronize());
  for (std::size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    auto const r = all_close<float, float>(dy[i].download(), cpu[i], kSum);
    CHECK_MESSAGE(r.ok, "GPU group vs CPU group: ", r.report);
  }
}

template <class Tag, std::size_t I>
void check_instance() {
  constexpr MoeSpec S = instances::kSpecs[I];
  CAPTURE(instances::kSpecNames[I]);
  CAPTURE(Tag::name);
  for (WeightFormat f : kAllWeightFormats) {
    if (S.weights != WeightFormat::kAny && S.weights != f) continue;
    for (std::int64_t tokens : {std::int64_t{1}, std::int64_t{5}, std::int64_t{70}})
      check_case<S, Tag>({f, 300, 512, tokens});
    check_case<S, Tag>({f, 17, 1024, 3, 8, 5, true});  // strided, accumulate
    if (row_fits(f, 200)) check_case<S, Tag>({f, 33, 200, 4, 3, 0, false});  // unaligned rows; int4's short group
    // bf16 and fp8 take the tensor-core path from 16 tokens: one m-tile, then four, with rows,
    // tokens and columns short of a tile, strided and accumulating.
    if (row_fits(f, 144)) check_case<S, Tag>({f, 130, 144, 16});
    if (row_fits(f, 528)) check_case<S, Tag>({f, 70, 528, 33, 4, 3, true});
    if (row_fits(f, 256)) check_case<S, Tag>({f, 40, 256, 20, 0, 5, false});  // strided y, written
    // Block formats take theirs from 16 tokens (70 tokens above: four m-tiles).
    if (row_fits(f, 768)) check_case<S, Tag>({f, 70, 768, 20, 4, 3, true});
    check_group<S, Tag>(f, 5, f);   // one launch
    check_group<S, Tag>(f, 20, f);  // a tensor-core launch per part (not f32, f16)
  }
  if (S.weights == WeightFormat::kAny || S.weights == WeightFormat::kInt4) {
    check_case<S, Tag>({WeightFormat::kInt4, 33, 160, 40});  // a short last int4 block
    // Tensor cores over rows that end mid-group (padded with zero codes): one m-tile, then
    // four, strided and accumulating.
    check_case<S, Tag>({WeightFormat::kInt4, 33, 200, 20});
    check_case<S, Tag>({WeightFormat::kInt4, 70, 100, 70, 3, 5, true});
  }
  if constexpr (S.weights == WeightFormat::kAny) {
    check_group<S, Tag>(WeightFormat::kBf16, 5, WeightFormat::kQ8_0);
    check_group<S, Tag>(WeightFormat::kQ4K, 20, WeightFormat::kQ6K);  // one quantization, two formats
  }
  if (test::gpu::kLargeCases && (S.weights == WeightFormat::kAny || S.weights == WeightFormat::kF32))
    check_case<S, Tag>({WeightFormat::kF32, 8, 32, 300000});  // token tiles past the grid's
  // Tensor cores over 4096 columns (their sums lose more to rounding than short rows' do).
  for (WeightFormat f : {WeightFormat::kBf16, WeightFormat::kFp8E4m3})
    if (S.weights == WeightFormat::kAny || S.weights == f) check_case<S, Tag>({f, 64, 4096, 16});
  // fp8 rows sliced from a larger tensor: from row 64, half a scale block in (the tensor cores
  // stage them), and from row 32 (they cannot: the GEMV, at 20 tokens).
  if (S.weights == WeightFormat::kAny || S.weights == WeightFormat::kFp8E4m3)
    for (std::int64_t row0 : {64, 32}) check_case<S, Tag>({WeightFormat::kFp8E4m3, 130, 256, 20, 0, 0, false, row0});
}

template <class Tag>
void check_arch() {
  test::gpu::check_each_instance<Tag>([]<std::size_t I>() { check_instance<Tag, I>(); });
}

}  // namespace

TEST_SUITE("gpu") {
  TEST_CASE("linear sm80 instances match the CPU in every weight format") { check_arch<arch::Sm80>(); }
  TEST_CASE("linear sm90a instances match the CPU in every weight format") { check_arch<arch::Sm90a>(); }
}
