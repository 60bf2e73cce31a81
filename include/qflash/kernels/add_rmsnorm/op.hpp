/// @file
/// Residual add fused with RMSNorm.
///
/// For each row r (width n = n_cols):
///   h[r]  = x[r] + residual[r]          (written back to `residual`; skipped when residual is null)
///   y[r]  = h[r] * rsqrt(mean(h[r]^2) + eps) * w'    with w' = w or (1 + w) (zero-centred)
/// Sums are accumulated in fp32; `h` is rounded to the activation dtype before it is normed,
/// so the fused result equals add-then-norm on the stored residual. y is rounded to the
/// activation dtype once, after the weight product (HF's Qwen3RMSNorm rounds x_hat to bf16
/// before multiplying by w: at most one bf16 ulp apart). inv_rms = 1 / sqrt(sum/n + eps) is
/// computed with correctly rounded ops on every target, so targets differ only in the order
/// of the fp32 sum.
///
/// Implementations: ref.hpp (fp64 truth), cpu.hpp (AVX-512 / AVX2 / scalar, threaded),
/// sm80.cuh / sm90a.cuh over device.cuh (instantiated in generated TUs), policy.hpp.
#pragma once

#include <cstdint>

#include "qflash/arch/arch.hpp"
#include "qflash/core/config.hpp"
#include "qflash/core/dtype.hpp"
#include "qflash/core/status.hpp"
#include "qflash/spec/moe_spec.hpp"

namespace qflash::kernels {

enum class NormWeight : int {
  kPlain = 0,         ///< y = x_hat * w          (qwen3_moe, GDN output norm)
  kZeroCentered = 1,  ///< y = x_hat * (1 + w)    (qwen3_5_moe)
};

struct AddRmsNormArgs {
  DType dtype = DType::kF32;         ///< of x, residual and y: kF32 or kBF16
  DType weight_dtype = DType::kF32;  ///< of weight: kF32 or kBF16
  void const* x = nullptr;           // [n_rows, n_cols]
  void* residual = nullptr;          // [n_rows, n_cols] in: residual, out: x + residual; may be null
  void const* weight = nullptr;      // [n_cols]
  void* y = nullptr;                 // [n_rows, n_cols]; may alias x
  std::int64_t n_rows = 0;
  int n_cols = 0;
  float eps = 1e-6f;
  NormWeight weight_kind = NormWeight::kPlain;
};

/// Checks arguments against the spec: the row width is the spec's d_model when that is static.
template <MoeSpec S>
[[nodiscard]] constexpr Status can_implement_add_rmsnorm(AddRmsNormArgs const& a) {
  if (a.dtype != DType::kF32 && a.dtype != DType::kBF16) return Status::kErrorNotSupported;
  if (a.weight_dtype != DType::kF32 && a.weight_dtype != DType::kBF16)
    return Status::kErrorNotSupported;
  if (!a.x || !a.weight || !a.y || a.n_rows < 0 || a.n_cols <= 0 || !(a.eps >= 0.0f))
    return Status::kErrorInvalidProblem;
  if (S.d_model != kDynamic && a.n_cols != S.d_model) return Status::kErrorInvalidProblem;
  return Status::kSuccess;
}

/// Launchers, one overload per arch tag. The CPU one is defined in cpu.hpp; the CUDA ones in
/// sm80.cuh / sm90a.cuh and explicitly instantiated in generated instance TUs.
template <MoeSpec S>
Status launch_add_rmsnorm(arch::Cpu, AddRmsNormArgs const& args, stream_t stream = nullptr);
template <MoeSpec S>
Status launch_add_rmsnorm(arch::Sm80, AddRmsNormArgs const& args, stream_t stream);
template <MoeSpec S>
Status launch_add_rmsnorm(arch::Sm90a, AddRmsNormArgs const& args, stream_t stream);
template <MoeSpec S, class Arch>
  requires(!arch::implemented_by<Arch, arch::Cpu, arch::Sm80, arch::Sm90a>)
Status launch_add_rmsnorm(Arch, AddRmsNormArgs const&, stream_t = nullptr) {
  static_assert(dependent_false<Arch>, "kernels/add_rmsnorm: no implementation for this arch");
  return Status::kErrorArchMismatch;
}

}  // namespace qflash::kernels
