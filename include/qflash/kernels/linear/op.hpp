/// @file
/// Dense projection of a batch of token rows by a weight matrix stored [out, in] (PyTorch
/// order):  y[t, o] = sum_i x[t, i] * W[o, i]   (+ y[t, o] when accumulate).
/// Activations are fp32; W is in any WeightFormat (numeric/weight_format.hpp), decoded as it
/// is read, with the format dispatched once per call; sums are fp32. With q8_0, q4_k, q6_k
/// and int4 weights the activations are first rounded to 8-bit blocks, as llama.cpp does
/// (q8_0 blocks of 32, for int4 too; q8_k blocks of 256; ref::round_activations), so that
/// the products are integer dot products.
#pragma once

#include <cstdint>

#include "qflash/arch/arch.hpp"
#include "qflash/core/config.hpp"
#include "qflash/core/dtype.hpp"
#include "qflash/core/status.hpp"
#include "qflash/numeric/weight_format.hpp"
#include "qflash/spec/moe_spec.hpp"

namespace qflash::kernels {

using ::qflash::WeightView;

/// A low-rank update beside a projection (LoRA): y += B (A x), with A [r, n_in] and B [n_out, r]
/// in f32, B already multiplied by the adapter's scale. Empty (no data): none.
struct LowRank {
  WeightView a;
  WeightView b;
  [[nodiscard]] bool empty() const { return a.data == nullptr; }
  [[nodiscard]] std::int64_t rank() const { return a.rows; }
  /// Empty, or an f32 update of a [rows, cols] matrix.
  [[nodiscard]] bool fits(std::int64_t rows, std::int64_t cols) const {
    if (empty()) return true;
    return a.format == WeightFormat::kF32 && b.format == WeightFormat::kF32 && b.data && a.rows > 0 &&
           a.cols == cols && b.rows == rows && b.cols == a.rows;
  }
};

struct LinearArgs {
  WeightView w;            // [n_out, n_in]
  float const* x = nullptr;  // [n_tokens, n_in], rows x_stride apart
  float* y = nullptr;        // [n_tokens, n_out], rows y_stride apart; must not alias x
  std::int64_t n_tokens = 0;
  std::int64_t x_stride = 0;  ///< 0: n_in
  std::int64_t y_stride = 0;  ///< 0: n_out
  bool accumulate = false;
};

/// Checks a weight the spec's kernels read: a format the spec compiles (S.weights), bytes, a
/// shape that fits the format's rows, and fp8's scales.
template <MoeSpec S>
[[nodiscard]] constexpr Status can_implement_weight(WeightView const& w) {
  if (w.format == WeightFormat::kAny || (S.weights != WeightFormat::kAny && w.format != S.weights))
    return Status::kErrorNotSupported;
  if (!w.data || w.rows <= 0 || w.cols <= 0 || !row_fits(w.format, w.cols) ||
      (w.format == WeightFormat::kFp8E4m3 && !w.scales))
    return Status::kErrorInvalidProblem;
  return Status::kSuccess;
}

/// Checks arguments; the weight as can_implement_weight does.
template <MoeSpec S>
[[nodiscard]] constexpr Status can_implement_linear(LinearArgs const& a) {
  if (!a.w.data || !a.x || !a.y || a.n_tokens < 0 || a.w.rows <= 0 || a.w.cols <= 0)
    return Status::kErrorInvalidProblem;
  if (Status s = can_implement_weight<S>(a.w); s != Status::kSuccess) return s;
  if ((a.x_stride != 0 && a.x_stride < a.w.cols) || (a.y_stride != 0 && a.y_stride < a.w.rows))
    return Status::kErrorInvalidProblem;
  return Status::kSuccess;
}

/// Launchers, one overload per arch tag with an implementation: cpu.hpp, and sm80.cuh /
/// sm90a.cuh (device pointers; weights at addresses the device can read, else
/// kErrorMisalignedOperand: cuda::device_aligned); any other arch stops the build here with
/// the op's name.
template <MoeSpec S>
Status launch_linear(arch::Cpu, LinearArgs const& args, stream_t stream = nullptr);
template <MoeSpec S>
Status launch_linear(arch::Sm80, LinearArgs const& args, stream_t stream);
template <MoeSpec S>
Status launch_linear(arch::Sm90a, LinearArgs const& args, stream_t stream);
template <MoeSpec S, class Arch>
  requires(!arch::implemented_by<Arch, arch::Cpu, arch::Sm80, arch::Sm90a>)
Status launch_linear(Arch, LinearArgs const&, stream_t = nullptr) {
  static_assert(dependent_false<Arch>, "kernels/linear: no implementation for this arch");
  return Status::kErrorArchMismatch;
}

}  // namespace qflash::kernels
