/// @file
/// CPU kernels/linear_group: linear's row kernels over every part in one parallel region
/// (cpu::linear_parts).
#pragma once

#include "qflash/kernels/linear/cpu.hpp"
#include "qflash/kernels/linear_group/op.hpp"

namespace qflash::kernels::cpu {

/// The group with an explicit ISA level (tests run every level this CPU has); compiled for
/// the weight formats F (kAny: all of them).
template <WeightFormat F = WeightFormat::kAny>
Status linear_group(arch::CpuIsa isa, LinearGroupArgs const& a) {
  if (Status s = can_implement_linear_group<MoeSpec{.weights = F}>(a); s != Status::kSuccess) return s;
  static_assert(LinearGroupArgs::kMaxParts <= kMaxLinearParts);
  linear_parts<F>(isa, a.used());
  return Status::kSuccess;
}

}  // namespace qflash::kernels::cpu

namespace qflash::kernels {

template <MoeSpec S>
Status launch_linear_group(arch::Cpu, LinearGroupArgs const& args, stream_t) {
  return cpu::linear_group<S.weights>(arch::cpu_isa(), args);
}

}  // namespace qflash::kernels
