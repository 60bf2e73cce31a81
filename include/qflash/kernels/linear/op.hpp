/// @file
/// Dense projection of a batch of token rows by a weight matrix stored [out, in] (PyTorch
/// order):  y[t, o] = sum_i x[t, i] * W[o, i]   (+ y[t, o] when accumulate).
/// Activations are fp32; W is fp32 or bf16 (dequantized in registers); sums are fp32.
#pragma once

#include <cstdint>

#include "qflash/arch/arch.hpp"
#include "qflash/core/config.hpp"
#include "qflash/core/dtype.hpp"
#include "qflash/core/status.hpp"
#include "qflash/spec/moe_spec.hpp"

namespace qflash::kernels {

/// A weight matrix [rows = out features, cols = in features], row-major, not owned.
struct WeightView {
  DType dtype = DType::kF32;  ///< kF32 or kBF16
  void const* data = nullptr;
  std::int64_t rows = 0;
  std::int64_t cols = 0;

  [[nodiscard]] std::size_t row_bytes() const {
    return static_cast<std::size_t>(cols) * size_of(dtype);
  }
  /// Rows [begin, begin + n) as their own view.
  [[nodiscard]] WeightView slice_rows(std::int64_t begin, std::int64_t n) const {
    return {dtype, static_cast<std::byte const*>(data) + static_cast<std::size_t>(begin) * row_bytes(),
            n, cols};
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

[[nodiscard]] inline Status can_implement_linear(LinearArgs const& a) {
  if (a.w.dtype != DType::kF32 && a.w.dtype != DType::kBF16) return Status::kErrorNotSupported;
  if (!a.w.data || !a.x || !a.y || a.n_tokens < 0 || a.w.rows <= 0 || a.w.cols <= 0)
    return Status::kErrorInvalidProblem;
  if ((a.x_stride != 0 && a.x_stride < a.w.cols) || (a.y_stride != 0 && a.y_stride < a.w.rows))
    return Status::kErrorInvalidProblem;
  return Status::kSuccess;
}

template <MoeSpec S>
Status launch_linear(arch::Cpu, LinearArgs const& args, stream_t stream = nullptr);

}  // namespace qflash::kernels
