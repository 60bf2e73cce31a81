/// @file
/// Several projections of one input in one call: a DeltaNet layer's in_proj_qkv, z, b and a,
/// or attention's q, k and v. Part i is kernels/linear with parts[i] (its weight, output,
/// output stride and accumulate); every part has the same x, x_stride, n_tokens and input
/// width, and no part's output overlaps another's or x. Each part's results equal
/// launch_linear's for it alone, bit for bit.
/// CPU: one parallel region over every part's rows, the activations quantized once per kind
/// of 8-bit block and packed for AMX tiles once per format. CUDA: one launch over every
/// part's rows when they share a format and linear's GEMV path (decode), else linear's
/// launches per part.
#pragma once

#include <array>
#include <span>

#include "qflash/kernels/linear/op.hpp"

namespace qflash::kernels {

struct LinearGroupArgs {
  static constexpr int kMaxParts = 4;
  std::array<LinearArgs, kMaxParts> parts{};
  int n_parts = 0;

  [[nodiscard]] std::span<LinearArgs const> used() const {
    return {parts.data(), static_cast<std::size_t>(n_parts < 0 ? 0 : n_parts)};
  }
};

/// Checks every part as can_implement_linear does, their count, and that they share the input.
template <MoeSpec S>
[[nodiscard]] constexpr Status can_implement_linear_group(LinearGroupArgs const& a) {
  if (a.n_parts < 1 || a.n_parts > LinearGroupArgs::kMaxParts) return Status::kErrorInvalidProblem;
  LinearArgs const& first = a.parts[0];
  auto const x_stride = [](LinearArgs const& p) { return p.x_stride ? p.x_stride : p.w.cols; };
  for (LinearArgs const& p : a.used()) {
    if (Status s = can_implement_linear<S>(p); s != Status::kSuccess) return s;
    if (p.x != first.x || p.n_tokens != first.n_tokens || p.w.cols != first.w.cols || x_stride(p) != x_stride(first))
      return Status::kErrorInvalidProblem;
  }
  return Status::kSuccess;
}

/// Launchers, one overload per arch tag with an implementation: cpu.hpp, and sm80.cuh /
/// sm90a.cuh (device pointers); any other arch stops the build here with the op's name.
template <MoeSpec S>
Status launch_linear_group(arch::Cpu, LinearGroupArgs const& args, stream_t stream = nullptr);
template <MoeSpec S>
Status launch_linear_group(arch::Sm80, LinearGroupArgs const& args, stream_t stream);
template <MoeSpec S>
Status launch_linear_group(arch::Sm90a, LinearGroupArgs const& args, stream_t stream);
template <MoeSpec S, class Arch>
  requires(!arch::implemented_by<Arch, arch::Cpu, arch::Sm80, arch::Sm90a>)
Status launch_linear_group(Arch, LinearGroupArgs const&, stream_t = nullptr) {
  static_assert(dependent_false<Arch>, "kernels/linear_group: no implementation for this arch");
  return Status::kErrorArchMismatch;
}

}  // namespace qflash::kernels
