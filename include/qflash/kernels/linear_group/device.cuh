/// @file
/// Several projections of one input on CUDA (kernels/linear_group), shared by sm80.cuh and
/// sm90a.cuh. When every part has one format and takes linear's GEMV path with the same
/// loads (decode: fewer tokens than the tensor-core path wants), one launch of
/// linear_group_kernel covers every part's rows, after one quantization of the input for block
/// formats; each row's sums are linear_kernel's. When every part takes the block formats'
/// tensor-core path with one rounding (q4_k and q6_k share q8_k's), one quantization of the
/// input serves each part's launch. Otherwise a linear launch per part.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "qflash/kernels/linear/device.cuh"
#include "qflash/kernels/linear_group/op.hpp"

namespace qflash::kernels::linear_group_cuda {

/// Whether the parts of `a` (checked) can run as one launch of linear_group_kernel.
inline bool one_launch(LinearGroupArgs const& a) {
  static_assert(LinearGroupArgs::kMaxParts <= linear_cuda::GroupParams::kMaxParts);
  LinearArgs const& first = a.parts[0];
  std::int64_t const xs = first.x_stride ? first.x_stride : first.w.cols;
  bool const vec = linear_cuda::vector_path(first.w, first.x, xs);
  return a.n_parts > 1 && std::all_of(a.used().begin(), a.used().end(), [&](LinearArgs const& p) {
           return p.w.format == first.w.format && !linear_cuda::tensor_cores(p.w, p.n_tokens) &&
                  linear_cuda::vector_path(p.w, first.x, xs) == vec;
         });
}

/// Whether the parts of `a` (checked) all take the block formats' tensor-core path with one
/// rounding of the input, so that one quantization serves them.
inline bool one_quantization(LinearGroupArgs const& a) {
  LinearArgs const& first = a.parts[0];
  return a.n_parts > 1 && std::all_of(a.used().begin(), a.used().end(), [&](LinearArgs const& p) {
           return linear_cuda::mma_blocks::usable(p.w, p.n_tokens) &&
                  linear_cuda::rounding(p.w.format) == linear_cuda::rounding(first.w.format);
         });
}

/// The body of `launch_linear_group<S>(Arch, args, stream)` for a CUDA arch tag.
template <class Arch, MoeSpec S>
Status launch(LinearGroupArgs const& a, stream_t stream_arg) {
  using namespace linear_cuda;
  if (Status s = can_implement_linear_group<S>(a); s != Status::kSuccess) return s;
  for (LinearArgs const& part : a.used())
    if (!cuda::device_aligned(part.w)) return Status::kErrorMisalignedOperand;
  if (a.parts[0].n_tokens == 0) return Status::kSuccess;
  auto const stream = static_cast<cudaStream_t>(stream_arg);
  if (one_quantization(a)) {
    namespace mb = linear_cuda::mma_blocks;
    Params const first = params_of(a.parts[0]);
    mb::Activations codes{};
    if (Status s = workspace_codes(first.n_tokens, padded_cols(first.w.cols), stream, codes); s != Status::kSuccess)
      return s;
    if (Status s = quantize<Arch>(rounding(first.w.format), first.x, first.xs, first.w.cols, codes, stream);
        s != Status::kSuccess)
      return s;
    for (LinearArgs const& part : a.used()) {
      Params const p = params_of(part);
      Status const s = with_format<S>(p.w.format, [&]<WeightFormat kF>() {
        if constexpr (reads_codes(kF))
          return mb::multiply<Arch, kF>(p.w, codes, p.y, p.ys, p.accumulate, stream);
        else
          return Status::kErrorNotSupported;
      });
      if (s != Status::kSuccess) return s;
    }
    return Status::kSuccess;
  }
  if (!one_launch(a)) {
    for (LinearArgs const& part : a.used())
      if (Status s = linear_cuda::launch<Arch, S>(part, stream); s != Status::kSuccess) return s;
    return Status::kSuccess;
  }
  return with_format<S>(a.parts[0].w.format, [&]<WeightFormat kF>() -> Status {
    GroupParams g{};
    g.n_parts = a.n_parts;
    unsigned blocks = 0;
    for (int i = 0; i < a.n_parts; ++i) {
      g.part[i] = params_of(a.parts[i]);
      g.first_block[i] = blocks;
      blocks += static_cast<unsigned>((g.part[i].w.rows + kWarps * kRows - 1) / (kWarps * kRows));
    }
    Params const& first = g.part[0];
    if constexpr (reads_codes(kF)) {  // every part reads the input's codes, quantized once
      if (Status s = workspace_codes(first.n_tokens, padded_cols(first.w.cols), stream, g.codes); s != Status::kSuccess)
        return s;
      if (Status s = quantize<Arch>(rounding(kF), first.x, first.xs, first.w.cols, g.codes, stream);
          s != Status::kSuccess)
        return s;
    }
    dim3 const grid(blocks, static_cast<unsigned>(
                                std::min<std::int64_t>((first.n_tokens + kTokens - 1) / kTokens, kMaxTokenTiles)));
    if constexpr (block_values(kF) == 1)
      if (vector_path(first.w, first.x, first.xs)) {
        QFLASH_LAUNCH(grid, kThreads, 0, stream, linear_group_kernel<Arch, kF, true>)(g);
        return cuda::last_launch_status();
      }
    QFLASH_LAUNCH(grid, kThreads, 0, stream, linear_group_kernel<Arch, kF, false>)(g);
    return cuda::last_launch_status();
  });
}

}  // namespace qflash::kernels::linear_group_cuda
